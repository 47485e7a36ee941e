"""Gated MLPs of Monarch layers computed by memfit's fused op: ``down(monarch_swiglu(x))``.

A decoder layer's MLP calls ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Where gate and up are Monarch layers
that :func:`memfit.kernels.monarch_swiglu.monarch_swiglu` takes (plain ``MonarchLinear`` of the same blocks and
shape, block-major outputs, no bias, no hooks, a SiLU activation), :func:`fuse_monarch_mlps` makes the MLP compute
the product by that op instead: gate's and up's second stages and the product in one kernel at decode (that module
says why). Only the MLP's forward changes (an attribute of the instance, as memfit.train.patch's is): the layers
and their weights stay as they are, so a ``state_dict`` saves and loads as before (a whole pickled model would not
find the patched forward), and :func:`unfuse_monarch_mlps` puts the class's forward back.
"""
from __future__ import annotations

import types

from torch import nn

from memfit.errors import MemfitError
from memfit.infer.fused import silu_activation
from memfit.kernels.monarch_swiglu import monarch_swiglu
from memfit.layers.monarch import MonarchLinear


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def fusable(mlp: nn.Module) -> bool:
    """Whether ``mlp``'s gate and up are Monarch layers the fused op takes, with a SiLU activation: plain
    ``MonarchLinear`` (a subclass may compute otherwise) with no forward hooks (the op reads their weights, so a hook
    would not run), of one shape and blocks, block-major outputs and no bias."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not (type(gate) is MonarchLinear and type(up) is MonarchLinear and silu_activation(mlp)):
        return False
    return (gate.blocks == up.blocks and gate.in_features == up.in_features and gate.out_features == up.out_features
            and gate.bias is None and up.bias is None and not gate.permute_output and not up.permute_output
            and not _hooked(gate) and not _hooked(up))


def _fused_forward(self, x):
    """The MLP's forward through the fused op while its layers still allow it (:func:`fusable`, checked at every
    call: a layer replaced or changed since the fusing runs the class's forward instead)."""
    if not fusable(self):
        return type(self).forward(self, x)
    gate, up = self.gate_proj, self.up_proj
    return self.down_proj(monarch_swiglu(x, gate.w1, gate.w2, up.w1, up.w2))


def fuse_monarch_mlps(model: nn.Module) -> int:
    """Make every MLP of ``model`` that :func:`fusable` accepts compute its product by the fused op; returns how
    many it changed (0 where the model has no such MLP, or they are fused already). An MLP whose forward something
    else has replaced (memfit.train.patch's fused SwiGLU, an offload hook) is refused, naming it."""
    changed = 0
    for name, module in model.named_modules():
        if not fusable(module):
            continue
        forward = module.__dict__.get("forward")
        if forward is None:
            module.forward = types.MethodType(_fused_forward, module)
            changed += 1
        elif getattr(forward, "__func__", None) is not _fused_forward:
            raise MemfitError(f"fuse_monarch_mlps: {name}'s forward is already replaced ({forward!r}); fusing would "
                              "drop that patch (apply one or the other)")
    return changed


def unfuse_monarch_mlps(model: nn.Module) -> int:
    """Undo :func:`fuse_monarch_mlps`; returns how many MLPs it changed back."""
    changed = 0
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__func__", None) is _fused_forward:
            del module.forward
            changed += 1
    return changed
