"""memfit.kernels.swiglu: the fused gated-MLP product against its float64 definition, forward and backward, on both
paths (Triton under the interpreter, and the PyTorch reference), and what it keeps: gate and up only, with their
gradients written over them."""
import pytest
import torch
from conftest import PassingDispatchMode, rel, seeded

from memfit.errors import MemfitError
from memfit.kernels.swiglu import swiglu, swiglu_reference

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
PATHS = ["triton", "reference"]


def projections(shape, dtype, gen):
    """gate and up as a model makes them: outputs of ops on a leaf x (so their gradients reach x's)."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    gate, up = x * 1.5, x.detach().flip(-1).requires_grad_() * 0.5
    return x, gate, up


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1037), (2, 5, 2049)])
def test_swiglu_forward_and_backward_against_the_definition(path, dtype, shape):
    """gate ~ N(0, 16): the sigmoid saturates at both ends at some elements (a reference backward that rebuilt s as
    1 - (1 - s) lost it there: every element of a one-element case on the GPU)."""
    gen = seeded(3)
    gate = (4 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_()
    up = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    grad = torch.randn(*shape, generator=gen, dtype=torch.float64)
    out = swiglu(gate * 1, up * 1, path=path)                       # non-leaf inputs: their storage is overwritten
    out.backward(grad.to(dtype))
    g64, u64 = (t.detach().double().requires_grad_() for t in (gate, up))
    ref = swiglu_reference(g64, u64)
    ref.backward(grad)
    assert out.dtype == dtype and out.shape == shape
    assert rel(out, ref) < TOL[dtype]
    assert rel(gate.grad, g64.grad) < TOL[dtype] and rel(up.grad, u64.grad) < TOL[dtype]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gradient_where_the_sigmoid_saturates(path, dtype):
    """Element by element where sigmoid(gate) is near 0 or 1: the reference path had rebuilt s as 1 - (1 - s), which in
    bf16 is 0 for gate = -9 (a relative error of 1 there, 1e-4 in fp32)."""
    g0 = torch.tensor([[-9.0, -5.0, 0.3, 7.0, 12.0]], dtype=torch.float64)
    u0 = torch.tensor([[0.5, -1.2, 2.0, 0.7, -0.3]], dtype=torch.float64)
    gate, up = g0.to(dtype).requires_grad_(), u0.to(dtype).requires_grad_()
    swiglu(gate * 1, up * 1, path=path).sum().backward()
    g64, u64 = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    swiglu_reference(g64, u64).sum().backward()
    assert ((gate.grad.double() - g64.grad).abs() / g64.grad.abs()).max() < TOL[dtype]
    assert ((up.grad.double() - u64.grad).abs() / u64.grad.abs()).max() < TOL[dtype]


@pytest.mark.parametrize("path", PATHS)
def test_swiglu_writes_its_input_gradients_over_the_inputs_it_saved(path):
    """The gradients that leave the op are gate's and up's own storage, and the op saves nothing else: the unfused
    product saves three intermediate-sized tensors and allocates three more in backward."""
    gen = seeded(4)
    _, gate, up = projections((4, 64), torch.float32, gen)
    saved = []

    def pack(t):
        saved.append((t.data_ptr(), t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = swiglu(gate, up, path=path)
    assert sorted(saved) == sorted([(gate.data_ptr(), gate.numel()), (up.data_ptr(), up.numel())])
    grads = {}

    def record(name):
        def hook(grad):
            grads[name] = grad.data_ptr()
        return hook
    gate.register_hook(record("gate"))
    up.register_hook(record("up"))
    out.sum().backward()
    assert grads == {"gate": gate.data_ptr(), "up": up.data_ptr()}


@pytest.mark.parametrize("path", PATHS)
def test_swiglu_of_one_tensor_twice_and_of_leaves_keeps_the_callers_tensors_and_gets_the_gradient_right(path):
    """silu(h) * h: both gradients would have been written into one buffer, then added as one (wrong); a leaf the caller
    holds, or an input that wants no gradient, keeps its values (only a copy, or nothing, is overwritten)."""
    gen = seeded(6)
    h0 = torch.randn(3, 50, generator=gen)
    h = h0.clone().requires_grad_()
    swiglu(h * 1, h * 1, path=path).sum().backward()                     # two tensors: the usual case
    once = h.grad.clone()
    h.grad = None
    inner = h * 1
    swiglu(inner, inner, path=path).sum().backward()                     # one tensor passed twice
    ref = h0.clone().requires_grad_()
    swiglu_reference(ref, ref).sum().backward()
    assert torch.allclose(h.grad, ref.grad) and torch.allclose(once, ref.grad)
    leaf, frozen = h0.clone().requires_grad_(), h0.flip(-1).clone()
    swiglu(leaf, frozen, path=path).sum().backward()
    assert torch.equal(leaf.detach(), h0) and torch.equal(frozen, h0.flip(-1))
    assert torch.allclose(leaf.grad, torch.autograd.grad(swiglu_reference(ref, h0.flip(-1)).sum(), ref)[0])


def test_swiglu_refuses_a_double_backward():
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = swiglu(x * 1, x * 2)
    with pytest.raises(MemfitError, match="no double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_swiglu_reads_strided_inputs_through_a_copy():
    gen = seeded(5)
    gate, up = (torch.randn(6, 8, generator=gen).t() for _ in range(2))
    assert torch.allclose(swiglu(gate, up, path="triton"), swiglu_reference(gate, up), atol=1e-6)


def test_swiglu_runs_float64_on_its_reference_and_refuses_it_on_the_forced_kernel():
    """The kernel computes in fp32, so float64 had come out rounded to fp32, unsaid; it now runs the reference."""
    gen = seeded(6)
    gate, up = (torch.randn(5, 7, dtype=torch.float64, generator=gen) for _ in range(2))
    assert torch.equal(swiglu(gate, up), swiglu_reference(gate, up))
    with pytest.raises(MemfitError, match="forced.*not torch.float64"):
        swiglu(gate, up, path="triton")


@pytest.mark.parametrize("gate,up,message", [
    (torch.randn(2, 3), torch.randn(3, 2), "share shape, dtype and device"),
    (torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64), "share shape, dtype and device"),
    (torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64), "floating point"),
])
def test_swiglu_refuses_mismatched_or_integer_inputs(gate, up, message):
    with pytest.raises(MemfitError, match=message):
        swiglu(gate, up)


def test_a_patched_model_trains_its_mlp_by_the_fused_op_with_the_same_loss_and_gradients(monkeypatch):
    """memfit.train.patch(fused_swiglu=True): the tiny model's loss and every gradient as the unpatched model's
    (fp32; the fused op rounds once where the pair rounds twice), and the switch turns it off again per call."""
    import copy

    from memfit.models import PRESETS, build_model
    from memfit.train.patch import patch, patch_state

    torch.manual_seed(0)
    plain = build_model(PRESETS["tiny"], dtype="float32", device=torch.get_default_device())
    fused = patch(copy.deepcopy(plain), fused_ce=False, fused_swiglu=True)
    ids = torch.randint(0, PRESETS["tiny"].vocab, (2, 24))
    calls = []
    import memfit.kernels.swiglu as module

    real = module._forward                               # the eager Function's forward, as a training step runs it
    monkeypatch.setattr(module, "_forward", lambda *args: calls.append(1) or real(*args))
    losses = [m(input_ids=ids, labels=ids).loss for m in (plain, fused)]
    for loss in losses:
        loss.backward()
    assert len(calls) == PRESETS["tiny"].num_layers
    patch_state(fused).fused_swiglu = False
    fused(input_ids=ids, labels=ids)
    assert len(calls) == PRESETS["tiny"].num_layers
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    for (name, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name


def test_a_model_whose_mlp_is_not_silu_is_refused_everywhere_the_fused_op_is_asked_for():
    import argparse
    import dataclasses

    from memfit.commands.finetune import fused_swiglu_of
    from memfit.ledger.job import Job, Knobs
    from memfit.ledger.predict import predict
    from memfit.models import PRESETS, build_model
    from memfit.train.patch import patch, patch_state

    gelu = dataclasses.replace(PRESETS["tiny"], activation="gelu")
    assert PRESETS["tiny"].silu_mlp and not gelu.silu_mlp
    device = torch.get_default_device()                  # the CPU, or CUDA under MEMFIT_TEST_DEVICE=cuda
    with pytest.raises(MemfitError, match="this model's MLP activation is GELU"):
        patch(build_model(gelu, dtype="float32", device=device), fused_ce=False, fused_swiglu=True)
    switched_later = patch(build_model(gelu, dtype="float32", device=device), fused_ce=False)  # off at patch, on per call
    patch_state(switched_later).fused_swiglu = True
    with pytest.raises(MemfitError, match="this model's MLP activation is GELU"):
        switched_later(input_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(MemfitError, match="activation is 'gelu'"):
        predict(Job(gelu, task="lora", seq=32, device="cpu"), Knobs(dtype="float32", fused_swiglu=True))
    with pytest.raises(MemfitError, match="--fused-swiglu computes silu"):
        fused_swiglu_of(argparse.Namespace(fused_swiglu=True), gelu)
    assert fused_swiglu_of(argparse.Namespace(fused_swiglu=False), gelu) is False
    assert fused_swiglu_of(argparse.Namespace(fused_swiglu=True), PRESETS["tiny"]) is True


def test_a_copy_of_a_patched_model_runs_its_own_mlps():
    """The fused MLP forward reads its module's own weights and switch: a deep copy (a reference or EMA model) had run
    the original's MLPs through the forward's closure."""
    import copy

    from memfit.models import PRESETS, build_model
    from memfit.train.patch import patch, patch_state

    torch.manual_seed(1)
    model = patch(build_model(PRESETS["tiny"], dtype="float32", device=torch.get_default_device()), fused_ce=False,
                  fused_swiglu=True)
    twin = copy.deepcopy(model)
    patch_state(model).fused_swiglu = False                  # the original's switch only
    mlp, twin_mlp = model.model.layers[0].mlp, twin.model.layers[0].mlp
    with torch.no_grad():
        twin_mlp.up_proj.weight.mul_(2)
        x = torch.randn(2, 5, PRESETS["tiny"].hidden)
        assert torch.allclose(twin_mlp(x), 2 * mlp(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_an_eager_call_skips_the_custom_ops_with_the_same_output_and_gradients(path, monkeypatch):
    """Outside compile, traces, modes and the profiler, swiglu runs its forward and backward through an
    autograd.Function, not its custom ops (whose calls cost host time at every step); under each of those it calls
    the custom op, and either way gives the same output and gradients."""
    import memfit.kernels.swiglu as module

    dispatched, op, backward_op = [], module._swiglu_op, module._swiglu_backward_op
    monkeypatch.setattr(module, "_swiglu_op", lambda *args: dispatched.append("forward") or op(*args))
    monkeypatch.setattr(module, "_swiglu_backward_op", lambda *args: dispatched.append("backward") or backward_op(*args))
    gen = seeded(7)
    x0 = torch.randn(3, 40, generator=gen)

    def step():
        x = x0.clone().requires_grad_()
        out = swiglu(x * 1, x * 2, path=path)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad

    eager = step()
    assert dispatched == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        profiled = step()
    with PassingDispatchMode():
        moded = step()
    assert dispatched == ["forward", "backward"] * 2
    assert all(torch.equal(a, b) for run in (profiled, moded) for a, b in zip(eager, run, strict=True))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("saved", ["gate", "up"])
def test_a_node_that_saved_an_input_refuses_to_read_the_gradient_written_over_it(path, eager, saved, monkeypatch):
    """An input's gradient is written over it: a node created before the op that saved that input (sin here) runs
    its backward after the op's, so it must raise rather than read the gradient as the input, on both routes (the
    custom op's mutation moves the input's version; the eager route moves it itself, since the kernel's stores do
    not)."""
    import memfit.kernels.swiglu as module

    if not eager:
        monkeypatch.setattr(module, "outside_the_dispatcher", lambda *tensors: False)
    x = torch.randn(4, 8, generator=seeded(8), requires_grad=True)
    inputs = {"gate": x * 1, "up": x * 2}
    loss = inputs[saved].sin().sum() + swiglu(inputs["gate"], inputs["up"], path=path).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("path", PATHS)
def test_a_view_of_a_parameter_is_copied_not_overwritten(path):
    """A view of a leaf that wants a gradient is the caller's tensor as much as the leaf: it is copied, so the
    parameter keeps its values and gets its gradient (it was overwritten with its gradient, unwarned)."""
    gen = seeded(9)
    w0, u0 = torch.randn(32, generator=gen), torch.randn(4, 8, generator=gen)
    w, ref = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    swiglu(w.view(4, 8), u0 * 1, path=path).sum().backward()
    swiglu_reference(ref.view(4, 8), u0).sum().backward()
    assert torch.equal(w.detach(), w0)
    assert torch.allclose(w.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_under_compile_a_view_of_a_parameter_is_copied_too():
    """Inside a traced graph a view's base is not known: the inputs are checked eagerly, at a graph break."""
    gen = seeded(10)
    w0, u0 = torch.randn(32, generator=gen), torch.randn(4, 8, generator=gen)
    w, ref = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    compiled = torch.compile(lambda w, u: swiglu(w.view(4, 8), u * 1, path="reference"), backend="aot_eager")
    compiled(w, u0).sum().backward()
    swiglu_reference(ref.view(4, 8), u0).sum().backward()
    assert torch.equal(w.detach(), w0)
    assert torch.allclose(w.grad, ref.grad, rtol=1e-5, atol=1e-6)
