"""One-launch decode pipelines: every stage of a BLR layer in one persistent kernel, grid barriers between them.

At decode (N <= ONE_LAUNCH_MAX_N) each BLR pipeline is two or three kernels, and each kernel is a launch, a ramp
and one dependent read of its weights: at Llama-7B the fastest pipelines read 1.8-2.1x (Monarch) and 2.0-2.1x
(BLAST) their floor in the 89a2ab1 table, and chaining the launches (the ``*_pdl`` pipelines) did not close the
gap. Here one launch runs them all: a grid of one program per SM runs stage 1's tiles (a strided batched
GEMM whose store regroups columns, as :func:`blr_common.bgemm`'s: Monarch's P^T), waits at a grid-wide barrier
until every program's tiles are stored, then runs the next stage's (BLAST: the mixing, a second barrier, then
stage 3). The intermediates make one round trip through L2 (read back with ``.cg`` loads, which skip the L1 that
could hold a stale line).

The barrier needs every program resident at once. A grid of one program per SM is: a compiled kernel
fits one block on an SM, and a program that waits for an SM held by another stream's kernel gets one when that
kernel ends. It would hang where fewer SMs are this process's than the device reports (an MPS client limited
by ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``); those are not detected. The barrier's state (arrivals, generation) is
one int64 counter per device that only grows, and every launch has one program per SM (those without a tile
only arrive), so each barrier of each launch ends at the next multiple of that count. Two streams running these
kernels at the same time would share it: the pipelines are for one decode stream.

Under the interpreter, which runs programs one after another (a barrier would wait forever), each stage is its
own launch of the same kernel (``ONLY``), so the tests check the same tile arithmetic.
"""
import functools

import torch
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels.blr_common import blr_precision, fits_smem, mma, n_bucket, pow2_at_least, tuned
from memfit.kernels.dispatch import interpreting

ONE_LAUNCH_MAX_N = 16    # one 16-token tile: every program holds all tokens, so no stage re-reads a weight
BN = 16

# BK1, BC1, BK2, BC2, warps, stages: narrow column tiles (many tiles per stage, so the programs' shares differ by
# at most one small tile) with K steps long enough to keep a few tens of KB of weights in flight per SM.
ONE_LAUNCH_CONFIGS = [(128, 32, 128, 32, 4, 4), (256, 32, 256, 32, 4, 3), (64, 64, 64, 64, 4, 4),
                      (128, 64, 128, 64, 8, 3), (256, 16, 256, 16, 4, 3), (128, 32, 256, 32, 8, 3),
                      (64, 32, 128, 16, 4, 6)]


def _prune(configs, named_args, **kwargs):
    """Tiles no wider than a stage's columns or K need, whose pipeline stages fit shared memory."""
    size = named_args["x_ptr"].element_size()
    keep = [c for c in configs
            if all(c.kwargs[bc] <= pow2_at_least(named_args[cols], 16) and c.kwargs[bk] <= pow2_at_least(named_args[k], 64)
                   for bc, bk, cols, k in (("BC1", "BK1", "C1", "K1"), ("BC2", "BK2", "C2", "K2")))
            and fits_smem(c, max(c.kwargs["BK1"] * (BN + c.kwargs["BC1"]), c.kwargs["BK2"] * (BN + c.kwargs["BC2"])),
                          size)]
    return keep or configs[:1]


