"""Monarch linear (definition in memfit.layers.monarch): reference, Triton kernels, op.

Shapes: x (..., in), w1 (b, m, r), w2 (b, r, p) with in = b m, out = b p, per-block
rank t = r/b; bias (out,) or None. w2[i]'s rows are in (s, j) order: row s b + j pairs
with column i t + s of w1[j] (memfit.layers.monarch says why). ``permute_output=False``
(the layers' default) writes output feature i p + s (block-major: every store contiguous);
True writes s b + i (the paper's P, a column stride of b elements in the store).

Stage 2 contracts over (j, s). The token-major pipelines make z with K in (j, s) order (each
stage-1 store a run of t elements) and read w2's rows interleaved (bgemm's ``b_interleaved``);
the pipelines whose stage 2 is cuBLAS make z in w2's (s, j) order, which cuBLAS reads plainly.

Pipelines; ``auto_variant`` (through ``pick_variant``) times the ones offered for the shape (cached on disk):

* ``two_stage``: two Triton GEMMs through :func:`bgemm`, the first storing z straight
  in P^T order (N, b_i, r) (the permutation folded into its store: runs of t contiguous
  elements), the second reading w2's rows interleaved and writing y with the output layout
  folded into its store. Z costs
  2 N b r elements of traffic; stage 1 (K = m) is bound by that write, stage 2
  (K = r, the bulk of the FLOPs) by the tensor cores. Both layouts.
* ``two_stage_pdl`` (N <= TWO_STAGE_PDL_MAX_N, Hopper+): ``two_stage`` with stage 2 chained to stage 1
  (blr_common's programmatic dependent launch: stage 2 starts while stage 1 runs, pulls
  its w2 slice into L2, then waits for z). At decode each stage is a launch plus one
  dependent weight read, so overlapping them is most of what is left to gain. The two stages' tiles
  are picked together (batched_gemm.pick_chain_tiles). Both layouts.
* ``gemv_gemv_pdl`` (N = 1, Hopper+): ``two_stage_pdl`` with both stages as row-streaming GEMVs
  (:func:`gemv.block_row_gemv`: w1 and w2 read along their unit-stride columns on CUDA cores, stage 2's vector
  gathered from z in w2's row order), where ``bgemm``'s tensor-core tile pads the one token to 16 rows. On the H200
  (42ef66a, ``results/blr_layers_subset_decode_gemv.json``) its first timings were 0.97-1.21x ``two_stage_pdl``'s
  (1.10-1.15x at Llama-1B gate and up and Llama-7B qkvo block-major, 1.21x at Llama-7B gate/up), and the pick took it
  at Llama-1B q/o in both layouts (finalists 4.12 against 4.27 us block-major) and down block-major (9.33 against
  9.54). In the end-to-end runs' own picks (44a54ef, ``earlier/blr_e2e_memfit_attention_44a54ef.json``)
  ``two_stage_pdl`` won at all four Llama-1B shapes, 1.015-1.108x faster by first timings (q/o 5.15 against 5.51 us);
  in 0cdc726's (``blr_e2e_memfit_attention.json``) at q/o, gate and up, and this pipeline at down (finalists 10.02
  against 10.27 us). In three more layer-table
  processes at q/o and down (62f9d18, each with a pick cache of its own, ``blr_layers_subset_decode_gemv_repeat*``)
  the pick took it every time where it had (finalists 4.13 against 4.28-4.29 us at q/o, 8.97-8.98 against 9.21-9.24
  at down): ahead by 3-4% in the layer table, behind by up to 11% inside the model at 44a54ef (not traced); at 0cdc726
  1.21x behind at q/o by first timings (6.81 against 5.63 us), ahead at down.
* ``bmm`` (N <= SCATTERED_Z_MAX_N): the Triton stage 1 storing z in (s, j) order (a column stride of b in
  its store), then stage 2 on cuBLAS (:func:`per_block_gemm`), a
  strided batched GEMM reading z as (b_i, N, r) (lda = b r) and writing the block-major
  y through a (b, N, p) view (ldc = b p): no copy. Block-major layout only
  (the permuted layout has a column stride of b, which cuBLAS cannot store).
* ``bmm_perm_bmm`` (N <= SCATTERED_Z_MAX_N): both stages on cuBLAS, stage 1 writing z in its natural order, and
  P^T as a memory-bound copy into w2's (s, j) order between them (:func:`_permute_kernel`, its stores b elements
  apart): 2 N b r more elements of traffic than ``bmm``. Block-major layout only.
* ``bmm_gather`` (N >= TOKEN_MAJOR_MIN_N, both layouts): stage 1 on cuBLAS as in ``bmm_perm_bmm``,
  stage 2 by :func:`bgemm` reading P^T through its loads (runs of t elements of z per K step,
  ``a_runs``, and w2's rows interleaved): z written and read once, no copy, no scattered store. The fastest pipeline at
  Llama-1B down and Llama-7B qkvo from N = 1024, and at Llama-7B down, N = 1024 (6cfd3c1); with ``tbmm_tbmm``
  offered, at Llama-7B qkvo, N = 1024 only (1476f91). At
  Llama-7B's t = 93 the runs start misaligned: read as they are, a was loaded 2 bytes at a time
  (profile, 18d9a39: stage 2 at 3-4x cuBLAS's time); it now reads aligned windows around them,
  1627 -> 1204 us at Llama-7B gate/up, N = 8192, still 2.5x cuBLAS on a P^T copy
  (``bgemm_tiles.py --gather``, 3834552). Offered where z's traffic is a visible share of the
  time; at decode the weights' reads dominate and it is not timed.
* ``tbmm`` (N >= TOKEN_MAJOR_MIN_N, block-major): ``bmm`` with z stored token-contiguous,
  (b, r, N) in (s, j) order: the stage-1 store folds P^T in as whole rows of tokens, and stage 2 reads z
  through a transposed view, no copy. Where t is not a multiple of 8 (Llama-7B: 93), it
  replaces ``bmm``'s slow scattered store (Llama-7B gate/up, N=8192: 908.9 against 3442.4 us,
  75317f4). (Both stages on cuBLAS with P^T as a copy of (t x N) slabs lost at every shape.)
* ``tbmm_tbmm`` (every N, block-major): both stages as plain cuBLAS batched GEMMs with no
  copy: z stored token-contiguous in (i, s, j) order, so that output block i's operand is one contiguous slab
  in w2's row order. Until w2 was stored in (s, j) order it reordered a copy of w2's rows on every call: in the
  layer profile (d281e41) that copy took 6.4 us of Llama-1B gate's 31.4 at N = 1024. With the copy, in the
  layer table (1476f91) the fastest pipeline at all seven shapes at N = 8192, 0.73-0.93x the next one's time,
  and at three at N = 1024 (Llama-1B down, Llama-7B gate/up and down); at N = 128 it read 1.07-1.63x the
  fastest. Without the copy (0888d75's table) the pick took it at every shape at N = 1024 and 8192 and at five of
  seven at 128. Offered at every N since: it is the plain PyTorch pipeline (``torch``) less its two permutation
  copies, and ``torch`` was the fastest Monarch pipeline at Llama-7B down, N = 1, in that table (19.01 against the
  pick's 19.44 us). In one run at N = 1 and 16 the pick took it at Llama-7B gate/up and down at N = 16 (8632dd8,
  1.339x and 1.571x dense; results/blr_layers_subset_monarch_decode.json); at the other twelve decode cases it took
  1.036-1.712x the pick.
  Tried and taken out, ``tbmm_tbmm_l2`` (702ebb8): the same a chunk of tokens at a time through one z buffer,
  each chunk's x, z and y half the L2, so that z would pass between the stages through the L2 instead of HBM. It
  took 1.08-1.57x ``tbmm_tbmm``'s time at N = 1024 and 8192 (1.39-1.57x at 8192; Llama-1B q/o 98.8 against
  63.8 us; results/earlier/blr_layers_subset_tbmm_tbmm_l2_702ebb8.json).
  Not profiled: the chunks' smaller GEMMs and extra launches cost more than z's round trip, or z did not stay in
  the L2.
  Tried and taken out, ``fused_scratch`` (e3a9d8e): both stages in one persistent Triton kernel, a program per SM
  walking token tiles, each tile's z written to a scratch buffer of the program's own and read back by its stage 2
  after a CTA barrier (each stage's (tile, K step) loop nest flattened into one pipelined loop, 64-wide K steps), so
  that z would never make its round trip through HBM. On the H200 its pick took 2.16-3.23x ``tbmm_tbmm``'s time at
  the four Llama-1B shapes at N = 8192 (q/o 132.3 against 61.3 us) and 8.6-17.7x at N = 1024, where 16 token tiles
  of 64 leave most SMs idle (results/earlier/blr_layers_subset_fused_scratch_e3a9d8e.json). Not profiled; at N = 8192
  it ran at about 130 TFLOP/s at q/o and 163-253 at the other three shapes, its short-K tiles each ending in a store.
* ``fused`` (the decode path where PDL is not offered, and there a candidate at every N; on a GPU that
  offers it ``two_stage_pdl`` is, and the pick does not time ``fused`` at any N: on the H200 it never came
  within 5% of the fastest, :func:`blr_common.pick_candidates`): one kernel, z on chip. A program owns
  a token tile, output block i and an output column tile; one loop over the input
  blocks j (both dots in it, so it is software-pipelined) computes
  s = X_j @ w1[j][:, i t:(i+1) t] (K = m, all of it in one tile) and at once
  acc += s @ w2[i][j::b, tile] (w2's rows of block j, b apart). One launch, weights read once from HBM (the w1
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
* Tried and taken out, a fused gated MLP for Monarch gate and up (``memfit.kernels.monarch_swiglu`` and
  ``memfit.infer.monarch_swiglu``, 2be652b to 97724cb): at N <= 16, gate's and up's first stages, then one kernel
  that summed both second stages in fp32 (w2 slices prefetched before its PDL wait) and stored silu(g) * u once:
  three launches where the MLP had five. At the Llama-1B MLP its pick timed it at 18.6 against 19.6 us for the two
  Monarch ops and a product kernel (49a4423), then 20.07 against 19.78 (26d0282). Forced in the Monarch model,
  beside the unfused model in the same process, the decode step took 1.208 against 1.221 ms (9a78771) and, with
  memfit's decode GEMV in both, 1.145 against 1.136 (97724cb): no gain beyond run-to-run spread
  (results/earlier/blr_e2e_memfit_attention_fused_mlp*.json). Not profiled.
* ``torch`` (the reference: two cuBLAS batched GEMMs with the permutations as copies)
  competes too, so the pick is never slower than plain PyTorch on a shape where the
  Triton stage 1 stores badly (e.g. a per-block rank t = 93, not a multiple of 8).
Backward: PyTorch ops (recompute-and-differentiate of the reference, memfit.kernels.recompute);
the forward saves only x (nothing where the weights are frozen: recompute.save_for_recompute).
"""
import torch
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels import gemv
from memfit.kernels.autotune import auto_variant, tuned
from memfit.kernels.batched_gemm import (
    A_WINDOW_SLACK,
    bgemm,
    bmm_into,
    per_block_gemm,
    pick_chain_tiles,
)
from memfit.kernels.blr_common import (
    TOKEN_MAJOR_MIN_N,
    bind_shapes,
    blr_precision,
    contiguous_bias,
    fits_smem,
    in_compute_dtype,
    keep_small_n,
    mma,
    n_bucket,
    pdl_offered,
    pick_bucket,
    pick_candidates,
    pow2_at_least,
    require_offered,
    runs_triton,
    skips_dispatcher,
)
from memfit.kernels.recompute import recompute_backward, recomputing, save_for_recompute
from memfit.kernels.tangents import carries_tangents

