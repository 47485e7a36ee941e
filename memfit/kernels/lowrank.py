"""Low-rank linear y = (x V) U^T + bias: reference, Triton path, custom op.

Shapes: x (..., in), V (in, r), U (out, r), bias (out,) or None.

Three pipelines, all two GEMMs with z = x V (N r elements) written and read once;
``auto_variant`` (through ``pick_variant``) times them per shape on the GPU (cached on disk):

* ``cublas``: two cuBLAS matmuls (``addmm`` folds the bias). Near the matmul rate at
  large N; at decode its GEMV kernels are bound by reading U and V.
* ``bgemm``: the same two GEMMs through memfit's Triton :func:`bgemm` (one batch),
  whose 16-token configs stream each factor with wide K steps over enough column
  tiles to cover the SMs: a decode competitor, and a check on cuBLAS at large N.
* ``bgemm_pdl`` (N <= PDL_MAX_N, Hopper+): ``bgemm`` with the second GEMM chained to the first
  (blr_common's programmatic dependent launch: it starts early, pulls its U slice into
  L2, then waits for z), the two GEMMs' tiles picked together (batched_gemm.pick_chain_tiles). On a GPU
  that offers it the pick does not time ``bgemm`` at any N: on the H200 it never came within 5% of the
  fastest (:func:`blr_common.pick_candidates`).
A chained single kernel (z on chip) is not offered: each output tile would recompute
its z, repeating the first GEMM out/BO times, which lost by 50-170x on the H200.
Backward: PyTorch ops (recompute-and-differentiate of the reference); saves only x (nothing where the
weights are frozen: recompute.save_for_recompute).
"""
from __future__ import annotations

import torch

from memfit.kernels.autotune import auto_variant
from memfit.kernels.batched_gemm import bgemm, pick_chain_tiles
from memfit.kernels.blr_common import (
    PDL_MAX_N,
    bind_shapes,
    contiguous_bias,
    in_compute_dtype,
    pdl_offered,
    pick_bucket,
    pick_candidates,
    require_offered,
    runs_triton,
    skips_dispatcher,
)
from memfit.kernels.recompute import recompute_backward, recomputing, save_for_recompute
from memfit.kernels.tangents import carries_tangents


def lowrank_linear_reference(x, u, v, bias=None):
    """The definition: two matmuls in x's dtype."""
    y = (x @ v) @ u.T
    return y if bias is None else y + bias


def _bgemm(x2, u, v, bias, chained=False, tiles=(None, None)):
    (out, r), (n, d_in) = u.shape, x2.shape
    z = torch.empty(n, r, device=x2.device, dtype=x2.dtype)
    bgemm(x2, v, z, n, d_in, r, 1, (0, x2.stride(0), 1), (0, *v.stride()), (0, z.stride(0), 0, 1),
          launch_dependents=chained, tile=tiles[0])
    y = torch.empty(n, out, device=x2.device, dtype=x2.dtype)
    bgemm(z, u, y, n, r, out, 1, (0, z.stride(0), 1), (0, u.stride(1), u.stride(0)), (0, y.stride(0), 0, 1),
          bias=bias, wait_for_previous=chained, tile=tiles[1])
    return y


def _chained_bgemm(x2, u, v, bias, tiles=(None, None)):
    return _bgemm(x2, u, v, bias, chained=True, tiles=tiles)


def _bgemm_pdl(x2, u, v, bias):
    """``bgemm`` chained, the two GEMMs' tiles picked together (:func:`batched_gemm.pick_chain_tiles`)."""
    (out, r), d_in = u.shape, v.shape[0]
    args = (x2, u, v, bias)
    tiles = pick_chain_tiles("lowrank_linear bgemm_pdl", (pick_bucket(x2.shape[0]), out, r, d_in, str(x2.dtype)),
                             ((d_in, r, 1), (r, out, 1)), _chained_bgemm, args)
    return _chained_bgemm(*args, tiles=tiles)


def _cublas(x2, u, v, bias):
    z = x2 @ v
    return torch.addmm(bias, z, u.T) if bias is not None else z @ u.T


VARIANTS = {"cublas": _cublas, "bgemm": _bgemm, "bgemm_pdl": _bgemm_pdl}
UNPICKED_WITH_PDL = ("bgemm",)   # never within 5% of the fastest on the H200 (blr_common.pick_candidates)


def variants_for(n: int) -> dict:
    """The pipelines offered at ``n`` tokens: cuBLAS and bgemm at every N, chained at small N (the pick times those
    :func:`blr_common.pick_candidates` keeps); the same for every N of one ``pick_bucket`` (which shares a pick)."""
    n = pick_bucket(n)
    names = ["cublas", "bgemm"] + (["bgemm_pdl"] if n <= PDL_MAX_N and pdl_offered() else [])
    return {name: VARIANTS[name] for name in names}


def _lowrank_forward(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                     variant: str) -> torch.Tensor:
    x2 = x.reshape(-1, v.shape[0]).contiguous()
    args = (x2, u.contiguous(), v.contiguous(), contiguous_bias(bias))
    if variant == "auto":
        n = x2.shape[0]
        variant = auto_variant("lowrank_linear", (pick_bucket(n), *u.shape, v.shape[0], str(x.dtype)),
                               lambda: (pick_candidates(variants_for(n), UNPICKED_WITH_PDL), "cublas"), args)
    return VARIANTS[variant](*args).reshape(*x.shape[:-1], u.shape[0])


_lowrank_op = torch.library.custom_op("memfit::lowrank_linear", _lowrank_forward, mutates_args=())


@_lowrank_op.register_fake
def _(x, u, v, bias, variant):
    return x.new_empty(*x.shape[:-1], u.shape[0])


_lowrank_op.register_autograd(recompute_backward(lowrank_linear_reference, 4),
                              setup_context=lambda ctx, inputs, output: save_for_recompute(ctx, inputs, output, 4))


_lowrank_recomputing = recomputing(lowrank_linear_reference, 4, 0)


@carries_tangents
def lowrank_linear(x, u, v, bias=None, path=None, variant="auto"):
    """y = (x V) U^T + bias by the Triton op where ``use_triton`` allows (``variant``: auto or one of VARIANTS), else
    the reference with the op's memory behaviour (:func:`recompute.recomputing`)."""
    size = bind_shapes("lowrank_linear", x, bias, {"u": (u, "o r"), "v": (v, "i r")}, "i", "o")
    x, cast = in_compute_dtype(x, u, v, bias)
    if not runs_triton("lowrank_linear", x, cast[:2], path, variant):
        return _lowrank_recomputing(x, *cast)
    require_offered("lowrank_linear", variant, lambda: variants_for(x.numel() // size["i"]), "at this token count")
    op = _lowrank_forward if skips_dispatcher(x, *cast) else _lowrank_op
    return op(x, *cast, variant)
