"""Low-rank linear y = (x V) U^T + bias: reference, Triton path, custom op.

Shapes: x (..., in), V (in, r), U (out, r), bias (out,) or None.

Two pipelines; ``pick_variant`` times both per shape on the GPU (cached on disk):

* ``fused``: Monarch's chained-dot kernel with one block (:func:`chain_matmul`):
  z = x V stays on chip, chunk by chunk of r. Each output tile recomputes its z, so the
  first matmul's work is repeated out/BO times: it pays only at small N (decode,
  N <= 16), where one launch instead of two and no z round trip is the whole game.
* ``cublas``: two cuBLAS matmuls (z materialised, N r elements), the default off the
  GPU timing path for N > 16: both are large well-shaped GEMMs.
Backward: PyTorch ops (recompute-and-differentiate of the reference); saves only x.
"""
from __future__ import annotations

import torch

from memfit.kernels.blr_common import n_bucket, pick_variant, recompute_backward, save_for_recompute
from memfit.kernels.dispatch import use_triton
from memfit.kernels.monarch import chain_matmul


def lowrank_linear_reference(x, u, v, bias=None):
    """The definition: two matmuls in x's dtype."""
    y = (x @ v) @ u.T
    return y if bias is None else y + bias


def _fused(x2, u, v, bias):
    out, r = u.shape
    y = torch.empty(x2.shape[0], out, device=x2.device, dtype=x2.dtype)
    w1_strides = (0, v.stride(0), v.stride(1))          # w1[0] = V (in x r)
    w2_strides = (0, u.stride(1), u.stride(0))          # w2[0] = U^T (r x out)
    return chain_matmul(x2, v, w1_strides, u, w2_strides, bias, 1, v.shape[0], r, out, y, 0, 1)


def _cublas(x2, u, v, bias):
    z = x2 @ v
    return torch.addmm(bias, z, u.T) if bias is not None else z @ u.T


VARIANTS = {"fused": _fused, "cublas": _cublas}
RECOMPUTE_MAX_N = 128  # beyond this the fused kernel's recomputed x V is hopeless (never timed)


def variants_for(n: int) -> dict:
    """The pipelines worth timing at ``n`` tokens."""
    return VARIANTS if n <= RECOMPUTE_MAX_N else {"cublas": _cublas}


@torch.library.custom_op("memfit::lowrank_linear", mutates_args=())
def _lowrank_op(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                variant: str) -> torch.Tensor:
    x2 = x.reshape(-1, v.shape[0]).contiguous()
    args = (x2, u.contiguous(), v.contiguous(), bias)
    if variant == "auto":
        n = x2.shape[0]
        variant = pick_variant("lowrank_linear", (n_bucket(n), *u.shape, v.shape[0], str(x.dtype)), variants_for(n),
                               "fused" if n <= 16 else "cublas", args)
    return VARIANTS[variant](*args).reshape(*x.shape[:-1], u.shape[0])


@_lowrank_op.register_fake
def _(x, u, v, bias, variant):
    return x.new_empty(*x.shape[:-1], u.shape[0])


_lowrank_op.register_autograd(recompute_backward(lowrank_linear_reference, 4),
                              setup_context=lambda ctx, inputs, output: save_for_recompute(ctx, inputs, output, 4))


def lowrank_linear(x, u, v, bias=None, path=None, variant="auto"):
    """y = (x V) U^T + bias by the Triton op where ``use_triton`` allows (``variant``: auto, fused, cublas)."""
    if use_triton("lowrank_linear", x, u, v, path=path):
        return _lowrank_op(x, *[w if w is None else w.to(x.dtype) for w in (u, v, bias)], variant)
    return lowrank_linear_reference(x, u, v, bias)
