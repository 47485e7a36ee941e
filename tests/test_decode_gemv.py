"""memfit.kernels.gemv.decode_linear (F.linear by the path its pick took for the shape) and memfit.infer.decode_gemv,
which makes a model's plain linear layers use it. Off the GPU the pick is cuBLAS, so the tests that need the GEMV
kernel make the pick name a variant (the kernel runs under the interpreter)."""
import pytest
import torch
import torch.nn.functional as F
from conftest import rel
from torch import nn

from memfit.errors import MemfitError
from memfit.infer.decode_gemv import undo_decode_gemv, use_decode_gemv
from memfit.infer.fused import plain_linear
from memfit.kernels import gemv
from memfit.models import PRESETS, build_model

VARIANT = "gemv_n4_k512_w4"


@pytest.fixture
def picks(monkeypatch):
    """Every pick names VARIANT, and each shape it is asked for is listed (a fresh cache of paths per test)."""
    asked = []

    def pick(x, weights):
        asked.append(gemv.shape_key(x.shape[0], *weights[0]))
        return VARIANT

    monkeypatch.setattr(gemv, "pick_path", pick)
    monkeypatch.setattr(gemv, "_DECODE_PATHS", {})
    return asked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_linear_runs_the_picked_kernel_and_matches_linear(picks, monkeypatch, dtype, rows, with_bias):
    launched = []
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *args: launched.append(args[-1]) or launch(*args))
    x, w = torch.randn(rows, 1, 40, dtype=dtype), torch.randn(24, 40, dtype=dtype)
    bias = torch.randn(24, dtype=dtype) if with_bias else None
    y = gemv.decode_linear(x, w, bias)
    assert launched == [VARIANT] and y.shape == (rows, 1, 24)
    assert rel(y, F.linear(x.double(), w.double(), None if bias is None else bias.double())) < (
        1e-5 if dtype == torch.float32 else 1e-2)


def test_a_shape_is_picked_once_and_more_rows_than_a_gemv_takes_are_f_linear(picks):
    w = torch.randn(24, 40)
    for rows in (1, 1, 2):
        gemv.decode_linear(torch.randn(rows, 40), w)
    assert picks == [gemv.shape_key(1, w, None), gemv.shape_key(2, w, None)]
    x = torch.randn(gemv.MAX_ROWS + 1, 40)
    assert torch.equal(gemv.decode_linear(x, w), F.linear(x, w)) and len(picks) == 2


@pytest.mark.cpu_only(reason="on the GPU the pick times the paths")
def test_off_the_gpu_the_pick_is_cublas(monkeypatch):
    monkeypatch.setattr(gemv, "_DECODE_PATHS", {})
    x, w = torch.randn(1, 40), torch.randn(24, 40)
    assert torch.equal(gemv.decode_linear(x, w), F.linear(x, w))
    assert list(gemv._DECODE_PATHS.values()) == [gemv.CUBLAS]


@pytest.mark.parametrize("with_bias", [False, True])
def test_gradients_through_the_gemv_path_are_f_linears(picks, with_bias):
    x, w = torch.randn(2, 40, requires_grad=True), torch.randn(24, 40, requires_grad=True)
    bias = torch.randn(24, requires_grad=True) if with_bias else None
    inputs = [t for t in (x, w, bias) if t is not None]
    grad = torch.randn(2, 24)
    got = torch.autograd.grad(gemv.decode_linear(x, w, bias), inputs, grad)
    want = torch.autograd.grad(F.linear(x, w, bias), inputs, grad)
    assert picks and all(rel(g, v) < 1e-5 for g, v in zip(got, want))


def test_what_the_kernel_would_misread_goes_to_f_linear_which_refuses_it(picks):
    x, w = torch.randn(1, 40), torch.randn(24, 40)
    for bias in (torch.randn(23), torch.randn(24, dtype=torch.float64)):        # read past its end; cast silently
        with pytest.raises(RuntimeError):
            gemv.decode_linear(x, w, bias)
    for narrow_or_wide in (torch.randn(1, 32), torch.randn(1, 48)):             # past x's end; w's row cut short
        with pytest.raises(RuntimeError):
            gemv.decode_linear(narrow_or_wide, w)
    assert not picks


def test_under_autocast_it_is_f_linear(picks):
    x, w = torch.randn(1, 40), torch.randn(24, 40)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y, want = gemv.decode_linear(x, w), F.linear(x, w)
    assert y.dtype == want.dtype == torch.bfloat16 and torch.equal(y, want) and not picks


def tiny_model():
    torch.manual_seed(0)
    return build_model(PRESETS["tiny"], dtype="float32", device=torch.get_default_device()).eval()


def linears(model):
    return sum(type(m) is nn.Linear for m in model.modules())


def test_a_models_linear_layers_decode_by_the_gemv_and_come_back(picks):
    model = tiny_model()
    ids = torch.randint(0, PRESETS["tiny"].vocab, (1, 1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert use_decode_gemv(model) == linears(model) == 7 * PRESETS["tiny"].num_layers + 1   # and the head
        assert use_decode_gemv(model) == 0                                                      # already patched
        patched = model(input_ids=ids).logits
        assert picks                                                  # the GEMV ran: every pick names VARIANT
        prefill = model(input_ids=torch.randint(0, PRESETS["tiny"].vocab, (1, 9))).logits       # F.linear above 4 rows
        assert undo_decode_gemv(model) == linears(model)
        after = model(input_ids=ids).logits
    assert rel(patched, before.double()) < 1e-5 and torch.equal(after, before) and prefill.shape[1] == 9


def test_plain_linears_are_patched_and_their_hooks_still_run(picks):
    model = tiny_model()
    assert not plain_linear(type("Subclass", (nn.Linear,), {})(4, 4))       # may compute otherwise
    proj = model.model.layers[0].self_attn.k_proj
    proj.register_forward_hook(lambda module, args, out: out * 0)
    assert use_decode_gemv(model) == linears(model)
    x = torch.randn(1, proj.in_features)
    assert torch.equal(proj(x), torch.zeros(1, proj.out_features))
    assert picks == [gemv.shape_key(1, proj.weight, None)]                      # the patched forward ran


def test_a_linear_whose_forward_something_else_replaced_is_refused():
    model = tiny_model()
    model.model.layers[1].mlp.down_proj.forward = lambda x: x
    with pytest.raises(MemfitError, match="layers.1.mlp.down_proj's forward is already replaced"):
        use_decode_gemv(model)


def test_the_patched_model_compiles_into_one_graph(picks):
    model = tiny_model()
    use_decode_gemv(model)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randint(0, PRESETS["tiny"].vocab, (1, 1)))
    assert explained.graph_break_count == 0, explained.break_reasons
    ops = [node for node in explained.graphs[0].graph.nodes if node.target is torch.ops.memfit.decode_linear.default]
    assert len(ops) == linears(model)