# Up to this N the chained two_stage is offered, past blr_common.PDL_MAX_N: at 19084f9 Monarch's pick read 0.873-0.978x
# dense at four shapes at N = 256 (blr_layers_subset_256_512.json); offered the chain there (ba0a9d7, five of the seven
# shapes timed, blr_layers_subset_256_chained.json) it took Llama-1B q/o from 7.89 to 6.56 us (0.873x -> 1.064x dense)
TWO_STAGE_PDL_MAX_N = 256
# Up to this N bmm and bmm_perm_bmm are offered: with w2 in (s, j) order they store z element by element, b apart, and
# they took 2.5-33x the pick's time in all 40 of their first timings recorded from N = 128 (412d845,
# results/earlier/blr_layers_subset_monarch_412d845.json; one case's pick was read from the cache)
SCATTERED_Z_MAX_N = 64
FUSED_MAX_TILE = 16384  # pow2(m) * pow2(t) elements of w1 slice per step: 32 KB in bf16, so 2-3 stages fit


def monarch_linear_reference(x, w1, w2, bias=None, permute_output=False):
    """The definition, with the permutations as explicit transposes (copies)."""
    b, m, r = w1.shape
    p = w2.shape[2]
    t = r // b
    lead = x.shape[:-1]
    xs = x.reshape(-1, b, m).transpose(0, 1)                      # (b_j, N, m)
    z = torch.bmm(xs, w1)                                          # (b_j, N, r) = (b_j, N, b_i, t)
    z = z.reshape(b, -1, b, t).permute(2, 1, 3, 0).reshape(b, -1, r)  # P^T: (b_i, N, t * b_j), w2's row order
    y = torch.bmm(z, w2)                                           # (b_i, N, p)
    y = y.permute(1, 2, 0) if permute_output else y.permute(1, 0, 2)  # P: feature s*b+i, else i*p+s
    y = y.reshape(*lead, b * p)
    return y if bias is None else y + bias


