"""IO-aware fused attention: forward, backward variants, and fused recompute+backward.

``attention(q, k, v, causal=..., cu_seqlens=...)`` computes softmax(q k^T * scale) v with
O(N) memory: the forward writes O and one fp32 log-sum-exp per query row, and the
backward recomputes the probabilities tile by tile from those. Layouts:

* dense: q ``(B, Hq, N, D)``, k/v ``(B, Hkv, N, D)``; ``Hq % Hkv == 0`` (GQA/MQA);
* packed: q ``(T, Hq, D)``, k/v ``(T, Hkv, D)`` with ``cu_seqlens`` int32 ``(B+1,)``
  (sequence b is rows ``cu[b]:cu[b+1]``; causal is within each sequence).

Three Triton kernels cover every variant (tile bodies are shared ``@triton.jit`` helpers):

* ``_fwd_kernel``: one program per (query block, head); online softmax in base 2
  (log2(e) folded into the scale); causal programs skip key blocks above the diagonal
  and mask only the blocks that cross it.
* ``_key_bwd_kernel``: one program per (key block, kv head); loops over the group's query
  heads and the query blocks; dK/dV in registers. ``DQ_MODE`` says what happens to the
  dQ contribution of each tile: dropped (0, a second kernel computes dQ), fp32 atomics
  (1), or read-modify-write into this program's partial buffer (2).
* ``_query_bwd_kernel``: one program per (query block, head); dQ in registers.
  ``STATS`` recomputes the row statistics (lse and delta = rowsum(dO * O)) in a first
  sweep over the keys instead of loading them, which is how the fused
  recompute+backward works without O. ``DKV_MODE`` says what happens to the dK/dV
  contributions: none (0), fp32 atomics (1), partial buffers (2).

Backward variants (``backward=``), for the separate path (given O, lse) and the fused
recompute path (given only Q, K, V, dO):

=================  ==========================================  ==========================================
variant            separate backward                           fused recompute+backward
=================  ==========================================  ==========================================
two_pass           dK/dV kernel + dQ kernel, no atomics        stats+dQ kernel (writes lse, delta), then
                                                               dK/dV kernel: two launches, no atomics
atomic             one key-block kernel, dQ by fp32 atomics    one query-block kernel, dK and dV by fp32
                   (all programs sweep query blocks in order)  atomics (all programs sweep keys in order)
atomic_remap       as atomic, each program starts its sweep    as atomic, each program starts its sweep
                   at a different block (spreads contention)   at a different block
partial_buffers    S programs per head each own an fp32 dQ     S programs per head each own fp32 dK/dV
                   buffer (plain read-add-write), then a sum   buffers, then a sum over S and the group
=================  ==========================================  ==========================================

Cost of the fused recompute: its first sweep does two matmuls per tile (QK^T and dO V^T,
the same count as the forward) and the second sweep five, so 7 per tile pair, against 2
(forward recompute) + 5 (atomic backward) = 7 or 2 + 7 = 9 (two-pass backward) for
recompute-then-backward; it saves writing and re-reading O and lse, and pays in atomics.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from memfit.errors import MemfitError
from memfit.kernels.dispatch import dot_precision, interpreting, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on GPU machines
    triton = None


VARIANTS = ("two_pass", "atomic", "atomic_remap", "partial_buffers")
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 128


# ----------------------------------------------------------------------------------------
# Reference (the definition; CPU fallback and tests)
# ----------------------------------------------------------------------------------------

def _dense_reference(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)).float() * scale if q.dtype != torch.float64 else (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1).to(v.dtype) @ v


def attention_reference(q, k, v, causal=False, scale=None, cu_seqlens=None):
    """softmax(q k^T * scale [+ causal mask]) v, materialising the scores (O(N^2) memory)."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if cu_seqlens is None:
        return _dense_reference(q, k, v, causal, scale)
    outs = []
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(_dense_reference(qs, ks, vs, causal, scale).squeeze(0).transpose(0, 1))
    return torch.cat(outs, 0)


# ----------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------

