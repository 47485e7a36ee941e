"""A model's plain linear layers computed at decode by memfit's GEMV wherever its pick times it faster than cuBLAS.

At batch-1 decode a linear layer is a matrix-vector product bound by reading its weight, and cuBLAS's GEMM tiles
leave much of the bandwidth unused at some shapes (memfit.kernels.gemv says which and why): a Llama-1B's k and v
projections, 2048 -> 512, run on eight thread blocks. memfit's own decode loop (memfit.infer.generate) picks a path
per shape, timed over all layers of that shape; a model that runs its Hugging Face forward (compiled with CUDA
graphs, as ``benchmarks/blr_e2e.py``'s) gets a like choice from :func:`use_decode_gemv`: every plain ``nn.Linear``
computes by :func:`memfit.kernels.gemv.decode_linear`, which takes the path its pick timed fastest for one weight
of that shape up to ``gemv.MAX_ROWS`` rows and ``F.linear`` above (prefill is unchanged).

Only the layers' forwards change, as an attribute of each instance: the layers and their weights stay as they
are, a ``state_dict`` saves and loads as before (a whole pickled model would not find the patched forward), and
:func:`undo_decode_gemv` deletes the attribute, which restores the class's forward. A forward that something else
already replaced (an offload hook's) is refused rather than dropped.
"""
from __future__ import annotations

import types

from torch import nn

from memfit.errors import MemfitError
from memfit.infer.fused import plain_linear
from memfit.kernels.gemv import decode_linear


def _decode_gemv_forward(self, x):
    return decode_linear(x, self.weight, self.bias)


def _patched(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _decode_gemv_forward


def use_decode_gemv(model: nn.Module) -> int:
    """Make every layer of ``model`` that :func:`memfit.infer.fused.plain_linear` accepts compute by ``decode_linear``
    (its hooks still run: the patch replaces the layer's forward, not the call); returns how many it changed (0
    where none, or all are changed already). A layer whose forward something else has replaced is refused, naming
    it."""
    changed = 0
    for name, module in model.named_modules():
        if not plain_linear(module) or _patched(module):
            continue
        if "forward" in module.__dict__:
            raise MemfitError(f"use_decode_gemv: {name}'s forward is already replaced ({module.forward!r}); patching "
                              "would drop that patch (apply one or the other)")
        module.forward = types.MethodType(_decode_gemv_forward, module)
        changed += 1
    return changed


def undo_decode_gemv(model: nn.Module) -> int:
    """Undo :func:`use_decode_gemv`; returns how many layers it changed back."""
    modules = [module for module in model.modules() if _patched(module)]
    for module in modules:
        del module.forward
    return len(modules)
