"""BLAST linear (definition in memfit.layers.blast): reference, Triton kernels, op.

Shapes: x (..., in), U (b, p, r), V (b, m, r), S (b, b, r) with in = b m, out = b p;
bias (out,) or None. Stages: Z_j = X_j V_j, T_i = sum_j Z_j diag(s_ij), Y_i = T_i U_i^T.
The mixing is b^2 r N multiply-adds, done exactly once per token by every pipeline at
large N: on CUDA cores where it is fused into stage 3's operand prologue (``_mixgemm_kernel``),
on tensor cores everywhere else (``_xvmix_kernel``, ``_zmix_kernel``: per rank a (tokens x b) @
(b x b) dot; ``_tmix_kernel``: per rank a (b x b) @ (b x tokens) dot on token-contiguous Z and T).

Pipelines; ``auto_variant`` (through ``pick_variant``) times the ones offered for the shape (cached on disk):

* ``xvmix_bmm`` (N <= XVMIX_MAX_N; the paper's partial fusion, taken further on tensor cores):
  ``_xvmix_kernel`` makes Z's (BN tokens, BK ranks) tile for every block j by one batched 3-D dot
  (b: BN x m @ m x BK), rounds it to x's dtype, mixes it by a second batched dot (per rank a
  (BN x b) @ (b x b) product) and writes T (N, b, r); stage 3 on cuBLAS (:func:`per_block_gemm`:
  T read as (b_i, N, r) with lda = b r, U_i^T as a transposed operand, Y written block-major
  through a (b, N, p) view, no copy). Z never reaches memory and no FLOP is recomputed. The price
  is the b-fold result each program holds, Z's and then T's (BB, BN, BK) fp32 tile: tiles stay
  small (16-64 tokens by 16-64 ranks), so X is re-read from L2 once per rank chunk and V once per
  token tile. It replaced the CUDA-core version of this fusion (``mix_bmm``: Z_j's tile scaled by
  s_ij and summed into a register tile per j), which it beat at every shape and N <= 1024, by
  1.03-1.8x (72dedee). On the H200 the three-kernel pipelines below beat it at every shape but
  Llama-1B gate and up at N = 128, where it is the pick by 2% or less (6cfd3c1; a tie at 72dedee),
  and take 0.24-0.62x its time at N = 8192.
* ``bmm_mix_bmm``: stages 1 and 3 on cuBLAS, the mixing alone between them as a
  memory-bound kernel (``_zmix_kernel``: Z read once, T written once, the b^2 products per
  element as a batched (BN x b) @ (b x b) tensor-core dot per rank). Traffic beyond the
  floor: Z's and T's writes and reads, 4 N b r elements, for full-size tensor-core tiles in
  stage 1 (the fused kernel above re-reads X once per rank chunk).
* ``z_mixgemm`` (N <= MIXGEMM_MAX_N, decode): Z (N, b, r) by one batched :func:`bgemm`
  (b ceil(r/BC) programs: every SM streams part of V), then ``_mixgemm_kernel``: stage
  3 with the mixing in its operand prologue, T_i's K-chunk formed from a (BN, b, BK)
  load of Z and s_i by a sum over j, then one dot with U_i^T. The mixing is redone per
  output column tile (ceil(p/BC) times), negligible at decode where Z (a few hundred
  KB) sits in L2 and the kernel is bound by reading U. Two launches, both wide.
* ``tbmm_mix_tbmm`` (N >= TOKEN_MAJOR_MIN_N): ``bmm_mix_bmm`` with Z and T stored token-contiguous,
  (b, r, N), so the mixing pass (``_tmix_kernel``) moves whole rows of tokens, near HBM
  bandwidth, where ``_zmix_kernel`` moves BK-rank runs (64 B) at about 40% of it; the
  cuBLAS stages read and write transposed views, no copies. The fastest pipeline at every
  shape from N = 1024 (75317f4, 18d9a39, 6cfd3c1); at N = 128 others win at some shapes.
* ``bgemm_mix_bgemm_pdl`` (N <= PDL_MAX_N, Hopper+): ``bmm_mix_bmm``'s three stages as one
  chain of Triton kernels (stages 1 and 3 by :func:`bgemm`, the mixing by ``_zmix_kernel``),
  each launched while the one before runs (blr_common's programmatic dependent launch);
  stage 3 pulls its U_i slice into L2 before it waits for T. At decode the three launches
  and dependent reads of ``bmm_mix_bmm`` are most of its time. The two GEMMs' tiles are picked
  together (batched_gemm.pick_chain_tiles).
* ``bgemm_mix_gemv_pdl`` (N = 1, Hopper+): ``bgemm_mix_bgemm_pdl`` with stage 3 as a GEMV (:func:`gemv.block_gemv`):
  U stored (b, p, r) has each output feature's ranks contiguous, so a program streams whole rows of U_i with 16-byte
  loads and sums on CUDA cores, where ``bgemm``'s tensor-core tile pads the one token to 16 rows and reads U_i^T as
  a transposed operand. Stage 1 runs the tile the GEMM chain's pick timed for it in a chain
  (:func:`_gemm_chain_tiles`): autotuned alone, it took different tiles in different runs, and the chain's time moved
  with them (Llama-1B down: 16 x 32 x 256 in the 9462638 and d777153 tables, 1.216x and 1.208x the GEMM chain's
  time; 16 x 64 x 128 in ce2e15c's, 0.942x; ``results/earlier/blr_layers_subset_gemv_chain_*``). So run (7eeb2bd,
  ``blr_layers_subset_gemv_chain.json``), it took 0.905-0.966x ``bgemm_mix_bgemm_pdl``'s time at six of the seven
  shapes (Llama-1B q/o 5.68 against 6.28 us, down 10.31 against 11.17) and was the fastest pipeline at the four
  Llama-1B shapes and Llama-7B qkvo; at Llama-7B gate/up 1.057x. There, under Nsight Compute, one kernel at a time
  (``blr_counters.json``, 7eeb2bd), its three kernels sum to 26.14 us against the GEMM chain's 27.52 (its GEMV stage
  reads U at 2.37 TB/s against ``bgemm``'s 2.04, 13.86 against 16.03 us; stage 1, the same tile in both, 7.90 against
  7.04): the kernels timed one at a time do not explain the loss (their overlap when chained, or tiles picked
  differently in the two processes, might; not traced). At N = 4 it was the fastest at no shape, 1.02-1.96x the
  fastest pipeline (Llama-7B gate/up: 41.38 against ``bmm_mix_bmm``'s 21.15 us; ``blr_layers_subset_gemv_chain_n4.json``,
  ce2e15c; not profiled: each of the four rows of x has its own programs, which read U_i again, from L2 at best). So
  it is offered at one token only.
* Tried and taken out, ``gemv_mix_gemv_pdl`` (42ef66a): ``bgemm_mix_gemv_pdl`` with stage 1 as a row-streaming GEMV
  too (:func:`gemv.block_row_gemv`, V read along its unit-stride ranks, the kernel Monarch's ``gemv_gemv_pdl`` runs).
  At one token it was the pick at Llama-1B q/o only (finalists 5.65 against ``bgemm_mix_gemv_pdl``'s 5.68 us), and took
  1.48-2.21x that pipeline's time at the other six shapes (first timings; Llama-1B up 22.34 against 10.09 us), where
  Monarch's chain, whose first stage is the same launch of the same kernel at the same shapes, took 0.97-1.21x its
  GEMM chain's (not profiled: what differs is the kernel z goes to; ``results/blr_layers_subset_decode_gemv.json``).
* Tried and taken out, ``bgemm_mixgemv_pdl`` (19c8b44): at one token, ``bgemm_mix_gemv_pdl`` with the mixing moved
  into the GEMV (per step of ranks, a program summed Z's and S_i's (b x BK) slices over j on CUDA cores and streamed
  its rows of U_i against the result): two dependent launches, not three, and T never written. On the H200 its first
  timings were 1.08-1.79x ``bgemm_mix_gemv_pdl``'s at the seven shapes, closest at Llama-1B q/o (6.20 against 5.74
  us) and furthest where a block has the most rows, Llama-7B gate/up (38.86 against 21.68) and Llama-1B up (16.41
  against 10.11): every program of block i reads Z's and S_i's slices from L2 and redoes the mixing, once per tile
  of rows (results/earlier/blr_layers_subset_mixgemv_19c8b44.json; not profiled).
* Tried and taken out, ``xvmix_gemv_pdl`` (f366b36, 2e1fb9b): at one token, stages 1 and 2 in one kernel (Z summed
  on CUDA cores from V's rank-contiguous rows and mixed on chip), chained into the same GEMV: two dependent launches
  where ``bgemm_mix_gemv_pdl`` has three. With one program a rank slice, every block in it (f366b36), it took
  1.056-1.828x ``bgemm_mix_gemv_pdl``'s time at the seven shapes; with the blocks spread over programs and the last
  program of a rank slice to arrive (an atomic counter a slice) mixing that slice from L2 (2e1fb9b), 1.140-1.355x
  (Llama-1B q/o 6.67 against 5.73 us; ``results/earlier/blr_layers_subset_xvmix_row_*.json``; not profiled). At
  2e1fb9b ``blr_e2e.py`` also stopped: torch.compile's CUDA-graph trees found a live tensor in their pool that no
  output tracked (``results/logs/blr_e2e_memfit_attention_stopped_2e1fb9b.log``), most likely its counters, one
  buffer kept across calls (the log does not name the tensor).
* ``z_mixgemm_pdl`` (N <= PDL_MAX_N, Hopper+): ``z_mixgemm`` with the second kernel chained
  to the first (blr_common's programmatic dependent launch: it starts while Z is being
  made, pulls its U_i slice into L2, then waits for Z). On a GPU that offers it the pick does
  not time ``z_mixgemm``: on the H200 it never came within 5% of the fastest
  (:func:`blr_common.pick_candidates`).
* ``torch`` (the reference: cuBLAS batched GEMMs, the mixing as an einsum) competes
  too, so the pick is never slower than plain PyTorch (it was the fastest at no shape in
  the 6cfd3c1 run).
Backward: PyTorch ops (recompute-and-differentiate of the reference); saves only x (nothing where the
weights are frozen: recompute.save_for_recompute).
"""
import torch
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels import gemv
from memfit.kernels.autotune import auto_variant, tuned
from memfit.kernels.batched_gemm import (
    bgemm,
    bmm_into,
    per_block_gemm,
    pick_chain_tiles,
)
from memfit.kernels.blr_common import (
    PDL_MAX_N,
    TOKEN_MAJOR_MIN_N,
    bind_shapes,
    blr_precision,
    chain_options,
    contiguous_bias,
    fits_smem,
    in_compute_dtype,
    keep_small_n,
    line_elements,
    mma,
    n_bucket,
    pdl_offered,
    pick_bucket,
    pick_candidates,
    pow2_at_least,
    prefetch_l2,
    require_offered,
    runs_triton,
    skips_dispatcher,
)
from memfit.kernels.recompute import recompute_backward, recomputing, save_for_recompute
from memfit.kernels.tangents import carries_tangents

