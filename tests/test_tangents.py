"""Forward-mode AD (torch.autograd.forward_ad) through the BLR ops, on their Triton path (the interpreter on the CPU)
and their reference: the output's tangent against torch.func.jvp of the float64 reference, with the tangent on x,
on each factor and on the bias, one at a time and all at once, with and without gradient recording, and through
torch.func.jvp. The fused SwiGLU refuses dual inputs.
"""
import pytest
import torch
import torch.autograd.forward_ad as fwad
from conftest import rel

from memfit.errors import MemfitError
from memfit.kernels.blast import blast_linear, blast_linear_reference
from memfit.kernels.lowrank import lowrank_linear, lowrank_linear_reference
from memfit.kernels.monarch import monarch_linear, monarch_linear_reference
from memfit.kernels.swiglu import swiglu

B, M, P, T, N = 3, 11, 7, 5, 19     # blocks, block in and out sizes, per-block rank, tokens


def monarch_case(permute_output):
    tensors = (torch.randn(2, N, B * M), torch.randn(B, M, B * T) / M**0.5, torch.randn(B, B * T, P) / T**0.5,
               torch.randn(B * P))
    return monarch_linear, monarch_linear_reference, tensors, {"permute_output": permute_output}


def blast_case():
    r = B * T
    tensors = (torch.randn(2, N, B * M), torch.randn(B, P, r) / r**0.5, torch.randn(B, M, r) / M**0.5,
               torch.randn(B, B, r), torch.randn(B * P))
    return blast_linear, blast_linear_reference, tensors, {}


def lowrank_case():
    tensors = (torch.randn(2, N, B * M), torch.randn(B * P, T) / T**0.5, torch.randn(B * M, T) / M**0.5,
               torch.randn(B * P))
    return lowrank_linear, lowrank_linear_reference, tensors, {}


CASES = {"monarch": lambda: monarch_case(False), "monarch_permuted": lambda: monarch_case(True),
         "blast": blast_case, "lowrank": lowrank_case}


def tangent_through(op, tensors, tangents, options, grad):
    """The tangent of ``op``'s output where tensor k carries ``tangents[k]`` (None: no tangent)."""
    with torch.set_grad_enabled(grad), fwad.dual_level():
        duals = [t if d is None else fwad.make_dual(t, d) for t, d in zip(tensors, tangents)]
        if grad:
            duals = [t.requires_grad_() if t.is_leaf else t for t in duals]
        out = op(*duals, **options)
        return fwad.unpack_dual(out).tangent


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_tangent_matches_the_references_jvp(name, grad, path):
    op, reference, tensors, options = CASES[name]()
    tangents = [torch.randn_like(t) for t in tensors]
    for carried in [[k] for k in range(len(tensors))] + [list(range(len(tensors)))]:
        chosen = [d if k in carried else torch.zeros_like(d) for k, d in enumerate(tangents)]
        _, want = torch.func.jvp(lambda *ts: reference(*ts, **options), tuple(t.double() for t in tensors),
                                 tuple(d.double() for d in chosen))
        got = tangent_through(op, tensors, [d if k in carried else None for k, d in enumerate(tangents)],
                              {**options, "path": path}, grad)
        assert got is not None, f"{name}: the tangent on input(s) {carried} was dropped"
        assert rel(got, want) < 1e-5, f"{name}: the tangent on input(s) {carried}"


def test_torch_func_jvp_through_the_triton_path():
    op, reference, tensors, options = CASES["blast"]()
    tangent = torch.randn_like(tensors[0])
    _, want = torch.func.jvp(lambda x: reference(x, *(t.double() for t in tensors[1:]), **options),
                             (tensors[0].double(),), (tangent.double(),))
    _, got = torch.func.jvp(lambda x: op(x, *tensors[1:], **options, path="triton"), (tensors[0],), (tangent,))
    assert rel(got, want) < 1e-5


def test_gradients_still_flow_through_a_dual_output():
    op, reference, tensors, options = CASES["monarch"]()
    leaves = [t.clone().requires_grad_() for t in tensors]
    with fwad.dual_level():
        out = op(fwad.make_dual(leaves[0], torch.randn_like(leaves[0])), *leaves[1:], **options, path="triton")
        fwad.unpack_dual(out).primal.sum().backward()
    want_leaves = [t.double().requires_grad_() for t in tensors]
    reference(*want_leaves, **options).sum().backward()
    for got, want in zip(leaves, want_leaves):
        assert rel(got.grad, want.grad) < 1e-5


def test_swiglu_refuses_a_dual_input():
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    with fwad.dual_level():
        with pytest.raises(MemfitError, match="forward-mode AD"):
            swiglu(fwad.make_dual(gate, torch.randn_like(gate)), up)
        assert torch.equal(swiglu(gate.clone(), up.clone()), swiglu(gate.clone(), up.clone()))   # no tangent: runs
