"""A model's plain linear layers computed at decode by memfit's GEMV wherever its pick times it faster than cuBLAS.

At batch-1 decode a linear layer is a matrix-vector product bound by reading its weight, and cuBLAS's GEMM tiles
leave much of the bandwidth unused at some shapes (memfit.kernels.gemv says which and why): a Llama-1B's k and v
projections, 2048 -> 512, run on eight thread blocks. memfit's own decode loop (memfit.infer.generate) picks a path
per shape, timed over all layers of that shape; a model that runs its Hugging Face forward (compiled with CUDA
graphs, as ``benchmarks/blr_e2e.py``'s) gets a like choice from :func:`use_decode_gemv`: every plain ``nn.Linear``
computes by :func:`memfit.kernels.gemv.decode_linear`, which takes the path its pick timed fastest for one weight
of that shape up to ``gemv.MAX_ROWS`` rows and ``F.linear`` above (prefill is unchanged). Only the layers'
forwards change (memfit.infer.instance_forward says what that keeps); :func:`undo_decode_gemv` puts the class's
back.
"""
from __future__ import annotations

from torch import nn

from memfit.infer.instance_forward import patch_forwards, unpatch_forwards
from memfit.kernels.gemv import decode_linear


def patchable_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` (a subclass, a 4-bit or LoRA layer, may compute otherwise). Its
    hooks still run: the patch replaces the layer's forward, not the call."""
    return type(module) is nn.Linear


def _decode_gemv_forward(self, x):
    return decode_linear(x, self.weight, self.bias)


def use_decode_gemv(model: nn.Module) -> int:
    """Make every layer of ``model`` that :func:`patchable_linear` accepts compute by ``decode_linear``; returns how
    many it changed (0 where none, or all are changed already). A layer whose forward something else has replaced is
    refused, naming it."""
    return patch_forwards(model, patchable_linear, _decode_gemv_forward, "use_decode_gemv")


def undo_decode_gemv(model: nn.Module) -> int:
    """Undo :func:`use_decode_gemv`; returns how many layers it changed back."""
    return unpatch_forwards(model, _decode_gemv_forward)
