"""BLR Triton ops (interpreter on CPU) against their float64 references, forward and backward.

Odd shapes (blocks 3, block sizes 7 and 11, per-block rank 5, N 1 and 2 x 19), every
variant, both Monarch output layouts, bias on and off, fp32 and bf16, outputs poisoned
with NaN before the run.
"""
import math

import pytest
import torch

from memfit.errors import MemfitError
from memfit.kernels import blast, lowrank, monarch
from memfit.kernels.blast import blast_linear, blast_linear_reference
from memfit.kernels.lowrank import lowrank_linear, lowrank_linear_reference
from memfit.kernels.monarch import monarch_linear, monarch_linear_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
B, M, P, N = 3, 11, 7, 19


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Every torch.empty the ops allocate starts as NaN, so unwritten elements show."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def check(op, reference, tensors, dtype, **options):
    """Forward and backward of ``op`` (Triton path) against the float64 reference; a None bias stays None."""
    inputs = [t if t is None else t.to(dtype).requires_grad_() for t in tensors]
    y = op(*inputs, path="triton", **options)
    options.pop("variant")
    ref_inputs = [t if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref = reference(*ref_inputs, **options)
    assert torch.isfinite(y).all()
    assert rel(y, ref) < TOL[dtype]
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [t for t in inputs if t is not None], grad)
    want = torch.autograd.grad(ref, [t for t in ref_inputs if t is not None], grad.double())
    for g, w in zip(got, want):
        assert rel(g, w) < TOL[dtype]


def drop_bias(tensors, bias):
    return tensors if bias else [*tensors[:-1], None]


DTYPES = [torch.float32, torch.bfloat16]


