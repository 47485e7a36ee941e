"""Forward-mode AD (torch.autograd.forward_ad) through the BLR ops, on their Triton path (the interpreter on the CPU)
and their reference: the output's tangent against torch.func.jvp of the float64 reference, with the tangent on x,
on each factor and on the bias, one at a time and all at once, with and without gradient recording (and the
tangent's own gradient), in a dtype other than its primal's, through torch.func.jvp, nested jvps, a vmap inside a
jvp and torch.compile. The fused SwiGLU refuses dual inputs.
"""
import logging

import pytest
import torch
import torch.autograd.forward_ad as fwad
from blr_cases import CASES, on_path
from conftest import rel

import memfit.log
from memfit.errors import MemfitError
from memfit.kernels.swiglu import swiglu, swiglu_reference


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
                              {**options, **on_path(path, name)}, grad)
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


@pytest.mark.parametrize("name", CASES)
def test_the_tangent_is_differentiable(name):
    """Reverse over forward: the gradient, with respect to the factors, of a loss on the tangent along x (which the
    bias does not enter)."""
    op, reference, tensors, options = CASES[name]()
    tangent = torch.randn_like(tensors[0])

    def factor_grads(run, tensors):
        factors = [t.clone().requires_grad_() for t in tensors[1:-1]]
        with fwad.dual_level():
            dual = fwad.make_dual(tensors[0], tangent.to(tensors[0].dtype))
            fwad.unpack_dual(run(dual, *factors, tensors[-1])).tangent.pow(2).sum().backward()
        return [f.grad for f in factors]

    got = factor_grads(lambda *ts: op(*ts, **options, **on_path("triton", name)), tensors)
    want = factor_grads(lambda *ts: reference(*ts, **options), [t.double() for t in tensors])
    for k, (g, w) in enumerate(zip(got, want)):
        assert g is not None and rel(g, w) < 1e-5, f"{name}: factor {k + 1}"


@pytest.mark.parametrize("name", CASES)
def test_a_tangent_is_read_in_its_primals_dtype(name):
    """A bfloat16 tangent on float32 tensors: the derivative is computed in float32, as the reference's is."""
    op, reference, tensors, options = CASES[name]()
    tangents = [torch.randn_like(t, dtype=torch.bfloat16) for t in tensors]
    _, want = torch.func.jvp(lambda *ts: reference(*ts, **options), tuple(t.double() for t in tensors),
                             tuple(d.double() for d in tangents))
    got = tangent_through(op, tensors, tangents, {**options, **on_path("triton", name)}, grad=False)
    assert got.dtype == torch.float32 and rel(got, want) < 1e-5


