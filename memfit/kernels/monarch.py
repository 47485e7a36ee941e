"""Monarch linear (definition in memfit.layers.monarch): reference, Triton kernels, op.

Shapes: x (..., in), w1 (b, m, r), w2 (b, r, p) with in = b m, out = b p, per-block
rank t = r/b; bias (out,) or None. ``permute_output=False`` (the layers' default) writes
output feature i p + s (block-major: every store contiguous); True writes s b + i (the
paper's P, a column stride of b elements in the store).

Pipelines; ``pick_variant`` times the ones offered for the shape (cached on disk):

* ``two_stage``: two Triton GEMMs through :func:`bgemm`, the first storing z straight
  in P^T order (N, b_i, r) (the permutation folded into its store: runs of t contiguous
  elements), the second writing y with the output layout folded into its store. Z costs
  2 N b r elements of traffic; stage 1 (K = m) is bound by that write, stage 2
  (K = r, the bulk of the FLOPs) by the tensor cores. Both layouts.
* ``two_stage_pdl`` (N <= TWO_STAGE_PDL_MAX_N, Hopper+): ``two_stage`` with stage 2 chained to stage 1
  (blr_common's programmatic dependent launch: stage 2 starts while stage 1 runs, pulls
  its w2 slice into L2, then waits for z). At decode each stage is a launch plus one
  dependent weight read, so overlapping them is most of what is left to gain. The two stages' tiles
  are picked together (blr_common.pick_chain_tiles). Both layouts.
* ``bmm``: the same Triton stage 1, then stage 2 on cuBLAS (:func:`per_block_gemm`), a
  strided batched GEMM reading z as (b_i, N, r) (lda = b r) and writing the block-major
  y through a (b, N, p) view (ldc = b p): no copy. Expected to win at large N, where
  stage 2 dominates and cuBLAS runs it near the matmul rate. Block-major layout only
  (the permuted layout has a column stride of b, which cuBLAS cannot store).
* ``bmm_perm_bmm``: both stages on cuBLAS, stage 1 writing z in its natural order, and
  P^T as a memory-bound copy between them (:func:`_permute_kernel`): 2 N b r more elements
  of traffic than ``bmm`` for no scattered store, which is slow where t is not a multiple
  of 8 (Llama-7B: t = 93). Block-major layout only.
* ``bmm_gather`` (N >= TOKEN_MAJOR_MIN_N, both layouts): stage 1 on cuBLAS as in ``bmm_perm_bmm``,
  stage 2 by :func:`bgemm` reading P^T through its loads (runs of t elements of z per K step,
  ``a_runs``): z written and read once, no copy, no scattered store. The fastest pipeline at
  Llama-1B down and Llama-7B qkvo from N = 1024, and at Llama-7B down, N = 1024 (6cfd3c1); with ``tbmm_tbmm``
  offered, at Llama-7B qkvo, N = 1024 only (1476f91). At
  Llama-7B's t = 93 the runs start misaligned: read as they are, a was loaded 2 bytes at a time
  (profile, 18d9a39: stage 2 at 3-4x cuBLAS's time); it now reads aligned windows around them,
  1627 -> 1204 us at Llama-7B gate/up, N = 8192, still 2.5x cuBLAS on a P^T copy
  (``bgemm_tiles.py --gather``, 3834552). Offered where z's traffic is a visible share of the
  time; at decode the weights' reads dominate and it is not timed.
* ``tbmm`` (N >= TOKEN_MAJOR_MIN_N, block-major): ``bmm`` with z stored token-contiguous,
  (b, r, N): the stage-1 store folds P^T in as whole rows of tokens, and stage 2 reads z
  through a transposed view, no copy. Where t is not a multiple of 8 (Llama-7B: 93), it
  replaces ``bmm``'s slow scattered store (Llama-7B gate/up, N=8192: 908.9 against 3442.4 us,
  75317f4). (Both stages on cuBLAS with P^T as a copy of (t x N) slabs lost at every shape.)
* ``tbmm_tbmm`` (N >= TBMM_TBMM_MIN_N, block-major, where :func:`tbmm_tbmm_within_ledger`): both stages as
  plain cuBLAS batched GEMMs with no activation copy: z stored token-contiguous in (i, s, j) order, so that
  output block i's operand is one contiguous slab, and P^T moved into a reordering of w2's rows (a weight-
  sized copy per call). In the layer table (1476f91) the fastest pipeline at all seven shapes at N = 8192,
  0.73-0.93x the next one's time, and at three at N = 1024 (Llama-1B down, Llama-7B gate/up and down); at N =
  128, where the copy of w2 weighs, it read 1.07-1.63x the fastest. Kept out where its w2 copy would pass the
  ledger's Monarch forward transient (Llama-7B gate/up in the 1024 bucket, where it had been 0.93x). Tried and
  taken out, ``tbmm_tbmm_l2`` (702ebb8): the same a chunk of tokens at a time through one z buffer, each chunk's x,
  z and y half the L2, so that z would pass between the stages through the L2 instead of HBM. It took 1.08-1.57x
  ``tbmm_tbmm``'s time at N = 1024 and 8192 (1.39-1.57x at 8192; Llama-1B q/o 98.8 against 63.8 us;
  results/earlier/blr_layers_subset_tbmm_tbmm_l2_702ebb8.json). Not profiled: the chunks' smaller GEMMs and extra
  launches cost more than z's round trip, or z did not stay in the L2.
* ``fused`` (the decode path where PDL is not offered, and there a candidate at every N; on a GPU that
  offers it ``two_stage_pdl`` is, and the pick does not time ``fused`` at any N: on the H200 it never came
  within 5% of the fastest, :func:`blr_common.pick_candidates`): one kernel, z on chip. A program owns
  a token tile, output block i and an output column tile; one loop over the input
  blocks j (both dots in it, so it is software-pipelined) computes
  s = X_j @ w1[j][:, i t:(i+1) t] (K = m, all of it in one tile) and at once
  acc += s @ w2[i][j t:(j+1) t, tile]. One launch, weights read once from HBM (the w1
  slice is re-read from L2 per column tile), x re-read from L2 per program, stage 1
  recomputed once per output column tile (ceil(p / BO) times). Cheap at decode; at large
  N it can only win where p is one or two column tiles (Llama-1B q/o: p = 128, where z's
  round trip through memory costs more than the stage-2 FLOPs), so where it is timed it is timed at
  every N. Needs pow2(m) * pow2(t) small enough for a pipelined tile (:func:`fused_fits`).
* Tried and taken out, ``fused_split`` (4fa42b0; the twelfth session's pipeline of that name was another, split
  differently: results/earlier/README.md): at decode, one program per block pair (i, j) read its w1 slice and w2
  rows once into an fp32 partial output of its own j (every weight element read by one of b^2 programs, no z in
  memory), and a second kernel, chained by PDL, summed the b partials. At four of the paper's shapes it took
  1.03-1.27x the pick's time at N = 1 and 1.10-1.55x at N = 16
  (results/earlier/blr_layers_subset_fused_split_4fa42b0.json); not profiled.
* ``torch`` (the reference: two cuBLAS batched GEMMs with the permutations as copies)
  competes too, so the pick is never slower than plain PyTorch on a shape where the
  Triton stage 1 stores badly (e.g. a per-block rank t = 93, not a multiple of 8).
Backward: PyTorch ops (recompute-and-differentiate of the reference, see blr_common);
the forward saves only x (nothing where the weights are frozen: blr_common.save_for_recompute).
"""
import torch
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels.blr_common import (
    A_WINDOW_SLACK,
    TOKEN_MAJOR_MIN_N,
    bgemm,
    bind_shapes,
    blr_precision,
    bmm_into,
    contiguous_bias,
    fits_smem,
    keep_small_n,
    mma,
    n_bucket,
    pdl_offered,
    per_block_gemm,
    pick_bucket,
    pick_candidates,
    pick_chain_tiles,
    pick_variant,
    pow2_at_least,
    recompute_backward,
    recomputing,
    require_offered,
    runs_triton,
    save_for_recompute,
    tuned,
)

