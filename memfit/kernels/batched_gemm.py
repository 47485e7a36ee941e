"""A strided batched GEMM kernel whose store can regroup columns (:func:`bgemm`), how the Monarch permutation and
output layouts are folded into stores, its tiles and their pick when two launches are chained
(:func:`pick_chain_tiles`), and the cuBLAS alternative for a stage that is a plain strided batched GEMM
(:func:`bmm_into`, :func:`per_block_gemm`).

* ``bgemm``: Hopper-sized tiles for many tokens, 16-token tiles with wide K steps for decode, a grouped program
  order (a group of token tiles sweeps the column tiles together, so A and B tiles are re-read from L2, not HBM)
  and 64-bit offsets.
* ``bmm_into``: cuBLAS writing a strided view of the output (ldc = the row stride), so no copy is made.
"""
import functools

import torch
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels import autotune
from memfit.kernels.autotune import tuned
from memfit.kernels.blr_common import (
    blr_precision,
    chain_options,
    fits_smem,
    keep_small_n,
    line_elements,
    mma,
    n_bucket,
    pow2_at_least,
    prefetch_l2,
)


def _prune_bgemm(configs, named_args, **kwargs):
    """Tiles for the token count (16-token tiles only at decode, a stage in a chain its own; the mid tiles where
    :func:`mid_tiles_offered`), no wider than the columns or a run of K (a group of a gathered a) needs, and whose
    pipeline stages fit shared memory; batch-grouped tiles only for a plain launch with few K steps at large N (judged
    by the N bucket, the autotuner's key, so one rule holds for every N that shares a pick)."""
    chained = kwargs.get("LAUNCH_DEPENDENTS") or kwargs.get("WAIT_FOR_PREVIOUS")
    other = BGEMM_PLAIN_DECODE if chained else BGEMM_CHAINED_DECODE
    if not mid_tiles_offered(named_args["N_BUCKET"], named_args["C"], named_args["BATCHES"],
                             named_args["a_ptr"].device):
        other = other + BGEMM_MID
    one_run = named_args["AGRP"] == named_args["K"]
    if one_run:                                        # a read in one run: the short-run tiles are not for it
        other = other + BGEMM_SHORT_RUNS
    grouped = (one_run and not named_args["BGRP"] and not chained
               and named_args["N_BUCKET"] >= BATCH_GROUP_MIN_N
               and named_args["K"] <= BATCH_GROUP_MAX_K and named_args["BATCHES"] > 1)
    configs = [c for c in configs if bgemm_tile(c) not in other and (grouped or c.kwargs["BATCH_GROUP"] == 1)]
    configs = keep_small_n(configs, named_args["N"])
    size = named_args["a_ptr"].element_size()
    keep = [c for c in configs if bgemm_tile_fits(c, named_args["C"], named_args["AGRP"], size)]
    return keep or configs[:1]


def mid_tiles_offered(n_bucket: int, cols: int, batches: int, device: torch.device) -> bool:
    """Whether bgemm tunes over BGEMM_MID: for an N bucket above decode up to MID_MAX_N where the smallest large tile
    (64 x 128) gives fewer programs than half the SMs of ``device``."""
    return (16 < n_bucket <= MID_MAX_N
            and triton.cdiv(n_bucket, 64) * triton.cdiv(cols, 128) * batches < sm_count(device) / 2)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def bgemm_tile(config) -> tuple:
    """A bgemm config as its tile tuple (BN, BC, BK, warps, stages), the form the tile lists use."""
    return (config.kwargs["BN"], config.kwargs["BC"], config.kwargs["BK"], config.num_warps, config.num_stages)


def bgemm_tile_fits(config, cols: int, k: int, elem_bytes: int) -> bool:
    """Whether a bgemm tile config is worth running: no wider than the columns or K need, and its
    pipeline stages fit shared memory."""
    bn, bc, bk = (config.kwargs[name] for name in ("BN", "BC", "BK"))
    return (bc <= max(32, pow2_at_least(cols)) and bk <= max(32, pow2_at_least(k))
            and fits_smem(config, bk * (bn + bc), elem_bytes))