MIXGEMM_MAX_N = 128      # beyond this the mixing prologue's per-column-tile repeats and Z's b-fold reads cost too much


def blast_linear_reference(x, u, v, s, bias=None):
    """The definition in three stages, each intermediate materialised in x's dtype."""
    b, p, _ = u.shape
    m = v.shape[1]
    lead = x.shape[:-1]
    z = torch.bmm(x.reshape(-1, b, m).transpose(0, 1), v)         # (b_j, N, r): Z_j = X_j V_j
    t = torch.einsum("jnk,ijk->ink", z, s)                         # (b_i, N, r): T_i = sum_j Z_j diag(s_ij)
    y = torch.bmm(t, u.transpose(1, 2))                            # (b_i, N, p): Y_i = T_i U_i^T
    y = y.transpose(0, 1).reshape(*lead, b * p)
    return y if bias is None else y + bias


# ---- the mixing on tensor cores: per rank a (tokens x b) @ (b x b) dot ---------------

@triton.jit
def _load_s_by_rank(s_ptr, rk, rb, B, R, ssi, ssj, ssk):
    """S's (BK, b_j, b_i) tile: per rank k the (b x b) matrix that mixes Z's blocks j into T's blocks i."""
    return tl.load(s_ptr + rk[:, None, None] * ssk + rb[None, :, None] * ssj + rb[None, None, :] * ssi,
                   mask=(rk[:, None, None] < R) & (rb[None, :, None] < B) & (rb[None, None, :] < B), other=0.0)