def _configs(pairs):
    """Autotune configs; the interpreter gets one small config (BLOCK_M != BLOCK_N on purpose)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in pairs]


def _by_element_size(sets: dict):
    """Autotune configs per input element size, and the pruner that keeps the set matching Q's dtype
    (fp32 tiles of the 16-bit sizes need more than the 227 KB of shared memory an H100/H200 block has)."""
    if interpreting():   # one config in all (the autotuner times candidates whenever it holds more than one)
        return sets[min(sets)], None
    every = [c for configs in sets.values() for c in configs]

    def prune(configs, named_args, **kwargs):
        size = min((s for s in sets if s >= named_args["Q"].element_size()), default=max(sets))
        return [c for c in configs if any(c is k for k in sets[size])]

    return every, {"early_config_prune": prune}


if triton is not None:
    # Hopper-sized tiles: 128-row blocks over two warpgroups, shallow pipelines (register-bound);
    # fp32 (TF32 or IEEE dots) gets tiles half as wide so that they fit shared memory.
    _FWD_CONFIGS, _FWD_PRUNE = _by_element_size({
        2: _configs([(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3)]),
        4: _configs([(64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 2)])})
    # Backward: the outer block (query rows for the query kernel, keys for the key kernel)
    # is BLOCK_M / BLOCK_N respectively; the inner one is kept small to bound registers.
    # Two each: every (mode, causal) pair compiles its own kernels, and the benchmark has a time budget.
    _QBWD_CONFIGS, _QBWD_PRUNE = _by_element_size({2: _configs([(128, 64, 8, 2), (64, 64, 4, 3)]),
                                                   4: _configs([(64, 32, 4, 2), (32, 32, 4, 2)])})
    _KBWD_CONFIGS, _KBWD_PRUNE = _by_element_size({2: _configs([(64, 128, 8, 2), (64, 64, 4, 3)]),
                                                   4: _configs([(32, 64, 4, 2), (32, 32, 4, 2)])})

    @triton.jit
    def _tile_ptrs(base, rows, offs_d, stride_m, WIDE: tl.constexpr):
        """Pointers to a (rows, head dim) tile of one sequence at ``base``. Row offsets are int32 (fewer registers on
        every tile) unless WIDE: a sequence whose row offsets pass 2**31 elements (see :func:`_wide_rows`). Added to
        the pointer in this order, as the kernels did before WIDE: the integer sum first had compiled other code,
        with more spills, for every launch (sm_90, found by a review)."""
        if WIDE:
            rows = rows.to(tl.int64)
        return base + rows[:, None] * stride_m + offs_d[None, :]

    @triton.jit
    def _load_rows(base, rows, offs_d, stride_m, L, HEAD_DIM: tl.constexpr, WIDE: tl.constexpr):
        mask = (rows < L)[:, None] & (offs_d < HEAD_DIM)[None, :]
        return tl.load(_tile_ptrs(base, rows, offs_d, stride_m, WIDE), mask=mask, other=0.0)

    @triton.jit
    def _seq_bounds(CU, b, N_CTX, VARLEN: tl.constexpr):
        """(first row of sequence b in the token axis, its length, batch index for strides)."""
        if VARLEN:
            start = tl.load(CU + b).to(tl.int64)
            length = (tl.load(CU + b + 1) - tl.load(CU + b)).to(tl.int32)
            bt = b * 0
        else:
            start = b.to(tl.int64) * 0
            length = N_CTX + b * 0
            bt = b
        return start, length, bt

    @triton.jit
    def _query_ranges(m0, L, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """For query rows [m0, m0+BLOCK_M): key blocks [0, full_end) need no mask, [full_end, hi) do."""
        if CAUSAL:
            full_end = (m0 + 1) // BLOCK_N * BLOCK_N
            hi = tl.minimum(m0 + BLOCK_M, L)
        else:
            full_end = L // BLOCK_N * BLOCK_N
            hi = L
        return full_end, hi

    @triton.jit
    def _stats_sweep(acc, m_i, l_i, q, do, k_ptr, v_ptr, skm, svm, lo, hi, offs_m, offs_d, L, qk_scale,
                     MASK: tl.constexpr, CAUSAL: tl.constexpr, FOR_DELTA: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, WIDE: tl.constexpr):
        """Online softmax over key blocks [lo, hi). Accumulates P V (forward) or rowsum(P * dO V^T)."""
        offs_n0 = tl.arange(0, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            k = _load_rows(k_ptr, offs_n, offs_d, skm, L, HEAD_DIM, WIDE)
            v = _load_rows(v_ptr, offs_n, offs_d, svm, L, HEAD_DIM, WIDE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            if MASK:
                keep = offs_n[None, :] < L
                if CAUSAL:
                    keep = keep & (offs_m[:, None] >= offs_n[None, :])
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FOR_DELTA:
                dpv = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
                acc = acc * alpha + tl.sum(p * dpv, 1)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
        return acc, m_i, l_i

    @triton.autotune(configs=_FWD_CONFIGS, key=["N_CTX", "HEAD_DIM", "CAUSAL", "DOT_PREC"], prune_configs_by=_FWD_PRUNE)
    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, CU, qk_scale,
                    sqb, sqh, sqm, skb, skh, skm, svb, svh, svm, sob, soh, som,
                    H, GROUP, N_CTX, N_TOT,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                    DOT_PREC: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        if CAUSAL:  # heaviest (last) query blocks first: shorter tail
            pid_m = tl.num_programs(1) - 1 - pid_m
        b = bh // H
        h = bh % H
        start, L, bt = _seq_bounds(CU, b, N_CTX, VARLEN)
        m0 = pid_m * BLOCK_M
        if m0 >= L:
            return
        hk = h // GROUP
        q_ptr = Q + bt.to(tl.int64) * sqb + h.to(tl.int64) * sqh + start * sqm
        k_ptr = K + bt.to(tl.int64) * skb + hk.to(tl.int64) * skh + start * skm
        v_ptr = V + bt.to(tl.int64) * svb + hk.to(tl.int64) * svh + start * svm
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_rows(q_ptr, offs_m, offs_d, sqm, L, HEAD_DIM, WIDE)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        full_end, hi = _query_ranges(m0, L, CAUSAL, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _stats_sweep(acc, m_i, l_i, q, q, k_ptr, v_ptr, skm, svm, 0, full_end, offs_m, offs_d, L,
                                     qk_scale, False, CAUSAL, False, HEAD_DIM, BLOCK_N, DOT_PREC, WIDE)
        acc, m_i, l_i = _stats_sweep(acc, m_i, l_i, q, q, k_ptr, v_ptr, skm, svm, full_end, hi, offs_m, offs_d, L,
                                     qk_scale, True, CAUSAL, False, HEAD_DIM, BLOCK_N, DOT_PREC, WIDE)
        o = acc / l_i[:, None]
        o_ptr = O + bt.to(tl.int64) * sob + h.to(tl.int64) * soh + start * som
        mask = (offs_m < L)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(_tile_ptrs(o_ptr, offs_m, offs_d, som, WIDE), o.to(O.dtype.element_ty), mask=mask)
        lse_ptr = LSE + (bt * H + h).to(tl.int64) * N_TOT + start
        tl.store(lse_ptr + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < L)

    @triton.jit
    def _delta_kernel(O, DO, DELTA, CU, sqb, sqh, sqm, sdb, sdh, sdm, H, N_CTX, N_TOT,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, WIDE: tl.constexpr,
                      BLOCK_M: tl.constexpr):
        """delta = rowsum(O * dO) in fp32, the softmax-backward row term."""
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        start, L, bt = _seq_bounds(CU, b, N_CTX, VARLEN)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        o = _load_rows(O + bt.to(tl.int64) * sqb + h.to(tl.int64) * sqh + start * sqm, offs_m, offs_d, sqm, L,
                       HEAD_DIM, WIDE)
        do = _load_rows(DO + bt.to(tl.int64) * sdb + h.to(tl.int64) * sdh + start * sdm, offs_m, offs_d, sdm, L,
                        HEAD_DIM, WIDE)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + (bt * H + h).to(tl.int64) * N_TOT + start + offs_m, delta, mask=offs_m < L)

    @triton.jit
    def _key_block_sweep(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, dl_ptr, dq_ptr, sqm, sdom, sdqm, first, count, rot,
                         offs_n, offs_d, L, qk_scale, sm_scale,
                         MASK: tl.constexpr, DQ_MODE: tl.constexpr, REMAP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr, WIDE: tl.constexpr):
        """For one key block, accumulate dK, dV over query blocks first + j*BLOCK_M, j < count."""
        offs_m0 = tl.arange(0, BLOCK_M)
        for i in range(0, count):
            if REMAP:
                j = (i + rot) % count
            else:
                j = i
            offs_m = first + j * BLOCK_M + offs_m0
            q = _load_rows(q_ptr, offs_m, offs_d, sqm, L, HEAD_DIM, WIDE)
            do = _load_rows(do_ptr, offs_m, offs_d, sdom, L, HEAD_DIM, WIDE)
            lse = tl.load(lse_ptr + offs_m, mask=offs_m < L, other=0.0)
            dl = tl.load(dl_ptr + offs_m, mask=offs_m < L, other=0.0)
            # Rows past L load as zeros: their q and dO are 0, so every contribution below is 0.
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale - lse[None, :])
            if MASK:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            ds_t = p_t * (dp_t - dl[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
            if DQ_MODE != 0:
                dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PREC) * sm_scale
                ptrs = _tile_ptrs(dq_ptr, offs_m, offs_d, sdqm, WIDE)
                mask = (offs_m < L)[:, None] & (offs_d < HEAD_DIM)[None, :]
                if DQ_MODE == 1:
                    tl.atomic_add(ptrs, dq, mask=mask, sem="relaxed")
                else:  # this program is the only writer of its partial buffer
                    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + dq, mask=mask)
        return dk, dv

    @triton.autotune(configs=_KBWD_CONFIGS, key=["N_CTX", "HEAD_DIM", "CAUSAL", "DQ_MODE", "REMAP", "DOT_PREC"],
                     reset_to_zero=["DQ"], prune_configs_by=_KBWD_PRUNE)
    @triton.jit
    def _key_bwd_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, CU, qk_scale, sm_scale,
                        sqb, sqh, sqm, skb, skh, skm, svb, svh, svm, sdb, sdh, sdm,
                        sdkb, sdkh, sdkm, sdvb, sdvh, sdvm, sdqb, sdqh, sdqm, dq_slot,
                        H, GROUP, N_CTX, N_TOT,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                        DQ_MODE: tl.constexpr, REMAP: tl.constexpr, DOT_PREC: tl.constexpr, WIDE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """dK, dV per key block (summed over the kv head's query-head group); dQ per DQ_MODE.

        DK, DV and DQ have their own strides (sdk*, sdv*, sdq*), not necessarily their inputs'.
        DQ (mode 1: fp32 accumulator; mode 2: partial buffers, one per program slot,
        ``dq_slot`` elements apart) must hold zeros at launch.
        """
        bhk = tl.program_id(0)
        pid = tl.program_id(1)
        nprog = tl.num_programs(1)
        Hk = H // GROUP
        b = bhk // Hk
        hk = bhk % Hk
        start, L, bt = _seq_bounds(CU, b, N_CTX, VARLEN)
        k_ptr = K + bt.to(tl.int64) * skb + hk.to(tl.int64) * skh + start * skm
        v_ptr = V + bt.to(tl.int64) * svb + hk.to(tl.int64) * svh + start * svm
        dq_base = DQ + pid.to(tl.int64) * dq_slot
        offs_d = tl.arange(0, BLOCK_D)
        num_m = tl.cdiv(L, BLOCK_M)
        for pid_n in range(pid, tl.cdiv(L, BLOCK_N), nprog):
            n0 = pid_n * BLOCK_N
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = _load_rows(k_ptr, offs_n, offs_d, skm, L, HEAD_DIM, WIDE)
            v = _load_rows(v_ptr, offs_n, offs_d, svm, L, HEAD_DIM, WIDE)
            dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            if CAUSAL:  # query blocks crossing the diagonal are masked, those below are full, above skipped
                first_m = n0 // BLOCK_M
                full_m = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M), num_m)
            else:
                first_m = 0
                full_m = 0
            for g in range(0, GROUP):
                h = hk * GROUP + g
                q_ptr = Q + bt.to(tl.int64) * sqb + h.to(tl.int64) * sqh + start * sqm
                do_ptr = DO + bt.to(tl.int64) * sdb + h.to(tl.int64) * sdh + start * sdm
                dq_ptr = dq_base + bt.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + start * sdqm
                row_off = (bt * H + h).to(tl.int64) * N_TOT + start
                dk, dv = _key_block_sweep(dk, dv, k, v, q_ptr, do_ptr, LSE + row_off, DELTA + row_off,
                                          dq_ptr, sqm, sdm, sdqm, first_m * BLOCK_M, full_m - first_m, 0,
                                          offs_n, offs_d, L, qk_scale, sm_scale, True, DQ_MODE, False, HEAD_DIM,
                                          BLOCK_M, DOT_PREC, WIDE)
                dk, dv = _key_block_sweep(dk, dv, k, v, q_ptr, do_ptr, LSE + row_off, DELTA + row_off,
                                          dq_ptr, sqm, sdm, sdqm, full_m * BLOCK_M, num_m - full_m, pid_n,
                                          offs_n, offs_d, L, qk_scale, sm_scale, False, DQ_MODE, REMAP, HEAD_DIM,
                                          BLOCK_M, DOT_PREC, WIDE)
            mask = (offs_n < L)[:, None] & (offs_d < HEAD_DIM)[None, :]
            dk_ptr = DK + bt.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + start * sdkm
            dv_ptr = DV + bt.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + start * sdvm
            tl.store(_tile_ptrs(dk_ptr, offs_n, offs_d, sdkm, WIDE), (dk * sm_scale).to(DK.dtype.element_ty),
                     mask=mask)
            tl.store(_tile_ptrs(dv_ptr, offs_n, offs_d, sdvm, WIDE), dv.to(DV.dtype.element_ty), mask=mask)

    @triton.jit
    def _query_block_sweep(dq, q, do, lse, dl, k_ptr, v_ptr, dk_ptr, dv_ptr, skm, svm, sdkm, first, count, rot,
                           offs_m, offs_d, L, qk_scale, sm_scale,
                           MASK: tl.constexpr, CAUSAL: tl.constexpr, DKV_MODE: tl.constexpr, REMAP: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                           WIDE: tl.constexpr):
        """For one query block, accumulate dQ over key blocks first + j*BLOCK_N, j < count."""
        offs_n0 = tl.arange(0, BLOCK_N)
        for i in range(0, count):
            if REMAP:
                j = (i + rot) % count
            else:
                j = i
            offs_n = first + j * BLOCK_N + offs_n0
            k = _load_rows(k_ptr, offs_n, offs_d, skm, L, HEAD_DIM, WIDE)
            v = _load_rows(v_ptr, offs_n, offs_d, svm, L, HEAD_DIM, WIDE)
            p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale - lse[:, None])
            if MASK:
                keep = offs_n[None, :] < L
                if CAUSAL:
                    keep = keep & (offs_m[:, None] >= offs_n[None, :])
                p = tl.where(keep, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = p * (dp - dl[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
            if DKV_MODE != 0:
                dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC) * sm_scale
                dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
                mask = (offs_n < L)[:, None] & (offs_d < HEAD_DIM)[None, :]
                dk_ptrs = _tile_ptrs(dk_ptr, offs_n, offs_d, sdkm, WIDE)
                dv_ptrs = _tile_ptrs(dv_ptr, offs_n, offs_d, sdkm, WIDE)
                if DKV_MODE == 1:
                    tl.atomic_add(dk_ptrs, dk, mask=mask, sem="relaxed")
                    tl.atomic_add(dv_ptrs, dv, mask=mask, sem="relaxed")
                else:  # this program is the only writer of its partial buffers
                    tl.store(dk_ptrs, tl.load(dk_ptrs, mask=mask, other=0.0) + dk, mask=mask)
                    tl.store(dv_ptrs, tl.load(dv_ptrs, mask=mask, other=0.0) + dv, mask=mask)
        return dq

    @triton.autotune(configs=_QBWD_CONFIGS, key=["N_CTX", "HEAD_DIM", "CAUSAL", "STATS", "DKV_MODE", "REMAP", "DOT_PREC"],
                     reset_to_zero=["DK", "DV"], prune_configs_by=_QBWD_PRUNE)
    @triton.jit
    def _query_bwd_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, CU, qk_scale, sm_scale,
                          sqb, sqh, sqm, skb, skh, skm, svb, svh, svm, sdb, sdh, sdm,
                          sdqb, sdqh, sdqm, sdkb, sdkh, sdkm, dkv_slot,
                          H, GROUP, N_CTX, N_TOT,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                          STATS: tl.constexpr, DKV_MODE: tl.constexpr, REMAP: tl.constexpr, DOT_PREC: tl.constexpr,
                          WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """dQ per query block; dK/dV contributions per DKV_MODE.

        STATS: recompute lse and delta here (first sweep over the keys) instead of loading
        them; with DKV_MODE 0 they are also stored for a following key kernel.
        DQ has its own strides (sdq*), not necessarily Q's.
        DK/DV (mode 1: fp32 accumulators of K's shape, strides sdk*; mode 2: partial
        buffers of Q's shape per program slot, strides sdk*, ``dkv_slot`` apart) must hold zeros.
        """
        bh = tl.program_id(0)
        pid = tl.program_id(1)
        nprog = tl.num_programs(1)
        if CAUSAL and DKV_MODE != 2:
            pid = nprog - 1 - pid
        b = bh // H
        h = bh % H
        hk = h // GROUP
        start, L, bt = _seq_bounds(CU, b, N_CTX, VARLEN)
        q_ptr = Q + bt.to(tl.int64) * sqb + h.to(tl.int64) * sqh + start * sqm
        k_ptr = K + bt.to(tl.int64) * skb + hk.to(tl.int64) * skh + start * skm
        v_ptr = V + bt.to(tl.int64) * svb + hk.to(tl.int64) * svh + start * svm
        do_ptr = DO + bt.to(tl.int64) * sdb + h.to(tl.int64) * sdh + start * sdm
        row_off = (bt * H + h).to(tl.int64) * N_TOT + start
        if DKV_MODE == 2:
            dkv_off = pid.to(tl.int64) * dkv_slot + bt.to(tl.int64) * sdkb + h.to(tl.int64) * sdkh + start * sdkm
        else:
            dkv_off = bt.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + start * sdkm
        offs_d = tl.arange(0, BLOCK_D)
        for pid_m in range(pid, tl.cdiv(L, BLOCK_M), nprog):
            m0 = pid_m * BLOCK_M
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q = _load_rows(q_ptr, offs_m, offs_d, sqm, L, HEAD_DIM, WIDE)
            do = _load_rows(do_ptr, offs_m, offs_d, sdm, L, HEAD_DIM, WIDE)
            full_end, hi = _query_ranges(m0, L, CAUSAL, BLOCK_M, BLOCK_N)
            if STATS:
                m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M], tl.float32)
                acc, m_i, l_i = _stats_sweep(acc, m_i, l_i, q, do, k_ptr, v_ptr, skm, svm, 0, full_end, offs_m,
                                             offs_d, L, qk_scale, False, CAUSAL, True, HEAD_DIM, BLOCK_N, DOT_PREC, WIDE)
                acc, m_i, l_i = _stats_sweep(acc, m_i, l_i, q, do, k_ptr, v_ptr, skm, svm, full_end, hi, offs_m,
                                             offs_d, L, qk_scale, True, CAUSAL, True, HEAD_DIM, BLOCK_N, DOT_PREC, WIDE)
                lse = m_i + tl.math.log2(l_i)
                dl = acc / l_i
                if DKV_MODE == 0:
                    tl.store(LSE + row_off + offs_m, lse, mask=offs_m < L)
                    tl.store(DELTA + row_off + offs_m, dl, mask=offs_m < L)
            else:
                lse = tl.load(LSE + row_off + offs_m, mask=offs_m < L, other=0.0)
                dl = tl.load(DELTA + row_off + offs_m, mask=offs_m < L, other=0.0)
            dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            dq = _query_block_sweep(dq, q, do, lse, dl, k_ptr, v_ptr, DK + dkv_off, DV + dkv_off, skm, svm, sdkm,
                                    0, full_end // BLOCK_N, pid_m, offs_m, offs_d, L, qk_scale, sm_scale,
                                    False, CAUSAL, DKV_MODE, REMAP, HEAD_DIM, BLOCK_N, DOT_PREC, WIDE)
            dq = _query_block_sweep(dq, q, do, lse, dl, k_ptr, v_ptr, DK + dkv_off, DV + dkv_off, skm, svm, sdkm,
                                    full_end, tl.cdiv(hi - full_end, BLOCK_N), 0, offs_m, offs_d, L, qk_scale,
                                    sm_scale, True, CAUSAL, DKV_MODE, False, HEAD_DIM, BLOCK_N, DOT_PREC, WIDE)
            mask = (offs_m < L)[:, None] & (offs_d < HEAD_DIM)[None, :]
            dq_ptr = DQ + bt.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh + start * sdqm
            tl.store(_tile_ptrs(dq_ptr, offs_m, offs_d, sdqm, WIDE), (dq * sm_scale).to(DQ.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------
# Launchers (canonical 4-D views: (Bt, H, Nt, D), last dim contiguous)
#
# Each output is ``torch.empty_like`` an input (what the fakes promise) and every kernel stores it
# by its own strides: an input may have gaps (q, k, v split from a fused QKV projection) or
# repeat itself (k, v expanded over heads, stride 0), and its empty_like then has other strides.
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Geom:
    nseq: int        # sequences (programs along the batch axis)
    heads: int       # query heads
    group: int       # query heads per kv head
    n_ctx: int       # longest sequence (grid size, autotune key)
    n_tot: int       # rows of the token axis (N dense, T packed)
    head_dim: int
    block_d: int
    varlen: bool
    dot_prec: str


def _geom(q, k, cu_seqlens, max_seqlen) -> _Geom:
    bt, heads, n_tot, d = q.shape
    varlen = cu_seqlens is not None
    return _Geom(nseq=cu_seqlens.numel() - 1 if varlen else bt, heads=heads, group=heads // k.shape[1],
                 n_ctx=max_seqlen if varlen else n_tot, n_tot=n_tot, head_dim=d,
                 block_d=max(16, triton.next_power_of_2(d)), varlen=varlen,
                 dot_prec=dot_precision(q.dtype, "memfit attention"))


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


_MAX_TILE = 128   # rows in the largest tile any config uses: masked rows past a sequence's end still get offsets


def _wide_rows(g, *tensors, row_strides=0) -> bool:
    """Whether a row offset within one sequence (row times row stride, in elements) can pass int32 for a kernel
    over these tensors (and a buffer of row stride ``row_strides``): a single sequence of about 175K tokens with
    a fused QKV projection's 12288-element rows does. The kernels then compute those offsets in int64 (WIDE)."""
    widest = max([row_strides, *(t.stride(2) for t in tensors)])
    return (g.n_ctx + _MAX_TILE) * widest + g.block_d >= 2**31


def _dummy(device):
    """Placeholder for a pointer argument a mode does not use (never the autotuner's reset target)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


_NO_STRIDES = (0, 0, 0)   # the strides passed with a _dummy


def _cu_arg(q, cu_seqlens):
    return cu_seqlens if cu_seqlens is not None else torch.zeros(1, dtype=torch.int32, device=q.device)


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: small, so that tests exercise several slots per head


def partial_slots(device, n_blocks: int, programs_per_slot: int) -> int:
    """Partial-buffer count S: enough programs for about two waves of SMs, at most one per block."""
    want = -(-2 * _num_sms(device) // max(1, programs_per_slot))
    return max(1, min(n_blocks, want))


def _fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale):
    g = _geom(q, k, cu_seqlens, max_seqlen)
    o = torch.empty_like(q)
    lse = torch.empty((q.shape[0], g.heads, g.n_tot), dtype=torch.float32, device=q.device)
    grid = lambda meta: (g.nseq * g.heads, triton.cdiv(g.n_ctx, meta["BLOCK_M"]))  # noqa: E731
    _fwd_kernel[grid](q, k, v, o, lse, _cu_arg(q, cu_seqlens), scale * LOG2E, *_strides(q), *_strides(k),
                      *_strides(v), *_strides(o), g.heads, g.group, g.n_ctx, g.n_tot, HEAD_DIM=g.head_dim,
                      BLOCK_D=g.block_d, CAUSAL=causal, VARLEN=g.varlen, DOT_PREC=g.dot_prec,
                      WIDE=_wide_rows(g, q, k, v, o))
    return o, lse


def _delta(o, do, cu_seqlens, g):
    delta = torch.empty((o.shape[0], g.heads, g.n_tot), dtype=torch.float32, device=o.device)
    block = 16 if interpreting() else 128
    _delta_kernel[(g.nseq * g.heads, triton.cdiv(g.n_ctx, block))](
        o, do, delta, _cu_arg(o, cu_seqlens), *_strides(o), *_strides(do), g.heads, g.n_ctx, g.n_tot,
        HEAD_DIM=g.head_dim, BLOCK_D=g.block_d, VARLEN=g.varlen, WIDE=_wide_rows(g, o, do), BLOCK_M=block)
    return delta


def _key_bwd(q, k, v, do, lse, delta, dq_buf, dq_strides, dq_slot, slots, cu_seqlens, g, causal, scale, dq_mode,
             remap):
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    hk = g.heads // g.group
    if slots:
        grid = (g.nseq * hk, slots)
    else:
        grid = lambda meta: (g.nseq * hk, triton.cdiv(g.n_ctx, meta["BLOCK_N"]))  # noqa: E731
    _key_bwd_kernel[grid](q, k, v, do, lse, delta, dk, dv, dq_buf, _cu_arg(q, cu_seqlens), scale * LOG2E, scale,
                          *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
                          *dq_strides, dq_slot, g.heads, g.group, g.n_ctx, g.n_tot, HEAD_DIM=g.head_dim,
                          BLOCK_D=g.block_d, CAUSAL=causal, VARLEN=g.varlen, DQ_MODE=dq_mode, REMAP=remap,
                          DOT_PREC=g.dot_prec, WIDE=_wide_rows(g, q, k, v, do, dk, dv, row_strides=dq_strides[2]))
    return dk, dv


def _query_bwd(q, k, v, do, lse, delta, dk_buf, dv_buf, dkv_strides, dkv_slot, slots, cu_seqlens, g, causal, scale,
               stats, dkv_mode, remap):
    dq = torch.empty_like(q)
    if slots:
        grid = (g.nseq * g.heads, slots)
    else:
        grid = lambda meta: (g.nseq * g.heads, triton.cdiv(g.n_ctx, meta["BLOCK_M"]))  # noqa: E731
    _query_bwd_kernel[grid](q, k, v, do, lse, delta, dq, dk_buf, dv_buf, _cu_arg(q, cu_seqlens), scale * LOG2E,
                            scale, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
                            *dkv_strides, dkv_slot, g.heads, g.group, g.n_ctx, g.n_tot, HEAD_DIM=g.head_dim,
                            BLOCK_D=g.block_d, CAUSAL=causal, VARLEN=g.varlen, STATS=stats, DKV_MODE=dkv_mode,
                            REMAP=remap, DOT_PREC=g.dot_prec,
                            WIDE=_wide_rows(g, q, k, v, do, dq, row_strides=dkv_strides[2]))
    return dq


def _slots_for(device, g, per_slot_heads):
    # the largest tile any config uses is 128 rows, so n_ctx/32 bounds the number of blocks
    return partial_slots(device, triton.cdiv(g.n_ctx, 32), g.nseq * per_slot_heads)


def _bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale, variant):
    g = _geom(q, k, cu_seqlens, max_seqlen)
    delta = _delta(o, do, cu_seqlens, g)
    hk = g.heads // g.group
    if variant == "two_pass":
        none = _dummy(q.device)
        dk, dv = _key_bwd(q, k, v, do, lse, delta, none, _NO_STRIDES, 0, 0, cu_seqlens, g, causal, scale, 0, False)
        dq = _query_bwd(q, k, v, do, lse, delta, none, none, _NO_STRIDES, 0, 0, cu_seqlens, g, causal, scale,
                        False, 0, False)
        return dq, dk, dv
    if variant in ("atomic", "atomic_remap"):
        acc = torch.zeros_like(q, dtype=torch.float32)
        dk, dv = _key_bwd(q, k, v, do, lse, delta, acc, _strides(acc), 0, 0, cu_seqlens, g, causal, scale, 1,
                          variant == "atomic_remap")
        return acc.to(q.dtype), dk, dv
    slots = _slots_for(q.device, g, hk)
    parts = torch.zeros((slots, *q.shape), dtype=torch.float32, device=q.device)
    dk, dv = _key_bwd(q, k, v, do, lse, delta, parts, _strides(parts[0]), parts[0].numel(), slots, cu_seqlens, g,
                      causal, scale, 2, False)
    return parts.sum(0).to(q.dtype), dk, dv


def _recompute_bwd(do, q, k, v, cu_seqlens, max_seqlen, causal, scale, variant):
    g = _geom(q, k, cu_seqlens, max_seqlen)
    rows = (q.shape[0], g.heads, g.n_tot)
    if variant == "two_pass":
        lse = torch.empty(rows, dtype=torch.float32, device=q.device)
        delta = torch.empty(rows, dtype=torch.float32, device=q.device)
        none = _dummy(q.device)
        dq = _query_bwd(q, k, v, do, lse, delta, none, none, _NO_STRIDES, 0, 0, cu_seqlens, g, causal, scale, True,
                        0, False)
        dk, dv = _key_bwd(q, k, v, do, lse, delta, none, _NO_STRIDES, 0, 0, cu_seqlens, g, causal, scale, 0, False)
        return dq, dk, dv
    if variant in ("atomic", "atomic_remap"):
        dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        none = _dummy(q.device)
        dq = _query_bwd(q, k, v, do, none, none, dk_acc, dv_acc, _strides(dk_acc), 0, 0, cu_seqlens, g, causal,
                        scale, True, 1, variant == "atomic_remap")
        return dq, dk_acc.to(k.dtype), dv_acc.to(v.dtype)
    slots = _slots_for(q.device, g, g.heads)
    dk_parts = torch.zeros((slots, *q.shape), dtype=torch.float32, device=q.device)
    dv_parts = torch.zeros_like(dk_parts)
    none = _dummy(q.device)
    dq = _query_bwd(q, k, v, do, none, none, dk_parts, dv_parts, _strides(dk_parts[0]), dk_parts[0].numel(),
                    slots, cu_seqlens, g, causal, scale, True, 2, False)
    bt, _, n_tot, d = q.shape
    shape = (slots, bt, g.heads // g.group, g.group, n_tot, d)
    return dq, dk_parts.view(shape).sum((0, 3)).to(k.dtype), dv_parts.view(shape).sum((0, 3)).to(v.dtype)


def _like(x, ref):
    """``x`` with the strides of ``torch.empty_like(ref)`` (what the fake kernels promise: ``ref``'s own where it
    is dense, a dense layout where it has gaps or is expanded), copying only if they differ."""
    return x if x.stride() == torch.empty_like(ref, device="meta").stride() else torch.empty_like(ref).copy_(x)


def _lastdim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------
# Registered ops (canonical 4-D views) and autograd
# ----------------------------------------------------------------------------------------

@torch.library.custom_op("memfit::attention_fwd", mutates_args=())
def _attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                      max_seqlen: int, causal: bool, scale: float, backward: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale)


@_attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal, scale, backward):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("memfit::attention_bwd", mutates_args=())
def _attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, cu_seqlens: Optional[torch.Tensor], max_seqlen: int, causal: bool,
                      scale: float, backward: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _bwd(_lastdim_contiguous(do), q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale, backward)
    return _like(dq, q), _like(dk, k), _like(dv, v)


@_attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale, backward):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("memfit::attention_recompute_bwd", mutates_args=())
def _attention_recompute_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens: Optional[torch.Tensor], max_seqlen: int, causal: bool, scale: float,
                                backward: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _recompute_bwd(_lastdim_contiguous(do), q, k, v, cu_seqlens, max_seqlen, causal, scale, backward)
    return _like(dq, q), _like(dk, k), _like(dv, v)


@_attention_recompute_bwd_op.register_fake
def _(do, q, k, v, cu_seqlens, max_seqlen, causal, scale, backward):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, causal, scale, backward = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.meta = (max_seqlen, causal, scale, backward)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _attention_bwd_op(do, q, k, v, o, lse, cu_seqlens, *ctx.meta)
    return dq, dk, dv, None, None, None, None, None


_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------

def _check(q, k, v, cu_seqlens, backward, triton_path):
    packed = cu_seqlens is not None
    want = 3 if packed else 4
    layout = "(T, H, D) with cu_seqlens" if packed else "(B, H, N, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise MemfitError(f"attention: {name} has shape {tuple(t.shape)}; expected {layout}")
    if k.shape != v.shape:
        raise MemfitError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    hq, hk = (q.shape[1], k.shape[1])
    if hq % hk:
        raise MemfitError(f"attention: {hq} query heads is not a multiple of {hk} key/value heads")
    seq_q, seq_k = (q.shape[0], k.shape[0]) if packed else (q.shape[2], k.shape[2])
    if seq_q != seq_k or q.shape[-1] != k.shape[-1] or (not packed and q.shape[0] != k.shape[0]):
        raise MemfitError(f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, sequence "
                          "and head dim (different query/key lengths are not supported)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise MemfitError(f"attention: dtypes {q.dtype}, {k.dtype}, {v.dtype}; expected one of float16, bfloat16, "
                          "float32 for all three")
    if backward not in VARIANTS:
        raise MemfitError(f"attention: backward={backward!r} is not one of {', '.join(VARIANTS)}")
    if packed and (cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2):
        raise MemfitError(f"attention: cu_seqlens must be a 1-D int32 tensor of B+1 offsets, got "
                          f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
    if packed and cu_seqlens.device != q.device:
        raise MemfitError(f"attention: cu_seqlens is on {cu_seqlens.device} and q on {q.device}; the kernels read "
                          "both on q's device")
    if triton_path and q.shape[-1] > MAX_HEAD_DIM:
        raise MemfitError(f"attention: head dim {q.shape[-1]} > {MAX_HEAD_DIM} is not supported by the Triton kernel")


# The CUDA offsets checked last: (a weak reference to cu_seqlens, (its version, max_seqlen, T), the result). A model
# passes one offsets tensor to every layer, so each step checks it once, not once per layer (12 small ops each).
_last_offsets: list = [None]


def _max_seqlen_checked(cu_seqlens, max_seqlen, tokens):
    """:func:`_offsets_checked`, remembered for the CUDA offsets tensor checked last while it is unchanged (the same
    object at the same version counter), eagerly: traced or captured into a CUDA graph, each call checks (a graph
    replays with other values), and so does every call on the CPU, where the check is cheap. A write the version
    counter does not see (through ``.data``, or memory shared with numpy or another library) is not seen either."""
    eager = cu_seqlens.is_cuda and not (torch.compiler.is_compiling() or is_fake(cu_seqlens)
                                        or cu_seqlens.is_inference() or torch.cuda.is_current_stream_capturing())
    if not eager:
        return _offsets_checked(cu_seqlens, max_seqlen, tokens)
    key = (cu_seqlens._version, max_seqlen, tokens)
    last = _last_offsets[0]
    if last is not None and last[0]() is cu_seqlens and last[1] == key:
        return last[2]
    result = _offsets_checked(cu_seqlens, max_seqlen, tokens)
    _last_offsets[0] = (weakref.ref(cu_seqlens), key, result)
    return result


def _offsets_checked(cu_seqlens, max_seqlen, tokens):
    """``max_seqlen``, or the longest sequence where it is None, once the offsets are checked: ``cu_seqlens``
    starts at 0, never decreases, ends at ``tokens`` (T), and no sequence is longer than ``max_seqlen``.

    The kernels trust all four (a sequence longer than ``max_seqlen`` loses its tail rows, rows past the last
    offset are never written, a negative length is read as a huge one). Where ``max_seqlen`` is omitted, finding
    the longest sequence reads the offsets back (one host sync, as before the check) and bad offsets are a
    MemfitError before any work; so on the CPU. Where it is given for CUDA tensors, and while torch.compile traces,
    the check runs on the device instead, as :func:`memfit.train.attention_hf._padded_in_place`'s does
    (``torch._assert_async``), so that a call costs no sync (one per layer in a training step, which stalls the
    host's run-ahead): a failure there is a device-side assert, which leaves the process's CUDA context unusable.
    A CUDA graph capture must give ``max_seqlen``. Fake tensors have no values: nothing is checked for them.
    """
    compiling = torch.compiler.is_compiling()
    if (max_seqlen is None and not compiling and cu_seqlens.is_cuda
            and torch.cuda.is_current_stream_capturing()):
        raise MemfitError("attention: max_seqlen must be given inside a CUDA graph capture (finding the longest "
                          "sequence reads cu_seqlens back to the host)")
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    stats = torch.stack([cu_seqlens[0], cu_seqlens[-1], lens.min(), lens.max()])
    if max_seqlen is not None and (compiling or cu_seqlens.is_cuda or is_fake(cu_seqlens)):
        torch._assert_async((stats[0] == 0) & (stats[1] == tokens) & (stats[2] >= 0) & (stats[3] <= max_seqlen),
                            "memfit attention: cu_seqlens must start at 0, be non-decreasing and end at the number of "
                            "packed tokens, and max_seqlen must be at least the longest sequence")
        return max_seqlen
    first, last, shortest, longest = stats.tolist()
    if first != 0:
        raise MemfitError(f"attention: cu_seqlens must start at 0; it starts at {first}")
    if shortest < 0:
        raise MemfitError(f"attention: cu_seqlens must be non-decreasing; it goes down by {-shortest} from one "
                          "offset to the next")
    if last != tokens:
        raise MemfitError(f"attention: cu_seqlens must end at the number of packed tokens, {tokens} (q, k and v's "
                          f"first dim); it ends at {last}")
    if max_seqlen is not None and max_seqlen < longest:
        raise MemfitError(f"attention: max_seqlen={max_seqlen} is shorter than the longest sequence in cu_seqlens, "
                          f"{longest}; pass at least {longest}, or leave it out to have it computed")
    return longest if max_seqlen is None else max_seqlen


def _to_canonical(t, packed):
    """(T, H, D) -> (1, H, T, D) view, or (B, H, N, D) as is; last dim made contiguous."""
    t = _lastdim_contiguous(t)
    return t.transpose(0, 1).unsqueeze(0) if packed else t


def _from_canonical(t, packed):
    return t.squeeze(0).transpose(0, 1) if packed else t


def _prepare(q, k, v, causal, scale, cu_seqlens, max_seqlen, backward, path, op):
    triton_path = use_triton(op, q, k, v, path=path)
    _check(q, k, v, cu_seqlens, backward, triton_path)
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    packed = cu_seqlens is not None
    if packed:
        max_seqlen = _max_seqlen_checked(cu_seqlens, max_seqlen, q.shape[0])
    return triton_path, scale, packed, int(max_seqlen or 0)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
              max_seqlen: int | None = None, backward: str = "two_pass", path: str | None = None) -> torch.Tensor:
    """Fused attention softmax(q k^T * scale) v, differentiable, O(N) memory.

    q ``(B, Hq, N, D)`` and k, v ``(B, Hkv, N, D)``, or packed ``(T, H, D)`` with int32
    ``cu_seqlens`` ``(B+1,)`` and ``max_seqlen`` (at least the longest sequence; computed if
    omitted). Any strides (a fused QKV split, k and v expanded over heads); a tensor whose
    last dim is not contiguous is copied. Packed offsets are checked (:func:`_max_seqlen_checked`:
    a MemfitError where max_seqlen is omitted or on the CPU, else a device-side assert, which
    costs no sync): ``cu_seqlens`` starts at 0, never decreases and ends at T, and no sequence
    is longer than ``max_seqlen``. ``causal`` masks keys after the query, within each sequence.
    ``scale`` defaults to 1/sqrt(D). ``backward`` picks the backward variant (see module
    docstring). Saved for backward: q, k, v, O and one fp32 log-sum-exp per row and head.
    """
    triton_path, scale, packed, max_seqlen = _prepare(q, k, v, causal, scale, cu_seqlens, max_seqlen, backward, path,
                                                      "attention")
    if not triton_path:
        return attention_reference(q, k, v, causal, scale, cu_seqlens)
    o, _ = _attention_fwd_op(*(_to_canonical(t, packed) for t in (q, k, v)), cu_seqlens, max_seqlen, causal, scale,
                             backward)
    return _from_canonical(o, packed)


def attention_recompute_backward(q, k, v, do, *, causal: bool = False, scale: float | None = None,
                                 cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                                 backward: str = "atomic_remap", path: str | None = None):
    """(dq, dk, dv) of ``attention`` from Q, K, V and dO alone, recomputing the forward in-kernel.

    For activation-checkpointed layers: nothing of the attention forward needs to be kept
    or rerun. The row statistics (lse, delta = rowsum(dO * O) = sum_j P_ij (dO_i . V_j))
    come from a first sweep over the keys; see the module docstring for each variant.
    """
    triton_path, scale, packed, max_seqlen = _prepare(q, k, v, causal, scale, cu_seqlens, max_seqlen, backward, path,
                                                      "attention_recompute_backward")
    if do.shape != q.shape:
        raise MemfitError(f"attention_recompute_backward: do {tuple(do.shape)} must have q's shape {tuple(q.shape)}")
    if not triton_path:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = attention_reference(*leaves, causal, scale, cu_seqlens)
            return torch.autograd.grad(out, leaves, do)
    grads = _attention_recompute_bwd_op(*(_to_canonical(t, packed) for t in (do, q, k, v)), cu_seqlens, max_seqlen,
                                        causal, scale, backward)
    return tuple(_from_canonical(g, packed) for g in grads)