TBMM_TBMM_MIN_N = 256  # tbmm_tbmm read 1.07-1.63x the fastest pipeline at N = 128 on all seven shapes (1476f91)
# Up to this N the chained two_stage is offered, past blr_common.PDL_MAX_N: at 19084f9 Monarch's pick read 0.873-0.978x
# dense at four shapes at N = 256 (blr_layers_subset_256_512.json); offered the chain there (ba0a9d7, five of the seven
# shapes timed, blr_layers_subset_256_chained.json) it took Llama-1B q/o from 7.89 to 6.56 us (0.873x -> 1.064x dense)
TWO_STAGE_PDL_MAX_N = 256
FUSED_MAX_TILE = 16384  # pow2(m) * pow2(t) elements of w1 slice per step: 32 KB in bf16, so 2-3 stages fit


def monarch_linear_reference(x, w1, w2, bias=None, permute_output=False):
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


def _stage1(x2, w1, launch_dependents=False, tile=None):
    """z[n, i, j t + s] = (x_j w1[j])[n, i t + s]: stage 1 with P^T folded into the store."""
    b, m, r = w1.shape
    t, n = r // b, x2.shape[0]
    z = torch.empty(n, b, r, device=x2.device, dtype=x2.dtype)
    bgemm(x2, w1, z, n, m, r, b, (m, x2.stride(0), 1), w1.stride(), (t, b * r, r, 1), grp=t,
          launch_dependents=launch_dependents, tile=tile)
    return z


