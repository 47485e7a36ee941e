"""4-bit frozen base: decoder-layer linears become bitsandbytes NF4 ``Linear4bit``.

The weights stay 4-bit (NF4, blocksize 64, double-quantized absmax as in QLoRA) and are
dequantized on the fly in forward and backward by bitsandbytes' kernels; compute runs in
the model's dtype. Embeddings, norms and the output head stay as they are (the output
head feeds the fused loss, which reads it densely). bitsandbytes is imported only here,
and only when asked for, so memfit works without it.
"""
from __future__ import annotations

import torch

from memfit.errors import MemfitError

BLOCKSIZE = 64


def import_bitsandbytes():
    """The bitsandbytes module, or a MemfitError saying why it cannot serve."""
    try:
        import bitsandbytes as bnb
    except (ImportError, RuntimeError, OSError) as err:  # missing, or its native library failed to load
        raise MemfitError(
            f"the 4-bit base needs bitsandbytes (pip install bitsandbytes) and a CUDA GPU; importing it failed: {err}"
        ) from None
    return bnb


def quantize_linears_4bit(root: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` under ``root`` by a frozen NF4 ``Linear4bit``; return the count.

    Each layer is quantized on its own device right after it is read, so the transient
    extra memory is one dense weight, not the model.
    """
    bnb = import_bitsandbytes()
    targets = [(name, module) for name, module in root.named_modules()
               if isinstance(module, torch.nn.Linear) and not isinstance(module, bnb.nn.Linear4bit)]
    for name, dense in targets:
        device = dense.weight.device
        if device.type != "cuda":
            raise MemfitError(f"the 4-bit base needs the model on a CUDA GPU; {name} is on {device}")
        quant = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=dense.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                  device="meta")
        quant.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, blocksize=BLOCKSIZE,
                                         compress_statistics=True, quant_type="nf4", module=quant).to(device)
        if dense.bias is not None:
            quant.bias = torch.nn.Parameter(dense.bias.data, requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, child, quant)
        del dense
    return len(targets)


def quantize_layers_4bit(layers, compute_dtype: torch.dtype, device: torch.device | str | None = None) -> None:
    """Quantize each decoder layer's linears to NF4 in turn (:func:`quantize_linears_4bit`), each first moved to
    ``device`` where one is given, so that the GPU holds one dense layer at a time."""
    for layer in layers:
        if device is not None:
            layer.to(device)
        quantize_linears_4bit(layer, compute_dtype)


def to_device_4bit(model: torch.nn.Module, device: torch.device | str, compute_dtype: torch.dtype) -> torch.nn.Module:
    """Move a ``*ForCausalLM`` held on the CPU to ``device`` with its decoder layers' linears in NF4, one layer at a
    time (the layer moved, then quantized), then the rest of the model; return it.

    ``patch(four_bit=True)`` quantizes a model already on the GPU, which a model that fits only in 4 bits never is:
    loading the dense weights first had needed their whole size on the GPU (14.96 GiB for Llama-3.1-8B in bfloat16, the
    weights of `memfit plan --model llama-3.1-8b --task infer --json`, where `memfit plan --model llama-3.1-8b --task
    lora --gpu-memory 16GiB` puts its fastest plan, 4-bit, at 12.15 GiB). Here the GPU holds at most one dense layer
    beyond the NF4 ones; patch then finds the layers quantized and leaves them."""
    quantize_layers_4bit(model.model.layers, compute_dtype, device)
    model.to(device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()       # the dense layers' blocks, cached as each was quantized, are not needed again
    return model


def nf4_bytes(in_features: int, out_features: int) -> int:
    """Device bytes of one NF4 weight with double-quantized statistics (for the ledger).

    4-bit codes: n/2. absmax: one uint8 per 64-block, plus one fp32 scale per 256 such
    bytes and a 256-entry fp32 code book (the nested quantization state).
    """
    n = in_features * out_features
    blocks = -(-n // BLOCKSIZE)
    return n // 2 + blocks + 4 * -(-blocks // 256) + 4 * 256 + 4
