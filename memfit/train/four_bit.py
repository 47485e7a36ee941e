"""4-bit frozen base: decoder-layer linears become bitsandbytes NF4 ``Linear4bit``.

The weights stay 4-bit (NF4, blocksize 64, double-quantized absmax as in QLoRA) and are
dequantized on the fly in forward and backward by bitsandbytes' kernels; compute runs in
the model's dtype. Embeddings, norms and the output head stay as they are (the output
head feeds the fused loss, which reads it densely). bitsandbytes is imported only here,
and only when asked for, so memfit works without it.

bitsandbytes' ``matmul_4bit`` dequantizes the whole weight for each product, forward and the
input gradient's (101 MB in fp32 for a Llama-3.2-3B MLP projection, at the peak of a LoRA step
with checkpoints); memfit's layers (:func:`matmul_4bit_in_chunks`) dequantize DEQUANT_CHUNK_BYTES
of its rows at a time, the same values (bitsandbytes' own dequantization, on row slices).
"""
from __future__ import annotations

import functools
import math

import torch

from memfit.errors import MemfitError

BLOCKSIZE = 64
DEQUANT_CHUNK_BYTES = 16 * 2**20    # the dense slice of a 4-bit weight that one product in a chunk reads


def dequant_rows(in_features: int, out_features: int, element_size: int) -> int:
    """Rows of a 4-bit weight dequantized at once: DEQUANT_CHUNK_BYTES of them in the compute dtype, in
    whole 64-element blocks (at least one such step of rows), all of them at most."""
    step = BLOCKSIZE // math.gcd(in_features, BLOCKSIZE)
    rows = DEQUANT_CHUNK_BYTES // (in_features * element_size) // step * step
    return min(max(rows, step), out_features)