@triton.jit
def _store_t_by_rank(t_ptr, t, rn, rk, rb, N, B, R, stn, sti, stk):
    """T's (BK, BN, b_i) fp32 tile, rounded to T's dtype, into T (N, b, r) at any strides."""
    tl.store(t_ptr + rk[:, None, None] * stk + rn[None, :, None] * stn + rb[None, None, :] * sti,
             t.to(t_ptr.dtype.element_ty), mask=(rk[:, None, None] < R) & (rn[None, :, None] < N) & (rb[None, None, :] < B))


# ---- full fusion of stages 1 and 2 on tensor cores: Z never leaves the chip -----------

XVMIX_RESULT_REGISTERS = 64   # fp32 results a thread may hold (BB * BN * BK a program, Z's then T's); ptxas
# compiles the tiles below at b = 16 in bf16 for sm_90 with at most 8 bytes of spill stores, where a
# 32 x 32 x 32 tile at 4 warps spills kilobytes (tests/test_blr_kernels.py checks both)
XVMIX_MAX_N = 128   # from N = 1024 the three-kernel pipelines took 0.24-0.83x its time at every shape (6cfd3c1)
XVMIX_CONFIGS = [(16, 16, 32, 8, 2), (16, 16, 16, 4, 2), (16, 32, 16, 8, 3), (32, 16, 32, 8, 2), (64, 16, 16, 8, 3),
                 (16, 64, 16, 8, 3), (32, 32, 16, 8, 3)]  # BN, BK, BM, warps, stages


def _prune_xvmix(configs, named_args, **kwargs):
    """Tiles whose (BB, BN, BK) fp32 result fits the registers (all listed ones at b <= 16, four at b = 32)
    and whose X and V slices fit shared memory at their stage count, no wider than the tokens, ranks and
    input block need; where none fits (b = 64), the tile with the smallest shared-memory slices."""
    bb, size = kwargs["BB"], named_args["x_ptr"].element_size()
    fit = [c for c in configs if bb * c.kwargs["BN"] * c.kwargs["BK"] <= XVMIX_RESULT_REGISTERS * 32 * c.num_warps
           and fits_smem(c, bb * c.kwargs["BM"] * (c.kwargs["BN"] + c.kwargs["BK"]), size)]
    keep = [c for c in fit if c.kwargs["BN"] <= pow2_at_least(named_args["N"])
            and c.kwargs["BK"] <= pow2_at_least(named_args["R"]) and c.kwargs["BM"] <= pow2_at_least(named_args["M"])]
    smallest = min(configs, key=lambda c: c.num_stages * c.kwargs["BM"] * (c.kwargs["BN"] + c.kwargs["BK"]))
    return keep or fit[:1] or [smallest]