def _two_stage(x2, w1, w2, bias, permute_output):
    return per_block_gemm(_stage1(x2, w1), w2, bias, cublas=False, permute_output=permute_output)


def _chained_two_stage(x2, w1, w2, bias, permute_output, tiles=(None, None)):
    return per_block_gemm(_stage1(x2, w1, launch_dependents=True, tile=tiles[0]), w2, bias, cublas=False,
                          permute_output=permute_output, wait_for_previous=True, tile=tiles[1])


def _two_stage_pdl(x2, w1, w2, bias, permute_output):
    """``two_stage`` chained, with the two stages' tiles picked together (:func:`blr_common.pick_chain_tiles`)."""
    (b, m, r), p = w1.shape, w2.shape[2]
    args = (x2, w1, w2, bias, permute_output)
    tiles = pick_chain_tiles("monarch_linear two_stage_pdl", (pick_bucket(x2.shape[0]), b, m, r, p, permute_output,
                                                              str(x2.dtype)), ((m, r, b), (r, p, b)),
                             _chained_two_stage, args)
    return _chained_two_stage(*args, tiles=tiles)


def _bmm(x2, w1, w2, bias, permute_output):
    return per_block_gemm(_stage1(x2, w1), w2, bias, cublas=True)


# ---- both GEMMs on cuBLAS, the permutation as one copy between them -------------------

@tuned([(16, 4, 2), (32, 4, 2), (64, 8, 2)], ("BN",), (16, 4, 1), key=["N_BUCKET", "T", "B"])
@triton.jit
def _permute_kernel(z_ptr, out_ptr, N, T, B, N_BUCKET, szn, BT: tl.constexpr, BN: tl.constexpr):
    """out[n, i, j T + s] = z[n, j, i T + s] for a tile of BN tokens and one (j, i): Monarch's P^T
    as a copy, each row a run of T contiguous elements on both sides."""
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    j, i = tl.program_id(1), tl.program_id(2)
    rs = tl.arange(0, BT)
    mask = (rn[:, None] < N) & (rs[None, :] < T)
    rows = rn[:, None] * szn + rs[None, :]
    tile = tl.load(z_ptr + rows + (j * B + i) * T, mask=mask)
    tl.store(out_ptr + rows + (i * B + j) * T, tile, mask=mask)


