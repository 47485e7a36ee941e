"""memfit's 4-bit linear: products with a frozen NF4 weight, dequantized a chunk of rows at a time.

bitsandbytes quantizes and dequantizes on the CPU too, so the chunked product is checked here against
its own full dequantization of the same weight, forward and backward, fp32 and bf16."""
import pytest
import torch

from memfit.errors import MemfitError
from memfit.train import four_bit

F = pytest.importorskip("bitsandbytes.functional")


def quantized(out_features, in_features, dtype):
    """An NF4 weight as the 4-bit base stores it (blocksize 64, double-quantized scales) and its dense values."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed, state = F.quantize_4bit(weight, blocksize=four_bit.BLOCKSIZE, compress_statistics=True, quant_type="nf4")
    return packed, state, F.dequantize_4bit(packed, state)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("in_features,out_features", [(96, 37), (128, 64), (40, 9)])
def test_chunked_product_matches_the_whole_dequantized_weight(monkeypatch, dtype, tol, in_features, out_features):
    """Several chunks of rows and a short last one (in = 96 and 40: a block spans rows, so chunks step by 2
    and 8 rows), lead dimensions, a bias: y, dL/dx and dL/dbias as with the weight dequantized at once."""
    monkeypatch.setattr(four_bit, "DEQUANT_CHUNK_BYTES", 8 * in_features * torch.tensor([], dtype=dtype).element_size())
    packed, state, dense = quantized(out_features, in_features, dtype)
    x = torch.randn(2, 5, in_features, dtype=dtype, requires_grad=True)
    bias = torch.randn(out_features, dtype=dtype, requires_grad=True)
    y = four_bit.matmul_4bit_in_chunks(x, packed, state, bias)
    xr, br = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    ref = xr @ dense.double().t() + br
    grad = torch.randn_like(y)
    got, want = torch.autograd.grad(y, (x, bias), grad), torch.autograd.grad(ref, (xr, br), grad.double())
    for a, b in ((y, ref), *zip(got, want)):
        assert ((a.double() - b).norm() / b.norm()).item() < tol


def test_each_product_holds_one_chunk_of_rows(monkeypatch):
    """Forward and backward each dequantize the rows in order, in chunks of at most DEQUANT_CHUNK_BYTES."""
    in_features, out_features = 64, 50
    monkeypatch.setattr(four_bit, "DEQUANT_CHUNK_BYTES", 16 * in_features * 4)
    packed, state, _ = quantized(out_features, in_features, torch.float32)
    chunks = []
    real = four_bit._dequantize_rows
    monkeypatch.setattr(four_bit, "_dequantize_rows", lambda *a: chunks.append(a[4:6]) or real(*a))
    x = torch.randn(3, in_features, requires_grad=True)
    four_bit.matmul_4bit_in_chunks(x, packed, state).sum().backward()
    expected = [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert chunks == expected * 2


def test_dequant_rows_are_whole_blocks_within_the_budget(monkeypatch):
    monkeypatch.setattr(four_bit, "DEQUANT_CHUNK_BYTES", 2**20)
    assert four_bit.dequant_rows(3072, 8192, 4) == 85                       # 1 MiB of fp32 rows of 3072
    assert four_bit.dequant_rows(96, 10**6, 2) % 2 == 0                      # 96 * rows a multiple of 64
    assert four_bit.dequant_rows(40, 10**6, 2) % 8 == 0
    assert four_bit.dequant_rows(2**20, 10, 4) == 1                          # one row past the budget: one row
    assert four_bit.dequant_rows(3072, 20, 4) == 20                          # never past the weight
    assert four_bit.dequant_workspace_bytes(3072, 20, 4) == 20 * 3072 * 4 + 4 * 20 * 3072 // 64


def test_mismatched_features_are_a_clear_error():
    packed, state, _ = quantized(8, 64, torch.float32)
    with pytest.raises(MemfitError, match="takes 64"):
        four_bit.matmul_4bit_in_chunks(torch.randn(2, 32), packed, state)