def _stage1(x2, w1, launch_dependents=False, tile=None, w2_order=False):
    """z[n, i, j t + s] = (x_j w1[j])[n, i t + s]: stage 1 with P^T folded into the store (runs of t elements); or,
    ``w2_order``, z[n, i, s b + j], in w2's row order for a cuBLAS stage 2 (a column stride of b in the store)."""
    b, m, r = w1.shape
    t, n = r // b, x2.shape[0]
    z = torch.empty(n, b, r, device=x2.device, dtype=x2.dtype)
    bgemm(x2, w1, z, n, m, r, b, (m, x2.stride(0), 1), w1.stride(), (1, b * r, r, b) if w2_order else (t, b * r, r, 1),
          grp=t, launch_dependents=launch_dependents, tile=tile)
    return z


def _two_stage(x2, w1, w2, bias, permute_output):
    return per_block_gemm(_stage1(x2, w1), w2, bias, cublas=False, permute_output=permute_output,
                          w_interleaved=w1.shape[0])


def _chained_two_stage(x2, w1, w2, bias, permute_output, tiles=(None, None)):
    return per_block_gemm(_stage1(x2, w1, launch_dependents=True, tile=tiles[0]), w2, bias, cublas=False,
                          permute_output=permute_output, wait_for_previous=True, w_interleaved=w1.shape[0],
                          tile=tiles[1])