@tuned(XVMIX_CONFIGS, ("BN", "BK", "BM"), (16, 16, 16, 4, 1), key=["N_BUCKET", "M", "R", "B"], prune=_prune_xvmix)
@triton.jit
def _xvmix_kernel(x_ptr, v_ptr, s_ptr, t_ptr, N, M, R, B, N_BUCKET,
                  sxn, svj, sva, svk, ssi, ssj, ssk, stn, sti, stk,
                  BB: tl.constexpr, PRECISION: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    """T[n, i, k] = sum_j s[i, j, k] (X_j V_j)[n, k] for a (BN tokens, BK ranks) tile, all i and j, on
    tensor cores: Z's tile for every block j by one batched (b: BN x m) @ (b: m x BK) dot, rounded to
    x's dtype as in the reference, then per rank k the (BN x b) @ (b x b) mixing dot, as ``_zmix_kernel``
    does it from memory. Z never leaves the chip; X's tile is read once per rank chunk."""
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    rb = tl.arange(0, BB)
    rm = tl.arange(0, BM)
    rows_ok = (rb[:, None, None] < B) & (rn[None, :, None] < N)
    z = tl.zeros((BB, BN, BK), dtype=tl.float32)
    for a0 in range(0, M, BM):
        am = a0 + rm
        xa = tl.load(x_ptr + rn[None, :, None] * sxn + rb[:, None, None] * M + am[None, None, :],
                     mask=rows_ok & (am[None, None, :] < M), other=0.0)                           # (b_j, BN, BM)
        va = tl.load(v_ptr + rb[:, None, None] * svj + am[None, :, None] * sva + rk[None, None, :] * svk,
                     mask=(rb[:, None, None] < B) & (am[None, :, None] < M) & (rk[None, None, :] < R),
                     other=0.0)                                                                  # (b_j, BM, BK)
        z = mma(xa, va, z, PRECISION)
    zt = tl.permute(z.to(x_ptr.dtype.element_ty), (2, 1, 0))                                     # (BK, BN, b_j)
    st = _load_s_by_rank(s_ptr, rk, rb, B, R, ssi, ssj, ssk)
    _store_t_by_rank(t_ptr, mma(zt, st.to(zt.dtype), tl.zeros((BK, BN, BB), dtype=tl.float32), PRECISION),
                     rn, rk, rb, N, B, R, stn, sti, stk)


def _xvmix(x2, v, s):
    """T (N, b, r) = sum_j Z_j diag(s_ij), Z made and mixed on chip (``_xvmix_kernel``)."""
    b, m, r = v.shape
    n = x2.shape[0]
    t = torch.empty(n, b, r, device=x2.device, dtype=x2.dtype)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]), triton.cdiv(r, meta["BK"]))
    _xvmix_kernel[grid](x2, v, s, t, n, m, r, b, n_bucket(n), x2.stride(0), *v.stride(), *s.stride(), *t.stride(),
                        BB=pow2_at_least(b), PRECISION=blr_precision(x2.dtype))
    return t


def _xvmix_bmm(x2, u, v, s, bias):
    """T by ``_xvmix_kernel``, Y_i = T_i U_i^T by cuBLAS: one round trip of an intermediate (T), not
    ``tbmm_mix_tbmm``'s two (Z and T)."""
    return per_block_gemm(_xvmix(x2, v, s), u.transpose(1, 2), bias, cublas=True)


# ---- large N: stage 1 and 3 on cuBLAS, the mixing alone between them ----------------

ZMIX_RESULT_REGISTERS = 128   # fp32 results a thread may hold (BK * BN * BB per program); past it, they spill


def _prune_zmix(configs, named_args, **kwargs):
    """Tiles no wider than the ranks and tokens need, whose (BK, BN, BB) result fits the registers:
    every listed tile fits at b <= 16, the smallest ones at b <= 64."""
    fit = [c for c in configs
           if c.kwargs["BK"] * c.kwargs["BN"] * kwargs["BB"] <= ZMIX_RESULT_REGISTERS * 32 * c.num_warps]
    keep = [c for c in fit if c.kwargs["BK"] <= pow2_at_least(named_args["R"])
            and c.kwargs["BN"] <= pow2_at_least(named_args["N"])]
    return keep or fit[-1:] or configs[-1:]


ZMIX_CONFIGS = [(16, 64, 4, 1), (32, 32, 4, 1), (64, 16, 4, 1), (32, 64, 8, 1), (64, 32, 8, 1), (128, 16, 8, 1),
                (16, 32, 4, 1), (16, 16, 4, 1)]  # BN, BK, warps, stages