def _bmm_perm_bmm(x2, w1, w2, bias, permute_output):
    """Stage 1 as one strided cuBLAS batched GEMM into z (N, b_j, r) in its natural order, P^T
    as a memory-bound copy (:func:`_permute_kernel`), stage 2 on cuBLAS. Against ``bmm``: the
    permutation costs z's write and read once more (2 N b r elements), for cuBLAS in stage 1,
    whose output then needs no scattered store; that wins where the scattered store is slow
    (a per-block rank t not a multiple of 8, e.g. Llama-7B's 1488 / 16 = 93)."""
    b, m, r = w1.shape
    t, n = r // b, x2.shape[0]
    z = torch.empty(n, b, r, device=x2.device, dtype=x2.dtype)
    bmm_into(x2.view(n, b, m).transpose(0, 1), w1, z.transpose(0, 1))                 # z[n, j] = x_j w1[j]
    zp = torch.empty_like(z)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]), b, b)
    _permute_kernel[grid](z, zp, n, t, b, n_bucket(n), z.stride(0), BT=pow2_at_least(t))
    return per_block_gemm(zp, w2, bias, cublas=True)


def _bmm_gather(x2, w1, w2, bias, permute_output):
    """Stage 1 on cuBLAS into z (N, b_j, r) in its natural order, as in ``bmm_perm_bmm``; stage 2 by
    :func:`bgemm` gathering P^T in its loads: block i's operand is the b runs z[:, j, i t:(i+1) t]
    side by side. z is written and read once, with no copy and no scattered store (against
    ``bmm_perm_bmm``: 2 N b r elements less traffic, for a Triton stage 2), and both layouts work.
    z has slack past its end for the aligned windows stage 2 reads where t is not a multiple of 8."""
    b, m, r = w1.shape
    t, n = r // b, x2.shape[0]
    z = torch.empty(n * b * r + A_WINDOW_SLACK, device=x2.device, dtype=x2.dtype)[:n * b * r].view(n, b, r)
    bmm_into(x2.view(n, b, m).transpose(0, 1), w1, z.transpose(0, 1))                 # z[n, j] = x_j w1[j]
    return per_block_gemm(z[:, 0].view(n, b, t), w2, bias, cublas=False, permute_output=permute_output,
                          gathered_runs=(b, r))


# ---- large N, token-contiguous z: whole rows of tokens in every store -------------------

def _refuse_permuted_output(variant: str, permute_output: bool) -> None:
    """The cuBLAS-stored pipelines write the block-major layout only (cuBLAS cannot store a column stride)."""
    if permute_output:
        raise MemfitError(f"monarch_linear: {variant} writes the block-major layout only (permute_output=False)")


def _tbmm(x2, w1, w2, bias, permute_output):
    """``bmm`` with z stored token-contiguous: zp[i, j t + s, n] = (x_j w1[j])[n, i t + s], P^T folded
    into the Triton stage's store as whole rows of tokens (``bmm``'s store writes runs of t
    elements, 186 B at Llama-7B's t = 93), then stage 2 on cuBLAS reading zp[i]^T as a transposed
    operand. Block-major output only (cuBLAS cannot store the permuted layout's column stride)."""
    _refuse_permuted_output("tbmm", permute_output)
    b, m, r = w1.shape
    t, n = r // b, x2.shape[0]
    zp = torch.empty(b, r, n, device=x2.device, dtype=x2.dtype)
    bgemm(x2, w1, zp, n, m, r, b, (m, x2.stride(0), 1), w1.stride(), (t * n, 1, r * n, n), grp=t)
    return per_block_gemm(zp.permute(2, 0, 1), w2, bias, cublas=True)