def _two_stage_pdl(x2, w1, w2, bias, permute_output):
    """``two_stage`` chained, with the two stages' tiles picked together (:func:`batched_gemm.pick_chain_tiles`)."""
    (b, m, r), p = w1.shape, w2.shape[2]
    args = (x2, w1, w2, bias, permute_output)
    tiles = pick_chain_tiles("monarch_linear two_stage_pdl", (pick_bucket(x2.shape[0]), b, m, r, p, permute_output,
                                                              str(x2.dtype)), ((m, r, b), (r, p, b)),
                             _chained_two_stage, args)
    return _chained_two_stage(*args, tiles=tiles)


def _bmm(x2, w1, w2, bias, permute_output):
    return per_block_gemm(_stage1(x2, w1, w2_order=True), w2, bias, cublas=True)


# ---- both GEMMs on cuBLAS, the permutation as one copy between them -------------------

@tuned([(16, 4, 2), (32, 4, 2), (64, 8, 2)], ("BN",), (16, 4, 1), key=["N_BUCKET", "T", "B"])
@triton.jit
def _permute_kernel(z_ptr, out_ptr, N, T, B, N_BUCKET, szn, BT: tl.constexpr, BN: tl.constexpr):
    """out[n, i, s B + j] = z[n, j, i T + s] for a tile of BN tokens and one (j, i): Monarch's P^T
    as a copy into w2's row order, each row read as a run of T contiguous elements and stored B elements apart."""
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    j, i = tl.program_id(1), tl.program_id(2)
    rs = tl.arange(0, BT)
    mask = (rn[:, None] < N) & (rs[None, :] < T)
    rows = rn[:, None] * szn + rs[None, :]
    tile = tl.load(z_ptr + rows + (j * B + i) * T, mask=mask)
    tl.store(out_ptr + rn[:, None] * szn + i * B * T + rs[None, :] * B + j, tile, mask=mask)


def _bmm_perm_bmm(x2, w1, w2, bias, permute_output):
    """Stage 1 as one strided cuBLAS batched GEMM into z (N, b_j, r) in its natural order, P^T
    as a memory-bound copy (:func:`_permute_kernel`), stage 2 on cuBLAS. Against ``bmm``: the
    permutation costs z's write and read once more (2 N b r elements), for cuBLAS in stage 1."""
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
                          gathered_runs=(b, r), w_interleaved=b)


# ---- large N, token-contiguous z: whole rows of tokens in every store -------------------

