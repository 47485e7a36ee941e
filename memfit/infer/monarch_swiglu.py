"""Gated MLPs of Monarch layers computed by memfit's fused op: ``down(monarch_swiglu(x))``.

A decoder layer's MLP calls ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Where gate and up are Monarch layers
that :func:`memfit.kernels.monarch_swiglu.monarch_swiglu` takes (plain ``MonarchLinear`` of the same blocks and
shape, block-major outputs, no bias, no hooks, a SiLU activation), :func:`fuse_monarch_mlps` makes the MLP compute
the product by that op instead: gate's and up's second stages and the product in one kernel at decode (that module
says why). Only the MLP's forward changes (memfit.infer.instance_forward says what that keeps), and
:func:`unfuse_monarch_mlps` puts the class's forward back.
"""
from __future__ import annotations

from torch import nn

from memfit.errors import MemfitError
from memfit.infer.fused import silu_activation
from memfit.infer.instance_forward import hooked, patch_forwards, patched_modules, unpatch_forwards
from memfit.kernels.monarch_swiglu import STEP, VARIANTS, monarch_swiglu, variants_for
from memfit.layers.monarch import MonarchLinear


def fusable(mlp: nn.Module) -> bool:
    """Whether ``mlp``'s gate and up are Monarch layers the fused op takes, with a SiLU activation: plain
    ``MonarchLinear`` (a subclass may compute otherwise) with no forward hooks (the op reads their weights, so a hook
    would not run), of one shape and blocks, block-major outputs and no bias."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not (type(gate) is MonarchLinear and type(up) is MonarchLinear and silu_activation(mlp)):
        return False
    return (gate.blocks == up.blocks and gate.in_features == up.in_features and gate.out_features == up.out_features
            and gate.bias is None and up.bias is None and not gate.permute_output and not up.permute_output
            and not hooked(gate) and not hooked(up))


def _fused_forward(self, x):
    """The MLP's forward through the fused op while its layers still allow it (:func:`fusable`, checked at every
    call: a layer replaced or changed since the fusing runs the class's forward instead)."""
    if not fusable(self):
        return type(self).forward(self, x)
    gate, up = self.gate_proj, self.up_proj
    variant = self.monarch_swiglu_variant
    if variant not in variants_for(x.numel() // gate.in_features, gate.w1, up.w1):   # static per compiled graph
        variant = "auto"
    return self.down_proj(monarch_swiglu(x, gate.w1, gate.w2, up.w1, up.w2, variant=variant))


def fuse_monarch_mlps(model: nn.Module, variant: str = "auto") -> int:
    """Make every MLP of ``model`` that :func:`fusable` accepts compute its product by the fused op; returns how
    many it changed (0 where the model has no such MLP, or they are fused already). An MLP whose forward something
    else has replaced (memfit.train.patch's fused SwiGLU, an offload hook) is refused, naming it.

    ``variant``: "auto", the op's pick, or one of its pipelines, run at every token count that offers it (the others
    take the pick, or compute as unfused where only one pipeline is offered): for measuring one pipeline in a model
    (``benchmarks/blr_e2e.py --fused-mlp``). A pipeline that one token is not offered (``fused_pdl`` before Hopper,
    or at ranks off its K step) is refused, so that a measurement never runs the unfused MLP under its name.
    Applies to every fused MLP, those fused before too."""
    if variant != "auto" and variant not in VARIANTS:
        raise MemfitError(f"fuse_monarch_mlps: variant {variant!r} is not auto or one of {', '.join(VARIANTS)}")
    for name, module in model.named_modules():
        if variant != "auto" and fusable(module) and variant not in variants_for(
                1, module.gate_proj.w1, module.up_proj.w1):
            raise MemfitError(f"fuse_monarch_mlps: {variant!r} is not offered for {name} at one token (fused_pdl "
                              f"needs Hopper or later and ranks that are multiples of {STEP})")
    changed = patch_forwards(model, fusable, _fused_forward, "fuse_monarch_mlps")
    for module in patched_modules(model, _fused_forward):
        module.monarch_swiglu_variant = variant
    return changed


def unfuse_monarch_mlps(model: nn.Module) -> int:
    """Undo :func:`fuse_monarch_mlps`; returns how many MLPs it changed back."""
    for module in patched_modules(model, _fused_forward):
        del module.monarch_swiglu_variant
    return unpatch_forwards(model, _fused_forward)