def jit_function(kernel):
    """The ``@triton.jit`` function under a kernel's autotune and heuristics wrappers."""
    from triton.runtime import Autotuner, Heuristics

    while isinstance(kernel, (Autotuner, Heuristics)):
        kernel = kernel.fn
    return kernel


# Decode, a launch on its own: six tiles, the best of which is within 0.9% of the best of 16 at every
# Monarch stage of the paper's shapes, N = 1 and 16 (bgemm_tiles_decode.json, 113a844: few warps, deep
# pipelines). A stage in a chain keeps the earlier four: with these six the PDL pipelines ran up to 1.5x
# slower (blr_layers, cba5eee; not profiled: a waiting stage's many small programs may hold SMs that the
# stage before it needs).
BGEMM_PLAIN_DECODE = [(16, 64, 128, 2, 4), (16, 32, 64, 2, 8), (16, 32, 256, 2, 4), (16, 64, 64, 4, 6),
                      (16, 128, 64, 4, 5), (16, 32, 128, 2, 6)]
BGEMM_CHAINED_DECODE = [(16, 32, 256, 4, 3), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3)]
# Offered to every gathered a (``a_runs``): K steps of 16 or 32, for runs where 64-wide steps mask much of
# their columns (Monarch's t = 16, 32, 48 at Llama-1B: 75%, 50%, 25%).
BGEMM_SHORT_RUNS = [(128, 128, 32, 4, 4), (128, 128, 16, 4, 5), (128, 256, 32, 8, 3)]
# 64-token tiles of few columns, offered at the N buckets between decode and MID_MAX_N to a launch that the large
# tiles leave with few programs (:func:`mid_tiles_offered`; the large tiles' pick, 128 x 64, gave Llama-1B q/o's stage
# 2 at N = 128 32 programs on 132 SMs). From `bgemm_tiles.py --mid` (d1edfef, bgemm_tiles_mid.json): at N = 128 one of
# these three was the best of the sweep's 14 mid tiles at 13 of the 14 Monarch stages (at Llama-7B qkvo's stage 1,
# 1.14x that best, and a large tile faster than all); the best of the three took 0.81-1.32x the time of the large
# tiles' pick, below 1.0x at 11 stages (Llama-1B q/o: 3.57 / 3.59 us against 3.97 / 4.43, stages 1 / 2); at N = 512
# a mid tile was faster at two stages (Llama-1B q/o and down, stage 2, 0.95-0.96x), which the large tiles fill with
# 128 programs. In the layer table at N = 128 Monarch's q/o went from 6.42 us (1476f91) to 5.48 (273092a) and 5.43
# (f969028). Offered to every launch up to 256 tokens (273092a), they slowed `tbmm` at Llama-7B gate/up, 25.29 ->
# 28.61 us, whose stage 1 the large tiles already give 384 programs (as 32-token tiles had in 04453a1's trial,
# results/earlier/README.md); kept out there, 25.60.
BGEMM_MID = [(64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 32, 128, 4, 3)]
MID_MAX_N = 256
BGEMM_CONFIGS = [  # BN, BC, BK, warps, stages
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
    *BGEMM_PLAIN_DECODE, *BGEMM_CHAINED_DECODE, *BGEMM_SHORT_RUNS, *BGEMM_MID,
]
# Tiles that run BATCH_GROUP batches per program (BN, BC, BK, BATCH_GROUP, warps, stages), offered to any plain
# launch whose K is a few steps (K <= BATCH_GROUP_MAX_K: Monarch's stage 1 at Llama-1B and -7B; two_stage's
# stage 2 at r <= 256 too until 412d845, whose interleaved reads of w2 they do not take) at large N; the autotuner
# keeps the one-batch tiles where they win. From the sweep
# `bgemm_tiles.py --groups 2 4 8` (f1b698c, bgemm_tiles_groups.json,
# bgemm_tiles_runs_z_groups.json): Llama-1B gate, N = 8192, K = 128, stage 1 84.4 -> 72.0 us token-major, q/o
# 46.2 -> 37.9, up 119.3 -> 107.1; at K = 256 (Llama-7B) they win in the (N, b, r) layout (qkvo, N = 8192: 214.4
# -> 196.5) and lose token-major; no gain at K >= 512; a few groups empty the grid at small N.
BGEMM_GROUPED = [(256, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 256, 64, 4, 8, 4), (64, 128, 64, 4, 4, 4)]
BATCH_GROUP_MIN_N, BATCH_GROUP_MAX_K = 1024, 256
BGEMM_TUNED = [(*tile[:3], 1, *tile[3:]) for tile in BGEMM_CONFIGS] + BGEMM_GROUPED   # BN, BC, BK, BATCH_GROUP, w, s