@triton.jit
def _w2_rows_kernel(src_ptr, dst_ptr, P, T, B, ROWS, BR: tl.constexpr, BP: tl.constexpr):
    """dst[i, s, j, :] = src[i, j, s, :] (rows of P contiguous elements): w2's rows from (j, s) to (s, j) order,
    a tile of BR destination rows by BP columns per program (its time: ``_w2_rows_kernel`` in the layer profile)."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    i, s, j = rows // (T * B), (rows // B) % T, rows % B
    src_rows = (i * B + j) * T + s
    cols = tl.program_id(1) * BP + tl.arange(0, BP)
    mask = (rows[:, None] < ROWS) & (cols[None, :] < P)
    tile = tl.load(src_ptr + src_rows[:, None] * P + cols[None, :], mask=mask)
    tl.store(dst_ptr + rows[:, None] * P + cols[None, :], tile, mask=mask)


def _w2_in_s_j_order(w2):
    """w2 (b, r, p), contiguous, with each block's rows reordered from j t + s to s b + j."""
    assert w2.is_contiguous(), "the row copy indexes w2 as contiguous (monarch's op makes it so)"
    b, r, p = w2.shape
    out = torch.empty_like(w2)
    br, bp = 16, min(pow2_at_least(p), 128)
    _w2_rows_kernel[(triton.cdiv(b * r, br), triton.cdiv(p, bp))](w2, out, p, r // b, b, b * r, BR=br, BP=bp)
    return out


def _tbmm_tbmm(x2, w1, w2, bias, permute_output):
    """Both stages as plain cuBLAS strided batched GEMMs, no copy of an activation: z stored
    token-contiguous in (i, s, j) order, zs[i, s, j, n] = (x_j w1[j])[n, i t + s]. Stage 1's batch j
    writes its r rows of tokens with a row stride of b N and a batch stride of N, so output block i's
    operand is one contiguous (t b, N) slab; P^T moves to w2, whose rows are reordered from (j, s) to
    (s, j) once per call (a weight-sized copy, :func:`_w2_in_s_j_order`). Against ``tbmm``: cuBLAS instead of
    the Triton stage 1. Block-major output only (cuBLAS cannot store the permuted layout's column stride)."""
    _refuse_permuted_output("tbmm_tbmm", permute_output)
    b, m, r = w1.shape
    t, n, p = r // b, x2.shape[0], w2.shape[2]
    zs = torch.empty(r, b, n, device=x2.device, dtype=x2.dtype)                      # [i t + s, j, n]
    bmm_into(w1.transpose(1, 2), x2.view(n, b, m).permute(1, 2, 0), zs.transpose(0, 1))
    w2s = _w2_in_s_j_order(w2)
    y = torch.empty(n, b * p, device=x2.device, dtype=x2.dtype)
    bmm_into(w2s.transpose(1, 2), zs.view(b, t * b, n), y.view(n, b, p).permute(1, 2, 0),
             None if bias is None else bias.view(b, p, 1))
    return y


# ---- fused kernel (decode without PDL; then a candidate at every N): both dots in one pipelined loop -----

def _prune_fused(configs, named_args, **kwargs):
    configs = keep_small_n(configs, named_args["N"])
    size = named_args["x_ptr"].element_size()
    bm, bt = kwargs["BM"], kwargs["BT"]
    keep = [c for c in configs if c.kwargs["BO"] <= pow2_at_least(named_args["P"], 32)
            and fits_smem(c, c.kwargs["BN"] * bm + bm * bt + bt * c.kwargs["BO"], size)]
    return keep or configs[:1]


@tuned([(16, 32, 4, 3), (16, 64, 4, 3), (16, 128, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 8, 3),
        (128, 128, 8, 2)],
       ("BN", "BO"), (16, 16, 4, 1), key=["N_BUCKET", "M", "T", "P", "B"], prune=_prune_fused)
@triton.jit
def _fused_kernel(x_ptr, w1_ptr, w2_ptr, y_ptr, bias_ptr, N, M, T, P, B, N_BUCKET,
                  sxn, s1j, s1a, s1c, s2i, s2c, s2o, syn, syi, syo,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                  BO: tl.constexpr):
    o_tiles = tl.cdiv(P, BO)
    i = tl.program_id(0) % B                           # the b programs of one token tile run side by side
    pid_o = (tl.program_id(0) // B) % o_tiles
    pid_n = tl.program_id(0) // (B * o_tiles)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    ro = pid_o * BO + tl.arange(0, BO)
    rm = tl.arange(0, BM)
    rt = tl.arange(0, BT)
    x_ptrs = x_ptr + rn[:, None] * sxn + rm[None, :]
    w1_ptrs = w1_ptr + rm[:, None] * s1a + (i * T + rt)[None, :] * s1c
    w2_ptrs = w2_ptr + i * s2i + rt[:, None] * s2c + ro[None, :] * s2o
    x_mask = (rn[:, None] < N) & (rm[None, :] < M)
    w1_mask = (rm[:, None] < M) & (rt[None, :] < T)
    w2_mask = (rt[:, None] < T) & (ro[None, :] < P)
    acc = tl.zeros((BN, BO), dtype=tl.float32)
    for j in range(B):
        xa = tl.load(x_ptrs + j * M, mask=x_mask, other=0.0)
        wa = tl.load(w1_ptrs + j * s1j, mask=w1_mask, other=0.0)
        s = mma(xa, wa, tl.zeros((BN, BT), dtype=tl.float32), PRECISION)
        wb = tl.load(w2_ptrs + j * T * s2c, mask=w2_mask, other=0.0)
        acc = mma(s.to(wb.dtype), wb, acc, PRECISION)               # z rounded to x's dtype, as in the reference
    col = i * syi + ro * syo
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=ro < P, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rn[:, None] * syn + col[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rn[:, None] < N) & (ro[None, :] < P))


def fused_fits(m: int, t: int) -> bool:
    """Whether one input block (m) and one per-block rank (t) fit the fused kernel's tile."""
    return pow2_at_least(m) * pow2_at_least(t) <= FUSED_MAX_TILE


def _fused(x2, w1, w2, bias, permute_output):
    b, m, r = w1.shape
    p, n, t = w2.shape[2], x2.shape[0], r // b
    y = torch.empty(n, b * p, device=x2.device, dtype=x2.dtype)
    block_stride, col_stride = (1, b) if permute_output else (p, 1)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]) * b * triton.cdiv(p, meta["BO"]),)
    _fused_kernel[grid](x2, w1, w2, y, bias if bias is not None else y, n, m, t, p, b, n_bucket(n),
                        x2.stride(0), *w1.stride(), *w2.stride(), y.stride(0), block_stride, col_stride,
                        HAS_BIAS=bias is not None, PRECISION=blr_precision(x2.dtype), BM=pow2_at_least(m),
                        BT=pow2_at_least(t))
    return y