@pytest.fixture
def said(monkeypatch, caplog):
    """The messages memfit says in the test (the say-once memory cleared first)."""
    monkeypatch.setattr(memfit.log, "_said", set())
    caplog.set_level(logging.WARNING, logger="memfit")
    return lambda: [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("name", ["monarch_permuted", "blast", "lowrank"])
def test_nested_jvps_take_the_reference_path_and_say_so(name, said):
    """jvp over x inside a jvp over the first factor: the mixed second derivative op(t_x, t_w1, ...), which one
    level of unpacked tangents read as zero."""
    op, reference, tensors, options = CASES[name]()
    x, w, rest = tensors[0], tensors[1], tensors[2:]
    tx, tw = torch.randn_like(x), torch.randn_like(w)

    def mixed(run, x, w, rest):
        return torch.func.jvp(lambda w: torch.func.jvp(lambda x: run(x, w, *rest), (x,), (tx.to(x.dtype),))[1],
                              (w,), (tw.to(w.dtype),))[1]

    got = mixed(lambda *ts: op(*ts, **options, **on_path("triton", name)), x, w, rest)
    want = mixed(lambda *ts: reference(*ts, **options), x.double(), w.double(), [t.double() for t in rest])
    assert rel(got, want) < 1e-5
    assert any("nested in another jvp" in m for m in said())


@pytest.mark.parametrize("name", ["monarch", "blast", "lowrank"])
def test_a_vmap_inside_a_jvp(name, said):
    op, reference, tensors, options = CASES[name]()
    x, factors = tensors[0], tensors[1:]
    tangent = torch.randn_like(x)

    def jvp_of_vmap(run, x, factors):
        return torch.func.jvp(lambda x: torch.func.vmap(lambda row: run(row, *factors))(x), (x,),
                              (tangent.to(x.dtype),))[1]

    got = jvp_of_vmap(lambda *ts: op(*ts, **options, **on_path("triton", name)), x, factors)
    want = jvp_of_vmap(lambda *ts: reference(*ts, **options), x.double(), [t.double() for t in factors])
    assert rel(got, want) < 1e-5
    assert any("around a vmap" in m for m in said())


@pytest.mark.parametrize("name", ["monarch", "blast", "lowrank"])
def test_transforms_over_trained_factors(name):
    """Factors that require a gradient (every nn.Parameter): a vmap inside a dual level, torch.func.grad on the
    reference path and a Hessian in x on the Triton path (a jvp over a grad: the tangents take the reference) match the
    float64 reference; the reference's recomputing autograd function, which has no vmap or jvp rule, raised in each."""
    op, reference, tensors, options = CASES[name]()
    x, factors = tensors[0], [t.clone().requires_grad_() for t in tensors[1:]]
    plain = [t.detach().double() for t in factors]
    tangent = torch.randn_like(x)
    with fwad.dual_level():
        got = torch.func.vmap(lambda row: op(row, *factors, **options, path="triton"))(fwad.make_dual(x, tangent))
        got = fwad.unpack_dual(got).tangent
    assert rel(got, reference(tangent.double(), *plain[:-1], **options)) < 1e-5
    loss = lambda run: lambda w: run(x, w, *factors[1:]).pow(2).sum()                           # noqa: E731
    got = torch.func.grad(loss(lambda *ts: op(*ts, **options, path="reference")))(factors[0].detach())
    want = torch.func.grad(lambda w: reference(x.double(), w, *plain[1:], **options).pow(2).sum())(plain[0])
    assert rel(got, want) < 1e-5
    row = x[0, :1]
    got = torch.func.hessian(lambda r: op(r, *factors, **options, **on_path("triton", name)).pow(2).sum())(row)
    want = torch.func.hessian(lambda r: reference(r, *plain, **options).pow(2).sum())(row.double())
    assert rel(got, want) < 1e-5


def test_tangents_under_torch_compile():
    """The compiled op, first called outside a dual level (a graph without the dual-level branch), then on a dual
    input: the tangent is there, and right."""
    torch._dynamo.reset()
    op, reference, tensors, options = CASES["monarch"]()
    compiled = torch.compile(lambda *ts: op(*ts, **options, path="triton"), backend="aot_eager")
    compiled(*tensors)
    tangent = torch.randn_like(tensors[0])
    with fwad.dual_level():
        got = fwad.unpack_dual(compiled(fwad.make_dual(tensors[0], tangent), *tensors[1:])).tangent
    _, want = torch.func.jvp(lambda x: reference(x, *(t.double() for t in tensors[1:]), **options),
                             (tensors[0].double(),), (tangent.double(),))
    assert got is not None and rel(got, want) < 1e-5


def test_swiglu_refuses_a_dual_input():
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    with fwad.dual_level():
        with pytest.raises(MemfitError, match="forward-mode AD"):
            swiglu(fwad.make_dual(gate, torch.randn_like(gate)), up)
        with pytest.raises(MemfitError, match="forward-mode AD"):
            torch.compile(lambda g, u: swiglu(g * 1, u), backend="aot_eager")(
                fwad.make_dual(gate, torch.randn_like(gate)), up)
        assert rel(swiglu(gate.clone(), up.clone()), swiglu_reference(gate.double(), up.double())) < 1e-6
    with pytest.raises(MemfitError, match="forward-mode AD"):
        torch.func.jvp(lambda g: torch.func.jvp(lambda u: swiglu(g * 1, u * 1), (up,), (up,))[1], (gate,), (gate,))