@triton.jit
def _grid_barrier(count_ptr, programs):
    """Wait until all ``programs`` programs have arrived; every store before it is visible to every load after
    it (as cooperative groups' grid sync: a block barrier, one release-acquire atomic per program, a block
    barrier). ``count`` (int64) only grows: every launch on the device has the same number of programs, so
    barrier e of all launches so far is complete when it reaches (e + 1) * programs. Its critical path is two
    round trips to L2: the last arrival, then each waiting program's next read."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    target = (arrived // programs + 1) * programs
    seen = arrived + 1
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _gemm_tiles(a_ptr, w_ptr, c_ptr, bias_ptr, N, K, C, GRP, BATCHES, sab, san, swb, swk, swc, scb, scn, scg,
                first, step, HAS_BIAS: tl.constexpr, A_CACHE: tl.constexpr, PRECISION: tl.constexpr,
                BK: tl.constexpr, BC: tl.constexpr):
    """Tiles first, first + step, ... of one stage: c[bt][n, col] = a[bt][n, :] @ w[bt][:, col] (+ bias), a tile
    being all N tokens by BC columns of one batch; column col stored at (col // GRP) * scg + col % GRP (the
    regrouping store: Monarch's P^T). a has a unit k stride; ``A_CACHE``: its loads' cache modifier.
    The program's tiles run as one flat loop of K steps, so the software pipeline keeps loading the next tile's
    weights while a tile is stored (a loop per tile drained the pipeline at every tile: one DRAM latency each)."""
    c_tiles = tl.cdiv(C, BC)
    k_steps = tl.cdiv(K, BK)
    rn = tl.arange(0, 16).to(tl.int64)
    rk = tl.arange(0, BK)
    a_rows = rn[:, None] < N
    acc = tl.zeros((16, BC), dtype=tl.float32)
    for it in range(0, tl.cdiv(BATCHES * c_tiles - first, step) * k_steps):
        tile = first + (it // k_steps) * step
        k0 = (it % k_steps) * BK
        bt = (tile // c_tiles).to(tl.int64)
        rc = (tile % c_tiles) * BC + tl.arange(0, BC)
        w_cols = rc[None, :] < C
        a = tl.load(a_ptr + bt * sab + rn[:, None] * san + (k0 + rk)[None, :], mask=a_rows & (rk[None, :] + k0 < K),
                    other=0.0, cache_modifier=A_CACHE)
        w = tl.load(w_ptr + bt * swb + (k0 + rk)[:, None].to(tl.int64) * swk + rc[None, :] * swc,
                    mask=(rk[:, None] + k0 < K) & w_cols, other=0.0)
        acc = mma(a, w, acc, PRECISION)
        if k0 + BK >= K:
            col = bt * scb + (rc // GRP).to(tl.int64) * scg + (rc % GRP).to(tl.int64)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + col, mask=rc < C, other=0.0).to(tl.float32)[None, :]
            tl.store(c_ptr + rn[:, None] * scn + col[None, :], acc.to(c_ptr.dtype.element_ty), mask=a_rows & w_cols)
            acc = tl.zeros((16, BC), dtype=tl.float32)


@triton.jit
def _mix_tiles(z_ptr, s_ptr, t_ptr, N, R, BATCHES, szn, szj, ssi, ssj, ssk, first, step, BR: tl.constexpr):
    """Tiles first, first + step, ... of BLAST's mixing: t[n, i, k] = sum_j z[n, j, k] s[i, j, k] (fp32 sum, rounded
    to t's dtype; t has z's layout), a tile being all N tokens by BR ranks of one output block i."""
    r_tiles = tl.cdiv(R, BR)
    rn = tl.arange(0, 16).to(tl.int64)
    for tile in range(first, BATCHES * r_tiles, step):
        i = (tile // r_tiles).to(tl.int64)
        rk = (tile % r_tiles) * BR + tl.arange(0, BR)
        mask = (rn[:, None] < N) & (rk[None, :] < R)
        acc = tl.zeros((16, BR), dtype=tl.float32)
        for j in range(BATCHES):
            z = tl.load(z_ptr + rn[:, None] * szn + j * szj + rk[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            s = tl.load(s_ptr + i * ssi + j * ssj + rk * ssk, mask=rk < R, other=0.0)
            acc += z.to(tl.float32) * s.to(tl.float32)[None, :]
        tl.store(t_ptr + rn[:, None] * szn + i * szj + rk[None, :], acc.to(t_ptr.dtype.element_ty), mask=mask)


@tuned(ONE_LAUNCH_CONFIGS, ("BK1", "BC1", "BK2", "BC2"), (32, 16, 32, 16, 4, 1),
       key=["N_BUCKET", "K1", "C1", "GRP1", "BATCHES", "K2", "C2", "MIX"], prune=_prune)
@triton.jit
def _one_launch_kernel(x_ptr, w1_ptr, z_ptr, s_ptr, t_ptr, w2_ptr, y_ptr, bias_ptr, state_ptr,
                       N, K1, C1, GRP1, BATCHES, K2, C2, N_BUCKET,
                       sxb, sxn, s1b, s1k, s1c, szb, szn, szg, sab, san, ssi, ssj, ssk, s2b, s2k, s2c, syb, syn, syc,
                       HAS_BIAS: tl.constexpr, MIX: tl.constexpr, ONLY: tl.constexpr, PRECISION: tl.constexpr,
                       BK1: tl.constexpr, BC1: tl.constexpr, BK2: tl.constexpr, BC2: tl.constexpr):
    """Stage 1 (x -> z), [the mixing (z -> t), ] stage 2 (z or t -> y), barriers between; ``ONLY`` > 0 runs that
    stage alone (1, 2 = the mixing, 3) with no barrier, for the interpreter."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    if ONLY == 0 or ONLY == 1:
        _gemm_tiles(x_ptr, w1_ptr, z_ptr, bias_ptr, N, K1, C1, GRP1, BATCHES, sxb, sxn, s1b, s1k, s1c, szb, szn, szg,
                    pid, programs, False, "", PRECISION, BK1, BC1)
    if ONLY == 0:
        _grid_barrier(state_ptr, programs)
    if MIX:
        if ONLY == 0 or ONLY == 2:
            _mix_tiles(z_ptr, s_ptr, t_ptr, N, C1, BATCHES, szn, szb, ssi, ssj, ssk, pid, programs, BC2)
        if ONLY == 0:
            _grid_barrier(state_ptr, programs)
    if ONLY == 0 or ONLY == 3:
        _gemm_tiles(t_ptr if MIX else z_ptr, w2_ptr, y_ptr, bias_ptr, N, K2, C2, 1, BATCHES, sab, san, s2b, s2k,
                    s2c, syb, syn, syc, pid, programs, HAS_BIAS, ".cg", PRECISION, BK2, BC2)


