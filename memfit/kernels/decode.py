"""Decode-step kernels over a static KV cache: rope + cache write + attention in one kernel, attention over a
cache the caller keeps (``cache_attention``: the decode of ``attn_implementation="memfit"``), and argmax.

**Attention of one new token** (``decode_attention``). At decode each sequence brings
one query per head; the step before this kernel had three compiled kernels a layer
(rope of q and k, the k and v cache writes, a transpose) and a cuDNN SDPA call over the
whole cache under an additive mask. Here one kernel does it all, per (sequence, KV
head, split of the cache):

* rope of q (the G query heads of the KV head, padded to 16 rows for the tensor cores)
  and of the new k, with the step's ``cos``/``sin`` (B, D) in the model dtype (the values
  the mask-and-SDPA path uses; the products are summed in fp32 and rounded once);
* the new k and v are written into the cache at ``slot`` by split 0, and *also* used from
  registers: the new token's score enters split 0's softmax directly, and no program
  reads the cache at ``slot`` (so no program waits for the write);
* keys ``j < slot`` with ``valid[b, j]`` (left padding is invalid) of the split's chunk,
  read only up to ``slot``: the length comes from device memory, so one captured CUDA
  graph serves every step. For the same reason no check of ``slot`` can raise: a slot outside the cache's
  [0, L) writes nothing and reads no key past the cache (it had written past the cache, into whatever memory
  followed), and the output is then not the reference's, which raises;
* online softmax in base 2 (log2 e folded into the scale), p in the model dtype for the
  p V product as in flash attention.

With more than one split, each writes its (max, sum, unnormalised output) in fp32 and a
second small kernel combines them (flash-decoding); with one split the kernel writes
the output itself. The chunk length is the speed knob: short chunks give many programs
(the cache read is spread over the GPU) and a bigger combine; ``pick_attention`` times the
variants at the full cache length with ``autotune.pick_variant``.

Output: (B, H * D), head ``h = kv * G + g`` (the layout o_proj takes). Prefill (many
queries) stays with SDPA in ``memfit.infer.generate``.

**Argmax** (``argmax``): greedy sampling over a 128k vocabulary with PyTorch's reduce
kernel takes tens of microseconds at batch 1 (one block per row); two stages (block
maxima over many programs, then one program per row) read the logits once at full
bandwidth. Ties go to the lowest index, as ``torch.argmax``; NaN logits are not handled.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels.autotune import pick_variant
from memfit.kernels.dispatch import dot_precision, use_triton

LOG2E = 1.4426950408889634
# name -> (chunk of cache slots per program, 0 = the whole cache in one program; keys per block; warps)
ATTENTION_VARIANTS = {
    "split32": (32, 32, 4),
    "split64": (64, 32, 4),
    "split128": (128, 64, 4),
    "split256": (256, 64, 4),
    "single": (0, 64, 4),
}
ATTENTION_DEFAULT = "split64"
MIN_DOT = 16                     # tl.dot's smallest M, N and K on the GPU
ARGMAX_BLOCK = 2048


# ---- references (the definitions) ----------------------------------------------------------

def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32 at least (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope of x (..., D) with cos/sin broadcast to it: x cos + rotate_half(x) sin, in fp32, rounded once."""
    half = x.shape[-1] // 2
    xf = _wide(x)
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * _wide(cos) + rotated * _wide(sin)).to(x.dtype)