@tuned(ZMIX_CONFIGS, ("BN", "BK"), (16, 16, 4, 1), key=["N_BUCKET", "R", "B"], prune=_prune_zmix)
@triton.jit
def _zmix_kernel(z_ptr, s_ptr, t_ptr, N, R, B, N_BUCKET, szn, szj, ssi, ssj, ssk, stn, sti, stk,
                 BB: tl.constexpr, PRECISION: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
                 WAIT_FOR_PREVIOUS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """T[n, i, k] = sum_j Z[n, j, k] s[i, j, k] for a (BN tokens, BK ranks) tile: per rank k a
    (BN x b) @ (b x b) product, all BK of them as one batched tensor-core dot (Z read and T
    written once; the b^2 multiply-adds per element stay off the CUDA cores)."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    rb = tl.arange(0, BB)
    st = _load_s_by_rank(s_ptr, rk, rb, B, R, ssi, ssj, ssk)
    if WAIT_FOR_PREVIOUS:                              # S is this op's weights; Z comes from the previous kernel
        tl.extra.cuda.gdc_wait()
    z = tl.load(z_ptr + rk[:, None, None] + rn[None, :, None] * szn + rb[None, None, :] * szj,
                mask=(rk[:, None, None] < R) & (rn[None, :, None] < N) & (rb[None, None, :] < B),
                other=0.0)                                                                      # (BK, BN, b_j)
    _store_t_by_rank(t_ptr, mma(z, st.to(z.dtype), tl.zeros((BK, BN, BB), dtype=tl.float32), PRECISION),
                     rn, rk, rb, N, B, R, stn, sti, stk)


def _bmm_mix_bmm(x2, u, v, s, bias):
    """Z (N, b, r) by one strided cuBLAS batched GEMM, T = the mixing of Z (``_zmix_kernel``: a
    memory-bound pass on tensor cores, Z read and T written once), Y by cuBLAS per block. Against ``xvmix_bmm``,
    stage 1 runs on cuBLAS's full-size tiles instead of small per-rank-chunk dots that re-read X
    ceil(r / BK) times (12 to 48 at Llama-1B's down projection), for Z's write and read (2 N b r)."""
    b, m, r = v.shape
    n = x2.shape[0]
    z = torch.empty(n, b, r, device=x2.device, dtype=x2.dtype)
    bmm_into(x2.view(n, b, m).transpose(0, 1), v, z.transpose(0, 1))         # Z_j = X_j V_j
    return per_block_gemm(_zmix(z, s), u.transpose(1, 2), bias, cublas=True)     # Y_i = T_i U_i^T


# ---- large N, token-contiguous intermediates: the mixing as one small 2-D dot per rank ----

def _prune_tmix(configs, named_args, **kwargs):
    """Token tiles no wider than the tokens (64 at least) and rank slices no wider than the ranks."""
    keep = [c for c in configs if c.kwargs["BN"] <= pow2_at_least(named_args["N"], 64)
            and c.kwargs["BK"] <= pow2_at_least(named_args["R"], 4)]
    return keep or configs[-1:]


# (BN, BK, warps, stages). With 1 stage each rank's loads wait for the previous rank's store: at N = 128
# (one or two token tiles) that chain of BK dependent reads looks like the pass's time (6.2 us for 6 MB at
# Llama-1B up, 6cfd3c1). Stages >= 2 let Triton prefetch the next ranks' Z_k rows by cp.async (S_k, b^2
# scalars r apart, stays a plain load). With the 3-stage tiles listed the pass took 5.50 us there (43f911d
# profile; 10.34 against 10.88 us at Llama-1B gate, N = 1024); the results do not record which tile won.
TMIX_CONFIGS = [(256, 8, 4, 1), (512, 8, 8, 1), (128, 16, 4, 1), (128, 8, 2, 1), (64, 8, 1, 1), (64, 16, 2, 1),
                (256, 8, 4, 3), (128, 8, 2, 3), (64, 4, 1, 3)]


@tuned(TMIX_CONFIGS, ("BN", "BK"), (64, 4, 4, 1), key=["N_BUCKET", "R", "B"], prune=_prune_tmix)
@triton.jit
def _tmix_kernel(z_ptr, s_ptr, t_ptr, N, R, B, N_BUCKET, szj, szk, ssi, ssj, ssk, stj, stk,
                 BB: tl.constexpr, PRECISION: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """T[i, k, n] = sum_j s[i, j, k] Z[j, k, n] for BK ranks and BN tokens: per rank k one
    (b x b) @ (b x BN) dot of S_k and Z_k, both loaded and stored as b rows of BN contiguous
    tokens (whole cache lines). Near HBM bandwidth on the H200 (71.6 us for Z's read and T's write,
    268 MB, at Llama-1B's gate projection, N = 8192; ``_zmix_kernel`` took 153.9 us, 724f49d)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rb = tl.arange(0, BB)
    n_ok = rn[None, :] < N
    b_ok = rb < B
    szk64 = tl.zeros((1, 1), dtype=tl.int64) + szk   # 64-bit: k N passes 2^31 before Z outgrows a GPU
    stk64 = tl.zeros((1, 1), dtype=tl.int64) + stk   # (a stride equal to 1 arrives as a plain int)
    for k in range(tl.program_id(1) * BK, tl.minimum(tl.program_id(1) * BK + BK, R)):
        sk = tl.load(s_ptr + rb[:, None] * ssi + rb[None, :] * ssj + k * ssk, mask=b_ok[:, None] & b_ok[None, :],
                     other=0.0)                                                   # (b_i, b_j)
        zk = tl.load(z_ptr + rb[:, None].to(tl.int64) * szj + k * szk64 + rn[None, :], mask=b_ok[:, None] & n_ok,
                     other=0.0)                                                   # (b_j, BN)
        tk = mma(sk.to(zk.dtype), zk, tl.zeros((BB, BN), dtype=tl.float32), PRECISION)
        tl.store(t_ptr + rb[:, None].to(tl.int64) * stj + k * stk64 + rn[None, :], tk.to(t_ptr.dtype.element_ty),
                 mask=b_ok[:, None] & n_ok)


def _tbmm_mix_tbmm(x2, u, v, s, bias):
    """``bmm_mix_bmm`` with Z and T stored token-contiguous, (b, r, N): the mixing kernel
    (``_tmix_kernel``) then reads and writes rows of BN contiguous tokens and does one small 2-D
    dot per rank, where ``_zmix_kernel`` reads runs of BK ranks (64 B at BK = 32) into a batched
    3-D dot. The cuBLAS stages take transposed views, no copies: Z_j^T = V_j^T X_j^T into (b, r, N),
    and Y_i = T_i U_i^T with T_i^T read as a transposed operand."""
    b, m, r = v.shape
    n = x2.shape[0]
    z = torch.empty(b, r, n, device=x2.device, dtype=x2.dtype)
    bmm_into(v.transpose(1, 2), x2.view(n, b, m).permute(1, 2, 0), z)
    t = torch.empty_like(z)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]), triton.cdiv(r, meta["BK"]))
    _tmix_kernel[grid](z, s, t, n, r, b, n_bucket(n), z.stride(0), z.stride(1), *s.stride(), t.stride(0), t.stride(1),
                       BB=pow2_at_least(b), PRECISION=blr_precision(z.dtype))
    return per_block_gemm(t.permute(2, 0, 1), u.transpose(1, 2), bias, cublas=True)