VARIANTS = {"two_stage": _two_stage, "two_stage_pdl": _two_stage_pdl, "bmm": _bmm, "bmm_perm_bmm": _bmm_perm_bmm,
            "bmm_gather": _bmm_gather, "tbmm": _tbmm, "tbmm_tbmm": _tbmm_tbmm, "fused": _fused,
            "torch": monarch_linear_reference}
UNPICKED_WITH_PDL = ("fused",)  # never within 5% of the fastest on the H200 (blr_common.pick_candidates)


def tbmm_tbmm_within_ledger(fewest_tokens: int, b: int, t: int, p: int) -> bool:
    """Whether ``tbmm_tbmm`` holds no more than the ledger counts for a Monarch forward
    (memfit.ledger.predict.blr_transient_per_token: N (b r + max(b r, b p)) elements besides x and y) at every N from
    ``fewest_tokens``: it holds z (N b r) and the reordered w2 (r p b), so N >= min(r, p) where r = b t."""
    return fewest_tokens >= min(b * t, p)


def variants_for(n: int, b: int, m: int, t: int, p: int, permute_output: bool) -> dict:
    """The pipelines offered for ``n`` tokens, b blocks of m inputs and p outputs, per-block rank t and the layout
    (the pick times those :func:`blr_common.pick_candidates` keeps); the same for every N of one ``pick_bucket``
    (which shares a pick: a token-major pipeline picked at N = 128 is offered at N = 100)."""
    n = pick_bucket(n)
    names = ["two_stage", "torch"] + (["two_stage_pdl"] if n <= TWO_STAGE_PDL_MAX_N and pdl_offered() else [])
    if n >= TOKEN_MAJOR_MIN_N:
        names.append("bmm_gather")
    if not permute_output:
        names += ["bmm", "bmm_perm_bmm"] + (["tbmm"] if n >= TOKEN_MAJOR_MIN_N else [])
        fewest = n // 2 + 1                                          # the bucket's smallest N
        names += ["tbmm_tbmm"] if n >= TBMM_TBMM_MIN_N and tbmm_tbmm_within_ledger(fewest, b, t, p) else []
    if fused_fits(m, t):
        names.append("fused")
    return {name: VARIANTS[name] for name in names}


