"""How the BLR ops are dispatched: under torch.compile (a graph break in a BLR layer's forward splits a compiled
model at every layer, and past dynamo's recompile limit runs the layers eagerly), and eagerly, where a call with
nothing to record skips the custom op. Kept apart from test_blr_kernels, whose autouse fixture replaces torch.empty:
dynamo tracing while it is replaced changed what later tests in the same process computed, and so did a default-device
context, whose cached set of factory functions then held the replacement (a later ``torch.device("meta")`` left
torch.empty's tensors on the CPU)."""
import pytest
import torch
from conftest import PassingDispatchMode

from memfit.kernels import blast, lowrank, monarch
from memfit.kernels.blast import blast_linear
from memfit.kernels.lowrank import lowrank_linear
from memfit.kernels.monarch import monarch_linear


def _blr_calls():
    x = torch.randn(5, 12)
    return {"monarch": lambda: monarch_linear(x, torch.randn(3, 4, 6), torch.randn(3, 6, 5), path="triton"),
            "blast": lambda: blast_linear(x, torch.randn(3, 5, 7), torch.randn(3, 4, 7), torch.randn(3, 3, 7),
                                          path="triton"),
            "lowrank": lambda: lowrank_linear(x, torch.randn(9, 7), torch.randn(12, 7), path="triton")}


@pytest.mark.parametrize("op", ["monarch", "blast", "lowrank"])
def test_the_auto_path_leaves_the_offer_to_the_op(op, monkeypatch):
    """variant="auto" leaves working out the offer (variants_for) to the op: the wrapper, which torch.compile traces,
    worked it out at every call (Monarch's from 8930a91, BLAST's and low-rank's from 4893418 to cd59de1), asking
    the device its capability. A named variant is still checked against the offer."""
    module = {"monarch": monarch, "blast": blast, "lowrank": lowrank}[op]

    def no_offer(*args):
        raise AssertionError("the wrapper worked out the offer")

    monkeypatch.setattr(module, "variants_for", no_offer)
    for name in (f"_{op}_op", f"_{op}_forward"):         # the custom op, or its function called directly
        monkeypatch.setattr(module, name, lambda x, *rest: x)
    _blr_calls()[op]()
    with pytest.raises(AssertionError, match="worked out the offer"):
        module.require_offered(op, "two_stage", no_offer, "here")


def _op_call(structure: str, requires_grad: bool = False):
    """A small call of each BLR op's wrapper (b = 2, 3 tokens) and the module attribute holding its custom op."""
    factors = {"monarch": [(2, 4, 6), (2, 6, 5)], "blast": [(2, 5, 6), (2, 4, 6), (2, 2, 6)], "lowrank": [(10, 6), (8, 6)]}
    weights = [torch.randn(shape, requires_grad=requires_grad) for shape in factors[structure]]
    wrapper = {"monarch": monarch_linear, "blast": blast_linear, "lowrank": lowrank_linear}[structure]
    return (lambda x: wrapper(x, *weights, path="triton")), f"_{structure}_op"


class _PassingFunctionMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")   # torch.jit.trace's
@pytest.mark.parametrize("structure", ["monarch", "blast", "lowrank"])
def test_an_eager_call_with_nothing_to_record_skips_the_custom_op(structure, monkeypatch):
    """Without a gradient to record, a trace, a mode or the profiler, the wrapper calls the op's function itself (the
    custom op's call cost a layer call 30-90 us of host time on the H200's host at a93ab16), with the same output;
    each of those goes through the op: a fake-tensor mode too (where running the function would launch on fake
    tensors), a jit trace and vmap."""
    module = {"monarch": monarch, "blast": blast, "lowrank": lowrank}[structure]
    call, attribute = _op_call(structure)
    x = torch.randn(3, 8)
    dispatched, op = [], getattr(module, attribute)
    monkeypatch.setattr(module, attribute, lambda *args: dispatched.append(1) or op(*args))
    with torch.no_grad():
        y = call(x)
        with torch.device("meta"):                  # a default device: still direct, its tensors where the inputs are
            assert torch.equal(call(x), y)
        assert not dispatched
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            assert torch.equal(call(x), y) and len(dispatched) == 1
        with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) as mode:
            assert call(mode.from_tensor(x)).shape == y.shape and len(dispatched) == 2
        for mode in (_PassingFunctionMode(), PassingDispatchMode()):
            with mode:
                call(x)
        assert len(dispatched) == 4
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            call(x)
        assert len(dispatched) == 5
        torch.jit.trace(call, x, check_trace=False)  # the trace records the op (it cannot see the launches)
        assert len(dispatched) == 6
        assert torch.equal(torch.vmap(call)(x[None])[0], y) and len(dispatched) == 7     # batched tensors: the op
    call(x)                                                                         # nothing needs a gradient
    assert len(dispatched) == 7
    call(x.clone().requires_grad_()).sum().backward()
    grad_call, _ = _op_call(structure, requires_grad=True)
    grad_call(x).sum().backward()
    assert len(dispatched) == 9


