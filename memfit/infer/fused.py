"""Fused weight layouts for decode: q/k/v as one matrix, gate/up interleaved per neuron.

At batch 1 a decode step is a chain of matrix-vector products, and each separate kernel
costs a few microseconds of launch and ramp on top of its bytes. The loader
(``memfit.infer.partial_load.load_model``) therefore allocates, per layer, one buffer
for q/k/v and one for gate/up and makes the model's own parameters *views* of them
(same values, no second copy): the Hugging Face modules still work unchanged, and the
decode loop runs one matmul where there were three (q/k/v) or two (gate/up).

- q/k/v: rows ``[q; k; v]`` of one (q_out + k_out + v_out, hidden) matrix (biases, as
  in Qwen2, likewise in one vector).
- gate/up: a (neurons, 2, hidden) buffer, ``[:, 0]`` = gate rows, ``[:, 1]`` = up rows.
  Interleaving per neuron keeps the first ``m`` neurons' gate *and* up rows one
  contiguous block ``[:m]``, which partial computation (``PartialMLP``) needs after it
  moves the selected neurons to the front; the matmul output is (..., 2m) with gate and
  up alternating, split by ``act_mul``.

The ``fused_*`` functions recognise the layout from the tensors' storage, so a model
whose parameters were replaced or moved (``.to()``) simply decodes unfused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def plain_linear(module: nn.Module | None) -> bool:
    """Whether ``module`` is exactly an ``nn.Linear``, which memfit may compute from its weight and bias; a subclass,
    a 4-bit, LoRA or block-low-rank layer may compute otherwise, and is called as it is. (Forward hooks on a plain
    layer computed so do not run.)"""
    return type(module) is nn.Linear


def _consecutive(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``tensors`` when they are consecutive contiguous row blocks of one storage, else None."""
    first = tensors[0]
    if any(type(t) not in (torch.Tensor, nn.Parameter) or not t.is_contiguous() or t.dtype != first.dtype
           or t.shape[1:] != first.shape[1:] or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           for t in tensors):
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def share_qkv(attn: nn.Module, dtype, device) -> list[tuple[str, torch.Tensor]]:
    """Make ``attn``'s q/k/v weights (and biases) views of one new buffer; returns (name, view) to fill."""
    views = []
    for kind in ("weight", "bias"):
        params = [getattr(getattr(attn, p), kind) for p in ("q_proj", "k_proj", "v_proj")]
        if any(p is None for p in params):
            continue
        buffer = torch.empty((sum(p.shape[0] for p in params), *params[0].shape[1:]), dtype=dtype, device=device)
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), buffer.split([p.shape[0] for p in params])):
            getattr(attn, proj)._parameters[kind] = nn.Parameter(part, requires_grad=False)
            views.append((f"{proj}.{kind}", part))
    return views


@torch.no_grad()
def fuse_layout(model: nn.Module) -> None:
    """Put a model built in memory into the fused layout ``load_model`` builds from a directory, values kept: each
    layer's plain q/k/v (``share_qkv``) and its dense, bias-free SiLU gate/up (``share_gate_up``) become views of one
    buffer. A layer at a time, each buffer filled before the weights it replaces are dropped. What ``memfit verify``
    measures ``memfit generate``'s loop on."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if all(map(plain_linear, projections)):
            old = {f"{name}.{kind}": getattr(proj, kind) for name, proj in zip(("q_proj", "k_proj", "v_proj"),
                                                                               projections) for kind in ("weight", "bias")}
            _refill(share_qkv(attn, projections[0].weight.dtype, projections[0].weight.device), old)
        gated = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
        if all(map(plain_linear, gated)) and all(g.bias is None for g in gated) and silu_activation(mlp):
            old = {"gate_proj.weight": gated[0].weight, "up_proj.weight": gated[1].weight}
            _refill(share_gate_up(mlp, gated[0].weight.dtype, gated[0].weight.device), old)


def _refill(views: list[tuple[str, torch.Tensor]], old: dict[str, torch.Tensor | None]) -> None:
    """Copy the ``old`` values into the new buffer's ``views`` (``share_*`` swapped the parameters for them)."""
    for name, view in views:
        view.copy_(old[name])


def fused_qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of q/k/v as one matmul when they share a buffer (see ``share_qkv``), else None."""
    projs = [getattr(attn, p, None) for p in ("q_proj", "k_proj", "v_proj")]
    if not all(map(plain_linear, projs)):
        return None
    weight = _consecutive([p.weight for p in projs])
    biases = [p.bias for p in projs]
    if all(b is None for b in biases):
        return (weight, None) if weight is not None else None
    bias = _consecutive(biases) if all(b is not None for b in biases) else None
    return (weight, bias) if weight is not None and bias is not None else None


def gate_up_buffer(neurons: int, hidden: int, dtype, device) -> torch.Tensor:
    """An uninitialised (neurons, 2, hidden) gate/up buffer."""
    return torch.empty(neurons, 2, hidden, dtype=dtype, device=device)


def share_gate_up(mlp: nn.Module, dtype, device) -> list[tuple[str, torch.Tensor]]:
    """Make a dense gated MLP's gate/up weights views ``[:, 0]`` / ``[:, 1]`` of one interleaved buffer."""
    gate = mlp.gate_proj.weight
    buffer = gate_up_buffer(gate.shape[0], gate.shape[1], dtype, device)
    mlp.gate_proj._parameters["weight"] = nn.Parameter(buffer[:, 0], requires_grad=False)
    mlp.up_proj._parameters["weight"] = nn.Parameter(buffer[:, 1], requires_grad=False)
    return [("gate_proj.weight", buffer[:, 0]), ("up_proj.weight", buffer[:, 1])]


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The (neurons, 2, hidden) buffer that ``gate`` and ``up`` are the two halves of, else None."""
    if type(gate) not in (torch.Tensor, nn.Parameter) or type(up) not in (torch.Tensor, nn.Parameter):
        return None
    k, hidden = gate.shape
    if (up.shape != gate.shape or up.dtype != gate.dtype or gate.stride() != (2 * hidden, 1) or up.stride() != gate.stride()
            or gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
            or up.storage_offset() != gate.storage_offset() + hidden):
        return None
    return gate.as_strided((k, 2, hidden), (2 * hidden, hidden, 1), gate.storage_offset())


def fused_gate_up(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gate/up buffer (k, 2, hidden), down weight (hidden, k)) of a SiLU-gated MLP in the fused layout, else None."""
    if hasattr(mlp, "gate_up_weight"):                    # PartialMLP: always interleaved
        pair = mlp.gate_up_weight, mlp.down_weight
    elif all(plain_linear(getattr(mlp, p, None)) for p in ("gate_proj", "up_proj", "down_proj")):
        if any(getattr(mlp, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
            return None
        buffer = interleaved(mlp.gate_proj.weight, mlp.up_proj.weight)
        pair = (buffer, mlp.down_proj.weight) if buffer is not None else None
    else:
        return None
    if pair is None or not silu_activation(mlp):
        return None
    return pair


def silu_activation(mlp: nn.Module) -> bool:
    """Whether a gated MLP's ``act_fn`` is SiLU (torch's module or function, or transformers' class of that name)."""
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu


def act_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a (..., 2m) matmul output whose columns alternate gate, up.

    Strided slices rather than ``unflatten``: under ``torch.set_default_device`` dynamo cannot trace
    ``Tensor.unflatten`` (its ``super()`` call), and the decode loop compiles this."""
    return F.silu(gate_up[..., 0::2]) * gate_up[..., 1::2]