def _zmix(z, s, chained=False):
    """T (N, b, r) = the mixing of Z (N, b, r) by ``_zmix_kernel``; ``chained``: launched dependent on
    the kernel that wrote Z, and letting the next one start."""
    n, b, r = z.shape
    t = torch.empty_like(z)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]), triton.cdiv(r, meta["BK"]))
    _zmix_kernel[grid](z, s, t, n, r, b, n_bucket(n), z.stride(0), z.stride(1), *s.stride(), *t.stride(),
                       BB=pow2_at_least(b), PRECISION=blr_precision(z.dtype),  # BB >= 16: a tensor-core K and N
                       **chain_options(chained, chained))
    return t


def _z_by_bgemm(x2, v, launch_dependents: bool, tile=None):
    """Z (N, b, r), z[n, j, k] = (X_j V_j)[n, k], by ``bgemm``; ``launch_dependents``: the first kernel of a chain."""
    b, m, r = v.shape
    n = x2.shape[0]
    z = torch.empty(n, b, r, device=x2.device, dtype=x2.dtype)
    bgemm(x2, v, z, n, m, r, b, (m, x2.stride(0), 1), v.stride(), (r, b * r, 0, 1), launch_dependents=launch_dependents,
          tile=tile)
    return z


def _chained_bgemm_mix_bgemm(x2, u, v, s, bias, tiles=(None, None)):
    z = _z_by_bgemm(x2, v, launch_dependents=True, tile=tiles[0])
    return per_block_gemm(_zmix(z, s, chained=True), u.transpose(1, 2), bias, cublas=False, wait_for_previous=True,
                          tile=tiles[1])


def _gemm_chain_tiles(x2, u, v, s, bias) -> tuple:
    """The tiles of ``bgemm_mix_bgemm_pdl``'s two GEMMs, picked together (:func:`batched_gemm.pick_chain_tiles`)."""
    (b, m, r), p = v.shape, u.shape[1]
    return pick_chain_tiles("blast_linear bgemm_mix_bgemm_pdl", (pick_bucket(x2.shape[0]), b, p, r, m, str(x2.dtype)),
                            ((m, r, b), (r, p, b)), _chained_bgemm_mix_bgemm, (x2, u, v, s, bias))


def _bgemm_mix_bgemm_pdl(x2, u, v, s, bias):
    """The three stages of ``bmm_mix_bmm`` as a chain of Triton kernels, each launched while the
    previous one runs; stage 3 prefetches its U_i slice before waiting for T. The two GEMMs' tiles are
    picked together (:func:`batched_gemm.pick_chain_tiles`; the mixing's alone, by its autotuner)."""
    return _chained_bgemm_mix_bgemm(x2, u, v, s, bias, tiles=_gemm_chain_tiles(x2, u, v, s, bias))


