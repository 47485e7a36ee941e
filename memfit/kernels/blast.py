"""BLAST linear (definition in memfit.layers.blast): reference, Triton kernels, op.

Shapes: x (..., in), U (b, p, r), V (b, m, r), S (b, b, r) with in = b m, out = b p;
bias (out,) or None. Stages: Z_j = X_j V_j, T_i = sum_j Z_j diag(s_ij), Y_i = T_i U_i^T.

Two Triton pipelines; ``pick_variant`` times both per shape (cached on disk):

* ``fused`` (the paper's partial fusion, done in the first kernel): ``_mix_kernel``
  computes, per token tile and rank chunk, Z_j = X_j V_j for every j on chip, scales
  by s_ij and sums over j into all b rows of T at once (a (BN, b, BK) register tile),
  so Z never reaches memory and V is read once per token tile. T (N, b, r) is written
  once and read by the per-block GEMM (:func:`bgemm`) that makes Y. Traffic beyond the
  floor: T's write and read, 2 N b r elements; no recomputed FLOPs.
* ``full`` (full fusion): one kernel, nothing intermediate in memory. A program owns a
  token tile and an output tile of block i and loops over rank chunks: T_i's chunk is
  formed with 2-D dots (X_j V_j[:, chunk], scaled by s_ij, summed over j) and
  multiplied straight into the output (another 2-D dot). The price: Z is recomputed
  for every output tile (b ceil(p/BO) times), so it suits decode (N <= 16), where
  FLOPs are free and one launch beats two.
Backward: PyTorch ops (recompute-and-differentiate of the reference); saves only x.
"""
import torch
import triton
import triton.language as tl

from memfit.kernels.blr_common import (bgemm, keep_small_n, mma, n_bucket, pick_variant, recompute_backward,
                                       save_for_recompute, tuned)
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


@tuned([(16, 32, 64, 4, 3), (16, 64, 64, 8, 3), (32, 32, 64, 4, 3), (64, 16, 64, 4, 3), (32, 64, 64, 8, 3)],
       ("BN", "BK", "BM"), (16, 16, 16, 4, 1), key=["N_BUCKET", "M", "R", "B"],
       prune=lambda configs, named_args, **kw: keep_small_n(configs, named_args["N"]))