# Elements an a gathered in aligned windows may be read past its last run: a step's BK less one, plus a
# window's lead (at most 16 B less one element).
A_WINDOW_SLACK = max(bk for _, _, bk, _, _ in BGEMM_CONFIGS) + 16


def a_window(a, sab: int, san: int, sak: int, sag: int, gathered: bool) -> int:
    """For a gathered a whose runs start misaligned (a batch stride, Monarch's t, not a multiple of 16 B)
    while its rows and runs are aligned: the alignment, in elements, of the windows the kernel reads
    instead (vector loads; the columns outside the run are zeroed in registers). 0: read the runs."""
    align = 16 // a.element_size()
    return align if (gathered and sak == 1 and sab % align and not san % align and not sag % align
                     and not a.data_ptr() % 16) else 0


@triton.jit
def _k_step_tiles(a_ptrs, b_ptrs, a_rows, b_cols, rk, k0, k_end, EVEN_K: tl.constexpr):
    """One K step's a (BN, BK) and b (BK, BC) tiles, at K offset k0 of a run (or of all of K) ending at
    k_end; EVEN_K: the run is a whole number of steps, so no K mask to build and apply."""
    if EVEN_K:
        return tl.load(a_ptrs, mask=a_rows, other=0.0), tl.load(b_ptrs, mask=b_cols, other=0.0)
    return (tl.load(a_ptrs, mask=a_rows & (rk[None, :] + k0 < k_end), other=0.0),
            tl.load(b_ptrs, mask=(rk[:, None] + k0 < k_end) & b_cols, other=0.0))