def _refuse_permuted_output(variant: str, permute_output: bool) -> None:
    """The cuBLAS-stored pipelines write the block-major layout only (cuBLAS cannot store a column stride)."""
    if permute_output:
        raise MemfitError(f"monarch_linear: {variant} writes the block-major layout only (permute_output=False)")


def _tbmm(x2, w1, w2, bias, permute_output):
    """``bmm`` with z stored token-contiguous: zp[i, s b + j, n] = (x_j w1[j])[n, i t + s], P^T folded
    into the Triton stage's store as whole rows of tokens (``bmm``'s store writes single elements b apart),
    then stage 2 on cuBLAS reading zp[i]^T as a transposed
    operand. Block-major output only (cuBLAS cannot store the permuted layout's column stride)."""
    _refuse_permuted_output("tbmm", permute_output)
    b, m, r = w1.shape
    t, n = r // b, x2.shape[0]
    zp = torch.empty(b, r, n, device=x2.device, dtype=x2.dtype)
    bgemm(x2, w1, zp, n, m, r, b, (m, x2.stride(0), 1), w1.stride(), (n, 1, r * n, b * n), grp=t)
    return per_block_gemm(zp.permute(2, 0, 1), w2, bias, cublas=True)


def _tbmm_tbmm(x2, w1, w2, bias, permute_output):
    """Both stages as plain cuBLAS strided batched GEMMs, no copy: z stored token-contiguous in (i, s, j) order,
    zs[i, s, j, n] = (x_j w1[j])[n, i t + s]. Stage 1's batch j writes its r rows of tokens with a row stride of b N
    and a batch stride of N, so output block i's operand is one contiguous (t b, N) slab in w2[i]'s row order.
    Against ``tbmm``: cuBLAS instead of the Triton stage 1. Block-major output only (cuBLAS cannot store the permuted
    layout's column stride)."""
    _refuse_permuted_output("tbmm_tbmm", permute_output)
    b, m, r = w1.shape
    t, n, p = r // b, x2.shape[0], w2.shape[2]
    zs = torch.empty(r, b, n, device=x2.device, dtype=x2.dtype)                      # [i t + s, j, n]
    bmm_into(w1.transpose(1, 2), x2.view(n, b, m).permute(1, 2, 0), zs.transpose(0, 1))
    y = torch.empty(n, b * p, device=x2.device, dtype=x2.dtype)
    bmm_into(w2.transpose(1, 2), zs.view(b, t * b, n), y.view(n, b, p).permute(1, 2, 0),
             None if bias is None else bias.view(b, p, 1))
    return y


# ---- one token: both stages as row-streaming GEMVs, chained ---------------------------------------------

def _gemv_gemv_pdl(x2, w1, w2, bias, permute_output):
    """Both stages by :func:`gemv.block_row_gemv`, the second launched while the first runs (it pulls its column
    slice of w2 into L2, then waits for z): z[n, j r + c] = x_j w1[j][:, c] in its natural order, then block i's
    vector gathered from it in w2's (s, j) row order, z[n, j r + i t + s] for row s b + j, with the output layout
    folded into the store. Each program streams whole rows of its weight tile along their unit-stride columns on
    CUDA cores, where ``two_stage_pdl``'s tensor-core tiles pad the one token to 16 rows."""
    b, m, r = w1.shape
    t, n, p = r // b, x2.shape[0], w2.shape[2]
    z = torch.empty(n, b * r, device=x2.device, dtype=x2.dtype)
    gemv.block_row_gemv(x2, w1, z, None, (m, m, 0, 1), (r, 1), launch_dependents=True)
    y = torch.empty(n, b * p, device=x2.device, dtype=x2.dtype)
    return gemv.block_row_gemv(z, w2, y, bias, (t, b, 1, r), (1, b) if permute_output else (p, 1),
                               wait_for_previous=True)


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
    w2_ptrs = w2_ptr + i * s2i + (rt * B)[:, None] * s2c + ro[None, :] * s2o     # rows s b + j: w2's (s, j) order
    x_mask = (rn[:, None] < N) & (rm[None, :] < M)
    w1_mask = (rm[:, None] < M) & (rt[None, :] < T)
    w2_mask = (rt[:, None] < T) & (ro[None, :] < P)
    acc = tl.zeros((BN, BO), dtype=tl.float32)
    for j in range(B):
        xa = tl.load(x_ptrs + j * M, mask=x_mask, other=0.0)
        wa = tl.load(w1_ptrs + j * s1j, mask=w1_mask, other=0.0)
        s = mma(xa, wa, tl.zeros((BN, BT), dtype=tl.float32), PRECISION)
        wb = tl.load(w2_ptrs + j * s2c, mask=w2_mask, other=0.0)
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
            "bmm_gather": _bmm_gather, "tbmm": _tbmm, "tbmm_tbmm": _tbmm_tbmm, "gemv_gemv_pdl": _gemv_gemv_pdl,
            "fused": _fused, "torch": monarch_linear_reference}