def _bgemm_mix_gemv_pdl(x2, u, v, s, bias):
    """Z by ``bgemm``, T by ``_zmix_kernel``, Y by :func:`gemv.block_gemv`, each kernel launched while the one before
    runs; the GEMV streams U (b p, r) row by row, block i times T_i. Stage 1, the same launch as the GEMM chain's,
    takes the tile that chain's pick timed for it in a chain (:func:`_gemm_chain_tiles`): its autotuner, timing it
    alone, took different tiles in different runs, and the chain's time moved with them (at Llama-1B down, 16 x 32 x
    256 in the 9462638 and d777153 tables, 16 x 64 x 128 in ce2e15c's, the GEMM chain's pair there in all three);
    the GEMV's and the mixing's tiles are their autotuners' picks. So a first call that names this variant also times
    the GEMM chain's pairs, where the pick has not (variants_for lists that chain first, so the pick times it first)."""
    (b, _, r), n = v.shape, x2.shape[0]
    stage1 = _gemm_chain_tiles(x2, u, v, s, bias)[0]
    t = _zmix(_z_by_bgemm(x2, v, launch_dependents=True, tile=stage1), s, chained=True)
    return gemv.block_gemv(t.view(n, b * r), u.view(-1, r), bias, b, r, wait_for_previous=True)


# ---- decode: Z by a batched GEMM, the mixing in stage 3's operand prologue -----------

def _prune_mixgemm(configs, named_args, **kwargs):
    configs = keep_small_n(configs, named_args["N"])
    keep = [c for c in configs if c.kwargs["BC"] <= pow2_at_least(named_args["P"], 32)
            and c.kwargs["BK"] <= pow2_at_least(named_args["R"])]
    return keep or configs[:1]


# BN * b * BK operand elements per step: <= 128 registers a thread at b = 16
@tuned([(16, 32, 64, 4, 3), (16, 64, 32, 4, 3), (16, 64, 64, 4, 3), (16, 128, 32, 4, 3),
        (64, 64, 32, 8, 2), (64, 128, 32, 8, 2)],
       ("BN", "BC", "BK"), (16, 16, 16, 4, 1), key=["N_BUCKET", "R", "P", "B"], prune=_prune_mixgemm)
