"""Monarch linear (definition in memfit.layers.monarch): reference, Triton kernels, op.

Shapes: x (..., in), w1 (b, m, r), w2 (b, r, p) with in = b m, out = b p, per-block
rank t = r/b; bias (out,) or None.

Two Triton pipelines; ``pick_variant`` times both per shape (cached on disk):

* ``fused`` (:func:`chain_matmul`): one kernel, all intermediates on chip. A program
  owns a token tile and an output tile of block i and, for each input block j and
  t-chunk, computes s = X_j @ w1[j][:, i t + chunk] (BN x BT) and at once
  acc += s @ w2[i][j t + chunk, :]. The P^T between the factors is only which w1
  columns and w2 rows are read; the output P is the store's column stride. No
  intermediate touches memory; the price is that s is recomputed for each output tile
  of a block (factor ceil(p / BO) on the first factor's FLOPs). This is also the
  decode path (N <= 16): each program reads its slices of w1 and w2 and x once, so
  the kernel is bound by reading the weights (w1 re-reads come from L2).
* ``two_stage``: two GEMMs through :func:`bgemm`, the first storing z directly in
  P^T order (N, b_i, r) (the permutation folded into its store), the second writing y
  with P folded into its store. Z costs 2 N b r bytes*2 of traffic but no recompute:
  it wins for wide blocks (large p) at large N.
Backward: PyTorch ops (recompute-and-differentiate of the reference, see blr_common);
the forward saves only x.
"""
import torch
import triton
import triton.language as tl

from memfit.kernels.blr_common import (bgemm, keep_small_n, mma, n_bucket, pick_variant, recompute_backward,
                                       save_for_recompute, tuned)
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


# ---- fused kernel: two chained dots per (input block, rank chunk) ------------------

def _prune_chain(configs, named_args, **kwargs):
    """Token-count tiles by N; rank chunks no wider than the per-block rank needs."""
    configs = keep_small_n(configs, named_args["N"])
    fit = [c for c in configs if c.kwargs["BT"] <= max(16, triton.next_power_of_2(named_args["T"]))]
    return fit or configs


@tuned([(16, 128, 64, 16, 4, 3), (16, 128, 64, 32, 4, 3), (16, 64, 128, 32, 4, 3), (16, 256, 64, 32, 8, 3),
        (64, 128, 64, 16, 4, 3), (128, 128, 64, 16, 8, 3), (64, 128, 64, 32, 4, 3), (128, 128, 64, 32, 8, 3),
        (128, 256, 64, 64, 8, 3), (64, 256, 64, 64, 8, 3)],
       ("BN", "BO", "BM", "BT"), (16, 32, 32, 16, 4, 1), key=["N_BUCKET", "M", "T", "P", "B"], prune=_prune_chain)
@triton.jit
def _chain_kernel(x_ptr, w1_ptr, w2_ptr, y_ptr, bias_ptr, N, M, T, P,
                  B, N_BUCKET,
                  sxn, s1j, s1a, s1c, s2i, s2c, s2o, syn, syi, syo,
                  HAS_BIAS: tl.constexpr, BN: tl.constexpr, BO: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr):
    pid_n = tl.program_id(0)
    o_tiles = tl.cdiv(P, BO)
    i = tl.program_id(1) // o_tiles
    rn = pid_n * BN + tl.arange(0, BN)
    ro = (tl.program_id(1) % o_tiles) * BO + tl.arange(0, BO)
    rm = tl.arange(0, BM)
    rt = tl.arange(0, BT)
    acc = tl.zeros((BN, BO), dtype=tl.float32)
    for j in range(0, B):
        for t0 in range(0, T, BT):
            s = tl.zeros((BN, BT), dtype=tl.float32)
            for a0 in range(0, M, BM):
                xa = tl.load(x_ptr + rn[:, None] * sxn + (j * M + a0 + rm)[None, :],
                             mask=(rn[:, None] < N) & (a0 + rm[None, :] < M), other=0.0)
                wa = tl.load(w1_ptr + j * s1j + (a0 + rm)[:, None] * s1a + (i * T + t0 + rt)[None, :] * s1c,
                             mask=(a0 + rm[:, None] < M) & (t0 + rt[None, :] < T), other=0.0)
                s = mma(xa, wa, s)
            wb = tl.load(w2_ptr + i * s2i + (j * T + t0 + rt)[:, None] * s2c + ro[None, :] * s2o,
                         mask=(t0 + rt[:, None] < T) & (ro[None, :] < P), other=0.0)
            acc = mma(s.to(wb.dtype), wb, acc)
    col = i * syi + ro * syo
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=ro < P, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rn[:, None] * syn + col[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rn[:, None] < N) & (ro[None, :] < P))