@triton.jit
def _interleaved_b_rows(k0, rk, BGRP: tl.constexpr, sbg, sbk, BK: tl.constexpr):
    """Offsets of b's rows for the K step at k0 where b holds interleaved runs of BGRP rows (runs sbg apart, a run's
    rows sbk apart): one scalar division where the step lies in one run (BK divides BGRP), else one per row. BGRP is
    a constexpr, so the divisions are shifts or multiplies. 412d845 divided by a runtime value for every row of every
    K step; its chained two_stage took 3.4-15.1% longer at decode, and at Llama-1B gate 90c6571 took back most of it
    (README's Monarch status)."""
    if BGRP % BK == 0:
        return (k0 // BGRP) * sbg + (k0 % BGRP + rk) * sbk
    k = k0 + rk
    return (k // BGRP) * sbg + (k % BGRP) * sbk


@tuned(BGEMM_TUNED, ("BN", "BC", "BK", "BATCH_GROUP"), (16, 32, 32, 1, 4, 1),
       key=["N_BUCKET", "K", "C", "GRP", "AGRP", "BGRP", "BATCHES", "LAUNCH_DEPENDENTS", "WAIT_FOR_PREVIOUS"],
       prune=_prune_bgemm)
@triton.heuristics({"EVEN_K": lambda meta: meta["AGRP"] % meta["BK"] == 0,
                    "A_GROUPED": lambda meta: meta["AGRP"] < meta["K"],
                    "B_INTERLEAVED": lambda meta: meta["BGRP"] > 0,    # BGRP: b's interleaved run length, or 0
                                                                        # (one compiled kernel for every K)
                    "A_WINDOW": lambda meta: a_window(meta["a_ptr"], meta["sab"], meta["san"], meta["sak"], meta["sag"],
                                                      meta["AGRP"] < meta["K"])})
@triton.jit
def _bgemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, N, K, C, GRP, AGRP, BATCHES, N_BUCKET,
                  sab, san, sak, sag, sbb, sbk, sbc, sbg, scb, scn, scg, sci, BGRP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
                  WAIT_FOR_PREVIOUS: tl.constexpr, B_ROWS_CONTIGUOUS: tl.constexpr, LINE: tl.constexpr,
                  BN: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                  A_GROUPED: tl.constexpr = False, B_INTERLEAVED: tl.constexpr = False, A_WINDOW: tl.constexpr = 0,
                  GROUP_N: tl.constexpr = 8, BATCH_GROUP: tl.constexpr = 1):
    tl.static_assert(BATCH_GROUP == 1 or not (A_GROUPED or B_INTERLEAVED or A_WINDOW > 0 or WAIT_FOR_PREVIOUS),
                     "batch groups: plain loop only")
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    n_tiles = tl.cdiv(N, BN)
    c_tiles = tl.cdiv(C, BC)
    pid = tl.program_id(0)
    per_group = GROUP_N * c_tiles                      # GROUP_N token tiles sweep all column tiles together
    first = (pid // per_group) * GROUP_N
    rows = tl.minimum(n_tiles - first, GROUP_N)
    pid_n = first + (pid % per_group) % rows
    pid_c = (pid % per_group) // rows
    bt = tl.program_id(1).to(tl.int64) * BATCH_GROUP    # this program's (first) batch
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rc = pid_c * BC + tl.arange(0, BC)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + bt * sab + rn[:, None] * san + rk[None, :] * sak
    b_cols_ptr = b_ptr + bt * sbb + rc[None, :] * sbc
    b_ptrs = b_cols_ptr + rk[:, None] * sbk
    if WAIT_FOR_PREVIOUS:                              # b is this op's weights: fetch them while a is being made
        b_tile = b_ptr + bt * sbb + pid_c * BC * sbc
        cols = tl.minimum(BC, C - pid_c * BC)
        if B_INTERLEAVED:                              # its K rows: one slab of rows sbg apart (bgemm checks)
            prefetch_l2(b_tile, K, sbg, cols, LINE)
        elif B_ROWS_CONTIGUOUS:                        # b[k, c] at k * sbk + c
            prefetch_l2(b_tile, K, sbk, cols, LINE)
        else:                                          # b[k, c] at k + c * sbc
            prefetch_l2(b_tile, cols, sbc, K, LINE)
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BN, BC), dtype=tl.float32)
    a_rows, b_cols = rn[:, None] < N, rc[None, :] < C
    if A_WINDOW > 0:                                   # runs of a that start misaligned: aligned windows
        lead = (bt * sab) % A_WINDOW                    # window column of the run's first element
        san_w = (san // A_WINDOW) * A_WINDOW            # = san (a_window checked): written so Triton sees the
        sag_w = (sag // A_WINDOW) * A_WINDOW            # alignment where it did not specialize the stride
        a_win = a_ptr + ((bt * sab) // A_WINDOW) * A_WINDOW + rn[:, None] * san_w + rk[None, :]
        steps = tl.cdiv(AGRP + A_WINDOW - 1, BK)
        for step in range(0, (K // AGRP) * steps):
            run = (step // steps).to(tl.int64)
            q = (step % steps) * BK + rk - lead        # position in the run of each window column
            in_run = (q >= 0) & (q < AGRP)
            a = tl.load(a_win + run * sag_w + (step % steps) * BK, mask=a_rows, other=0.0)
            a = tl.where(in_run[None, :], a, tl.zeros_like(a))     # neighbours' columns (or slack) out
            b = tl.load(b_cols_ptr + run * sbg + q[:, None] * sbk, mask=in_run[:, None] & b_cols, other=0.0)
            acc = mma(a, b, acc, PRECISION)
    elif A_GROUPED:                                    # K = (K / AGRP) runs of AGRP, a's runs sag apart, b's sbg
        steps = tl.cdiv(AGRP, BK)                      # steps per run; a step never crosses a run
        for step in range(0, (K // AGRP) * steps):
            run = (step // steps).to(tl.int64)
            start = (step % steps) * BK                # of this step in its run
            a, b = _k_step_tiles(a_ptrs + run * sag + start * sak, b_ptrs + run * sbg + start * sbk, a_rows,
                                 b_cols, rk, start, AGRP, EVEN_K)
            acc = mma(a, b, acc, PRECISION)
    elif BATCH_GROUP > 1:                              # BATCH_GROUP batches in one flat loop of K steps: the
        k_steps = tl.cdiv(K, BK)                       # next batch's tiles load while this one's is stored
        for step in range(0, BATCH_GROUP * k_steps):
            g = (step // k_steps).to(tl.int64)
            k0 = (step % k_steps) * BK
            live = bt + g < BATCHES
            a, b = _k_step_tiles(a_ptrs + g * sab + k0 * sak, b_ptrs + g * sbb + k0 * sbk, a_rows & live,
                                 b_cols & live, rk, k0, K, EVEN_K)
            acc = mma(a, b, acc, PRECISION)
            if k0 + BK >= K:
                _store_tile(c_ptr, bias_ptr, acc, bt + g, rn, rc, a_rows & b_cols & live, live, C, GRP, scb, scn, scg,
                            sci, HAS_BIAS)
                acc = tl.zeros((BN, BC), dtype=tl.float32)
    else:
        for k0 in range(0, K, BK):
            if B_INTERLEAVED:
                b_ptrs = b_cols_ptr + _interleaved_b_rows(k0, rk, BGRP, sbg, sbk, BK)[:, None]
            a, b = _k_step_tiles(a_ptrs, b_ptrs, a_rows, b_cols, rk, k0, K, EVEN_K)
            acc = mma(a, b, acc, PRECISION)
            a_ptrs += BK * sak
            if not B_INTERLEAVED:
                b_ptrs += BK * sbk
    if BATCH_GROUP == 1:
        _store_tile(c_ptr, bias_ptr, acc, bt, rn, rc, a_rows & b_cols, True, C, GRP, scb, scn, scg, sci, HAS_BIAS)


@triton.jit
def _store_tile(c_ptr, bias_ptr, acc, bt, rn, rc, mask, live, C, GRP, scb, scn, scg, sci, HAS_BIAS: tl.constexpr):
    """c[bt][rn, rc] = acc (+ bias), column rc stored at its group's offset (the regrouping store); ``live``:
    batch bt exists (a batch group's last may run past the batches: then nothing is read or written)."""
    col = bt * scb + (rc // GRP).to(tl.int64) * scg + (rc % GRP).to(tl.int64) * sci   # token-major: i r N > 2^31
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=(rc < C) & live, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rn[:, None] * scn + col[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def bgemm_grid(n: int, cols: int, batches: int, bn: int, bc: int, batch_group: int) -> tuple[int, int]:
    """bgemm's launch grid: (token tiles x column tiles, batch groups)."""
    return triton.cdiv(n, bn) * triton.cdiv(cols, bc), triton.cdiv(batches, batch_group)


def bgemm(a, b, c, n: int, k: int, cols: int, batches: int, a_strides, b_strides, c_strides,
          grp: int | None = None, bias=None, launch_dependents: bool = False,
          wait_for_previous: bool = False, a_runs: tuple[int, int] | None = None, b_interleaved: int = 1,
          tile: tuple | None = None) -> None:
    """c[bt][n, col] = sum_k a[bt][n, k] b[bt][k, col] (+ bias[feature]) for bt < batches.

    Strides in elements: a (batch, n, k), b (batch, k, col), c (batch, n, group, in-group):
    column ``col`` is stored at ``(col // grp) * group + (col % grp) * in_group`` so a
    store can scatter column groups (the Monarch P^T) with no copy. The bias is read at
    the stored column offset, so it applies when c is the (N, out) output itself.

    ``a_runs = (length, stride)`` gathers a the same way on load: k in runs of ``length``
    (a divisor of k), run g of a row starting ``g * stride`` elements after run 0, which the
    a strides address (so Monarch's stage 2 reads P^T straight from stage 1's natural output).
    Where the runs start misaligned but rows and runs are 16-B aligned (Monarch's t = 93), the
    kernel reads aligned windows around each run, up to A_WINDOW_SLACK elements past the last
    run, which a's storage must hold (checked).

    ``b_interleaved = g`` reads b's rows interleaved: K index ``q + j * (k / g)`` (position q of run j) from row
    ``q * g + j``, rows ``b_strides[1]`` apart (Monarch's w2, stored in (s, j) order so that cuBLAS can read it, read
    by a stage 2 whose K is in (j, s) order). With ``a_runs``, b's runs are a's (the same length).

    Where K is a few steps (K <= BATCH_GROUP_MAX_K) and N's bucket >= BATCH_GROUP_MIN_N, a plain launch (a and b
    read in one run) also tunes over tiles that run several batches per program in one flat loop (``BGEMM_GROUPED``).

    In a chain (:func:`chain_options`): ``launch_dependents`` lets the next kernel start now;
    ``wait_for_previous`` prefetches this program's slice of b (the weights) into L2, then
    waits for the previous kernel (which writes a). b needs a unit stride along k or col.

    ``tile`` (BN, BC, BK, warps, stages), one of :func:`bgemm_tiles_offered`, runs that tile instead of the
    autotuner's pick (a chain's tiles are picked together: :func:`pick_chain_tiles`).
    """
    grp = grp or cols
    run, run_stride = a_runs or (k, 0)
    if wait_for_previous and 1 not in tuple(b_strides)[1:]:
        raise MemfitError(f"bgemm: a chained stage needs b with a unit stride, got strides {tuple(b_strides)}")
    if run < 1 or k % run:
        raise MemfitError(f"bgemm: a's runs of {run} do not divide k = {k}")
    if b_interleaved < 1 or k % b_interleaved:
        raise MemfitError(f"bgemm: b's {b_interleaved} interleaved runs do not divide k = {k}")
    if b_interleaved > 1 and wait_for_previous and b_strides[2] != 1:
        raise MemfitError("bgemm: a chained stage reads interleaved b rows only with a unit column stride")
    if b_interleaved > 1 and a_runs and run != k // b_interleaved:
        raise MemfitError(f"bgemm: b's interleaved runs of {k // b_interleaved} must be a's runs of {run}")
    sbb, sbk, sbc, sbg = bgemm_b_strides(b_strides, run, b_interleaved)
    if a_window(a, *a_strides, run_stride, run < k):             # reads aligned windows around the runs
        last = (batches - 1) * a_strides[0] + (n - 1) * a_strides[1] + (k // run - 1) * run_stride + run
        if (a.storage_offset() + last + A_WINDOW_SLACK) * a.element_size() > a.untyped_storage().nbytes():
            raise MemfitError(f"bgemm: a's runs start misaligned, so a's storage needs {A_WINDOW_SLACK} elements "
                              "of slack past its last run (allocate it larger)")
    grid = lambda meta: bgemm_grid(n, cols, batches, meta["BN"], meta["BC"], meta["BATCH_GROUP"])
    kernel, fixed = _bgemm_kernel, {}
    if tile is not None:                                          # the heuristics still set EVEN_K and the a reads
        if tuple(tile) not in BGEMM_CONFIGS:
            raise MemfitError(f"bgemm: tile {tile} is none of its (BN, BC, BK, warps, stages) tiles (BGEMM_CONFIGS)")
        kernel = _bgemm_kernel.fn
        fixed = dict(zip(("BN", "BC", "BK", "num_warps", "num_stages"), tile), BATCH_GROUP=1)
    kernel[grid](a, b, c, bias if bias is not None else c, n, k, cols, grp, run, batches, n_bucket(n),
                 *a_strides, run_stride, sbb, sbk, sbc, sbg, *c_strides, k // b_interleaved if b_interleaved > 1 else 0,
                 HAS_BIAS=bias is not None,
                 PRECISION=blr_precision(a.dtype), B_ROWS_CONTIGUOUS=wait_for_previous and b_strides[2] == 1,
                 LINE=line_elements(b), **chain_options(launch_dependents, wait_for_previous), **fixed)


def bgemm_b_strides(b_strides, run: int, interleaved: int) -> tuple[int, int, int, int]:
    """The kernel's b strides (batch, row within a run, column, run) for b (batch, k, col) strides, a's runs of
    ``run`` rows and ``interleaved`` interleaved runs of b (1: none; then a run of b is a's, ``run`` rows on)."""
    sbb, row, sbc = b_strides
    return (sbb, row * interleaved, sbc, row) if interleaved > 1 else (sbb, row, sbc, run * row)


def bgemm_tiles_offered(a, n: int, k: int, cols: int, batches: int, launch_dependents: bool = False,
                        wait_for_previous: bool = False) -> list[tuple]:
    """The one-batch tiles (BN, BC, BK, warps, stages) bgemm's autotuner chooses between for this launch (a plain,
    ungathered a of ``a``'s dtype and device; :func:`_prune_bgemm`)."""
    shape = {"N": n, "N_BUCKET": n_bucket(n), "C": cols, "K": k, "AGRP": k, "BGRP": 0, "BATCHES": batches, "a_ptr": a}
    kept = _prune_bgemm(_bgemm_kernel.configs, shape, LAUNCH_DEPENDENTS=launch_dependents,
                        WAIT_FOR_PREVIOUS=wait_for_previous)
    return sorted({bgemm_tile(c) for c in kept if c.kwargs["BATCH_GROUP"] == 1})


AUTOTUNED_PAIR = (None, None)           # a chain's two launches left to the autotuner, each tuned alone


def pick_chain_tiles(op: str, shape_key: tuple, stages: tuple[tuple[int, int, int], tuple[int, int, int]],
                     run_with, args: tuple) -> tuple:
    """The tiles of a pipeline's two chained bgemm launches (the first launching its dependents, the last waiting
    for the kernel before it), picked together: every pair of the tiles each launch is offered
    (:func:`bgemm_tiles_offered`), the whole pipeline ``run_with(*args, tiles=pair)`` timed as the variant pick times
    pipelines, by the same :func:`autotune.disk_pick` (rotating copies, CUDA-graph replays, finalists again; cached on disk
    beside the variant picks; every pair's timing recorded in ``autotune.CHAIN_TILE_PICKS``, so in ``autotune.tile_picks``).
    ``stages``: each launch's (K, columns, batches); args[0] is the (N, in) input. AUTOTUNED_PAIR where the launches are left
    to the autotuner: off the GPU, where nothing is timed; at a first call inside a CUDA graph capture, or
    where no pair could be timed (each said once).

    Why: the autotuner times each launch alone, but in a chain the second runs beside the first. At Llama-1B up,
    N = 128, the pair of its picks read 11.15 us in Monarch's ``two_stage_pdl`` (the op 11.40) where the best of 25
    pairs took 10.88, and one stage-2 tile it can take alone (128 x 128 for 128 x 64) made the chain 13.33 us, the
    time the f969028 layer table read (``benchmarks/chain_tiles.py``, 19084f9). The price is paid once per shape and
    N bucket (the pick is cached on disk): a layer's first calls at N = 1 and 16, three structures at the seven
    shapes, took 142.5 s against 92.3 s before (``benchmarks/pick_cost.py``, af7a5bc and d1edfef)."""
    x, device = args[0], autotune.cuda_device(args)
    if device is None:
        return AUTOTUNED_PAIR
    memo = (op, shape_key, device)
    if memo in autotune.CHAIN_TILE_MEMO:
        return autotune.CHAIN_TILE_MEMO[memo]
    n = x.shape[0]
    (k1, cols1, batches1), (k2, cols2, batches2) = stages
    pairs = {f"{t1} + {t2}": (t1, t2)
             for t1 in bgemm_tiles_offered(x, n, k1, cols1, batches1, launch_dependents=True)
             for t2 in bgemm_tiles_offered(x, n, k2, cols2, batches2, wait_for_previous=True)}
    key = "|".join([torch.cuda.get_device_name(), triton.__version__, autotune.source_digest((run_with,)), op,
                    "chained tiles", *map(str, shape_key)])
    picked = autotune.disk_pick(op, shape_key, key, {label: functools.partial(run_with, tiles=tiles)
                                                     for label, tiles in pairs.items()}, args, autotune.CHAIN_TILE_PICKS,
                                "each chained launch takes the tile its autotuner picks alone")
    if picked is None and torch.cuda.is_current_stream_capturing():
        return AUTOTUNED_PAIR                       # not remembered: the next call outside a capture times the pairs
    autotune.CHAIN_TILE_MEMO[memo] = AUTOTUNED_PAIR if picked is None else pairs[picked]
    return autotune.CHAIN_TILE_MEMO[memo]


def bmm_into(a, b, out, bias=None) -> None:
    """out = a @ b (+ bias) by cuBLAS, written straight into ``out``.

    ``a`` (batch, n, k), ``b`` (batch, k, col) and ``out`` (batch, n, col) may be strided
    views (e.g. ``y.view(n, b, p).transpose(0, 1)``): cuBLAS takes a row stride as its
    leading dimension and any batch stride, so the block-major output needs no copy.
    ``bias`` broadcasts to ``out``: (batch, 1, col) over rows, (batch, n, 1) over columns.
    """
    if bias is None:
        torch.bmm(a, b, out=out)
    else:
        torch.baddbmm(bias, a, b, out=out)


def per_block_gemm(a, w, bias, cublas: bool, permute_output: bool = False, wait_for_previous: bool = False,
                   gathered_runs: tuple[int, int] = (1, 0), w_interleaved: int = 1, tile: tuple | None = None):
    """y (N, b p): output block i = a[:, i, :] @ w[i] (+ bias), the last stage of Monarch and BLAST.

    ``a`` (N, b, K) and ``w`` (b, K, p) may be strided views. Block-major output (feature
    i p + s) by cuBLAS (:func:`bmm_into`) or by :func:`bgemm`; ``permute_output`` (bgemm
    only: cuBLAS cannot store a column stride) writes the interleaved feature s b + i, and
    ``wait_for_previous`` (bgemm only) chains it after the kernel that wrote ``a``.
    ``gathered_runs = (count, stride)`` (bgemm only): block i's operand is ``count`` runs of K columns
    side by side, run g read ``g * stride`` elements after a[:, i, :] (w then has count * K rows).
    ``w_interleaved = g`` (bgemm only): w[i]'s rows hold g interleaved runs (:func:`bgemm`'s ``b_interleaved``).
    ``tile``: bgemm's tile, where not autotuned (:func:`bgemm`).
    """
    n, b, k = a.shape
    p = w.shape[2]
    runs, run_stride = gathered_runs
    if w.shape[1] != runs * k:
        raise MemfitError(f"per_block_gemm: w has {w.shape[1]} rows for {runs} runs of {k}")
    y = torch.empty(n, b * p, device=a.device, dtype=a.dtype)
    if cublas:
        if runs != 1 or w_interleaved != 1 or tile is not None:
            raise MemfitError("per_block_gemm: cuBLAS takes no bgemm tile and cannot gather runs of a or interleaved "
                              "rows of w; use bgemm (cublas=False)")
        bmm_into(a.transpose(0, 1), w, y.view(n, b, p).transpose(0, 1), None if bias is None else bias.view(b, 1, p))
    else:
        block_stride, col_stride = (1, b) if permute_output else (p, 1)
        bgemm(a, w, y, n, runs * k, p, b, (a.stride(1), a.stride(0), a.stride(2)), w.stride(),
              (block_stride, y.stride(0), 0, col_stride), bias=bias, wait_for_previous=wait_for_previous,
              a_runs=(k, run_stride) if runs > 1 else None, b_interleaved=w_interleaved, tile=tile)
    return y