def decode_attention_reference(q, k, v, cos, sin, k_cache, v_cache, valid, slot, scale):
    """The definition of ``decode_attention``; writes the caches like the kernel.

    q (B, H, D), k/v (B, Hkv, D): the new token's projections before rope; cos/sin (B, D);
    caches (B, Hkv, L, D); valid (B, L) bool; slot: 1-element int tensor. Returns (B, H * D).
    """
    B, H, D = q.shape
    Hkv = k.shape[1]
    s = int(slot.reshape(-1)[0])
    q = rotate(q, cos[:, None], sin[:, None])
    k_cache[:, :, s] = rotate(k, cos[:, None], sin[:, None])
    v_cache[:, :, s] = v
    keys = _wide(k_cache[:, :, : s + 1].repeat_interleave(H // Hkv, dim=1))
    values = _wide(v_cache[:, :, : s + 1].repeat_interleave(H // Hkv, dim=1))
    scores = torch.einsum("bhd,bhjd->bhj", _wide(q), keys) * scale
    visible = valid[:, : s + 1].clone()
    visible[:, s] = True
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhj,bhjd->bhd", scores.softmax(-1), values).to(q.dtype).reshape(B, H * D)


# ---- attention kernels ---------------------------------------------------------------------

@triton.jit
def _rope_rows(ptr, rows, row_stride, row_mask, cos, sin, d, D: tl.constexpr):
    """Rows of ``ptr`` (rows x D) rotated by cos/sin (D,), rounded to the tensor's dtype."""
    half: tl.constexpr = D // 2
    base = ptr + rows[:, None] * row_stride
    x = tl.load(base + d[None, :], mask=row_mask[:, None], other=0.0)
    partner = tl.load(base + ((d + half) % D)[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    rotated = tl.where((d < half)[None, :], -partner, partner)
    return (x.to(tl.float32) * cos[None, :] + rotated * sin[None, :]).to(x.dtype)


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, valid_ptr, slot_ptr,
                             out_ptr, m_ptr, l_ptr, acc_ptr,
                             sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, scs_b, sc_b, sc_h, sc_n, sval_b,
                             qk_scale, G, H, S, L,
                             D: tl.constexpr, GP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLIT: tl.constexpr, DOT_PREC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr)
    in_cache = (slot >= 0) & (slot < L)        # outside: no store and no read past the cache (the caller's defect)
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    one = tl.arange(0, 1)
    cos = tl.load(cos_ptr + b * scs_b + d).to(tl.float32)
    sin = tl.load(sin_ptr + b * scs_b + d).to(tl.float32)
    q = _rope_rows(q_ptr + b * sq_b, kv * G + g, sq_h, g < G, cos, sin, d, D)                # (GP, D)
    k_new = _rope_rows(k_ptr + b * sk_b + kv * sk_h, one, 0, one < 1, cos, sin, d, D)       # (1, D)
    v_new = tl.load(v_ptr + b * sv_b + kv * sv_h + one[:, None] * 0 + d[None, :])          # (1, D)
    cache = b * sc_b + kv * sc_h
    first = split == 0
    if first:
        tl.store(kc_ptr + cache + slot * sc_n + one[:, None] * 0 + d[None, :], k_new, mask=in_cache)
        tl.store(vc_ptr + cache + slot * sc_n + one[:, None] * 0 + d[None, :], v_new, mask=in_cache)
    # split 0 starts from the new token (every query sees itself); the others from nothing
    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale             # (GP,)
    m_i = tl.where(first, s_new, float("-inf"))
    l_i = tl.where(first, 1.0, 0.0) + tl.zeros((GP,), tl.float32)
    acc = tl.where(first, 1.0, 0.0) * v_new.to(tl.float32) + tl.zeros((GP, D), tl.float32)
    start = split * CHUNK
    m_i, l_i, acc = _attend_cache(q, kc_ptr, vc_ptr, valid_ptr + b * sval_b, cache, sc_n, start,
                                  tl.minimum(start + CHUNK, tl.minimum(slot, L)), m_i, l_i, acc, qk_scale, D, BLOCK_N,
                                  True, DOT_PREC)
    _store_heads(out_ptr, m_ptr, l_ptr, acc_ptr, b, kv * G + g, g < G, split, m_i, l_i, acc, H, S, D, SPLIT)


@triton.jit
def _attend_cache(q, kc_ptr, vc_ptr, valid_row_ptr, cache, sc_n, start, end, m_i, l_i, acc, qk_scale,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_VALID: tl.constexpr, DOT_PREC: tl.constexpr):
    """The running (max, sum, output) of q's rows (GP, D) after online softmax (base 2) over cache slots
    [start, end) (where ``valid_row_ptr[j]`` is nonzero, with HAS_VALID), from the running values given."""
    d = tl.arange(0, D)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        ok = j < end
        if HAS_VALID:
            ok = ok & (tl.load(valid_row_ptr + j, mask=ok, other=0) != 0)
        kv_offsets = cache + j.to(tl.int64)[:, None] * sc_n + d[None, :]
        keys = tl.load(kc_ptr + kv_offsets, mask=ok[:, None], other=0.0)                    # (BLOCK_N, D)
        s = tl.dot(q, tl.trans(keys), input_precision=DOT_PREC)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # a fully masked row: keep 0/0 out
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        values = tl.load(vc_ptr + kv_offsets, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _store_heads(out_ptr, m_ptr, l_ptr, acc_ptr, b, heads, live, split, m_i, l_i, acc, H, S,
                 D: tl.constexpr, SPLIT: tl.constexpr):
    """A program's rows (query heads ``heads``, those ``live``): with SPLIT its partials (B, H, S[, D]) for
    ``_attention_combine_kernel``, else the normalised output rows of out (B * H, D)."""
    d = tl.arange(0, D)
    if SPLIT:
        part = (b * H + heads) * S + split
        tl.store(m_ptr + part, m_i, mask=live)
        tl.store(l_ptr + part, l_i, mask=live)
        tl.store(acc_ptr + part.to(tl.int64)[:, None] * D + d[None, :], acc, mask=live[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]          # a row with every key masked: zeros
        tl.store(out_ptr + (b * H + heads).to(tl.int64)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=live[:, None])


@triton.jit
def _cache_attention_kernel(q_ptr, kc_ptr, vc_ptr, valid_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                            sq_b, sq_h, sc_b, sc_h, sc_n, sval_b, qk_scale, G, H, S, L,
                            D: tl.constexpr, GP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT: tl.constexpr, HAS_VALID: tl.constexpr, DOT_PREC: tl.constexpr):
    """``cache_attention``: per (sequence, KV head, split of the cache) its G query heads against the split's
    slots, the cache as it is (written and roped by the caller)."""
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, D)
    g = tl.arange(0, GP)
    q = tl.load(q_ptr + b * sq_b + (kv * G + g)[:, None] * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0)
    start = split * CHUNK
    m_i, l_i, acc = _attend_cache(q, kc_ptr, vc_ptr, valid_ptr + b * sval_b, b * sc_b + kv * sc_h, sc_n, start,
                                  tl.minimum(start + CHUNK, L), tl.full((GP,), float("-inf"), tl.float32),
                                  tl.zeros((GP,), tl.float32), tl.zeros((GP, D), tl.float32), qk_scale, D, BLOCK_N,
                                  HAS_VALID, DOT_PREC)
    _store_heads(out_ptr, m_ptr, l_ptr, acc_ptr, b, kv * G + g, g < G, split, m_i, l_i, acc, H, S, D, SPLIT)


@triton.jit
def _attention_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, slot_ptr, S,
                    D: tl.constexpr, CHUNK: tl.constexpr, SP: tl.constexpr, EVERY_SPLIT: tl.constexpr = False):
    """The output row of the splits' partials; with EVERY_SPLIT all S splits count (``slot_ptr`` unread), else
    those that saw a slot before the new token's."""
    row = tl.program_id(0).to(tl.int64)                            # b * H + head
    if EVERY_SPLIT:
        active = S
    else:
        active = tl.maximum(tl.cdiv(tl.load(slot_ptr), CHUNK), 1)  # splits that saw a key (split 0 always)
    s = tl.arange(0, SP)
    on = (s < active) & (s < S)
    m = tl.load(m_ptr + row * S + s, mask=on, other=float("-inf"))
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)                 # a row with every key masked: zeros, no NaN
    w = tl.where(on, tl.exp2(m - top), 0.0)
    l_sum = tl.sum(w * tl.load(l_ptr + row * S + s, mask=on, other=0.0), axis=0)
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + (row * S + s)[:, None] * D + d[None, :], mask=on[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


def shape_problem(heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the decode attention kernel cannot take these head counts and size, or None when it can.

    The G = heads / kv_heads query heads of a KV head are one tile, and D is a tile side
    (a power of two, at least tl.dot's minimum).
    """
    if heads % kv_heads or head_dim & (head_dim - 1) or head_dim < MIN_DOT:
        return (f"heads {heads} must be a multiple of KV heads {kv_heads} and head_dim {head_dim} "
                f"a power of two >= {MIN_DOT}")
    return None


def _check_attention(q, k, v, cos, sin, k_cache, v_cache, valid):
    """Every way the kernel's reads would go wrong, as one MemfitError: it reads sin with cos's strides,
    v_cache with k_cache's, valid as bytes, and stores k/v into the caches in q's dtype."""
    B, H, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    problems = []
    if k.shape != (B, Hkv, D) or v.shape != k.shape:
        problems.append(f"k/v {tuple(k.shape)}/{tuple(v.shape)} must be (B, Hkv, D) = {(B, Hkv, D)}")
    if (heads := shape_problem(H, Hkv, D)) is not None:
        problems.append(heads)
    if cos.shape != (B, D) or sin.shape != cos.shape or sin.stride() != cos.stride():
        problems.append(f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must both be (B, D) = {(B, D)} with the same strides")
    if k_cache.shape != (B, Hkv, L, D) or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        problems.append(f"k/v caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} must both be (B, Hkv, L, D) = "
                        f"{(B, Hkv, L, D)} with the same strides")
    if valid.shape != (B, L) or valid.dtype != torch.bool:
        problems.append(f"valid {tuple(valid.shape)} {valid.dtype} must be (B, L) = {(B, L)} torch.bool")
    dtypes = {t.dtype for t in (q, k, v, k_cache, v_cache)}
    if len(dtypes) > 1 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        problems.append(f"q, k, v and the caches must share one dtype of float16, bfloat16, float32; got "
                        f"{', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache, valid)):
        problems.append("q, k, v, cos, sin, the caches and valid need unit stride along their last dim")
    if problems:
        raise MemfitError("decode_attention: " + "; ".join(problems))


def launch_config(variant: str, L: int) -> tuple[int, int, int]:
    """(chunk, keys per block, warps) of ``variant`` over a cache of L slots.

    "single" takes the whole cache in one chunk; the block never exceeds the chunk (no block
    wholly past it) nor drops below tl.dot's minimum (the kernel masks keys past the chunk).
    """
    chunk, block_n, warps = ATTENTION_VARIANTS[variant]
    chunk = chunk or triton.next_power_of_2(L)
    return chunk, max(MIN_DOT, min(block_n, chunk)), warps


def _split_partials(rows: int, splits: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (max, sum, unnormalised output) of every split of every output row, for ``_attention_combine_kernel``;
    one-element placeholders where the cache is one split (the kernel then writes the output itself)."""
    many = splits > 1
    m = torch.empty(rows * splits if many else 1, dtype=torch.float32, device=device)
    return m, torch.empty_like(m), torch.empty(rows * splits * head_dim if many else 1, dtype=torch.float32,
                                               device=device)


def _attention_launch(q, k, v, cos, sin, k_cache, v_cache, valid, slot, scale, variant):
    B, H, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    chunk, block_n, warps = launch_config(variant, L)
    S = triton.cdiv(L, chunk)
    out = torch.empty(B, H * D, dtype=q.dtype, device=q.device)
    split = S > 1
    m, l_, acc = _split_partials(B * H, S, D, q.device)
    valid8 = valid.view(torch.uint8)
    _decode_attention_kernel[(B, Hkv, S)](
        q, k, v, cos, sin, k_cache, v_cache, valid8, slot, out, m, l_, acc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), valid8.stride(0),
        scale * LOG2E, G, H, S, L, D=D, GP=max(MIN_DOT, triton.next_power_of_2(G)), CHUNK=chunk, BLOCK_N=block_n,
        SPLIT=split, DOT_PREC=dot_precision(q.dtype, "decode attention"), num_warps=warps)
    if split:
        _attention_combine_kernel[(B * H,)](m, l_, acc, out, slot, S, D=D, CHUNK=chunk, SP=triton.next_power_of_2(S))
    return out


@torch.library.custom_op("memfit::decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, valid: torch.Tensor, slot: torch.Tensor,
                         scale: float, variant: str) -> torch.Tensor:
    return _attention_launch(q, k, v, cos, sin, k_cache, v_cache, valid, slot, scale, variant)


@_decode_attention_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, valid, slot, scale, variant):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def decode_attention(q, k, v, cos, sin, k_cache, v_cache, valid, slot, scale: float | None = None,
                     variant: str = ATTENTION_DEFAULT) -> torch.Tensor:
    """One new token per sequence: rope q and k, write k/v into the caches at ``slot``, attend over the cache.

    Shapes as ``decode_attention_reference``; q/k/v may be strided views (e.g. of a fused q/k/v
    matmul output) with unit stride along D. ``scale`` defaults to D ** -0.5.
    """
    if variant not in ATTENTION_VARIANTS:
        raise MemfitError(f"decode_attention variant {variant!r} is not one of {', '.join(ATTENTION_VARIANTS)}")
    _check_attention(q, k, v, cos, sin, k_cache, v_cache, valid)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _decode_attention_op(q, k, v, cos, sin, k_cache, v_cache, valid, slot, scale, variant)


def cache_attention_reference(q, k_cache, v_cache, key_mask=None, scale=None):
    """The definition of ``cache_attention``: K and V repeated per query head, scores in fp32, masked keys at -inf."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k_cache.shape[1]
    keys, values = (_wide(t.repeat_interleave(group, dim=1)) for t in (k_cache, v_cache))
    scores = (_wide(q) @ keys.transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    return (scores.softmax(-1).nan_to_num(0.0) @ values).to(q.dtype)       # a row with every key masked: zeros


def cache_attention_problem(q, k_cache, v_cache, key_mask) -> str | None:
    """Why ``cache_attention`` cannot take these, or None: q (B, H, 1, D), caches (B, Hkv, L, D), L >= 1, of one dtype
    with the same strides and unit stride along D (heads and D as ``shape_problem`` needs), no gradient asked for,
    key_mask None or bool (B or 1, 1, 1, L) on q's device."""
    if q.dim() != 4 or q.shape[2] != 1 or k_cache.dim() != 4 or k_cache.shape[::3] != q.shape[::3] \
            or k_cache.shape[2] < 1:
        return (f"q {tuple(q.shape)} must be (B, H, 1, D) and the caches {tuple(k_cache.shape)} (B, Hkv, L, D) "
                "with L >= 1")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        return "it has no backward (decode): call it under torch.no_grad() or with tensors that need no gradient"
    if key_mask is not None and key_mask.device != q.device:
        return f"key_mask is on {key_mask.device}, q on {q.device}"
    if (heads := shape_problem(q.shape[1], k_cache.shape[1], q.shape[3])) is not None:
        return heads
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1:
        return (f"the caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} need one shape, the same strides and "
                "unit stride along D")
    if len({t.dtype for t in (q, k_cache, v_cache)}) > 1 or q.dtype not in (torch.float16, torch.bfloat16,
                                                                            torch.float32):
        return "q and the caches must share one dtype of float16, bfloat16, float32"
    want = (q.shape[0], 1, 1, k_cache.shape[2])
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.dim() != 4
                                 or key_mask.shape[0] not in (1, want[0]) or tuple(key_mask.shape[1:]) != want[1:]):
        return f"key_mask {key_mask.dtype} {tuple(key_mask.shape)} must be bool {want} (or batch 1), True: attend"
    return None


def _cache_attention_launch(q, k_cache, v_cache, key_mask, scale):
    B, H, _, D = q.shape
    Hkv, L = k_cache.shape[1], k_cache.shape[2]
    chunk, block_n, warps = launch_config(ATTENTION_DEFAULT, L)
    S = triton.cdiv(L, chunk)
    out = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device)
    m, l_, acc = _split_partials(B * H, S, D, q.device)
    valid = (key_mask if key_mask.stride(-1) == 1 else key_mask.contiguous()).view(torch.uint8) \
        if key_mask is not None else m                                                  # (unread without a mask)
    valid_b = valid.stride(0) if key_mask is not None and valid.shape[0] > 1 else 0
    _cache_attention_kernel[(B, Hkv, S)](
        q, k_cache, v_cache, valid, out, m, l_, acc, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), valid_b, scale * LOG2E, H // Hkv, H, S, L, D=D,
        GP=max(MIN_DOT, triton.next_power_of_2(H // Hkv)), CHUNK=chunk, BLOCK_N=block_n, SPLIT=S > 1,
        HAS_VALID=key_mask is not None, DOT_PREC=dot_precision(q.dtype, "cache attention"), num_warps=warps)
    if S > 1:
        _attention_combine_kernel[(B * H,)](m, l_, acc, out, m, S, D=D, CHUNK=chunk, SP=triton.next_power_of_2(S),
                                  EVERY_SPLIT=True)
    return out


@torch.library.custom_op("memfit::cache_attention", mutates_args=())
def _cache_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        key_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    return _cache_attention_launch(q, k_cache, v_cache, key_mask, scale)


@_cache_attention_op.register_fake
def _(q, k_cache, v_cache, key_mask, scale):
    return q.new_empty(q.shape)


def cache_attention(q, k_cache, v_cache, key_mask=None, scale: float | None = None,
                    path: str | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v (B, H, 1, D) of one query token per sequence against caches (B, Hkv, L, D) that
    already hold it (written and roped by the caller: transformers' cache update), keys where ``key_mask``
    (B or 1, 1, 1, L) is False left out; no gradient. The decode step of ``attn_implementation="memfit"``.

    Where ``decode_attention`` serves memfit's own decode loop (rope and the cache write fused in), this serves
    any caller that keeps its own cache. Given a static cache's mask, transformers' SDPA path repeats K and V for
    every query head before SDPA, a copy of the cache per layer and step (0.156 ms of the 0.261 ms a step of decode
    attention in the end-to-end benchmark's profile at 1476f91); here each program reads its KV head's slots once
    for the head's G query heads, and the mask as it is (one byte a slot). Cut into chunks as ``decode_attention``'s
    default variant (not timed per shape; on the H200 it runs the decode steps of ``blr_e2e.py --attention memfit``,
    whose profile at 7eeb2bd gives it 0.061-0.064 ms a step of 16 layers and its chunks' combine 0.029-0.030)."""
    if problem := cache_attention_problem(q, k_cache, v_cache, key_mask):
        raise MemfitError(f"cache_attention: {problem}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not use_triton("cache_attention", q, k_cache, v_cache, path=path):
        return cache_attention_reference(q, k_cache, v_cache, key_mask, scale)
    return _cache_attention_op(q if q.stride(-1) == 1 else q.contiguous(), k_cache, v_cache, key_mask, scale)


def over_layers(variant: str):
    """fn(q, k, v, cos, sin, caches, valid, slot, scale) running ``variant`` over every layer's caches (what is timed)."""
    def run(q, k, v, cos, sin, caches, valid, slot, scale):
        for k_cache, v_cache in caches:
            decode_attention(q, k, v, cos, sin, k_cache, v_cache, valid, slot, scale, variant)
    return run


def pick_attention(caches: list[tuple[torch.Tensor, torch.Tensor]], heads: int, scale: float) -> str:
    """Fastest variant for these caches at their full length (every slot valid), timed over all layers.

    Timing writes random k/v at the last slot, which decode overwrites before it reads it.
    """
    k_cache = caches[0][0]
    B, Hkv, L, D = k_cache.shape
    if not k_cache.is_cuda:
        return ATTENTION_DEFAULT
    args = timing_args(caches, heads, scale)
    key = (f"B{B} H{heads} Hkv{Hkv} L{L} D{D} {str(k_cache.dtype).removeprefix('torch.')}", f"x{len(caches)}")
    candidates = {name: over_layers(name) for name in ATTENTION_VARIANTS}
    return pick_variant("decode_attention", key, candidates, ATTENTION_DEFAULT, args)


def timing_args(caches: list[tuple[torch.Tensor, torch.Tensor]], heads: int, scale: float) -> tuple:
    """Arguments of ``over_layers(variant)`` at the caches' full length: random new token, every slot valid."""
    k_cache = caches[0][0]
    B, Hkv, L, D = k_cache.shape
    factory = {"device": k_cache.device, "dtype": k_cache.dtype}
    q, k, v = torch.randn(B, heads, D, **factory), torch.randn(B, Hkv, D, **factory), torch.randn(B, Hkv, D, **factory)
    angle = torch.rand(B, D, device=k_cache.device) * math.tau
    cos, sin = angle.cos().to(k_cache.dtype), angle.sin().to(k_cache.dtype)
    valid = torch.ones(B, L, dtype=torch.bool, device=k_cache.device)
    slot = torch.full((1,), L - 1, dtype=torch.long, device=k_cache.device)
    return q, k, v, cos, sin, caches, valid, slot, scale


# ---- argmax --------------------------------------------------------------------------------

@triton.jit
def _argmax_blocks_kernel(x_ptr, val_ptr, idx_ptr, V, sx, P, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * sx + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * P + block, best)
    tl.store(idx_ptr + row * P + block, block * BLOCK + where)


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, P, PP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PP)
    vals = tl.load(val_ptr + row * P + p, mask=p < P, other=float("-inf"))
    _, where = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * P + where).to(tl.int64))


@torch.library.custom_op("memfit::argmax", mutates_args=())
def _argmax_op(x: torch.Tensor) -> torch.Tensor:
    rows, V = x.shape
    P = triton.cdiv(V, ARGMAX_BLOCK)
    vals = torch.empty(rows, P, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, P, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_blocks_kernel[(rows, P)](x, vals, idx, V, x.stride(0), P, BLOCK=ARGMAX_BLOCK, num_warps=8)
    _argmax_rows_kernel[(rows,)](vals, idx, out, P, PP=triton.next_power_of_2(P))
    return out


@_argmax_op.register_fake
def _(x):
    return x.new_empty(x.shape[0], dtype=torch.int64)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value of each row of x (rows, V) (lowest index on ties), as int64 (rows,)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.dtype.is_floating_point:
        raise MemfitError(f"argmax takes a (rows, V) float tensor with unit column stride, got {tuple(x.shape)} {x.dtype}")
    return _argmax_op(x)

