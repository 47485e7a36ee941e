"""Replacing the forward of chosen module instances in a model, and putting the class's back.

memfit's inference patches (memfit.infer.decode_gemv's linear layers) change what a module computes without
changing the module: the replacement is an attribute of the instance, so
the layers and their weights stay as they are, a ``state_dict`` saves and loads as before (a whole pickled model
would not find the patched forward), and deleting the attribute restores the class's forward. A forward that
something else already replaced (memfit.train.patch's, an offload hook's) is refused rather than dropped.
"""
from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn

from memfit.errors import MemfitError


def patch_forwards(model: nn.Module, accepts: Callable[[nn.Module], bool], forward: Callable, patch: str) -> int:
    """Make every module of ``model`` that ``accepts`` run ``forward`` (a function of (self, ...)); returns how many
    it changed (0 where none is accepted or all are patched already). A module whose forward something else
    replaced is refused, naming it and ``patch`` (the caller's name, for the message)."""
    changed = 0
    for name, module in model.named_modules():
        if not accepts(module):
            continue
        current = module.__dict__.get("forward")
        if current is None:
            module.forward = types.MethodType(forward, module)
            changed += 1
        elif not _runs(module, forward):
            raise MemfitError(f"{patch}: {name}'s forward is already replaced ({current!r}); patching would drop "
                              "that patch (apply one or the other)")
    return changed


def _runs(module: nn.Module, forward: Callable) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is forward


def patched_modules(model: nn.Module, forward: Callable) -> list[nn.Module]:
    """The modules of ``model`` that :func:`patch_forwards` made run ``forward``."""
    return [module for module in model.modules() if _runs(module, forward)]


def unpatch_forwards(model: nn.Module, forward: Callable) -> int:
    """Undo :func:`patch_forwards` of ``forward``; returns how many modules it changed back."""
    modules = patched_modules(model, forward)
    for module in modules:
        del module.forward
    return len(modules)