@pytest.mark.parametrize("op", ["monarch", "blast", "lowrank"])
def test_the_ops_compile_into_one_graph(op):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_blr_calls()[op])()
    assert explained.graph_break_count == 0, explained.break_reasons


def _graph_breaks(method):
    from memfit.compress import structure_model
    from memfit.models import PRESETS, build_model

    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], dtype="float32", device="cpu").eval()
    if method != "dense":
        structure_model(model, method, ratio=0.5, blocks=4)
    torch._dynamo.reset()
    with torch.no_grad():
        return torch._dynamo.explain(model)(torch.randint(0, 100, (1, 8)), logits_to_keep=1).graph_break_count


@pytest.mark.cpu_only(reason="builds its tiny model on the CPU, where inputs on the default CUDA device miss it")
@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("method", ["monarch", "blast", "lowrank"])
def test_a_compressed_model_compiles_with_no_more_graph_breaks_than_the_dense_one(method, path, monkeypatch):
    """A graph break in a BLR layer's forward splits a compiled model at every layer; this tiny model never breaks
    dense. On the Triton path it broke 13 times compressed at fd16a94, at math.prod over a generator in bind_shapes
    (from 084c10d), and the end-to-end benchmark's compiled BLR models ran at 0.02-0.23x dense. On the reference
    path (CPU) it still broke 13 times at cd59de1, at the recomputing autograd function (from b85a879), which
    no_grad inference now skips; the low-rank model crashed inside dynamo."""
    monkeypatch.setenv("MEMFIT_KERNELS", path)
    assert _graph_breaks(method) <= _graph_breaks("dense")


def _training_step(model, ids):
    """Loss and parameter gradients of one training step of ``model`` on ``ids``."""
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.cpu_only(reason="builds its tiny model on the CPU, where inputs on the default CUDA device miss it")
@pytest.mark.parametrize("method,path", [("monarch", "triton"), ("blast", "triton"), ("lowrank", "triton"),
                                         ("monarch", "reference")])
def test_a_compressed_model_trains_under_compile_in_one_graph_with_the_eager_gradients(method, path, monkeypatch,
                                                                                         caplog):
    """A training step (forward, loss, backward) of a compressed tiny Llama compiles with no graph break and gives
    eager's loss and gradients: through each Triton op (their autograd: recompute.recompute_backward), and on the
    CPU reference path, whose recomputing autograd function (one for all three structures) broke the graph in
    training (its backward's autograd.grad) and which torch.compile now differentiates as it is, said once."""
    from torch._dynamo.utils import counters

    from memfit import log
    from memfit.compress import structure_model
    from memfit.models import PRESETS, build_model

    monkeypatch.setenv("MEMFIT_KERNELS", path)
    log._said.discard("blr:compiled-reference")
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], dtype="float32", device="cpu")
    structure_model(model, method, ratio=0.5, blocks=4)
    ids = torch.randint(0, 100, (2, 8))
    eager_loss, eager_grads = _training_step(model, ids)
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    counters.clear()
    loss, grads = _training_step(torch.compile(model, backend="aot_eager"), ids)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert torch.allclose(loss, eager_loss, rtol=1e-6) and len(grads) == len(eager_grads) > 0
    assert all(torch.allclose(g, e, rtol=1e-5, atol=1e-7) for g, e in zip(grads, eager_grads))
    assert ("differentiated as it is" in caplog.text) == (path == "reference")


def test_the_constant_mark_is_torchs_own():
    """dispatch.constant_when_compiled sets the mark torch.compiler.assume_constant_result sets (without importing
    dynamo at memfit's import), and importing memfit's decode kernels does not import dynamo."""
    import subprocess
    import sys

    from memfit.kernels.dispatch import constant_when_compiled

    def ours():
        return True

    def torchs():
        return True

    constant_when_compiled(ours)
    torch.compiler.assume_constant_result(torchs)
    marks = lambda fn: {k: v for k, v in vars(fn).items()}  # noqa: E731
    assert marks(ours) == marks(torchs) and marks(ours)
    probe = "import sys, memfit.kernels.gemv, memfit.kernels.monarch; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
