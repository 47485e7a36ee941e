"""Dense -> structured projections: low-rank, Monarch and BLAST, plain or activation-aware.

Every function is pure tensor math on a weight ``W`` of shape ``(..., out, in)`` (the
leading dims batch several same-shape matrices, e.g. one projection kind across all
decoder layers, so a GPU does them in one go). The factor layouts match memfit.layers:

* low-rank:  ``U (..., out, r)``, ``V (..., in, r)``; ``W ~ U V^T``.
* Monarch:   per sub-block ``(i, j)`` (output block i, input block j, ``b`` blocks each way)
  a rank ``r/b`` product ``W_ij ~ L_ij R_ij^T`` with ``L (..., b, b, out/b, r/b)`` and
  ``R (..., b, b, in/b, r/b)``: the closed form is one truncated SVD per sub-block.
  ``MonarchLinear.set_factors`` packs these into the layer's ``w1``/``w2``.
* BLAST:     ``U (..., b, out/b, r)``, ``V (..., b, in/b, r)``, ``S (..., b, b, r)``;
  ``W_ij ~ U_i diag(S_ij) V_j^T``. No closed form: preconditioned alternating descent
  (Lee et al. 2024, "BLAST", Alg. 1) from the better of a block-SVD start (in the bases that
  make every block's core diagonal where the matrix is (nearly) BLAST of the rank) and the
  truncated SVD's, so that a result fits no worse than low-rank of the same rank (to rounding).

Activation-aware ("whitened") variants minimise the output error ``||(W - W^) X^T||_F``
on calibration inputs ``X`` instead of ``||W - W^||_F``. With ``C = X^T X = L L^T``,
that error is ``||(W - W^) L||_F``: project ``W L`` in weight space, then map the input-side
factor back through ``L^{-T}``. Low-rank whitens with the full ``C`` (exact, SVD-LLM
style). Monarch and BLAST whiten with the diagonal blocks ``C_jj`` of each input block,
which keeps the structure (a full ``L^{-1}`` would mix input blocks) and is exact when the
input blocks are uncorrelated with each other. Where they are not, BLAST then refines the
better of its block-whitened and weight-space factors on the true output error with the
full ``C`` (:func:`blast_refine_output_error`: exact block-coordinate descent, so that error
never rises), and Monarch refines its block-whitened factors likewise
(:func:`monarch_refine_output_error`). ``relative_output_error`` reports the true output error.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import warnings

import torch

from memfit.errors import MemfitError, is_count
from memfit.layers.structured import truncated_svd
from memfit.log import warn_once

# The relative error below which blast_factorize starts from the bases that diagonalise a matrix's cores. Elsewhere
# (a matrix that is not BLAST of the rank) those bases can be ill-conditioned, and from a start that fits better the
# descent has ended worse than from the block SVD's.
NEARLY_EXACT = 1e-3
# Steps of blast_factorize between checks of its iterate's true error (the dense miss, not the descent's expanded loss,
# which cancels): the best iterate checked is the result. A check is one dense reconstruction: fewer FLOPs than a step.
BLAST_CHECK_EVERY = 25
# The root-mean-square blast_factorize scales every matrix to before its descent: the descent's damping (delta0 times
# the error, floored at 1e-7 of the matrix's norm) is absolute, and was set where weights have about this scale
# (transformers initialises Llama's linear layers at std 0.02). A weight of another scale had fitted worse
# (test_blast_fits_a_weight_alike_at_any_scale), and at rms 1 the floor of a 2048x2048 matrix, which grows with the
# matrix's size, is 50x what it is at 0.02.
DESCENT_RMS = 0.02

# Relative damping added to a calibration covariance before its Cholesky factor, so dead
# input features (zero variance) do not blow the input-side factor up.
COV_DAMP = 1e-4
# The largest ridge (of the mean variance) the whitening and the refinements raise a covariance's to, tenfold at a
# time, where COV_DAMP's leaves it not positive definite (:func:`_damped_cholesky`). A float32 sum of x^T x is off
# by rounding that grows with its largest eigenvalue, the ridge with its mean: a covariance dominated by a few
# directions (few distinct tokens in the calibration text, a randomly initialised model's inputs) can keep negative
# eigenvalues below COV_DAMP's ridge.
COV_DAMP_MAX = 1.0


# ---- checks -----------------------------------------------------------------------------
def check_structure(method: str, in_features: int, out_features: int, rank: int, blocks: int = 1) -> None:
    """Raise MemfitError when ``method`` cannot take these shapes (before any work)."""
    if method not in ("lowrank", "monarch", "blast"):
        raise MemfitError(f"unknown method {method!r}: use blast, monarch or lowrank")
    if not isinstance(rank, int) or rank < 1:
        raise MemfitError(f"{method}: rank must be a positive integer, got {rank!r}")
    if method == "lowrank":
        return
    if not isinstance(blocks, int) or blocks < 1:
        raise MemfitError(f"{method}: blocks must be a positive integer, got {blocks!r}")
    for name, size in (("in_features", in_features), ("out_features", out_features)):
        if size % blocks:
            raise MemfitError(f"{method}: {name}={size} is not divisible by blocks={blocks}; "
                              f"use a block count that divides {size}")
    if method == "monarch" and rank % blocks:
        raise MemfitError(f"monarch: rank={rank} must be a multiple of blocks={blocks} (each of the "
                          f"{blocks}x{blocks} sub-blocks gets rank/blocks)")


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ---- whitening --------------------------------------------------------------------------
def whitening_factor(cov: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """Lower Cholesky factors ``L_j`` of the diagonal blocks of ``cov`` (``(..., in, in)``), each damped by
    ``COV_DAMP`` of its mean variance, more where that does not factor (:func:`_damped_cholesky`).

    Returns ``(..., blocks, in/blocks, in/blocks)``; ``blocks=1`` gives the full factor.
    """
    n = cov.shape[-1]
    q = n // blocks
    cov = cov.to(torch.float64)
    diag = cov.reshape(*cov.shape[:-2], blocks, q, blocks, q).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
    scale = diag.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    damped = diag.clone()                              # the ridge added in place: no identity and scaled copy of it
    damped.diagonal(dim1=-2, dim2=-1).add_(COV_DAMP * scale[..., None])
    return _damped_cholesky(damped, scale[..., None].expand(damped.shape[:-1]))[0]


def _damped_cholesky(damped: torch.Tensor, unit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cholesky factors of the float64 ``damped`` (``(..., n, n)``), whose diagonal holds a ridge of ``COV_DAMP *
    unit`` (``unit``: ``(..., n)``, the variance each diagonal element's ridge is a fraction of). A matrix that does
    not factor so has its ridge raised tenfold at a time until it does, up to ``COV_DAMP_MAX`` (said once a level);
    only those are factored again, on a copy: ``damped`` is left as it is, the others' factors are the first. Returns
    the factors and each matrix's ridge as a fraction of ``unit``."""
    n = damped.shape[-1]
    flat, units = damped.reshape(-1, n, n), unit.reshape(-1, n)
    factor, info = torch.linalg.cholesky_ex(flat)
    level = torch.full(info.shape, COV_DAMP, dtype=torch.float64, device=flat.device)
    todo, damp = (info != 0).nonzero().squeeze(-1), COV_DAMP
    pending = flat[todo]                               # a copy (advanced indexing)
    while todo.numel():
        if damp >= COV_DAMP_MAX:
            raise MemfitError(f"a calibration covariance is not positive definite even with a ridge of {damp:g} times "
                              "its mean variance: give more (or more varied) calibration text, or compress without "
                              "the activation-aware projection")
        pending.diagonal(dim1=-2, dim2=-1).add_(9 * damp * units[todo])
        damp *= 10
        retried, info = torch.linalg.cholesky_ex(pending)
        done = info == 0
        factor[todo[done]], level[todo[done]] = retried[done], damp
        todo, pending = todo[~done], pending[~done]
        if bool(done.any()):
            warn_once(f"covariance-damped:{damp:g}", f"a calibration covariance is not positive definite with a ridge "
                      f"of {COV_DAMP:g} of its mean variance (its inputs span few directions on this text, or float32 "
                      f"rounding of their sum left it indefinite): a ridge of {damp:g} is used there, which weighs "
                      "the input directions the text leaves out more, nearer the weight-space projection; more varied "
                      "calibration text avoids it")
    return factor.reshape(damped.shape), level.reshape(damped.shape[:-2])