UNPICKED_WITH_PDL = ("fused",)  # never within 5% of the fastest on the H200 (blr_common.pick_candidates)


def variants_for(n: int, b: int, m: int, t: int, p: int, permute_output: bool) -> dict:
    """The pipelines offered for ``n`` tokens, b blocks of m inputs and p outputs, per-block rank t and the layout
    (the pick times those :func:`blr_common.pick_candidates` keeps); the same for every N of one ``pick_bucket``
    (which shares a pick: a token-major pipeline picked at N = 128 is offered at N = 100)."""
    n = pick_bucket(n)
    names = ["two_stage", "torch"] + (["two_stage_pdl"] if n <= TWO_STAGE_PDL_MAX_N and pdl_offered() else [])
    names += ["gemv_gemv_pdl"] if n == 1 and pdl_offered() else []
    if n >= TOKEN_MAJOR_MIN_N:
        names.append("bmm_gather")
    if not permute_output:
        names += (["bmm", "bmm_perm_bmm"] if n <= SCATTERED_Z_MAX_N else []) + (["tbmm"] if n >= TOKEN_MAJOR_MIN_N else [])
        names.append("tbmm_tbmm")
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


def _monarch_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, bias: torch.Tensor | None,
                     permute_output: bool, variant: str) -> torch.Tensor:
    b, m, r = w1.shape
    x2 = x.reshape(-1, b * m).contiguous()
    w1, w2 = w1.contiguous(), w2.contiguous()
    args = (x2, w1, w2, contiguous_bias(bias), permute_output)
    if variant == "auto":
        n = x2.shape[0]

        def offer():
            offered = pick_candidates(variants_for(n, b, m, r // b, w2.shape[2], permute_output), UNPICKED_WITH_PDL)
            default = _default(n, permute_output)
            return offered, default if default in offered else "two_stage"          # the fused tile may not fit

        variant = auto_variant("monarch_linear", (pick_bucket(n), *w1.shape, w2.shape[2], permute_output,
                                                  str(x.dtype)), offer, args)
    return VARIANTS[variant](*args).reshape(*x.shape[:-1], -1)


_monarch_op = torch.library.custom_op("memfit::monarch_linear", _monarch_forward, mutates_args=())


@_monarch_op.register_fake
def _(x, w1, w2, bias, permute_output, variant):
    return x.new_empty(*x.shape[:-1], w1.shape[0] * w2.shape[2])


_monarch_op.register_autograd(recompute_backward(monarch_linear_reference, 4, 1),
                              setup_context=lambda ctx, inputs, output: save_for_recompute(ctx, inputs, output, 4))


_monarch_recomputing = recomputing(monarch_linear_reference, 4, 1)


@carries_tangents
def monarch_linear(x, w1, w2, bias=None, permute_output=False, path=None, variant="auto"):
    """Monarch forward by the Triton op where ``use_triton`` allows (``variant``: auto or one of VARIANTS), else the
    reference with the op's memory behaviour (:func:`recompute.recomputing`: only x kept, the backward recomputes,
    as the ledger counts on every device)."""
    size = bind_shapes("monarch_linear", x, bias, {"w1": (w1, "b m r"), "w2": (w2, "b r p")}, "b m", "b p")
    b, m, r, p = size["b"], size["m"], size["r"], size["p"]
    if r % b:
        raise MemfitError(f"monarch_linear: rank r = {r} (w1's last dimension) is not a multiple of blocks b = {b}")
    x, cast = in_compute_dtype(x, w1, w2, bias)
    if not runs_triton("monarch_linear", x, cast[:2], path, variant):
        return _monarch_recomputing(x, *cast, permute_output)
    require_offered("monarch_linear", variant, lambda: variants_for(x.numel() // (b * m), b, m, r // b, p, permute_output),
                    f"for this shape, token count and layout (permute_output={permute_output})")
    op = _monarch_forward if skips_dispatcher(x, *cast) else _monarch_op
    return op(x, *cast, permute_output, variant)
