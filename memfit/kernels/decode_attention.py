"""Decode attention: one query token per sequence against a KV cache, split over the keys (flash-decoding).

``decode_attention(q, k, v, key_mask)`` is softmax(q k^T * scale) v for q ``(B, Hq, 1, D)`` and a cache's
k, v ``(B, Hkv, L, D)`` (``Hq % Hkv == 0``), with ``key_mask`` ``(B or 1, 1, 1, L)`` bool (True: attend) or None
(every key). It is the decode step of ``attn_implementation="memfit"`` (:mod:`memfit.train.attention_hf`).

Why a kernel of its own: a static cache's decode needs a mask (the cache holds positions not filled yet), and
given a mask, transformers' SDPA path repeats K and V for every query head of a group before calling SDPA: a
copy of the whole cache per layer and step. In the end-to-end benchmark's profile (1476f91, SDPA run) decode
attention took 0.261 ms of a 0.778 ms step of the model whose compressed layers cost nothing, 0.156 ms of it
that copy. Here each program reads its kv head's keys once for the whole group of query heads, and the mask
is read as it is (one byte per key).

Two Triton kernels:

* ``_decode_attention_partial_kernel``: one program per (sequence x kv head, key split). Its G query heads
  are the rows of one tile (padded to 16 for the tensor-core dot); online softmax in base 2 over its split's
  keys, in blocks of BL; writes the split's row max, row sum and unnormalised output (fp32).
* ``_decode_attention_combine_kernel``: one program per (sequence x kv head): rescales the splits to a common
  max, sums them and normalises.

(The kernels' names hold "attention": the end-to-end benchmark's profile counts such kernels as attention.)

The splits give the GPU enough programs at batch 1 (B x Hkv is 8 at Llama-1B: 8 programs could not stream a
cache at HBM bandwidth). Not yet timed on a GPU; tiles are fixed (BL = 64, 4 warps), not autotuned.
"""
from __future__ import annotations

from typing import Optional

import torch

from memfit.errors import MemfitError
from memfit.kernels.dispatch import dot_precision, interpreting, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on GPU machines
    triton = None

LOG2E = 1.4426950408889634
BLOCK_KEYS = 64            # keys per step of a split
MAX_HEAD_DIM = 256
PROGRAMS_PER_SM = 2        # splits are chosen to give about this many programs per SM


def decode_attention_reference(q, k, v, key_mask=None, scale=None):
    """The definition: K and V repeated per query head, scores in fp32, masked keys at -inf."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)


if triton is not None:

    @triton.jit
    def _decode_attention_partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
                               HKV, G, L, D, CHUNK, SPLITS,
                               sqb, sqh, skb, skh, skl, svb, svh, svl, smb, sml, scale_log2,
                               HAS_MASK: tl.constexpr, RP: tl.constexpr, DP: tl.constexpr, BL: tl.constexpr,
                               PRECISION: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)
        h = (bh % HKV).to(tl.int64)
        rows = tl.arange(0, RP)
        cols = tl.arange(0, DP)
        row_ok, col_ok = rows < G, cols < D
        q = tl.load(q_ptr + b * sqb + (h * G + rows)[:, None] * sqh + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        m_i = tl.full((RP,), float("-inf"), tl.float32)
        l_i = tl.zeros((RP,), tl.float32)
        acc = tl.zeros((RP, DP), tl.float32)
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, L)
        for l0 in range(start, end, BL):
            keys = l0 + tl.arange(0, BL)
            key_ok = keys < end
            kv_mask = key_ok[:, None] & col_ok[None, :]
            k = tl.load(k_ptr + b * skb + h * skh + keys.to(tl.int64)[:, None] * skl + cols[None, :], mask=kv_mask,
                        other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2            # (RP, BL), base 2
            if HAS_MASK:
                key_ok = key_ok & (tl.load(mask_ptr + b * smb + keys * sml, mask=key_ok, other=0) != 0)
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # a row with no key yet: no NaN from -inf - -inf
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + b * svb + h * svh + keys.to(tl.int64)[:, None] * svl + cols[None, :], mask=kv_mask,
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        part = (bh * SPLITS + split).to(tl.int64) * RP + rows
        tl.store(part_m_ptr + part, m_i)
        tl.store(part_l_ptr + part, l_i)
        tl.store(part_o_ptr + part[:, None] * DP + cols[None, :], acc)

    @triton.jit
    def _decode_attention_combine_kernel(part_o_ptr, part_m_ptr, part_l_ptr, out_ptr, HKV, G, D, SPLITS, sob, soh,
                               RP: tl.constexpr, DP: tl.constexpr):
        bh = tl.program_id(0)
        b = (bh // HKV).to(tl.int64)
        h = (bh % HKV).to(tl.int64)
        rows = tl.arange(0, RP)
        cols = tl.arange(0, DP)
        first = (bh * SPLITS).to(tl.int64) * RP + rows
        m = tl.full((RP,), float("-inf"), tl.float32)
        for split in range(0, SPLITS):
            m = tl.maximum(m, tl.load(part_m_ptr + first + split * RP))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros((RP,), tl.float32)
        acc = tl.zeros((RP, DP), tl.float32)
        for split in range(0, SPLITS):
            part = first + split * RP
            weight = tl.exp2(tl.load(part_m_ptr + part) - m_safe)
            total += weight * tl.load(part_l_ptr + part)
            acc += weight[:, None] * tl.load(part_o_ptr + part[:, None] * DP + cols[None, :])
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]          # a row with every key masked: zeros
        tl.store(out_ptr + b * sob + (h * G + rows)[:, None] * soh + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rows < G)[:, None] & (cols < D)[None, :])


def _splits(batch_heads: int, keys: int, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split, a multiple of BLOCK_KEYS): about PROGRAMS_PER_SM programs per SM in all."""
    sms = 4 if interpreting() else torch.cuda.get_device_properties(device).multi_processor_count
    blocks = triton.cdiv(keys, BLOCK_KEYS)
    wanted = max(1, min(blocks, triton.cdiv(PROGRAMS_PER_SM * sms, batch_heads)))
    chunk = triton.cdiv(blocks, wanted) * BLOCK_KEYS
    return triton.cdiv(keys, chunk), chunk


