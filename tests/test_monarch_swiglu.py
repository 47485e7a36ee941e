"""memfit.kernels.monarch_swiglu (silu(gate(x)) * up(x) for Monarch gate and up) and memfit.infer.monarch_swiglu,
which makes a model's Monarch MLPs use it: every pipeline against the float64 reference, forward and backward, at
awkward shapes (4 blocks, 11 inputs and 7 outputs a block, per-block ranks 12 and 20: K steps of 16 ranks cross
from one input block's run to the next)."""
import pytest
import torch
from conftest import rel

from memfit.compress import structure_model
from memfit.errors import MemfitError
from memfit.infer.monarch_swiglu import fusable, fuse_monarch_mlps, unfuse_monarch_mlps
from memfit.kernels import monarch_swiglu as ms
from memfit.models import PRESETS, build_model

B, M, P = 4, 11, 7
TG, TU = 12, 20
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
pytestmark = pytest.mark.usefixtures("poisoned_empty")     # unwritten output elements show as NaN


def factors(tg=TG, tu=TU):
    return [torch.randn(B, M, B * tg) / M**0.5, torch.randn(B, B * tg, P) / tg**0.5,
            torch.randn(B, M, B * tu) / M**0.5, torch.randn(B, B * tu, P) / tu**0.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["separate", "fused_pdl"])
@pytest.mark.parametrize("lead", [(1,), (2, 3), (16,)])
def test_forward_and_backward_match_the_reference(dtype, variant, lead):
    inputs = [t.to(dtype).requires_grad_() for t in (torch.randn(*lead, B * M), *factors())]
    y = ms.monarch_swiglu(*inputs, path="triton", variant=variant)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = ms.monarch_swiglu_reference(*ref_inputs)
    assert y.shape == (*lead, B * P) and torch.isfinite(y).all()
    assert rel(y, ref) < TOL[dtype]
    grad = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, inputs, grad), torch.autograd.grad(ref, ref_inputs, grad.double())):
        assert rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("path,variant", [("triton", "separate"), ("triton", "fused_pdl"), ("reference", "auto")])
def test_the_gradient_for_x_with_frozen_weights(path, variant):
    """silu(gate(x)) * up(x) is not linear in x: with the weights frozen the op still saves x (a linear BLR op need
    not: blr_common.save_for_recompute), or x's gradient would be the reference's at x = 0."""
    x = torch.randn(3, B * M, requires_grad=True)
    weights = factors()
    y = ms.monarch_swiglu(x, *weights, path=path, variant=variant)
    ref_x = x.detach().double().requires_grad_()
    ref = ms.monarch_swiglu_reference(ref_x, *(w.double() for w in weights))
    grad = torch.randn_like(y)
    (got,), (want,) = torch.autograd.grad(y, [x], grad), torch.autograd.grad(ref, [ref_x], grad.double())
    assert rel(got, want) < 1e-5


def test_past_the_fused_pipelines_offer_the_mlp_runs_as_it_would_unfused(monkeypatch):
    """Where fused_pdl is not offered (here 32 tokens), the wrapper does not enter the op: the two Monarch ops and
    the product, as the unpatched MLP computes them (torch.compile fuses the product as before)."""
    monkeypatch.setattr(ms, "_monarch_swiglu_op", lambda *args: pytest.fail("entered the op"))
    x = torch.randn(32, B * M)
    weights = factors()
    assert rel(ms.monarch_swiglu(x, *weights, path="triton"), ms.monarch_swiglu_reference(
        x.double(), *(w.double() for w in weights))) < 1e-5


def test_the_fused_pipeline_is_offered_at_decode_for_ranks_in_whole_k_steps():
    gate_w1, _, up_w1, _ = factors()
    assert "fused_pdl" in ms.variants_for(16, gate_w1, up_w1)
    assert list(ms.variants_for(17, gate_w1, up_w1)) == ["separate"]             # 17 tokens share 32's pick
    odd = factors(tg=13)                                                         # rank 52: no whole K step
    assert list(ms.variants_for(1, odd[0], odd[2])) == ["separate"]


def test_bad_shapes_and_variants_are_refused():
    x = torch.randn(2, B * M)
    gate_w1, gate_w2, up_w1, up_w2 = factors()
    with pytest.raises(MemfitError, match="not a multiple of blocks"):
        ms.monarch_swiglu(x, gate_w1[..., :-1], gate_w2[:, :-1], up_w1, up_w2, path="triton")
    with pytest.raises(MemfitError, match="up_w2 has shape"):
        ms.monarch_swiglu(x, gate_w1, gate_w2, up_w1, up_w2[..., :-1], path="triton")
    with pytest.raises(MemfitError, match="fused_pdl"):
        ms.monarch_swiglu(torch.randn(32, B * M), gate_w1, gate_w2, up_w1, up_w2, path="triton", variant="fused_pdl")


