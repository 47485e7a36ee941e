"""cache_attention (one query token against a cache the caller keeps, split over the cache) against its reference:
random shapes including awkward ones (37 and 130 slots, groups of 3 and 6 query heads, one slot), fp32 and bf16,
with and without a key mask (per sequence or one for the batch), chunks whose slots are all masked; bad inputs are
refused. The Triton kernels run under the interpreter."""
import pytest
import torch
from conftest import rel, seeded

from memfit.errors import MemfitError
from memfit.kernels import decode

CASES = [(1, 4, 1, 200, 64), (2, 6, 2, 37, 16), (1, 8, 8, 130, 16), (2, 12, 2, 1, 64), (1, 6, 1, 300, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,slots,d", CASES)
@pytest.mark.parametrize("masked", ["none", "mask", "batch-1 mask"])
def test_cache_attention_matches_its_reference(b, hq, hkv, slots, d, dtype, masked):
    gen = seeded(slots + d)
    q = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, slots, d, generator=gen).to(dtype) for _ in range(2))
    mask = None
    if masked != "none":
        mask = torch.rand(1 if masked == "batch-1 mask" else b, 1, 1, slots, generator=gen) < 0.7
        mask[..., -1] = True                                     # the token itself: every row attends something
    got = decode.cache_attention(q, k, v, mask, path="triton")
    want = decode.cache_attention_reference(q, k, v, mask)
    assert got.shape == (b, hq, 1, d) and got.dtype == dtype
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_chunks_whose_slots_are_all_masked_do_not_spoil_the_rest():
    """A static cache at its first positions: the slots past them are masked, whole chunks of them (no NaN from a
    chunk whose max is -inf)."""
    gen = seeded(0)
    q = torch.randn(1, 4, 1, 32, generator=gen)
    k, v = torch.randn(1, 1, 300, 32, generator=gen), torch.randn(1, 1, 300, 32, generator=gen)
    mask = torch.zeros(1, 1, 1, 300, dtype=torch.bool)
    mask[..., :3] = True
    assert decode.launch_config(decode.ATTENTION_DEFAULT, 300)[0] < 300                 # more than one chunk
    got = decode.cache_attention(q, k, v, mask, path="triton")
    assert torch.isfinite(got).all() and rel(got, decode.cache_attention_reference(q, k, v, mask)) < 1e-5
    assert rel(got, decode.cache_attention_reference(q, k[:, :, :3], v[:, :, :3])) < 1e-5


@pytest.mark.parametrize("q_shape,k_shape,mask,message", [
    ((1, 4, 2, 16), (1, 2, 9, 16), None, "must be \\(B, H, 1, D\\)"),
    ((1, 3, 1, 16), (1, 2, 9, 16), None, "multiple of KV heads"),
    ((1, 4, 1, 16), (1, 2, 9, 8), None, "must be \\(B, H, 1, D\\)"),
    ((1, 4, 1, 40), (1, 2, 9, 40), None, "a power of two"),
    ((1, 4, 1, 16), (1, 2, 9, 16), torch.zeros(1, 1, 1, 9), "must be bool"),
    ((1, 4, 1, 16), (1, 2, 9, 16), torch.ones(1, 4, 1, 9, dtype=torch.bool), "must be bool"),
    ((1, 4, 1, 16), (1, 2, 9, 16), torch.ones(1, 1, 1, 8, dtype=torch.bool), "must be bool"),
    ((1, 4, 1, 16), (1, 2, 0, 16), None, "L >= 1"),
    ((1, 4, 1, 16), (1, 2, 9, 16), torch.ones(1, 1, 1, 9, dtype=torch.bool, device="meta"), "key_mask is on meta"),
])
def test_bad_inputs_are_refused(q_shape, k_shape, mask, message):
    with pytest.raises(MemfitError, match=message):
        decode.cache_attention(torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape), mask)


def test_mixed_dtypes_and_a_gradient_are_refused():
    with pytest.raises(MemfitError, match="one dtype"):
        decode.cache_attention(torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16).half(), torch.randn(1, 2, 9, 16).half())
    with pytest.raises(MemfitError, match="no backward"):
        decode.cache_attention(torch.randn(1, 4, 1, 16, requires_grad=True), torch.randn(1, 2, 9, 16),
                               torch.randn(1, 2, 9, 16))


@pytest.mark.parametrize("slots", [20, 300])
def test_a_row_with_every_key_masked_is_zeros_in_one_chunk_or_many(slots):
    """Not NaN, in the kernel (one chunk: the output store; many: the combine) as in the reference; the other
    sequence of the batch is untouched."""
    gen = seeded(1)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = torch.randn(2, 2, slots, 16, generator=gen), torch.randn(2, 2, slots, 16, generator=gen)
    mask = torch.ones(2, 1, 1, slots, dtype=torch.bool)
    mask[0] = False
    got = decode.cache_attention(q, k, v, mask, path="triton")
    want = decode.cache_attention_reference(q, k, v, mask)
    assert (got[0] == 0).all() and (want[0] == 0).all() and rel(got[1], want[1]) < 1e-5


def test_a_mask_strided_along_the_slots_is_read_right():
    gen = seeded(2)
    q, k, v = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 70, 16, generator=gen), \
        torch.randn(1, 2, 70, 16, generator=gen)
    mask = (torch.rand(1, 1, 1, 140, generator=gen) < 0.6)[..., ::2]
    mask[..., 0] = True
    assert mask.stride(-1) == 2
    got = decode.cache_attention(q, k, v, mask, path="triton")
    assert rel(got, decode.cache_attention_reference(q, k, v, mask)) < 1e-5
