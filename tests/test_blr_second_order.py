"""Second derivatives through the BLR ops (a gradient penalty, a Hessian-vector product: ``create_graph=True``), on
their Triton path (the interpreter on the CPU) and their reference, against the float64 reference differentiated by
torch: the backward recomputes through the reference, and through 2d431bc it detached that recompute, so the second
derivative came back wrong on the Triton path and None on the reference path, without a word.
"""
import pytest
import torch
from blr_cases import CASES, on_path
from conftest import rel


def penalty_grads(run, tensors, trained):
    """The gradients, for x and the ``trained`` factors, of ``|d/dx sum(out^2)|^2 + sum(out^2)``."""
    leaves = [t.clone().requires_grad_(k == 0 or k in trained) for k, t in enumerate(tensors)]
    loss = run(*leaves).pow(2).sum()
    grad_x, = torch.autograd.grad(loss, leaves[0], create_graph=True)
    (grad_x.pow(2).sum() + loss).backward()
    return [leaves[k].grad for k in [0, *trained]]


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("name", CASES)
def test_a_gradient_penalty(name, frozen, path):
    """Every factor trained, or all frozen (x alone wants a gradient: the backward then differentiates at x = 0)."""
    op, reference, tensors, options = CASES[name]()
    trained = [] if frozen else list(range(1, len(tensors)))
    got = penalty_grads(lambda *ts: op(*ts, **options, **on_path(path, name)), tensors, trained)
    want = penalty_grads(lambda *ts: reference(*ts, **options), [t.double() for t in tensors], trained)
    for k, (g, w) in zip([0, *trained], zip(got, want)):
        assert g is not None and rel(g, w) < 1e-5, f"{name}: input {k}"
