"""Gated MLPs of Monarch layers computed by memfit's fused op: ``down(monarch_swiglu(x))``.

A decoder layer's MLP calls ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Where gate and up are Monarch layers
that :func:`memfit.kernels.monarch_swiglu.monarch_swiglu` takes (same blocks, block-major outputs, no bias, a SiLU
activation), :func:`fuse_monarch_mlps` makes the MLP compute the product by that op instead: gate's and up's second
stages and the product in one kernel at decode (that module says why). The layers and their weights stay as they
are (saved and loaded as before); only the MLP's forward changes, and :func:`unfuse_monarch_mlps` puts it back.
"""
from __future__ import annotations

import types

from torch import nn

from memfit.infer.fused import silu_activation
from memfit.layers.monarch import MonarchLinear


def fusable(mlp: nn.Module) -> bool:
    """Whether ``mlp``'s gate and up are Monarch layers the fused op takes, with a SiLU activation."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not (isinstance(gate, MonarchLinear) and isinstance(up, MonarchLinear) and silu_activation(mlp)):
        return False
    return (gate.blocks == up.blocks and gate.in_features == up.in_features and gate.out_features == up.out_features
            and gate.bias is None and up.bias is None and not gate.permute_output and not up.permute_output)


def _fused_forward(self, x):
    from memfit.kernels.monarch_swiglu import monarch_swiglu

    gate, up = self.gate_proj, self.up_proj
    return self.down_proj(monarch_swiglu(x, gate.w1, gate.w2, up.w1, up.w2))


def fuse_monarch_mlps(model: nn.Module) -> int:
    """Make every MLP of ``model`` that :func:`fusable` accepts compute its product by the fused op; returns how
    many it changed (0 where the model has no such MLP)."""
    changed = 0
    for module in model.modules():
        if fusable(module) and not isinstance(module.__dict__.get("forward"), types.MethodType):
            module.forward = types.MethodType(_fused_forward, module)
            changed += 1
    return changed


def unfuse_monarch_mlps(model: nn.Module) -> int:
    """Undo :func:`fuse_monarch_mlps`; returns how many MLPs it changed back."""
    changed = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, types.MethodType) and forward.__func__ is _fused_forward:
            del module.forward
            changed += 1
    return changed