MONARCH_CASES = [("two_stage", True), ("two_stage", False), ("bmm", False), ("bmm_perm_bmm", False), ("fused", True),
                 ("fused", False), ("torch", True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,permute", MONARCH_CASES)
@pytest.mark.parametrize("lead,bias", [((1,), True), ((2, N), False), ((2, N), True)])
def test_monarch(dtype, variant, permute, lead, bias):
    t = 5
    tensors = [torch.randn(*lead, B * M), torch.randn(B, M, B * t) / M**0.5, torch.randn(B, B * t, P) / t**0.5,
               torch.randn(B * P)]
    check(monarch_linear, monarch_linear_reference, drop_bias(tensors, bias), dtype, permute_output=permute,
                  variant=variant)


def test_monarch_variants_offered():
    """bmm and bmm_perm_bmm only for the block-major layout; the fused kernel at every N where its
    tile fits; the plain PyTorch pipeline always competes."""
    assert set(monarch.variants_for(16, 128, 32, False)) == {"two_stage", "bmm", "bmm_perm_bmm", "fused", "torch"}
    assert set(monarch.variants_for(16, 128, 32, True)) == {"two_stage", "fused", "torch"}
    assert set(monarch.variants_for(8192, 128, 32, False)) == {"two_stage", "bmm", "bmm_perm_bmm", "fused", "torch"}
    assert "fused" not in monarch.variants_for(1, 688, 93, False)


def test_forcing_a_variant_not_offered_is_a_clear_error():
    x, w1, w2 = torch.randn(3, B * M), torch.randn(B, M, B * 5), torch.randn(B, B * 5, P)
    with pytest.raises(MemfitError, match="bmm"):
        monarch_linear(x, w1, w2, permute_output=True, path="triton", variant="bmm")
    u, v, s = torch.randn(B, P, 6), torch.randn(B, M, 6), torch.randn(B, B, 6)
    with pytest.raises(MemfitError, match="nope"):
        blast_linear(x, u, v, s, path="triton", variant="nope")


BLAST_VARIANTS = list(blast.VARIANTS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", BLAST_VARIANTS)
@pytest.mark.parametrize("n,bias", [(1, True), (N, False), (N, True)])
def test_blast(dtype, variant, n, bias):
    r = 19
    tensors = [torch.randn(n, B * M), torch.randn(B, P, r) / r**0.5, torch.randn(B, M, r) / M**0.5,
               torch.randn(B, B, r) / B**0.5, torch.randn(B * P)]
    check(blast_linear, blast_linear_reference, drop_bias(tensors, bias), dtype, variant=variant)


@pytest.mark.parametrize("variant", ["mix_bgemm", "mix_bmm"])
def test_blast_mix_loops_over_wide_blocks(monkeypatch, variant):
    """Input blocks wider than one K tile take the mixing kernel's inner loop over m (3 steps here)."""
    monkeypatch.setattr(blast, "MIX_ONE_TILE_M", 16)
    monkeypatch.setattr(blast, "MIX_LOOP_BM", 16)
    m, r = 37, 9
    tensors = [torch.randn(N, 2 * m), torch.randn(2, P, r) / r**0.5, torch.randn(2, m, r) / m**0.5,
               torch.randn(2, 2, r), torch.randn(2 * P)]
    check(blast_linear, blast_linear_reference, tensors, torch.float32, variant=variant)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(lowrank.VARIANTS))
@pytest.mark.parametrize("n,bias", [(1, True), (N, False)])
def test_lowrank(dtype, variant, n, bias):
    tensors = [torch.randn(n, 33), torch.randn(17, 20) / 20**0.5, torch.randn(33, 20) / 33**0.5, torch.randn(17)]
    check(lowrank_linear, lowrank_linear_reference, drop_bias(tensors, bias), dtype, variant=variant)


def test_fake_tensor_shapes():
    """register_fake: the ops trace under FakeTensorMode with the right output shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 6, 12)
        y = monarch_linear(x, torch.empty(3, 4, 6), torch.empty(3, 6, 5), path="triton")
        z = blast_linear(x, torch.empty(3, 5, 7), torch.empty(3, 4, 7), torch.empty(3, 3, 7), path="triton")
        w = lowrank_linear(x, torch.empty(9, 7), torch.empty(12, 7), path="triton")
    assert y.shape == z.shape == (4, 6, 15) and w.shape == (4, 6, 9)


def test_pick_variant_inside_graph_capture_uses_the_cached_winner(monkeypatch):
    """A shape timed before capture keeps its winner inside the capture (the bug: the default ran instead);
    a shape never timed gets the default, and a warning says so."""
    from memfit.kernels import blr_common

    def slow():
        return None

    def fast():
        return None

    candidates = {"slow": slow, "fast": fast}
    monkeypatch.setattr(blr_common, "_CACHE", {})
    monkeypatch.setattr(blr_common, "_save_cache", lambda cache: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(blr_common, "_time_candidate", lambda op, name, fn, args: {"slow": 2.0, "fast": 1.0}[name])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert blr_common.pick_variant("op", (8,), candidates, "slow", ()) == "fast"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert blr_common.pick_variant("op", (8,), candidates, "slow", ()) == "fast"
    warned = []
    monkeypatch.setattr(blr_common, "warn_once", lambda key, message: warned.append(message))
    assert blr_common.pick_variant("op", (16,), candidates, "slow", ()) == "slow"
    assert warned and "capture" in warned[0]


def test_fp32_blr_dots_follow_torch_matmul_precision(monkeypatch, caplog):
    """fp32 BLR kernels run IEEE dots by default and TF32 only when torch allows it, said once."""
    from memfit import log

    monkeypatch.setattr(log, "_said", set())
    x, w1, w2 = torch.randn(N, B * M), torch.randn(B, M, 6), torch.randn(B, 6, P)
    monarch_linear(x, w1, w2, path="triton", variant="two_stage")
    assert "TF32" not in caplog.text
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        monarch_linear(x, w1, w2, path="triton", variant="two_stage")
    finally:
        torch.set_float32_matmul_precision(previous)
    assert "block-low-rank kernels: fp32 inputs use TF32" in caplog.text


@pytest.mark.parametrize("blocks,rank,n,widest", [(16, 512, 8192, 128 * 16 * 16), (3, 19, 1, 16 * 32 * 16),
                                                   (32, 512, 8192, 16 * 32 * 32), (64, 512, 8192, 16 * 16 * 64)])
def test_zmix_tiles_fit_the_registers(blocks, rank, n, widest):
    """The mixing kernel's tiles hold a (BK, BN, BB) fp32 result: at most 128 registers a thread for b up
    to 64, and no wider in ranks or tokens than the shape needs."""
    import triton

    from memfit.kernels.blr_common import pow2_at_least

    configs = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in blast.ZMIX_CONFIGS]
    kept = blast._prune_zmix(configs, {"R": rank, "N": n}, BB=pow2_at_least(blocks))
    assert kept
    for c in kept:
        assert c.kwargs["BK"] * c.kwargs["BN"] * pow2_at_least(blocks) <= 128 * 32 * c.num_warps
        assert c.kwargs["BK"] <= pow2_at_least(rank) and c.kwargs["BN"] <= pow2_at_least(n)
    assert max(c.kwargs["BK"] * c.kwargs["BN"] * pow2_at_least(blocks) for c in kept) == widest