@triton.jit
def _mix_kernel(x_ptr, v_ptr, s_ptr, t_ptr, N, M, R, B, N_BUCKET,
                sxn, svj, sva, svk, ssi, ssj, ssk, stn, sti, stk,
                BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    """T[n, i, k] = sum_j s[i, j, k] (X_j V_j)[n, k] for a (BN tokens, BK ranks) tile, all i."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    rm = tl.arange(0, BM)
    rb = tl.arange(0, BB)
    t = tl.zeros((BN, BB, BK), dtype=tl.float32)
    for j in range(0, B):
        z = tl.zeros((BN, BK), dtype=tl.float32)
        for a0 in range(0, M, BM):
            xa = tl.load(x_ptr + rn[:, None] * sxn + (j * M + a0 + rm)[None, :],
                         mask=(rn[:, None] < N) & (a0 + rm[None, :] < M), other=0.0)
            va = tl.load(v_ptr + j * svj + (a0 + rm)[:, None] * sva + rk[None, :] * svk,
                         mask=(a0 + rm[:, None] < M) & (rk[None, :] < R), other=0.0)
            z = mma(xa, va, z)
        sj = tl.load(s_ptr + rb[:, None] * ssi + j * ssj + rk[None, :] * ssk,
                     mask=(rb[:, None] < B) & (rk[None, :] < R), other=0.0).to(tl.float32)
        z = z.to(x_ptr.dtype.element_ty).to(tl.float32)          # Z is rounded to x's dtype, as in the reference
        t += z[:, None, :] * sj[None, :, :]
    mask = (rn[:, None, None] < N) & (rb[None, :, None] < B) & (rk[None, None, :] < R)
    tl.store(t_ptr + rn[:, None, None] * stn + rb[None, :, None] * sti + rk[None, None, :] * stk,
             t.to(t_ptr.dtype.element_ty), mask=mask)


@tuned([(16, 64, 64, 32, 4, 3), (16, 128, 64, 32, 4, 3), (16, 128, 128, 32, 8, 3),
        (64, 128, 64, 32, 4, 3), (128, 128, 64, 32, 8, 3)],
       ("BN", "BO", "BM", "BK"), (16, 16, 16, 16, 4, 1), key=["N_BUCKET", "M", "P", "R", "B"],
       prune=lambda configs, named_args, **kw: keep_small_n(configs, named_args["N"]))
@triton.jit
def _full_kernel(x_ptr, u_ptr, v_ptr, s_ptr, y_ptr, bias_ptr, N, M, P, R,
                 B, N_BUCKET,
                 sxn, sui, suo, suk, svj, sva, svk, ssi, ssj, ssk, syn,
                 HAS_BIAS: tl.constexpr, BN: tl.constexpr, BO: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    o_tiles = tl.cdiv(P, BO)
    i = tl.program_id(1) // o_tiles
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    ro = (tl.program_id(1) % o_tiles) * BO + tl.arange(0, BO)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BN, BO), dtype=tl.float32)
    for k0 in range(0, R, BK):
        t = tl.zeros((BN, BK), dtype=tl.float32)
        for j in range(0, B):
            z = tl.zeros((BN, BK), dtype=tl.float32)
            for a0 in range(0, M, BM):
                xa = tl.load(x_ptr + rn[:, None] * sxn + (j * M + a0 + rm)[None, :],
                             mask=(rn[:, None] < N) & (a0 + rm[None, :] < M), other=0.0)
                va = tl.load(v_ptr + j * svj + (a0 + rm)[:, None] * sva + (k0 + rk)[None, :] * svk,
                             mask=(a0 + rm[:, None] < M) & (k0 + rk[None, :] < R), other=0.0)
                z = mma(xa, va, z)
            sij = tl.load(s_ptr + i * ssi + j * ssj + (k0 + rk) * ssk, mask=k0 + rk < R, other=0.0).to(tl.float32)
            t += z.to(x_ptr.dtype.element_ty).to(tl.float32) * sij[None, :]
        ut = tl.load(u_ptr + i * sui + (k0 + rk)[:, None] * suk + ro[None, :] * suo,
                     mask=(k0 + rk[:, None] < R) & (ro[None, :] < P), other=0.0)
        acc = mma(t.to(ut.dtype), ut, acc)
    col = i * P + ro
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=ro < P, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rn[:, None] * syn + col[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rn[:, None] < N) & (ro[None, :] < P))


def _fused(x2, u, v, s, bias):
    b, p, r = u.shape
    m, n = v.shape[1], x2.shape[0]
    t = torch.empty(n, b, r, device=x2.device, dtype=x2.dtype)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]), triton.cdiv(r, meta["BK"]))  # noqa: E731
    _mix_kernel[grid](x2, v, s, t, n, m, r, b, n_bucket(n), x2.stride(0), *v.stride(), *s.stride(), *t.stride(),
                      BB=max(16, triton.next_power_of_2(b)))
    y = torch.empty(n, b * p, device=x2.device, dtype=x2.dtype)
    # y[n, i p + o] = sum_k T[n, i, k] U[i, o, k]
    bgemm(t, u, y, n, r, p, b, (r, b * r, 1), (u.stride(0), u.stride(2), u.stride(1)), (p, y.stride(0), 0, 1), bias=bias)
    return y


def _full(x2, u, v, s, bias):
    b, p, r = u.shape
    m, n = v.shape[1], x2.shape[0]
    y = torch.empty(n, b * p, device=x2.device, dtype=x2.dtype)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]), b * triton.cdiv(p, meta["BO"]))  # noqa: E731
    _full_kernel[grid](x2, u, v, s, y, bias if bias is not None else y, n, m, p, r, b, n_bucket(n), x2.stride(0),
                       *u.stride(), *v.stride(), *s.stride(), y.stride(0), HAS_BIAS=bias is not None)
    return y


VARIANTS = {"fused": _fused, "full": _full}
RECOMPUTE_MAX_N = 128  # beyond this, full fusion's recomputed Z costs more than T's round trip (never timed)


def variants_for(n: int) -> dict:
    """The pipelines worth timing at ``n`` tokens."""
    return VARIANTS if n <= RECOMPUTE_MAX_N else {"fused": _fused}


@torch.library.custom_op("memfit::blast_linear", mutates_args=())
def _blast_op(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
              variant: str) -> torch.Tensor:
    b, m, r = v.shape
    x2 = x.reshape(-1, b * m).contiguous()
    args = (x2, u.contiguous(), v.contiguous(), s.contiguous(), bias)
    if variant == "auto":
        n = x2.shape[0]
        variant = pick_variant("blast_linear", (n_bucket(n), *u.shape, m, str(x.dtype)), variants_for(n),
                               "full" if n <= 16 else "fused", args)
    return VARIANTS[variant](*args).reshape(*x.shape[:-1], -1)


@_blast_op.register_fake
def _(x, u, v, s, bias, variant):
    return x.new_empty(*x.shape[:-1], u.shape[0] * u.shape[1])


_blast_op.register_autograd(recompute_backward(blast_linear_reference, 5),
                            setup_context=lambda ctx, inputs, output: save_for_recompute(ctx, inputs, output, 5))


def blast_linear(x, u, v, s, bias=None, path=None, variant="auto"):
    """BLAST forward by the Triton op where ``use_triton`` allows (``variant``: auto, fused, full)."""
    if use_triton("blast_linear", x, u, v, s, path=path):
        return _blast_op(x, *[w if w is None else w.to(x.dtype) for w in (u, v, s, bias)], variant)
    return blast_linear_reference(x, u, v, s, bias)