def tiny_monarch_model():
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], dtype="float32", device=torch.get_default_device())  # CUDA under MEMFIT_TEST_DEVICE
    structure_model(model, "monarch", ranks={"gate_proj": 2 * ms.STEP, "up_proj": 2 * ms.STEP}, blocks=2,
                    skip=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))   # ranks that pay at this size
    return model.eval()


def test_fused_mlps_give_the_models_outputs_and_come_undone():
    model = tiny_monarch_model()
    ids = torch.randint(0, PRESETS["tiny"].vocab, (1, 5))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert fuse_monarch_mlps(model) == PRESETS["tiny"].num_layers
        assert fuse_monarch_mlps(model) == 0                                       # already fused
        fused = model(input_ids=ids).logits
        assert unfuse_monarch_mlps(model) == PRESETS["tiny"].num_layers
        after = model(input_ids=ids).logits
    assert rel(fused, before.double()) < 1e-5
    assert torch.equal(after, before)


def test_a_named_variant_runs_wherever_offered_and_the_pick_elsewhere(monkeypatch):
    """fuse_monarch_mlps(variant=...) is for measuring one pipeline in a model: it runs at the token counts that
    offer it (here decode, with fused_pdl offered as on a Hopper GPU) and the others are as with "auto"."""
    import memfit.infer.monarch_swiglu as patch

    offered = lambda n, *weights: ms.VARIANTS if n <= ms.FUSED_MAX_N else {"separate": ms.VARIANTS["separate"]}  # noqa: E731
    monkeypatch.setattr(patch, "variants_for", offered)
    variants = []
    monkeypatch.setattr(patch, "monarch_swiglu", lambda *args, variant: variants.append(variant) or args[0][..., :1])
    model = tiny_monarch_model()
    down = model.model.layers[0].mlp.down_proj
    monkeypatch.setattr(down, "forward", lambda h: torch.zeros(*h.shape[:-1], down.out_features))
    with pytest.raises(MemfitError, match="variant 'fused' is not auto or one of separate, fused_pdl"):
        fuse_monarch_mlps(model, variant="fused")
    fuse_monarch_mlps(model, variant="fused_pdl")
    mlp, hidden = model.model.layers[0].mlp, PRESETS["tiny"].hidden
    mlp(torch.randn(1, 1, hidden)), mlp(torch.randn(1, 17, hidden))
    assert variants == ["fused_pdl", "auto"]
    assert fuse_monarch_mlps(model, variant="separate") == 0 and mlp.monarch_swiglu_variant == "separate"
    unfuse_monarch_mlps(model)
    assert not hasattr(mlp, "monarch_swiglu_variant")
    monkeypatch.setattr(patch, "variants_for", lambda n, *weights: {"separate": ms.VARIANTS["separate"]})
    with pytest.raises(MemfitError, match="'fused_pdl' is not offered for model.layers.0.mlp at one token"):
        fuse_monarch_mlps(model, variant="fused_pdl")                      # never the unfused MLP under its name


def test_only_plain_unhooked_monarch_gate_and_up_of_one_layout_are_fused():
    model = build_model(PRESETS["tiny"], dtype="float32")
    assert fuse_monarch_mlps(model) == 0                                           # dense MLPs
    mlp = tiny_monarch_model().model.layers[0].mlp
    assert fusable(mlp)
    mlp.gate_proj.permute_output = True
    assert not fusable(mlp)
    mlp.gate_proj.permute_output = False
    handle = mlp.up_proj.register_forward_hook(lambda *args: None)             # the op would skip the hook
    assert not fusable(mlp)
    handle.remove()
    mlp.up_proj.__class__ = type("Subclass", (type(mlp.up_proj),), {})           # may compute otherwise
    assert not fusable(mlp)


def test_a_layer_changed_after_fusing_runs_the_class_forward():
    model = tiny_monarch_model()
    ids = torch.randint(0, PRESETS["tiny"].vocab, (1, 5))
    fuse_monarch_mlps(model)
    mlp = model.model.layers[0].mlp
    handle = mlp.gate_proj.register_forward_hook(lambda module, args, out: out * 0)
    with torch.no_grad():
        hooked = model(input_ids=ids).logits
        unfuse_monarch_mlps(model)
        want = model(input_ids=ids).logits
    handle.remove()
    assert rel(hooked, want.double()) < 1e-5          # layer 1 stays fused in the first run: rounding apart


def test_an_mlp_whose_forward_something_else_replaced_is_refused():
    model = tiny_monarch_model()
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: x
    with pytest.raises(MemfitError, match="layers.1.mlp's forward is already replaced"):
        fuse_monarch_mlps(model)