def chain_matmul(x2, w1, w1_strides, w2, w2_strides, bias, blocks, m, t, p, y, y_block_stride, y_col_stride):
    """y[n, i*syi + o*syo] = sum_j (x2[:, j m:(j+1) m] @ w1[j][:, i t:(i+1) t]) @ w2[i][j t:(j+1) t, o].

    ``w1_strides`` (block j, row a, column c) and ``w2_strides`` (block i, row c, column o)
    in elements; low-rank is the case blocks = 1.
    """
    n = x2.shape[0]
    grid = lambda meta: (triton.cdiv(n, meta["BN"]), blocks * triton.cdiv(p, meta["BO"]))  # noqa: E731
    _chain_kernel[grid](x2, w1, w2, y, bias if bias is not None else y, n, m, t, p, blocks, n_bucket(n),
                        x2.stride(0), *w1_strides, *w2_strides, y.stride(0), y_block_stride, y_col_stride,
                        HAS_BIAS=bias is not None)
    return y


def _fused(x2, w1, w2, bias, permute_output):
    b, m, r = w1.shape
    p = w2.shape[2]
    y = torch.empty(x2.shape[0], b * p, device=x2.device, dtype=x2.dtype)
    block_stride, col_stride = (1, b) if permute_output else (p, 1)
    return chain_matmul(x2, w1, w1.stride(), w2, w2.stride(), bias, b, m, r // b, p, y, block_stride, col_stride)


def _two_stage(x2, w1, w2, bias, permute_output):
    b, m, r = w1.shape
    p = w2.shape[2]
    t, n = r // b, x2.shape[0]
    z = torch.empty(n, b, r, device=x2.device, dtype=x2.dtype)   # z[n, i, j t + s] = (x_j w1[j])[n, i t + s]
    bgemm(x2, w1, z, n, m, r, b, (m, x2.stride(0), 1), w1.stride(), (t, b * r, r, 1), grp=t)
    y = torch.empty(n, b * p, device=x2.device, dtype=x2.dtype)
    block_stride, col_stride = (1, b) if permute_output else (p, 1)
    bgemm(z, w2, y, n, r, p, b, (r, b * r, 1), w2.stride(), (block_stride, y.stride(0), 0, col_stride), bias=bias)
    return y


VARIANTS = {"fused": _fused, "two_stage": _two_stage}


def variants_for(n: int) -> dict:
    """The pipelines worth timing at ``n`` tokens (both: the fused recompute is at most ceil(p/BO)-fold)."""
    return VARIANTS


@torch.library.custom_op("memfit::monarch_linear", mutates_args=())
def _monarch_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, bias: torch.Tensor | None,
                permute_output: bool, variant: str) -> torch.Tensor:
    b, m, r = w1.shape
    x2 = x.reshape(-1, b * m).contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()
    args = (x2, w1, w2, bias, permute_output)
    if variant == "auto":
        variant = pick_variant("monarch_linear", (n_bucket(x2.shape[0]), *w1.shape, w2.shape[2], permute_output,
                                                  str(x.dtype)), VARIANTS, "fused", args)
    return VARIANTS[variant](*args).reshape(*x.shape[:-1], -1)


@_monarch_op.register_fake
def _(x, w1, w2, bias, permute_output, variant):
    return x.new_empty(*x.shape[:-1], w1.shape[0] * w2.shape[2])


_monarch_op.register_autograd(recompute_backward(monarch_linear_reference, 4, 1),
                              setup_context=lambda ctx, inputs, output: save_for_recompute(ctx, inputs, output, 4))


def monarch_linear(x, w1, w2, bias=None, permute_output=True, path=None, variant="auto"):
    """Monarch forward by the Triton op where ``use_triton`` allows (``variant``: auto, fused, two_stage)."""
    if use_triton("monarch_linear", x, w1, w2, path=path):
        cast = [w if w is None else w.to(x.dtype) for w in (w1, w2, bias)]
        return _monarch_op(x, *cast, permute_output, variant)
    return monarch_linear_reference(x, w1, w2, bias, permute_output)