@torch.library.custom_op("memfit::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
                         scale: float) -> torch.Tensor:
    batch, hq, _, d = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    group = hq // hkv
    rp, dp = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(d))
    splits, chunk = _splits(batch * hkv, keys, q.device)
    part_o = torch.empty(batch * hkv * splits * rp * dp, device=q.device, dtype=torch.float32)
    part_m = torch.empty(batch * hkv * splits * rp, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    mask = key_mask.view(torch.uint8) if key_mask is not None else part_m       # (unread without a mask)
    smb, sml = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(3)) if key_mask is not None else (0, 0)
    _decode_attention_partial_kernel[(batch * hkv, splits)](
        q, k, v, mask, part_o, part_m, part_l, hkv, group, keys, d, chunk, splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        smb, sml, scale * LOG2E, HAS_MASK=key_mask is not None, RP=rp, DP=dp, BL=BLOCK_KEYS,
        PRECISION=dot_precision(q.dtype, "decode_attention"), num_warps=4)
    out = torch.empty(batch, hq, 1, d, device=q.device, dtype=q.dtype)
    _decode_attention_combine_kernel[(batch * hkv,)](part_o, part_m, part_l, out, hkv, group, d, splits,
                                                     out.stride(0), out.stride(1), RP=rp, DP=dp, num_warps=4)
    return out


@_decode_attention_op.register_fake
def _(q, k, v, key_mask, scale):
    return q.new_empty(q.shape[0], q.shape[1], 1, q.shape[3])


def decode_mask_problem(q, k, key_mask) -> str | None:
    """Why ``key_mask`` is not a mask decode_attention takes for q and k, or None: it takes None or a bool
    (B or 1, 1, 1, L) mask, True where a key is attended."""
    if key_mask is None:
        return None
    want = (q.shape[0], 1, 1, k.shape[2])
    if (key_mask.dtype != torch.bool or key_mask.dim() != 4 or key_mask.shape[0] not in (1, want[0])
            or tuple(key_mask.shape[1:]) != want[1:]):
        return (f"key_mask must be bool of shape {want} (or batch 1), True where a key is attended; got "
                f"{key_mask.dtype} {tuple(key_mask.shape)}")
    return None


def decode_attention(q, k, v, key_mask=None, scale: float | None = None, path: str | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v (B, Hq, 1, D) for one query token per sequence against a cache's k, v
    (B, Hkv, L, D), keys where ``key_mask`` (B or 1, 1, 1, L) is False left out; no gradient (decode)."""
    if q.dim() != 4 or q.shape[2] != 1 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] \
            or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        raise MemfitError(f"decode_attention: q (B, Hq, 1, D) and k, v (B, Hkv, L, D) with Hq a multiple of Hkv; "
                          f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[3] > MAX_HEAD_DIM:
        raise MemfitError(f"decode_attention: head dim {q.shape[3]} is over {MAX_HEAD_DIM}")
    if problem := decode_mask_problem(q, k, key_mask):
        raise MemfitError(f"decode_attention: {problem}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not use_triton("decode_attention", q, k, v, path=path):
        return decode_attention_reference(q, k, v, key_mask, scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _decode_attention_op(q, k, v, key_mask, scale)