@triton.jit
def _mixgemm_kernel(z_ptr, s_ptr, u_ptr, y_ptr, bias_ptr, N, R, P, B, N_BUCKET,
                    szn, szj, ssi, ssj, ssk, sui, suo, suk, syn,
                    HAS_BIAS: tl.constexpr, BB: tl.constexpr, PRECISION: tl.constexpr,
                    WAIT_FOR_PREVIOUS: tl.constexpr, LINE: tl.constexpr,
                    BN: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """y[n, i p + o] = sum_k (sum_j s[i, j, k] Z[n, j, k]) U[i, o, k] for a (BN, BC) tile of block i."""
    c_tiles = tl.cdiv(P, BC)
    i = tl.program_id(0) % B
    pid_c = (tl.program_id(0) // B) % c_tiles
    pid_n = tl.program_id(0) // (B * c_tiles)
    if WAIT_FOR_PREVIOUS:                              # U_i's rows of this column tile (unit stride along k) into L2
        prefetch_l2(u_ptr + i * sui + pid_c * BC * suo, tl.minimum(BC, P - pid_c * BC), suo, R, LINE)
        tl.extra.cuda.gdc_wait()                       # then Z, written by the previous kernel
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rc = pid_c * BC + tl.arange(0, BC)
    rk = tl.arange(0, BK)
    rb = tl.arange(0, BB)
    acc = tl.zeros((BN, BC), dtype=tl.float32)
    for k0 in range(0, R, BK):
        kk = k0 + rk
        z = tl.load(z_ptr + rn[:, None, None] * szn + rb[None, :, None] * szj + kk[None, None, :],
                    mask=(rn[:, None, None] < N) & (rb[None, :, None] < B) & (kk[None, None, :] < R), other=0.0)
        si = tl.load(s_ptr + i * ssi + rb[:, None] * ssj + kk[None, :] * ssk,
                     mask=(rb[:, None] < B) & (kk[None, :] < R), other=0.0).to(tl.float32)
        a = tl.sum(z.to(tl.float32) * si[None, :, :], axis=1)
        u = tl.load(u_ptr + i * sui + kk[:, None] * suk + rc[None, :] * suo,
                    mask=(kk[:, None] < R) & (rc[None, :] < P), other=0.0)
        acc = mma(a.to(u.dtype), u, acc, PRECISION)                      # T rounded to x's dtype, as in the reference
    col = i * P + rc
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=rc < P, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rn[:, None] * syn + col[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rn[:, None] < N) & (rc[None, :] < P))


def _z_mixgemm(x2, u, v, s, bias, chained=False):
    b, p, r = u.shape
    if chained and u.stride(2) != 1:                                 # the prefetch walks U_i's rows along k
        raise MemfitError(f"blast_linear: z_mixgemm_pdl needs U with a unit stride along the rank, got {u.stride()}")
    n = x2.shape[0]
    z = _z_by_bgemm(x2, v, launch_dependents=chained)
    y = torch.empty(n, b * p, device=x2.device, dtype=x2.dtype)
    grid = lambda meta: (triton.cdiv(n, meta["BN"]) * b * triton.cdiv(p, meta["BC"]),)
    _mixgemm_kernel[grid](z, s, u, y, bias if bias is not None else y, n, r, p, b, n_bucket(n), z.stride(0),
                          z.stride(1), *s.stride(), *u.stride(), y.stride(0), HAS_BIAS=bias is not None,
                          BB=pow2_at_least(b, 1), PRECISION=blr_precision(x2.dtype), LINE=line_elements(u),
                          **chain_options(wait_for_previous=chained))
    return y


def _z_mixgemm_pdl(x2, u, v, s, bias):
    return _z_mixgemm(x2, u, v, s, bias, chained=True)


VARIANTS = {"xvmix_bmm": _xvmix_bmm, "bmm_mix_bmm": _bmm_mix_bmm, "tbmm_mix_tbmm": _tbmm_mix_tbmm, "z_mixgemm": _z_mixgemm,
            "z_mixgemm_pdl": _z_mixgemm_pdl, "bgemm_mix_bgemm_pdl": _bgemm_mix_bgemm_pdl,
            "bgemm_mix_gemv_pdl": _bgemm_mix_gemv_pdl,
            "torch": blast_linear_reference}


def variants_for(n: int) -> dict:
    """The pipelines offered at ``n`` tokens (the pick times those :func:`blr_common.pick_candidates` keeps), the same
    for every N of one ``pick_bucket`` (which shares a pick)."""
    n = pick_bucket(n)
    names = ["bmm_mix_bmm", "torch"] + (["z_mixgemm"] if n <= MIXGEMM_MAX_N else [])
    names += ["xvmix_bmm"] if n <= XVMIX_MAX_N else []
    if n >= TOKEN_MAJOR_MIN_N:
        names.append("tbmm_mix_tbmm")
    if n <= PDL_MAX_N and pdl_offered():
        names += ["bgemm_mix_bgemm_pdl"] + (["z_mixgemm_pdl"] if n <= MIXGEMM_MAX_N else [])
        names += ["bgemm_mix_gemv_pdl"] if n == 1 else []      # after the GEMM chain, whose stage-1 tile it takes
    return {name: VARIANTS[name] for name in names}


UNPICKED_WITH_PDL = ("z_mixgemm",)  # never within 5% of the fastest on the H200 (blr_common.pick_candidates)


def _default(n: int) -> str:
    """The pick off the GPU timing path (interpreter, CUDA-graph capture): at decode the three-kernel chain where PDL
    is offered (at most 1.56x, 1.16x and 1.43x the fastest pipeline at N <= 16 in the 43f911d, 6a18df8 and 89a2ab1
    tables, where ``z_mixgemm_pdl`` reached 2.15x, 2.07x and 2.38x), else the two-launch ``z_mixgemm``."""
    if n <= 16:
        return "bgemm_mix_bgemm_pdl" if pdl_offered() else "z_mixgemm"
    return "tbmm_mix_tbmm" if n >= TOKEN_MAJOR_MIN_N else "bmm_mix_bmm"


def _blast_forward(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None,
                   variant: str) -> torch.Tensor:
    b, m, _ = v.shape
    x2 = x.reshape(-1, b * m).contiguous()
    args = (x2, u.contiguous(), v.contiguous(), s.contiguous(), contiguous_bias(bias))
    if variant == "auto":
        n = x2.shape[0]
        variant = auto_variant("blast_linear", (pick_bucket(n), *u.shape, m, str(x.dtype)),
                               lambda: (pick_candidates(variants_for(n), UNPICKED_WITH_PDL), _default(n)), args)
    return VARIANTS[variant](*args).reshape(*x.shape[:-1], -1)


_blast_op = torch.library.custom_op("memfit::blast_linear", _blast_forward, mutates_args=())


@_blast_op.register_fake
def _(x, u, v, s, bias, variant):
    return x.new_empty(*x.shape[:-1], u.shape[0] * u.shape[1])


_blast_op.register_autograd(recompute_backward(blast_linear_reference, 5),
                            setup_context=lambda ctx, inputs, output: save_for_recompute(ctx, inputs, output, 5))


_blast_recomputing = recomputing(blast_linear_reference, 5, 0)


@carries_tangents
def blast_linear(x, u, v, s, bias=None, path=None, variant="auto"):
    """BLAST forward by the Triton op where ``use_triton`` allows (``variant``: auto or one of VARIANTS), else the
    reference with the op's memory behaviour (:func:`recompute.recomputing`)."""
    size = bind_shapes("blast_linear", x, bias, {"u": (u, "b p r"), "v": (v, "b m r"), "s": (s, "b b r")}, "b m",
                       "b p")
    x, cast = in_compute_dtype(x, u, v, s, bias)
    if not runs_triton("blast_linear", x, cast[:3], path, variant):
        return _blast_recomputing(x, *cast)
    require_offered("blast_linear", variant, lambda: variants_for(x.numel() // (size["b"] * size["m"])),
                    "at this token count")
    op = _blast_forward if skips_dispatcher(x, *cast) else _blast_op
    return op(x, *cast, variant)
