"""Decode kernels (memfit.kernels.decode, memfit.kernels.gemv) against their references, under the interpreter on CPU."""
import pytest
import torch
import triton
from conftest import seeded

from memfit import log
from memfit.errors import MemfitError
from memfit.kernels import gemv
from memfit.kernels.decode import (
    ATTENTION_VARIANTS,
    argmax,
    decode_attention,
    decode_attention_reference,
    launch_config,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rel(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, out, inner, ld", [(1, 37, 200, 200), (3, 19, 136, 160), (4, 40, 600, 608),
                                                   (2, 21, 131, 133)])
def test_gemv_matches_linear(dtype, rows, out, inner, ld):
    """Odd out counts, inner sizes not a multiple of the chunk, row-strided W (a partial FFN's down[:, :a]), bias;
    the last shape's rows are not 16-byte multiples, so it runs the scalar loads (VEC = 1)."""
    x = torch.randn(rows, inner).to(dtype)
    w = torch.randn(out, ld).to(dtype)[:, :inner]
    bias = torch.randn(2 * out).to(dtype)[::2]                         # a strided view: read as its own values
    assert gemv._vector_width(x, w) == (1 if inner % 8 else 16 // w.element_size())
    ref = x.double() @ w.double().T + bias.double()
    for variant in ("gemv_n2_k1024_w4", "gemv_n8_k256_w4", "gemv_n16_k512_w8"):
        got = gemv.gemv(x[:, None], w, bias, variant)
        assert got.shape == (rows, 1, out) and _rel(got, ref[:, None]) < TOL[dtype]
    assert _rel(gemv.gemv(x, w, None, "gemv_n4_k512_w4"), x.double() @ w.double().T) < TOL[dtype]


def _block_reference(x, w, bias, blocks, x_block_stride):
    """y[:, i P + o] = x[:, i stride : i stride + K] . w[i P + o] (+ bias), block by block in float64."""
    p, k = w.shape[0] // blocks, w.shape[1]
    y = torch.cat([x[:, i * x_block_stride:i * x_block_stride + k].double() @ w[i * p:(i + 1) * p].double().T
                   for i in range(blocks)], dim=1)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, blocks, p, k, stride, tile", [
    (1, 3, 7, 19, 19, None),          # BLAST's T (N, b, r) as x: the slices side by side; odd rows a block
    (3, 4, 8, 24, 40, (4, 16, 4, 1)),  # slices with gaps between them, 16-byte rows (VEC > 1), K not a chunk multiple
    (4, 2, 6, 64, 64, (2, 32, 4, 1)),  # K a whole number of chunks: no masked tail
])
def test_block_gemv_matches_blocks(dtype, rows, blocks, p, k, stride, tile):
    """Each block of W's rows meets its own slice of x, bias added per row, with the autotuner's tile (the
    interpreter's one row a program) and with wider ones whose rows must stay inside one block."""
    x = torch.randn(rows, (blocks - 1) * stride + k).to(dtype)
    w, bias = torch.randn(blocks * p, k).to(dtype), torch.randn(2 * blocks * p).to(dtype)[::2]     # a strided bias
    vec = 16 // w.element_size()
    assert gemv._vector_width(x, w, stride) == (vec if k % vec == 0 and stride % vec == 0 else 1)
    got = gemv.block_gemv(x, w, bias, blocks, stride, tile=tile)
    assert _rel(got, _block_reference(x, w, bias, blocks, stride)) < TOL[dtype]
    assert _rel(gemv.block_gemv(x, w, None, blocks, stride), _block_reference(x, w, None, blocks, stride)) < TOL[dtype]


def test_block_gemv_refuses_what_it_cannot_take():
    """Each bad argument gets a MemfitError naming it, before anything is launched."""
    x, w = torch.randn(1, 3 * 8), torch.randn(6, 8)
    bad = {"2-D": dict(x2=torch.randn(1, 1, 24)), "dtype": dict(x2=x.double()), "rows": dict(x2=torch.randn(5, 24)),
           "equal blocks": dict(w=torch.randn(7, 8)), "unit inner": dict(w=torch.randn(8, 6).T),
           "slice of K": dict(x_block_stride=9), "bias": dict(bias=torch.randn(2)),
           "tile": dict(tile=(4, 32, 4, 1))}
    for problem, change in bad.items():
        args = dict(x2=x, w=w, bias=None, blocks=3, x_block_stride=8) | change
        with pytest.raises(MemfitError, match=problem):
            gemv.block_gemv(**args)
    for tile in [(0, 32, 4, 1), (3, 32, 4, 1), (2, 32, 3, 1), (2, 32), (2.0, 32, 4, 1)]:
        with pytest.raises(MemfitError, match="tile"):
            gemv.block_gemv(x, w, None, 3, 8, tile=tile)
    with pytest.raises(MemfitError, match="slice of K"):
        gemv.block_gemv(x, w, None, 3, -8)