def _default(n: int, permute_output: bool) -> str:
    """The pick off the GPU timing path (interpreter, CUDA-graph capture): at decode the chained two GEMMs where
    PDL is offered, else the fused kernel; two GEMMs; or from TOKEN_MAJOR_MIN_N (block-major layout) ``tbmm``
    (``two_stage`` took 3.9x its time at Llama-7B's t = 93, 75317f4)."""
    if n <= 16:
        return "two_stage_pdl" if pdl_offered() else "fused"
    return "tbmm" if n >= TOKEN_MAJOR_MIN_N and not permute_output else "two_stage"


@torch.library.custom_op("memfit::monarch_linear", mutates_args=())
def _monarch_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, bias: torch.Tensor | None,
                permute_output: bool, variant: str) -> torch.Tensor:
    b, m, r = w1.shape
    x2 = x.reshape(-1, b * m).contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()
    args = (x2, w1, w2, contiguous_bias(bias), permute_output)
    if variant == "auto":
        n = x2.shape[0]
        offered = pick_candidates(variants_for(n, b, m, r // b, w2.shape[2], permute_output), UNPICKED_WITH_PDL)
        default = _default(n, permute_output)
        default = default if default in offered else "two_stage"          # the fused tile may not fit
        variant = pick_variant("monarch_linear", (pick_bucket(n), *w1.shape, w2.shape[2], permute_output, str(x.dtype)),
                               offered, default, args)
    return VARIANTS[variant](*args).reshape(*x.shape[:-1], -1)


@_monarch_op.register_fake
def _(x, w1, w2, bias, permute_output, variant):
    return x.new_empty(*x.shape[:-1], w1.shape[0] * w2.shape[2])


_monarch_op.register_autograd(recompute_backward(monarch_linear_reference, 4, 1),
                              setup_context=lambda ctx, inputs, output: save_for_recompute(ctx, inputs, output, 4))


_monarch_recomputing = recomputing(monarch_linear_reference, 4, 1)


def monarch_linear(x, w1, w2, bias=None, permute_output=False, path=None, variant="auto"):
    """Monarch forward by the Triton op where ``use_triton`` allows (``variant``: auto or one of VARIANTS), else the
    reference with the op's memory behaviour (:func:`blr_common.recomputing`: only x kept, the backward recomputes,
    as the ledger counts on every device)."""
    size = bind_shapes("monarch_linear", x, bias, {"w1": (w1, "b m r"), "w2": (w2, "b r p")}, "b m", "b p")
    b, m, r, p = size["b"], size["m"], size["r"], size["p"]
    if r % b:
        raise MemfitError(f"monarch_linear: rank r = {r} (w1's last dimension) is not a multiple of blocks b = {b}")
    cast = [w if w is None else w.to(x.dtype) for w in (w1, w2, bias)]
    if not runs_triton("monarch_linear", x, (w1, w2), path, variant):
        return _monarch_recomputing(x, *cast, permute_output)
    require_offered("monarch_linear", variant, lambda: variants_for(x.numel() // (b * m), b, m, r // b, p, permute_output),
                    f"for this shape, token count and layout (permute_output={permute_output})")
    return _monarch_op(x, *cast, permute_output, variant)