_BARRIER_STATES: dict[torch.device, torch.Tensor] = {}


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def barrier_state(device: torch.device) -> torch.Tensor:
    """The device's barrier counter, made on first use, which must not be inside a CUDA-graph capture (its
    allocation and zeroing would be captured, not run)."""
    state = _BARRIER_STATES.get(device)
    if state is None:
        if torch.cuda.is_current_stream_capturing():
            raise MemfitError("one-launch BLR kernel: its first call on this device is inside a CUDA graph capture; "
                              "call the layer once before capturing")
        state = _BARRIER_STATES[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return state


def one_launch(x, w1, z, w2, y, *, n: int, k1: int, c1: int, grp1: int, batches: int, k2: int, c2: int,
               x_strides, w1_strides, z_strides, a2_strides, w2_strides, y_strides, bias=None, mix=None) -> None:
    """Run a BLR layer's stages in one launch (at most ONE_LAUNCH_MAX_N tokens).

    Stage 1: z[b][n, col] = x[b][n, :] @ w1[b][:, col] for b < batches, col < c1, stored at
    ``(col // grp1) * group + col % grp1`` (z_strides = (batch, n, group)). Stage 2: y[b][n, col] = a[b][n, :] @
    w2[b][:, col] (+ bias at the stored offset), col < c2, stored at ``col * y_strides[2]``, where a is z, or
    with ``mix = (s, t)`` BLAST's t[n, i, k] = sum_j z[n, j, k] s[i, j, k] (t laid out as z, which is then
    (N, batches, c1) with grp1 = c1). Strides in elements: x (batch, n), w (batch, k, col), a (batch, n),
    y (batch, n, col); x and a have a unit k stride.
    """
    if n > ONE_LAUNCH_MAX_N:
        raise MemfitError(f"one_launch: {n} tokens; it runs at most {ONE_LAUNCH_MAX_N} (one token tile)")
    s, t = mix if mix is not None else (z, z)
    args = (x, w1, z, s, t, w2, y, bias if bias is not None else y)
    sizes = (n, k1, c1, grp1, batches, k2, c2, n_bucket(n))
    strides = (*x_strides, *w1_strides, *z_strides, *a2_strides, *(s.stride() if mix is not None else (0, 0, 0)),
               *w2_strides, *y_strides)
    flags = dict(HAS_BIAS=bias is not None, MIX=mix is not None, PRECISION=blr_precision(x.dtype))
    if interpreting():                                 # programs run in turn: each stage a launch of its own
        tiles = {1: lambda meta: batches * triton.cdiv(c1, meta["BC1"]),
                 2: lambda meta: batches * triton.cdiv(c1, meta["BC2"]),
                 3: lambda meta: batches * triton.cdiv(c2, meta["BC2"])}
        for only in (1, 2, 3) if mix is not None else (1, 3):
            _one_launch_kernel[lambda meta, stage=only: (tiles[stage](meta),)](*args, y, *sizes, *strides, ONLY=only,
                                                                               **flags)
        return
    _one_launch_kernel[(_sm_count(x.device),)](*args, barrier_state(x.device), *sizes, *strides, ONLY=0, **flags)