def _row_reference(x, w, bias, x_index, y_index, width):
    """block_row_gemv's definition in float64, index by index."""
    (blocks, k, c), (sxi, d, sxh, sxl), (syi, syc) = w.shape, x_index, y_index
    rk = torch.arange(k)
    y = torch.zeros(x.shape[0], width, dtype=torch.float64)
    for i in range(blocks):
        cols = i * syi + torch.arange(c) * syc
        y[:, cols] = x[:, i * sxi + (rk // d) * sxh + (rk % d) * sxl].double() @ w[i].double()
        if bias is not None:
            y[:, cols] += bias[cols].double()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, blocks, k, c, x_index, y_index", [
    (1, 3, 11, 35, (11, 11, 0, 1), (35, 1)),      # Monarch's stage 1 / BLAST's: x_j's slice, z in its natural order
    (3, 4, 20, 9, (5, 4, 1, 20), (1, 4)),         # Monarch's stage 2: w2's (s, j) rows gathered from z, permuted y
    (4, 2, 300, 40, (3, 300, 0, 1), (40, 1)),     # K over many steps of a tile, overlapping x slices
    (2, 3, 5, 8, (2, 4, 4, 1), (8, 1)),           # K not a multiple of the divisor: the largest index is not at k = K-1
])
def test_block_row_gemv_matches_blocks(dtype, rows, blocks, k, c, x_index, y_index):
    """Each block of W (B, K, C) meets the x vector its index gathers, written where the y index puts it, with and
    without a bias, at odd sizes (C and K not multiples of a tile) and up to MAX_ROWS rows, x no longer than the
    index reaches."""
    sxi, d, sxh, sxl = x_index
    width_x = (blocks - 1) * sxi + max((i // d) * sxh + (i % d) * sxl for i in range(k)) + 1
    width_y = (blocks - 1) * y_index[0] + (c - 1) * y_index[1] + 1
    x, w = torch.randn(rows, width_x).to(dtype), (torch.randn(blocks, k, c) / k**0.5).to(dtype)
    bias = torch.randn(width_y).to(dtype)
    for b in (bias, None):
        y = torch.full((rows, width_y), float("nan"), dtype=dtype)
        gemv.block_row_gemv(x, w, y, b, x_index, y_index)
        assert not y.isnan().any()                  # every element of y's rows written (the indexes cover them)
        assert _rel(y, _row_reference(x, w, b, x_index, y_index, width_y)) < TOL.get(dtype, 2e-2)


def test_block_row_gemv_refuses_what_it_cannot_take():
    """Each bad argument gets a MemfitError naming it, before anything is launched."""
    x, w, y = torch.randn(1, 3 * 8), torch.randn(3, 8, 5), torch.empty(1, 15)
    bad = {"3-D": dict(w=torch.randn(24, 5)), "one float dtype": dict(x2=x.double()),
           "1 to 4 rows": dict(x2=torch.randn(5, 24)), "unit inner": dict(w=torch.randn(3, 5, 8).transpose(1, 2)),
           "divisor": dict(x_index=(8, 0, 0, 1)), "end of x": dict(x_index=(9, 8, 0, 1)),
           "end of y": dict(y_index=(5, 2)), "bias": dict(bias=torch.randn(30)[::2]),
           "side by side or interleave": dict(y_index=(0, 1)), "shares memory": dict(y=x[:, :15]),
           "rows that do not overlap": dict(x2=torch.randn(2, 24), y=torch.empty(1, 15).expand(2, 15))}
    for problem, change in bad.items():
        args = dict(x2=x, w=w, y=y, bias=None, x_index=(8, 8, 0, 1), y_index=(5, 1)) | change
        with pytest.raises(MemfitError, match=problem):
            gemv.block_row_gemv(**args)


@pytest.mark.cpu_only(reason="its last check is the pick off the GPU")
def test_gemv_refuses_what_it_cannot_take():
    assert gemv.takes(torch.randn(4, 8), torch.randn(3, 8)) and not gemv.takes(torch.randn(5, 8), torch.randn(3, 8))
    assert not gemv.takes(torch.randn(1, 8), torch.randn(8, 3).T)        # inner stride != 1
    with pytest.raises(MemfitError, match="rows"):
        gemv.gemv(torch.randn(6, 8), torch.randn(3, 8))
    with pytest.raises(MemfitError, match=r"rows of w's width .* got x \(1, 7\)"):        # would read past x's end
        gemv.gemv(torch.randn(1, 7), torch.randn(3, 8))
    with pytest.raises(MemfitError, match="variant"):
        gemv.gemv(torch.randn(1, 8), torch.randn(3, 8), variant="nope")
    assert gemv.pick_path(torch.randn(1, 8), [(torch.randn(3, 8), None)]) == gemv.CUBLAS     # off the GPU


def _attention_case(dtype, B, H, Hkv, D, L, slot, seed):
    gen = seeded(seed)
    qkv = torch.randn(B, H + 2 * Hkv, D, generator=gen).to(dtype)     # views of one fused output, as in decode
    angle = torch.rand(B, D, generator=gen) * 6
    caches = [torch.randn(B, Hkv, L, D, generator=gen).to(dtype) for _ in range(2)]
    valid = torch.rand(B, L, generator=gen) > 0.3
    valid[1:, :5] = False                                             # left padding of the second sequence
    return (qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:], angle.cos().to(dtype), angle.sin().to(dtype), *caches,
            valid, torch.tensor([slot]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B, H, Hkv, D, L, slot", [(2, 6, 2, 32, 70, 45), (1, 4, 4, 16, 40, 0), (2, 8, 1, 16, 33, 32),
                                                  (2, 4, 2, 16, 6, 5)])
def test_decode_attention_matches_reference(dtype, B, H, Hkv, D, L, slot):
    """GQA groups 3, 1, 8; the slot at 0, inside a chunk and at the cache end (length not a multiple of the block);
    a cache shorter than one 16-key block; batch 2 with invalid (padding) slots; every variant writes the
    reference's cache entry at the slot and leaves the others as they were. The entry is compared to rounding: on
    the H200 it was not bit-equal to the reference's in fp32, likely because a GPU fuses the rope's multiply and add
    (one rounding fewer than the reference's fp32 ops)."""
    args = _attention_case(dtype, B, H, Hkv, D, L, slot, seed=slot)
    ref_caches = [t.clone() for t in args[5:7]]
    ref = decode_attention_reference(*args[:5], *ref_caches, *args[7:], 0.3)
    for variant in ("split32", "split128", "single") if slot else ATTENTION_VARIANTS:
        caches = [t.clone() for t in args[5:7]]
        got = decode_attention(*args[:5], *caches, *args[7:], 0.3, variant)
        assert got.shape == (B, H * D) and _rel(got, ref) < TOL[dtype], variant
        others = torch.arange(L, device=caches[0].device) != slot
        for c, r in zip(caches, ref_caches):
            assert torch.equal(c[:, :, others], r[:, :, others]), variant
            ulps = 2 * torch.finfo(dtype).eps * args[1].abs().max().item()      # of the rope's addends, |k| x 1
            torch.testing.assert_close(c[:, :, slot], r[:, :, slot], rtol=0, atol=ulps, msg=variant)


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
@pytest.mark.parametrize("slot", [-1, 260, 270])
def test_decode_attention_never_writes_outside_the_cache(slot, variant):
    """The slot comes from device memory, so nothing can check it on the host before a graph's replay: a slot
    outside [0, L) had stored the new k and v past the cache (or before it), into the memory there. L = 260 is more
    than one chunk of every split variant."""
    B, H, Hkv, D, L = 1, 2, 1, 16, 260
    q, k, v, cos, sin, *_ = _attention_case(torch.float32, B, H, Hkv, D, L, 0, seed=4)
    memory = torch.zeros(2, 3 * L, D)                         # each cache with a row block before it and two after
    k_cache, v_cache = (memory[i, L:2 * L].view(B, Hkv, L, D) for i in range(2))
    out = decode_attention(q, k, v, cos, sin, k_cache, v_cache, torch.ones(B, L, dtype=torch.bool),
                           torch.tensor([slot]), None, variant)
    assert torch.isfinite(out).all() and not memory.any()


def test_decode_attention_reference_is_sdpa_with_rope():
    """The reference itself against SDPA over the roped cache (what the mask path computes)."""
    q, k, v, cos, sin, kc, vc, valid, slot = _attention_case(torch.float64, 2, 6, 2, 16, 20, 11, seed=3)
    out = decode_attention_reference(q, k, v, cos, sin, kc, vc, valid, slot, 0.25)
    half = 8

    def rope(x):
        return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[:, None]
    mask = valid[:, :12].clone()
    mask[:, 11] = True
    assert torch.equal(kc[:, :, 11], rope(k)) and torch.equal(vc[:, :, 11], v)
    expect = torch.nn.functional.scaled_dot_product_attention(
        rope(q)[:, :, None], kc[:, :, :12].repeat_interleave(3, 1), vc[:, :, :12].repeat_interleave(3, 1),
        attn_mask=mask[:, None, None], scale=0.25)
    assert torch.allclose(out, expect.reshape(2, -1))


def test_decode_attention_bad_shapes():
    q, k, v, cos, sin, kc, vc, valid, slot = _attention_case(torch.float32, 1, 6, 2, 16, 20, 3, seed=0)
    with pytest.raises(MemfitError, match="multiple"):
        decode_attention(q[:, :5], k, v, cos, sin, kc, vc, valid, slot)
    with pytest.raises(MemfitError, match="variant"):
        decode_attention(q, k, v, cos, sin, kc, vc, valid, slot, variant="x")


@pytest.mark.parametrize("change, message", [
    pytest.param(lambda a: {"sin": a["sin"][:, :8]}, "cos/sin", id="sin-shape"),
    pytest.param(lambda a: {"sin": torch.randn(2, 32)[:, :16]}, "same strides", id="sin-strides"),  # read with cos's
    pytest.param(lambda a: {"v_cache": torch.randn(2, 2, 23, 16)[:, :, :20]}, "caches", id="v-strides"),  # k's
    pytest.param(lambda a: {"v_cache": a["v_cache"][:, :, :19]}, "caches", id="v-shape"),
    pytest.param(lambda a: {"valid": a["valid"].to(torch.uint8)}, "torch.bool", id="valid-uint8"),
    pytest.param(lambda a: {"valid": a["valid"].float()}, "torch.bool", id="valid-float"),  # byte view: 4x wide
    pytest.param(lambda a: {"k_cache": a["k_cache"].half(), "v_cache": a["v_cache"].half()}, "one dtype",
                 id="cache-dtype"),
    pytest.param(lambda a: {k: a[k].double() for k in ("q", "k", "v", "k_cache", "v_cache")}, "one dtype",
                 id="fp64"),
])
def test_decode_attention_refuses_what_its_reads_would_get_wrong(change, message):
    names = ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "valid", "slot")
    args = dict(zip(names, _attention_case(torch.float32, 2, 6, 2, 16, 20, 3, seed=0)))
    args.update(change(args))
    with pytest.raises(MemfitError, match=message):
        decode_attention(**args)


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_attention_blocks_are_dot_sized(variant):
    """tl.dot needs at least 16 keys a block on the GPU (the interpreter does not check): short caches too."""
    for L in (2, 5, 15, 16, 17, 100, 3000):
        chunk, block_n, _ = launch_config(variant, L)
        assert 16 <= block_n <= max(16, chunk) and chunk * triton.cdiv(L, chunk) >= L, (variant, L)


def test_fp32_attention_follows_torch_matmul_precision(monkeypatch, caplog):
    """fp32 dots are TF32 when torch's float32 matmul precision allows it (as memfit attention), IEEE by default."""
    monkeypatch.setattr(log, "_said", set())
    args = _attention_case(torch.float32, 1, 4, 2, 16, 20, 7, seed=1)
    decode_attention(*args)
    assert "TF32" not in caplog.text
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        decode_attention(*args)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert "TF32" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_matches_torch_with_ties(dtype):
    x = torch.randn(3, 5000).to(dtype)
    x[1, 4100] = x[1, 4999] = x[1, 2047] = 50          # a tie across blocks: the lowest index wins
    x[2, :] = -1e4
    x[2, 2048] = x[2, 2049] = 0                         # a tie inside a block
    assert torch.equal(argmax(x), x.argmax(-1)) and argmax(x)[1] == 2047 and argmax(x)[2] == 2048