def _unwhiten(factor_t: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """Map an input-side factor of ``W L`` back to ``W``'s: ``L^{-T} X`` (per input block)."""
    return torch.linalg.solve_triangular(chol.transpose(-1, -2), factor_t, upper=True)


def _whitened_svd(Wb: torch.Tensor, chol: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-``k`` ``L R^T`` minimising ``||(Wb - L R^T) chol||_F`` per sub-block (``chol`` its input covariance's
    Cholesky factor): the truncated SVD of ``Wb chol``, its right factor mapped back."""
    L, Rw = truncated_svd((Wb.double() @ chol).to(Wb.dtype), k)
    return _balance_pair(L, _unwhiten(Rw.double(), chol).to(Wb.dtype))


def _blocks(W: torch.Tensor, blocks: int) -> torch.Tensor:
    """``(..., out, in)`` -> ``(..., i, j, out/b, in/b)`` sub-blocks."""
    *lead, out, inp = W.shape
    p, q = out // blocks, inp // blocks
    return W.reshape(*lead, blocks, p, blocks, q).transpose(-3, -2)


def _unblocks(Wb: torch.Tensor) -> torch.Tensor:
    *lead, bi, bj, p, q = Wb.shape
    return Wb.transpose(-3, -2).reshape(*lead, bi * p, bj * q)


def _unit_rms(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` scaled to unit root-mean-square per matrix, and that scale ``(..., 1, 1)``: the descents' and the
    refinements' ridges are absolute, and a weight's own scale must not weigh them."""
    rms = A.square().mean((-2, -1)).sqrt().clamp_min(torch.finfo(A.dtype).tiny)[..., None, None]
    return A / rms, rms


def _unit_covariance(cov: torch.Tensor, dtype: torch.dtype, blocks: int = 1) -> torch.Tensor:
    """``cov`` scaled to unit mean variance, each of its ``blocks`` diagonal blocks damped by ``COV_DAMP`` of its own
    mean variance (as :func:`whitening_factor` damps them): what the refinements measure the output error on. Where
    the whole is not positive definite so, every block's ridge is raised by the same factor until it is
    (:func:`_damped_cholesky`, one matrix at a time: a float64 copy and its factor): on an indefinite covariance the
    refinements' objective has no minimum, and a sweep that drove the error below zero had been taken as a better
    fit. Where that leaves a block's ridge above the whitening's, the refinement fits a little more weight-like."""
    C = cov.to(dtype)
    C = C / C.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(dtype).tiny)[..., None, None]
    block_variance = C.diagonal(dim1=-2, dim2=-1).unflatten(-1, (blocks, -1)).mean(-1)          # (..., blocks)
    unit = block_variance.clamp_min(torch.finfo(dtype).tiny).repeat_interleave(C.shape[-1] // blocks, -1)
    C = C + torch.diag_embed(COV_DAMP * unit)
    for index in itertools.product(*map(range, C.shape[:-2])):
        ridge = float(_damped_cholesky(C[index].double(), unit[index].double())[1])
        if ridge > COV_DAMP:
            C[index].diagonal().add_((ridge - COV_DAMP) * unit[index])
    return C


def _output_error(E: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """``||E L||_F^2`` (``C = L L^T``) per matrix of the error ``E``, +inf where not finite: the refinements' objective."""
    err = (E * (E @ C)).sum((-2, -1))
    return torch.where(err.isfinite(), err, torch.full_like(err, math.inf))


def _keep_better_sweep(swept: torch.Tensor, err: torch.Tensor, new: tuple, old: tuple):
    """A refinement sweep's factors ``new`` where its error ``swept`` is not above ``err``, else ``old``, per matrix;
    the error kept, and whether any matrix took the sweep (if none did, the next sweep, a function of the factors,
    would repeat it)."""
    kept = swept <= err
    return (tuple(_per_matrix(kept, n, o) for n, o in zip(new, old)), torch.where(kept, swept, err),
            bool(kept.any()))


# ---- low-rank ----------------------------------------------------------------------------
def lowrank_project(W: torch.Tensor, rank: int, cov: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` ``U V^T`` to ``W`` (truncated SVD), or to ``W`` on inputs of covariance ``cov``."""
    check_structure("lowrank", W.shape[-1], W.shape[-2], rank)
    A = W.to(_work_dtype(W))
    if cov is None:
        return truncated_svd(A, rank)
    return _whitened_svd(A, whitening_factor(cov, 1)[..., 0, :, :], rank)


def _balance_pair(U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``U`` and ``V`` scaled per rank column to equal norms; ``U V^T`` is unchanged.

    The whitened SVD splits the singular values of ``W L`` evenly, and unwhitening then moves
    the covariance's scale (a sum over calibration tokens) onto ``V`` alone: on the CPU accuracy
    run (085885f) the q_proj factors came out with rms 0.64 and 0.009, and a recovery fine-tune,
    whose AdamW steps are about the same size per element, moved the small factor so far that
    it raised the perplexity. Zero columns (rank padding, pairs below truncated_svd's floor) stay as they are."""
    nu, nv = U.norm(dim=-2, keepdim=True), V.norm(dim=-2, keepdim=True)
    c = torch.where((nu > 0) & (nv > 0), (nv / nu.clamp_min(1e-300)).sqrt(), torch.ones_like(nu))
    return U * c, V / c


def lowrank_dense(U: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    return U @ V.transpose(-1, -2)


# ---- Monarch -----------------------------------------------------------------------------
def monarch_project(W: torch.Tensor, rank: int, blocks: int, cov: torch.Tensor | None = None,
                    refine_sweeps: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form Monarch projection: a rank-``rank/blocks`` truncated SVD of each sub-block.

    Returns ``L (..., b, b, out/b, r/b)`` and ``R (..., b, b, in/b, r/b)`` with
    ``W_ij ~ L_ij R_ij^T``. With ``cov``, sub-block ``(i, j)`` is whitened by ``C_jj``, and
    ``refine_sweeps`` of :func:`monarch_refine_output_error` then lower the output error on the
    full covariance, which the block whitening leaves out.
    """
    check_structure("monarch", W.shape[-1], W.shape[-2], rank, blocks)
    k = rank // blocks
    A = W.to(_work_dtype(W))
    Wb = _blocks(A, blocks)
    if cov is None:
        return truncated_svd(Wb, k)
    chol = whitening_factor(cov, blocks).unsqueeze(-4)  # (..., 1, j, q, q): broadcast over i
    L, R = _whitened_svd(Wb, chol, k)
    return _balance_pair(*monarch_refine_output_error(A, L, R, cov, refine_sweeps))


def monarch_refine_output_error(A: torch.Tensor, L: torch.Tensor, R: torch.Tensor, cov: torch.Tensor,
                                sweeps: int = 20, history: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower ``||(A - A^) X^T||_F^2`` (``X^T X = C``, the full input covariance) over Monarch factors.

    Whitening each input block by its own ``C_jj`` ignores the covariance between input blocks. With the other
    blocks' errors ``e_k`` fixed, the output error is, in input block j's error ``e_j = A_:j - A^_:j``,
    ``||(e_j + G_j) L_jj||_F^2`` plus a constant, ``G_j = sum_{k != j} e_k C_kj C_jj^-1`` (``L_jj L_jj^T = C_jj``):
    so every sub-block ``(i, j)`` of block column j is the rank-``r/b`` whitened truncated SVD of ``A_ij + G_ij``,
    the exact minimum. A sweep takes the block columns in turn (Gauss-Seidel), all output blocks at once, tracking
    ``E C``; in exact arithmetic the error never rises, and a sweep that fits worse is dropped, per matrix.
    ``history`` receives the relative output error after every sweep. Runs on ``A`` and ``C`` scaled as
    :func:`blast_refine_output_error`'s, ``C`` damped by :func:`_unit_covariance` (positive definite as a whole, so
    every diagonal block is too).
    """
    dt = A.dtype
    *lead, out, inp = A.shape
    b, k = L.shape[-4], L.shape[-1]
    q = inp // b
    A, rms = _unit_rms(A)
    L = L / rms.unsqueeze(-1).unsqueeze(-1)
    C = _unit_covariance(cov, dt, b)
    C_jj = C.unflatten(-2, (b, q)).unflatten(-1, (b, q)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # (..., j, q, q)
    chol = torch.linalg.cholesky(C_jj.double())       # float64, as the whitening's; C's blocks: positive definite

    a_norm2 = (A * (A @ C)).sum((-2, -1))
    E = A - monarch_dense(L, R)
    err = _output_error(E, C)
    for _ in range(sweeps):
        before = (L, R, E)
        L, R, E = L.clone(), R.clone(), E.clone()
        EC = E @ C
        for j in range(b):
            cols = slice(j * q, (j + 1) * q)
            e_j = E[..., :, cols]
            G = torch.cholesky_solve((EC[..., :, cols] - e_j @ C_jj[..., j, :, :]).transpose(-1, -2).double(),
                                     chol[..., j, :, :]).transpose(-1, -2).to(dt)       # (..., out, q)
            target = (A[..., :, cols] + G).reshape(*lead, b, out // b, q)               # (..., i, p, q)
            L_j, R_j = _whitened_svd(target, chol[..., j, :, :].unsqueeze(-3), k)
            L[..., :, j, :, :], R[..., :, j, :, :] = L_j, R_j
            new_e = A[..., :, cols] - (L_j @ R_j.transpose(-1, -2)).reshape(*lead, out, q)
            EC = EC + (new_e - e_j) @ C[..., cols, :]
            E[..., :, cols] = new_e
        (L, R, E), err, any_kept = _keep_better_sweep(_output_error(E, C), err, (L, R, E), before)
        if history is not None:
            history.append((err / a_norm2.clamp_min(1e-30)).sqrt())
        if not any_kept:
            break
    return L * rms.unsqueeze(-1).unsqueeze(-1), R


def monarch_dense(L: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    return _unblocks(L @ R.transpose(-1, -2))


# ---- BLAST -------------------------------------------------------------------------------
def blast_dense(U: torch.Tensor, V: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``W_ij = U_i diag(S_ij) V_j^T`` assembled into ``(..., out, in)``."""
    blocks = (U.unsqueeze(-3) * S.unsqueeze(-2)) @ V.unsqueeze(-4).transpose(-1, -2)
    return _unblocks(blocks)


def _top_eigvecs(gram: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` leading eigenvectors of a PSD ``gram``; random unit columns beyond its size."""
    n = gram.shape[-1]
    _, vecs = torch.linalg.eigh(gram)
    top = vecs[..., :, max(n - k, 0):].flip(-1)
    if k > n:
        extra = torch.randn(*gram.shape[:-1], k - n, dtype=gram.dtype, device=gram.device, generator=generator)
        top = torch.cat([top, extra / math.sqrt(n)], -1)
    return top


SOLVES = ("lu", "cholesky")
SOLVE_BY_DEVICE = {"cpu": "lu", "cuda": "cholesky"}   # benchmarks/probes/damped_solve_time.py times both
# torch's linear-algebra back end for the damped solves' Cholesky on CUDA where a call factors more than one system
# (None: torch's own choice, which factored by cuSOLVER and solved the triangular systems by MAGMA's batched kernels,
# benchmarks/results/probes/blast_step_time_da462fa.json). On an H100, with factor and solve forced to each, cuSOLVER
# took 1.9x MAGMA's time for 16 systems of 770 with 128 right-hand sides (a Llama-3.2-1B gate weight's V step), 2.1x
# at q's rank of 464, and 4.6x for four gate weights' systems at once (blast_step_time_4dc1da1.json). torch calls its
# MAGMA back end deprecated: a torch without it solves by its own choice, and memfit says so once.
CUDA_CHOLESKY_LIBRARY = "magma"
# Conjugate-gradient iterations of BLAST's S step, from zero, in place of its exact damped solve: b^2 systems of
# rank x rank each step, which an exact solve factors: 11.3 ms by cuSOLVER and 9.6 by MAGMA for a Llama-3.2-1B gate
# weight's, 1.3 ms by these iterations, on an H100 (blast_step_time_4dc1da1.json). The systems have a unit diagonal
# (the descent normalises every U_i and V_j column) plus the ridge; after 300 steps the error is the exact solve's to
# six digits there, at the q and gate shapes, on Gaussian weights and on weights with a trained one's falling
# spectrum (test_blast_descent_fits_by_cg_as_by_the_exact_s_step holds it at a small shape). 0: the exact solve.
S_STEP_CG_ITERATIONS = 5
# One caller at a time sets torch's process-wide preferred back end (_cholesky_library), so that threads projecting
# at once cannot leave each other's choice behind.
_LIBRARY_LOCK = threading.Lock()


@contextlib.contextmanager
def _cholesky_library(device: torch.device, systems: int):
    """Within: torch's preferred linear-algebra back end set to ``CUDA_CHOLESKY_LIBRARY`` for ``systems`` (more than
    one) on a CUDA ``device``, and restored after; nothing changes otherwise. The preference is process-wide: the
    block holds a lock, and another thread's linear algebra meanwhile runs under it too. torch's Python warning that
    its MAGMA back end is deprecated is not passed on (a filter that, like the preference, holds for every thread while
    the block runs; torch's C++ messages on setting the preference, printed once a process, still show); a torch
    built without that back end is said once, and the solves go on by torch's own choice."""
    if device.type != "cuda" or systems < 2 or CUDA_CHOLESKY_LIBRARY is None:
        yield
        return
    if CUDA_CHOLESKY_LIBRARY == "magma" and not torch._C._has_magma:
        warn_once("cholesky-library", "BLAST's damped solves factor by torch's default linear-algebra back end, "
                  "slower than MAGMA's at these shapes: this torch was built without MAGMA")
        yield
        return
    with _LIBRARY_LOCK:
        before = torch.backends.cuda.preferred_linalg_library()
        try:
            torch.backends.cuda.preferred_linalg_library(CUDA_CHOLESKY_LIBRARY)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*MAGMA.*deprecated")
                yield
        finally:
            torch.backends.cuda.preferred_linalg_library(before)


def _damped_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: torch.Tensor, solve: str | None = None) -> torch.Tensor:
    """``(gram + ridge I)^{-1} rhs`` for a batch of symmetric positive semi-definite ``gram`` and a finite ``ridge``
    shaped to broadcast over its diagonals, never raising (a singular system gives non-finite entries, which a caller
    compares away). The ridge is added on the diagonal in place and taken off again: ``gram`` comes back bit for bit,
    with no copy of the batch (each BLAST descent step had copied its b^2 (r x r) Gram matrices). So ``gram`` must be
    a tensor of the caller's own, outside autograd (the projections run under no_grad).

    ``solve`` (default: ``SOLVE_BY_DEVICE`` for ``gram``'s device) is ``"lu"`` or ``"cholesky"`` (on CUDA by
    ``CUDA_CHOLESKY_LIBRARY``): on the CPU, torch's batched Cholesky was the slower at the shapes of BLAST's S step
    (which takes conjugate-gradient iterations now, ``S_STEP_CG_ITERATIONS``); on an H100 it took 0.35-0.63x LU's time
    at every Llama-3.2-1B shape's U and S steps, and 10 descent steps of its q projection 0.194 against 0.319 s, to the
    same error (``benchmarks/results/probes/damped_solve_time_17f23bd.json``, before either change). A damped Gram
    matrix that rounding leaves indefinite does not factor: those systems, and only those, are solved by LU, as
    before, so Cholesky changes the result's rounding, not which systems are solved. ``SOLVE_BY_DEVICE`` is for BLAST's
    descent (its start's S fit and its U and V steps); its output-error refinement, whose ridge is far smaller, passes
    ``"lu"``."""
    solve = solve or SOLVE_BY_DEVICE.get(gram.device.type, "lu")
    if solve not in SOLVES:
        raise ValueError(f"solve must be one of {SOLVES}, got {solve!r}")
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    saved = diagonal.clone()
    diagonal.add_(ridge)
    try:
        if solve == "lu":
            return torch.linalg.solve_ex(gram, rhs)[0]
        with _cholesky_library(gram.device, gram.shape[:-2].numel()):
            factor, info = torch.linalg.cholesky_ex(gram)
            result = torch.cholesky_solve(rhs, factor)
        if bool((failed := info != 0).any()):                 # one host sync a call
            batch = result.shape[:-2]
            failed = failed.expand(batch)
            result[failed] = torch.linalg.solve_ex(gram.expand(*batch, *gram.shape[-2:])[failed],
                                                   rhs.expand(*batch, *rhs.shape[-2:])[failed])[0]
        return result
    finally:
        diagonal.copy_(saved)


def _damped_cg(gram: torch.Tensor, rhs: torch.Tensor, ridge: torch.Tensor, iterations: int) -> torch.Tensor:
    """``(gram + ridge I)^{-1} rhs`` approximately: ``iterations`` of conjugate gradients from zero, batched over
    every system (one batched matrix-vector product an iteration, no host sync), for symmetric positive semi-definite
    ``gram (..., n, n)``, ``rhs (..., n, 1)`` and a positive ``ridge`` shaped as :func:`_damped_solve` takes it, to
    broadcast over the diagonals ``(..., n)``. Each iterate minimises the damped quadratic over a larger Krylov
    space, so any count lowers it; a non-finite system gives non-finite entries, which a caller compares away."""
    ridge = ridge.unsqueeze(-1)
    x = torch.zeros_like(rhs)
    residual = rhs
    direction = rhs
    norm2 = residual.square().sum(-2, keepdim=True)
    for _ in range(iterations):
        product = gram @ direction + ridge * direction
        alpha = norm2 / (direction * product).sum(-2, keepdim=True).clamp_min(torch.finfo(rhs.dtype).tiny)
        x = x + alpha * direction
        residual = residual - alpha * product
        new_norm2 = residual.square().sum(-2, keepdim=True)
        direction = residual + new_norm2 / norm2.clamp_min(torch.finfo(rhs.dtype).tiny) * direction
        norm2 = new_norm2
    return x


def _solve_s(U, V, D, delta):
    """Least-squares ``S_ij`` given ``U``, ``V`` and ``D_ij = diag(U_i^T A_ij V_j)``."""
    gram = (U.transpose(-1, -2) @ U).unsqueeze(-3) * (V.transpose(-1, -2) @ V).unsqueeze(-4)  # (...,i,j,r,r)
    return _damped_solve(gram, D.unsqueeze(-1), delta[..., None, None, None]).squeeze(-1), gram


def _diag_uav(Ab, U, V):
    """``D_ij = diag(U_i^T A_ij V_j)`` for all sub-blocks: ``(..., i, j, r)``."""
    UA = U.transpose(-1, -2).unsqueeze(-3) @ Ab  # (..., i, j, r, q)
    return (UA * V.transpose(-1, -2).unsqueeze(-4)).sum(-1)


def _normalise(U, V, S):
    """Unit-norm columns of every ``U_i`` and ``V_j``, the scale moved into ``S`` (W^ unchanged)."""
    nu = U.norm(dim=-2).clamp_min(1e-30)  # (..., i, r)
    nv = V.norm(dim=-2).clamp_min(1e-30)  # (..., j, r)
    return U / nu.unsqueeze(-2), V / nv.unsqueeze(-2), S * nu.unsqueeze(-2) * nv.unsqueeze(-3)


def _scaled_gram_sum(gram: torch.Tensor, S: torch.Tensor, over: int) -> torch.Tensor:
    """``sum_k diag(s_k) G_k diag(s_k)`` over the block axis ``over`` of ``S (..., i, j, r)`` (-2: over j, one sum per
    block row i; -3: over i, one per block column j), for the blocks' Gram matrices ``gram (..., k, r, r)``: the Gram
    matrix ``Xbar^T Xbar`` of the blocks scaled by ``S`` and stacked, from ``b`` Gram matrices of ``r x r`` instead of a
    product over the stacked length. The descent's U step needs it of V's blocks (length ``in``), its V step of U's
    (length ``out``): at a Llama-3.2-1B gate weight's shape, 8192 x 770 stacked, that product took the most of a step's
    floating-point work."""
    total = torch.zeros(*S.shape[:over], *S.shape[over + 1:], S.shape[-1], dtype=S.dtype, device=S.device)
    for k in range(S.shape[over]):
        s = S.select(over, k)
        total.addcmul_(s.unsqueeze(-1) * s.unsqueeze(-2), gram.select(-3, k).unsqueeze(-3))
    return total


def _right_divide(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A B^{-1}``, never raising: a singular ``B`` gives non-finite entries, which a caller compares away."""
    return torch.linalg.solve_ex(B, A, left=False)[0]


def _unit_columns(X: torch.Tensor) -> torch.Tensor:
    """``X`` with every column scaled to unit norm (a zero column stays zero)."""
    return X / X.norm(dim=-2, keepdim=True).clamp_min(1e-30)


def _lowrank_bases(A: torch.Tensor, rank: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-``rank`` truncated SVD ``U V^T`` as BLAST bases: ``U_i`` the rows of ``U`` in block row i, ``V_j``
    those of ``V`` in block column j (with ``S`` all ones, BLAST's form of that matrix).

    On weights whose singular values fall off, as trained ones do, the block SVD's start is far from this one (from
    it, the descent had ended above the truncated SVD's own error), and this one is the better start."""
    *lead, out, inp = A.shape
    U, V = truncated_svd(A, rank)                     # zero columns past min(out, in) and below its floor
    return U.reshape(*lead, blocks, out // blocks, rank), V.reshape(*lead, blocks, inp // blocks, rank)


def _diagonalising_bases(Ab: torch.Tensor, U: torch.Tensor, V: torch.Tensor, generator: torch.Generator | None):
    """New bases of the block-SVD subspaces ``U (..., i, p, r)``, ``V (..., j, q, r)`` in which every core
    ``U_i^T A_ij V_j`` is diagonal, where such bases exist (Jennrich's simultaneous diagonalisation).

    For an exactly BLAST matrix the block SVD finds each ``U_i`` and ``V_j`` only up to a change of basis: its cores
    are ``C_ij = P_i diag(s_ij) T_j`` with invertible ``P_i``, ``T_j`` (r x r), not diagonal, so a diagonal ``S``
    fitted to them misses, and from there the descent stalled short of some random exact matrices. With
    ``M_j = C_1j C_2j^{-1} = P_1 D_j P_2^{-1}``, two random combinations give ``E = M_a M_b^{-1} = P_1 D P_1^{-1}``,
    whose eigenvectors are ``P_1``'s columns; then ``P_1^{-1} C_1j`` is ``T_j`` up to row scales and ``C_i1`` times
    that of ``j = 1`` inverted is ``P_i`` up to column scales, all in one order of the rank components (``S`` takes
    the scales). For a matrix that is not exactly BLAST, a complex pair of eigenvalues gives its eigenvector's real
    and imaginary parts, a real basis of the same plane; singular cores give non-finite bases. Needs two blocks.
    """
    C = U.transpose(-1, -2).unsqueeze(-3) @ Ab @ V.unsqueeze(-4)                       # (..., i, j, r, r)
    M = _right_divide(C[..., 0, :, :, :], C[..., 1, :, :, :])                          # (..., j, r, r)
    mix = torch.randn(2, M.shape[-3], dtype=M.dtype, device=M.device, generator=generator)
    E = _right_divide((mix[0, :, None, None] * M).sum(-3), (mix[1, :, None, None] * M).sum(-3))
    values, vectors = torch.linalg.eig(torch.nan_to_num(E, nan=0.0, posinf=0.0, neginf=0.0))
    P1 = torch.where(values.imag.unsqueeze(-2) < 0, vectors.imag, vectors.real)
    T = torch.linalg.solve_ex(P1.unsqueeze(-3), C[..., 0, :, :, :])[0]                 # (..., j, r, r), T_j up to rows
    P = _right_divide(C[..., :, 0, :, :], T[..., :1, :, :])                            # (..., i, r, r), P_i up to cols
    return U @ P, V @ T.transpose(-1, -2)


def check_steps(steps, name: str = "steps", least: int = 1) -> None:
    """BLAST's descent steps per matrix, an integer of at least ``least``: where a caller asks for a projection, 0 or
    fewer had returned the descent's start unsaid; :func:`blast_factorize` takes 0 for that start."""
    if not is_count(steps, least):
        what = "a positive integer" if least == 1 else f"an integer of at least {least}"
        raise MemfitError(f"{name} (BLAST's descent steps per matrix) must be {what}, got {steps!r}")


def blast_factorize(A: torch.Tensor, rank: int, blocks: int, steps: int = 300, step_size: float = 1.0,
                    delta0: float = 0.01, seed: int = 0, history: list | None = None):
    """BLAST factors of ``A (..., out, in)`` by preconditioned alternating gradient descent.

    Each step updates, in turn, every ``U_i``, every ``V_j`` and every ``S_ij`` with the
    gradient of ``||A - A^||_F^2`` right-multiplied by the inverse of the damped Gram
    matrix of the other factors (BLAST paper, Alg. 1); ``step_size=1`` makes the U and V updates
    the exact damped least-squares solves, and the S update ``S_STEP_CG_ITERATIONS`` conjugate-gradient iterations
    toward its own (the exact solve where that is 0). The damping is ``delta0 * ||A - A^||_F`` so it
    vanishes as the fit converges; the descent runs on ``A`` scaled to root-mean-square ``DESCENT_RMS`` (the scale
    goes back on ``S``), so that a weight's own scale, which that absolute damping had weighed, does not change its fit.
    The start, per matrix, is the better fit of two: a block SVD
    (``U_i`` spans block row i, ``V_j`` block column j, ``S`` their least-squares weights; in
    the bases that make every block's core diagonal (:func:`_diagonalising_bases`; rank at most
    the block size) where those fit the matrix to ``NEARLY_EXACT`` -- so a generic matrix that is
    exactly BLAST of this rank starts within that and is recovered by the descent (in float64; a
    float32 matrix's bases are diagonalised in float64, and still miss the gate for some matrices,
    and at ranks near the block size for all we tried: at 768x768 in 16 blocks, rank 40)), and the rank-``rank``
    truncated SVD in BLAST's form (:func:`_lowrank_bases`, ``S`` fitted likewise), so the result
    fits no worse than it (to the solves' damping and rounding). ``history`` (a list) receives the relative error
    after every step.

    The result is, per matrix, the iterate with the lowest true error among the start and every
    ``BLAST_CHECK_EVERY``-th step (and the last; ``steps=0`` returns the start): where a matrix is fitted exactly at
    a lower rank than asked (a rank-deficient weight), the spare rank components pair up with large opposite
    weights once the fit is exact and the descent runs away to non-finite factors; an all-zero
    matrix makes every Gram matrix singular. Every solve is non-raising, and those iterates lose.
    """
    check_structure("blast", A.shape[-1], A.shape[-2], rank, blocks)
    check_steps(steps, least=0)
    A = A.to(_work_dtype(A))
    A, rms = _unit_rms(A)                              # the damping is absolute: the descent runs at DESCENT_RMS
    A, rms = A * DESCENT_RMS, rms / DESCENT_RMS
    gen = torch.Generator(device=A.device).manual_seed(seed)
    b = blocks
    *lead, out, inp = A.shape
    p, q = out // b, inp // b
    Ab = _blocks(A, b)                               # (..., i, j, p, q)
    Arow = A.reshape(*lead, b, p, inp)               # block rows A_{i,*}
    Acol = A.reshape(*lead, out, b, q).movedim(-2, -3)  # block columns A_{*,j}: (..., j, out, q)
    a_norm2 = A.square().sum((-2, -1))

    tiny = 1e-7 * a_norm2.sqrt()

    def loss(S, gram, D):
        fit = (S * D).sum((-3, -2, -1))
        quad = (S.unsqueeze(-2) @ gram @ S.unsqueeze(-1)).sum((-4, -3, -2, -1))
        return (a_norm2 - 2 * fit + quad).clamp_min(0)

    def start(U, V):                                   # S fitted to U and V, and the squared error
        D = _diag_uav(Ab, U, V)
        S, gram = _solve_s(U, V, D, tiny)
        return U, V, S, gram, loss(S, gram, D)

    def true_miss(U, V, S):                            # squared dense error, +inf where not finite
        miss = (A - blast_dense(U, V, S)).square().sum((-2, -1))
        return torch.where(miss.isfinite(), miss, torch.full_like(miss, math.inf))

    U = _top_eigvecs(Arow @ Arow.transpose(-1, -2), rank, gen)          # (..., i, p, r)
    V = _top_eigvecs(Acol.transpose(-1, -2) @ Acol, rank, gen)          # (..., j, q, r)
    U, V, S, gram, err = start(U, V)
    if b > 1 and rank <= min(p, q):  # per matrix, the bases that diagonalise its cores where they fit it (nearly) exactly
        # (beyond the block size every core is singular); in float64 whatever A's dtype: from float32 cores, their
        # products' inverses had missed the gate (test_a_float32_exactly_blast_matrix_starts_within_the_gate)
        U2, V2 = (x.to(A.dtype) for x in _diagonalising_bases(Ab.double(), U.double(), V.double(), gen))
        diagonal = start(_unit_columns(U2), _unit_columns(V2))
        miss = (A - blast_dense(*diagonal[:3])).square().sum((-2, -1))     # not from loss(): it cancels at large S
        better = miss < NEARLY_EXACT ** 2 * a_norm2    # False where the diagonalising start is not finite
        U, V, S, gram, err = (_per_matrix(better, y, x) for x, y in zip((U, V, S, gram, err), diagonal))
        del U2, V2, diagonal, miss, better             # not held through the descent
    # per matrix, the truncated SVD's bases where they fit better: BLAST of rank r holds every rank-r matrix
    lowrank = start(*map(_unit_columns, _lowrank_bases(A, rank, b)))
    better = true_miss(*lowrank[:3]) < true_miss(U, V, S)
    U, V, S, gram, err = (_per_matrix(better, y, x) for x, y in zip((U, V, S, gram, err), lowrank))
    del lowrank, better
    best, best_miss = (U, V, S), true_miss(U, V, S)
    gram_v = V.transpose(-1, -2) @ V                   # (..., j, r, r): V's blocks', made by each step for the next
    for step in range(1, steps + 1):
        delta = (delta0 * err.sqrt()).clamp_min(tiny)
        dd = delta[..., None, None]
        # U_i: gradient (U_i M_i - A_{i,*} Vbar_i), preconditioner (M_i + delta I)^{-1}, M_i = Vbar_i^T Vbar_i
        Vbar = (V.unsqueeze(-4) * S.unsqueeze(-2)).flatten(-3, -2)         # (..., i, in, r)
        M = _scaled_gram_sum(gram_v, S, -2)
        grad = U @ M - Arow @ Vbar
        U = U - step_size * _damped_solve(M, grad.transpose(-1, -2), dd).transpose(-1, -2)
        # V_j: gradient (V_j N_j - A_{*,j}^T Ubar_j), preconditioner (N_j + delta I)^{-1}, N_j = Ubar_j^T Ubar_j
        gram_u = U.transpose(-1, -2) @ U                                    # (..., i, r, r)
        Ubar = (U.unsqueeze(-3) * S.unsqueeze(-2)).transpose(-4, -3).flatten(-3, -2)  # (..., j, out, r)
        N = _scaled_gram_sum(gram_u, S, -3)
        grad = V @ N - Acol.transpose(-1, -2) @ Ubar
        V = V - step_size * _damped_solve(N, grad.transpose(-1, -2), dd).transpose(-1, -2)
        U, V, S = _normalise(U, V, S)
        # the blocks' Gram matrices of the unit columns: the S step's, and V's for the next step's U step (made from
        # the normalised factors, not scaled from those above: a column too small to square in float32 would not be
        # scaled consistently)
        gram_u, gram_v = U.transpose(-1, -2) @ U, V.transpose(-1, -2) @ V
        # S_ij: gradient (G_ij s_ij - diag(U_i^T A_ij V_j)), preconditioner (G_ij + delta I)^{-1}
        D = _diag_uav(Ab, U, V)
        gram = gram_u.unsqueeze(-3) * gram_v.unsqueeze(-4)
        g = ((gram @ S.unsqueeze(-1)).squeeze(-1) - D).unsqueeze(-1)
        ridge = delta[..., None, None, None]
        S = S - step_size * (_damped_cg(gram, g, ridge, S_STEP_CG_ITERATIONS) if S_STEP_CG_ITERATIONS
                             else _damped_solve(gram, g, ridge)).squeeze(-1)
        err = loss(S, gram, D)
        if history is not None:
            history.append((err / a_norm2.clamp_min(1e-30)).sqrt())
        if step % BLAST_CHECK_EVERY == 0 or step == steps:
            miss = true_miss(U, V, S)
            better = miss < best_miss
            best = tuple(_per_matrix(better, new, old) for new, old in zip((U, V, S), best))
            best_miss = torch.minimum(miss, best_miss)
    U, V, S = best
    return _balance(U, V, S * rms.unsqueeze(-1))


def _per_matrix(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` where ``mask`` (one flag per matrix of the batch), else ``old``."""
    return torch.where(mask.view(mask.shape + (1,) * (new.dim() - mask.dim())), new, old)


def _balance(U, V, S):
    """Spread the scale evenly: unit-rms ``S`` per rank column, the rest split over ``U`` and ``V``."""
    U, V, S = _normalise(U, V, S)
    c = S.square().mean((-3, -2)).sqrt().clamp_min(1e-30)  # (..., r)
    root = c.sqrt()[..., None, None, :]
    return U * root, V * root, S / c[..., None, None, :]


def blast_project(W: torch.Tensor, rank: int, blocks: int, cov: torch.Tensor | None = None,
                  steps: int = 300, history: list | None = None, refine_sweeps: int = 20, **kwargs):
    """BLAST projection of ``W``; with ``cov``, of its output on inputs with covariance ``cov``:
    the block-whitened and the weight-space descents both run, the one with the lower true
    output error starts ``refine_sweeps`` of :func:`blast_refine_output_error`, so the result's
    output error is never above the weight-space projection's.

    Returns ``U (..., b, out/b, r)``, ``V (..., b, in/b, r)``, ``S (..., b, b, r)``.
    """
    check_structure("blast", W.shape[-1], W.shape[-2], rank, blocks)
    A = W.to(_work_dtype(W))
    if cov is None:
        return blast_factorize(A, rank, blocks, steps=steps, history=history, **kwargs)
    chol = whitening_factor(cov, blocks)  # (..., j, q, q)
    Aw = _unblocks(_blocks(A.double(), blocks) @ chol.unsqueeze(-4)).to(A.dtype)
    U, Vw, S = blast_factorize(Aw, rank, blocks, steps=steps, history=history, **kwargs)
    whitened = (U, _unwhiten(Vw.double(), chol).to(A.dtype), S)
    plain = blast_factorize(A, rank, blocks, steps=steps, **kwargs)
    # per matrix, the start with the lower true output error (block whitening can lose to weight space)
    worse = relative_output_error(A, blast_dense(*whitened), cov) > relative_output_error(A, blast_dense(*plain), cov)
    start = [torch.where(worse[..., None, None, None], p, w) for w, p in zip(whitened, plain)]
    return _balance(*blast_refine_output_error(A, *start, cov, refine_sweeps))  # the scale refining put on V, spread


def blast_refine_output_error(A: torch.Tensor, U: torch.Tensor, V: torch.Tensor, S: torch.Tensor, cov: torch.Tensor,
                              sweeps: int = 20, history: list | None = None):
    """Lower ``||(A - A^) L||_F^2`` (``C = L L^T``, the full input covariance) over BLAST factors.

    Block-whitened factors ignore the covariance between input blocks. Each sweep solves
    exactly, given the others, for every ``U_i`` (row blocks are independent), then for
    each ``V_j`` in turn and for each column ``S_{:, j}`` in turn (input blocks are coupled
    through ``C``, so these go one block at a time, Gauss-Seidel), tracking ``R = (A - A^) C``
    through rank-``r`` updates. Every update is a damped least-squares minimum of the
    output error in its block, so in exact arithmetic the error never rises; a sweep whose
    result is not finite or fits worse (a zero block's singular Gram matrices, a rank-deficient
    weight: NaN or torch's singular-matrix error had ended the compression) is dropped, per
    matrix. ``history`` receives the relative output error after every sweep. Shapes as in
    :func:`blast_factorize`. The sweeps run on ``A`` scaled to unit root-mean-square and ``C`` to
    unit mean variance (the scales go back on ``S``), so that the ridges' floor is scale-free; ``C`` damped by
    :func:`_unit_covariance`.
    """
    dt = A.dtype
    *lead, out, inp = A.shape
    b, p, r = U.shape[-3:]
    q = V.shape[-2]
    A, rms = _unit_rms(A)
    S = S / rms.unsqueeze(-1)
    C = _unit_covariance(cov, dt)
    AC = A @ C
    a_norm2 = (A * AC).sum((-2, -1))
    C_jj = C.unflatten(-2, (b, q)).unflatten(-1, (b, q)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # (..., j, q, q)

    def damped_solve(gram, rhs):                       # a relative ridge, floored: a zero Gram matrix solves to 0.
        # By LU on every device: a ridge of 1e-9 is below float32's precision, where Cholesky would fail (and fall back
        # to LU) often; damped_solve_time.py measured the descent's solves only
        return _damped_solve(gram, rhs, (1e-9 * gram.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True)).clamp_min(1e-12),
                             "lu")

    def solve(matrix, rhs):                            # non-raising: a singular solve's result is dropped below
        return torch.linalg.solve_ex(matrix, rhs)[0]

    err = _output_error(A - blast_dense(U, V, S), C)
    for _ in range(sweeps):
        before = (U, V, S)
        Vbar = (V.unsqueeze(-4) * S.unsqueeze(-2)).flatten(-3, -2)                     # (..., i, in, r)
        M = Vbar.transpose(-1, -2) @ (C.unsqueeze(-3) @ Vbar)
        rhs = AC.reshape(*lead, b, p, inp) @ Vbar                                         # (..., i, p, r)
        U = damped_solve(M, rhs.transpose(-1, -2)).transpose(-1, -2)
        R = AC - blast_dense(U, V, S) @ C                                                 # (A - A^) C
        Ubar = (U.unsqueeze(-3) * S.unsqueeze(-2)).transpose(-4, -3).flatten(-3, -2)    # (..., j, out, r)
        N = Ubar.transpose(-1, -2) @ Ubar
        V = V.clone()
        for j in range(b):
            cols = slice(j * q, (j + 1) * q)
            G = R[..., :, cols].transpose(-1, -2) @ Ubar[..., j, :, :]                   # (..., q, r)
            step = damped_solve(N[..., j, :, :], solve(C_jj[..., j, :, :], G).transpose(-1, -2)).transpose(-1, -2)
            V[..., j, :, :] += step
            R = R - Ubar[..., j, :, :] @ (step.transpose(-1, -2) @ C[..., cols, :])
        UU = U.transpose(-1, -2) @ U                                                       # (..., i, r, r)
        S = S.clone()
        for j in range(b):
            cols = slice(j * q, (j + 1) * q)
            Vj = V[..., j, :, :]
            gram = UU * (Vj.transpose(-1, -2) @ C_jj[..., j, :, :] @ Vj).unsqueeze(-3)
            Rj = R[..., :, cols].reshape(*lead, b, p, q)
            rhs = ((U.transpose(-1, -2) @ Rj) * Vj.transpose(-1, -2).unsqueeze(-3)).sum(-1)  # (..., i, r)
            ds = damped_solve(gram, rhs.unsqueeze(-1)).squeeze(-1)
            S[..., :, j, :] += ds
            R = R - (U * ds.unsqueeze(-2)).reshape(*lead, out, r) @ (Vj.transpose(-1, -2) @ C[..., cols, :])
        (U, V, S), err, any_kept = _keep_better_sweep(_output_error(A - blast_dense(U, V, S), C), err, (U, V, S), before)
        if history is not None:
            history.append((err / a_norm2.clamp_min(1e-30)).sqrt())
        if not any_kept:
            break
    return U, V, S * rms.unsqueeze(-1)


# ---- errors ------------------------------------------------------------------------------
def relative_weight_error(W: torch.Tensor, W_hat: torch.Tensor) -> torch.Tensor:
    """``||W - W^||_F / ||W||_F`` over the last two dims."""
    W, W_hat = W.double(), W_hat.double()
    return (W - W_hat).norm(dim=(-2, -1)) / W.norm(dim=(-2, -1)).clamp_min(1e-300)


def relative_output_error(W: torch.Tensor, W_hat: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """``||(W - W^) X^T||_F / ||W X^T||_F`` for inputs ``X`` with ``X^T X = cov``."""
    W, E, C = W.double(), (W - W_hat).double(), cov.double()
    num = ((E @ C) * E).sum((-2, -1)).clamp_min(0)
    den = ((W @ C) * W).sum((-2, -1)).clamp_min(1e-300)
    return (num / den).sqrt()