def dequant_workspace_bytes(in_features: int, out_features: int, element_size: int) -> int:
    """Bytes a 4-bit layer holds during one product beside its operands (for the ledger): a dense weight
    slice and the weight's per-block scales in fp32."""
    scales = 4 * -(-in_features * out_features // BLOCKSIZE)
    return dequant_rows(in_features, out_features, element_size) * in_features * element_size + scales


def _dequantize_rows(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, in_features: int,
                     r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [r0, r1) of an NF4 weight (``packed``: its 4-bit codes, two per byte, row-major) as a dense
    (r1 - r0, in) tensor, from its per-block ``absmax`` already dequantized; r0 * in is a multiple of
    BLOCKSIZE, and so is r1 * in unless r1 is the last row (the weight's last block may be short)."""
    import bitsandbytes.functional as F

    first, end = r0 * in_features, r1 * in_features
    state = F.QuantState(absmax=absmax[first // BLOCKSIZE:-(-end // BLOCKSIZE)],
                         shape=torch.Size([r1 - r0, in_features]), code=code, blocksize=BLOCKSIZE, quant_type="nf4",
                         dtype=dtype)
    return F.dequantize_4bit(packed.view(-1)[first // 2:-(-end // 2)], state)


def _absmax(quant_state) -> torch.Tensor:
    """A weight's per-block scales as fp32 (undoing the double quantization, as bitsandbytes does per call)."""
    if not quant_state.nested:
        return quant_state.absmax.float()
    import bitsandbytes.functional as F

    return F.dequantize_blockwise(quant_state.absmax, quant_state.state2) + quant_state.offset


class _Matmul4bitInChunks(torch.autograd.Function):
    """y = x W^T (+ bias) for a frozen NF4 weight W, dequantized a chunk of rows at a time
    (:func:`dequant_rows`): forward writes y's columns chunk by chunk, backward adds the input
    gradient's terms chunk by chunk. Saves no activation: W is the layer's own, frozen."""

    @staticmethod
    def forward(ctx, x, packed, quant_state, bias):
        out_features, in_features = quant_state.shape
        x2 = x.reshape(-1, in_features)
        absmax = _absmax(quant_state)
        y = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
        rows = dequant_rows(in_features, out_features, x.element_size())
        for r0 in range(0, out_features, rows):
            r1 = min(r0 + rows, out_features)
            w = _dequantize_rows(packed, absmax, quant_state.code, in_features, r0, r1, x.dtype)
            torch.mm(x2, w.t(), out=y[:, r0:r1])
        if bias is not None:
            y += bias
        ctx.packed, ctx.quant_state, ctx.x_shape = packed, quant_state, x.shape
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_y):
        out_features, in_features = ctx.quant_state.shape
        g2 = grad_y.reshape(-1, out_features)
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            absmax = _absmax(ctx.quant_state)
            rows = dequant_rows(in_features, out_features, grad_y.element_size())
            for r0 in range(0, out_features, rows):
                r1 = min(r0 + rows, out_features)
                w = _dequantize_rows(ctx.packed, absmax, ctx.quant_state.code, in_features, r0, r1, grad_y.dtype)
                grad_x = g2[:, r0:r1] @ w if grad_x is None else grad_x.addmm_(g2[:, r0:r1], w)
            grad_x = grad_x.view(ctx.x_shape)
        if ctx.needs_input_grad[3]:
            grad_bias = g2.sum(0)
        return grad_x, None, None, grad_bias


def matmul_4bit_in_chunks(x: torch.Tensor, packed: torch.Tensor, quant_state, bias: torch.Tensor | None = None):
    """x W^T (+ bias) for the NF4 weight ``packed`` with bitsandbytes' ``quant_state``, in x's dtype,
    never more than DEQUANT_CHUNK_BYTES of W dense at once; differentiable in x and bias."""
    if tuple(quant_state.shape)[1] != x.shape[-1]:
        raise MemfitError(f"matmul_4bit_in_chunks: x has {x.shape[-1]} features, the weight takes "
                          f"{tuple(quant_state.shape)[1]}")
    return _Matmul4bitInChunks.apply(x, packed, quant_state, bias)


@functools.cache
def chunked_linear_4bit_class():
    """bitsandbytes' ``Linear4bit`` whose products dequantize the weight in chunks (built on first use,
    so importing memfit does not import bitsandbytes)."""
    bnb = import_bitsandbytes()

    class ChunkedLinear4bit(bnb.nn.Linear4bit):
        """``Linear4bit`` (frozen NF4 weight) computing x W^T by :func:`matmul_4bit_in_chunks`."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dtype = self.compute_dtype or x.dtype
            bias = None if self.bias is None else self.bias.to(dtype)
            return matmul_4bit_in_chunks(x.to(dtype), self.weight.data, self.weight.quant_state, bias).to(x.dtype)

    return ChunkedLinear4bit


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
    """Replace every ``nn.Linear`` under ``root`` by a frozen NF4 ``Linear4bit`` (memfit's, whose products
    dequantize the weight in chunks: :func:`chunked_linear_4bit_class`); return the count.

    Each layer is quantized on its own device right after it is read, so the transient
    extra memory is one dense weight, not the model.
    """
    bnb = import_bitsandbytes()
    linear_4bit = chunked_linear_4bit_class()
    targets = [(name, module) for name, module in root.named_modules()
               if isinstance(module, torch.nn.Linear) and not isinstance(module, bnb.nn.Linear4bit)]
    for name, dense in targets:
        device = dense.weight.device
        if device.type != "cuda":
            raise MemfitError(f"the 4-bit base needs the model on a CUDA GPU; {name} is on {device}")
        quant = linear_4bit(dense.in_features, dense.out_features, bias=dense.bias is not None,
                            compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4", device="meta")
        quant.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, blocksize=BLOCKSIZE,
                                         compress_statistics=True, quant_type="nf4", module=quant).to(device)
        if dense.bias is not None:
            quant.bias = torch.nn.Parameter(dense.bias.data, requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, child, quant)
        del dense
    return len(targets)


def nf4_bytes(in_features: int, out_features: int) -> int:
    """Device bytes of one NF4 weight with double-quantized statistics (for the ledger).

    4-bit codes: n/2. absmax: one uint8 per 64-block, plus one fp32 scale per 256 such
    bytes and a 256-entry fp32 code book (the nested quantization state).
    """
    n = in_features * out_features
    blocks = -(-n // BLOCKSIZE)
    return n // 2 + blocks + 4 * -(-blocks // 256) + 4 * 256 + 4
