"""Decode attention (one query token against a KV cache, split over the keys) against its reference: random
shapes including awkward ones (a head dim of 40, 37 keys, groups of 3 and 6 query heads), fp32 and bf16, with and
without a key mask, splits whose keys are all masked; bad inputs are refused. The Triton kernels run under the
interpreter."""
import pytest
import torch

from memfit.errors import MemfitError
from memfit.kernels import decode_attention as da


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


CASES = [(1, 4, 1, 200, 64), (2, 6, 2, 37, 40), (1, 8, 8, 130, 16), (2, 12, 2, 1, 64), (1, 6, 1, 300, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,keys,d", CASES)
@pytest.mark.parametrize("masked", ["none", "mask", "batch-1 mask"])
def test_decode_attention_matches_its_reference(b, hq, hkv, keys, d, dtype, masked):
    gen = torch.Generator().manual_seed(keys + d)
    q = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, keys, d, generator=gen).to(dtype) for _ in range(2))
    mask = None
    if masked != "none":
        mask = torch.rand(1 if masked == "batch-1 mask" else b, 1, 1, keys, generator=gen) < 0.7
        mask[..., -1] = True                                     # the token itself: every row attends something
    got = da.decode_attention(q, k, v, mask, path="triton")
    want = da.decode_attention_reference(q, k, v, mask)
    assert got.shape == (b, hq, 1, d) and got.dtype == dtype
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_splits_whose_keys_are_all_masked_do_not_spoil_the_rest():
    """A static cache at its first positions: the keys past them are masked, whole splits of them (no NaN from a
    split whose max is -inf)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 32, generator=gen), torch.randn(1, 1, 300, 32, generator=gen), \
        torch.randn(1, 1, 300, 32, generator=gen)
    mask = torch.zeros(1, 1, 1, 300, dtype=torch.bool)
    mask[..., :3] = True
    assert da._splits(1, 300, q.device)[0] > 1
    got = da.decode_attention(q, k, v, mask, path="triton")
    assert torch.isfinite(got).all() and rel(got, da.decode_attention_reference(q, k, v, mask)) < 1e-5
    assert rel(got, da.decode_attention_reference(q, k[:, :, :3], v[:, :, :3])) < 1e-5


def test_the_keys_are_split_to_fill_the_gpu():
    """About PROGRAMS_PER_SM programs per SM (4 SMs under the interpreter), in splits of whole key blocks that
    cover every key, one split where the batch and heads fill the SMs alone."""
    device = torch.device("cpu")
    for batch_heads, keys in [(1, 1088), (8, 1088), (64, 1088), (1, 1), (2, 130)]:
        splits, chunk = da._splits(batch_heads, keys, device)
        assert chunk % da.BLOCK_KEYS == 0 and (splits - 1) * chunk < keys <= splits * chunk
        assert batch_heads * splits <= max(batch_heads, da.PROGRAMS_PER_SM * 4)
    assert da._splits(64, 1088, device)[0] == 1 and da._splits(1, 1088, device) == (6, 192)   # 17 blocks, 3 a split


@pytest.mark.parametrize("q_shape,k_shape,mask,message", [
    ((1, 4, 2, 16), (1, 2, 9, 16), None, "q \\(B, Hq, 1, D\\)"),
    ((1, 3, 1, 16), (1, 2, 9, 16), None, "multiple of Hkv"),
    ((1, 4, 1, 16), (1, 2, 9, 8), None, "q \\(B, Hq, 1, D\\)"),
    ((1, 4, 1, 16), (1, 2, 9, 16), torch.zeros(1, 1, 1, 9), "must be bool"),
    ((1, 4, 1, 16), (1, 2, 9, 16), torch.ones(1, 4, 1, 9, dtype=torch.bool), "must be bool of shape"),
    ((1, 4, 1, 16), (1, 2, 9, 16), torch.ones(1, 1, 1, 8, dtype=torch.bool), "must be bool of shape"),
    ((1, 4, 1, 512), (1, 2, 9, 512), None, "head dim 512"),
])
def test_bad_inputs_are_refused(q_shape, k_shape, mask, message):
    with pytest.raises(MemfitError, match=message):
        da.decode_attention(torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape), mask)
