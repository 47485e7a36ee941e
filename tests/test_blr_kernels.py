"""BLR Triton ops (interpreter on CPU) against their float64 references, forward and backward.

Odd shapes (blocks 3, block sizes 7 and 11, per-block rank 5, N 19), every variant,
fp32 and bf16, outputs poisoned with NaN before the run.
"""
import math

import pytest
import torch

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
    inputs = [t.to(dtype).requires_grad_() for t in tensors]
    y = op(*inputs, path="triton", **options)
    options.pop("variant")
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference(*ref_inputs, **options)
    assert torch.isfinite(y).all()
    assert rel(y, ref) < TOL[dtype]
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, inputs, grad)
    want = torch.autograd.grad(ref, ref_inputs, grad.double())
    for g, w in zip(got, want):
        assert rel(g, w) < TOL[dtype]


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,permute", [("fused", True), ("fused", False), ("two_stage", True)])
def test_monarch(dtype, variant, permute):
    t = 5
    tensors = [torch.randn(2, N, B * M), torch.randn(B, M, B * t) / M**0.5, torch.randn(B, B * t, P) / t**0.5,
               torch.randn(B * P)]
    check(monarch_linear, monarch_linear_reference, tensors, dtype, permute_output=permute, variant=variant)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["fused", "full"])
def test_blast(dtype, variant):
    r = 19
    tensors = [torch.randn(N, B * M), torch.randn(B, P, r) / r**0.5, torch.randn(B, M, r) / M**0.5,
               torch.randn(B, B, r) / B**0.5, torch.randn(B * P)]
    check(blast_linear, blast_linear_reference, tensors, dtype, variant=variant)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lowrank_fused(dtype):
    tensors = [torch.randn(5, 33), torch.randn(17, 20) / 20**0.5, torch.randn(33, 20) / 33**0.5]
    check(lowrank_linear, lowrank_linear_reference, tensors, dtype, variant="fused")


def test_fake_tensor_shapes():
    """register_fake: the ops trace under FakeTensorMode with the right output shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 6, 12)
        y = monarch_linear(x, torch.empty(3, 4, 6), torch.empty(3, 6, 5), path="triton")
        z = blast_linear(x, torch.empty(3, 5, 7), torch.empty(3, 4, 7), torch.empty(3, 3, 7), path="triton")
        w = lowrank_linear(x, torch.empty(9, 7), torch.empty(12, 7), path="triton")
    assert y.shape == z.shape == (4, 6, 15) and w.shape == (4, 6, 9)
