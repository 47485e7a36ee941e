"""memfit.kernels.monarch_swiglu (silu(gate(x)) * up(x) for Monarch gate and up) and memfit.compress.fused_mlp,
which makes a model's Monarch MLPs use it: every pipeline against the float64 reference, forward and backward, at
awkward shapes (4 blocks, 11 inputs and 7 outputs a block, per-block ranks 12 and 20: K steps of 16 ranks cross
from one input block's run to the next)."""
import math

import pytest
import torch

from memfit.compress import structure_model
from memfit.compress.fused_mlp import fusable, fuse_monarch_mlps, unfuse_monarch_mlps
from memfit.errors import MemfitError
from memfit.kernels import monarch_swiglu as ms
from memfit.models import PRESETS, build_model

B, M, P = 4, 11, 7
TG, TU = 12, 20
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Every torch.empty the op allocates starts as NaN, so an element the kernel never wrote shows."""
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (lambda t: t.fill_(math.nan) if t.is_floating_point()
                                                         else t)(real(*a, **k)))


def factors(tg=TG, tu=TU):
    return [torch.randn(B, M, B * tg) / M**0.5, torch.randn(B, B * tg, P) / tg**0.5,
            torch.randn(B, M, B * tu) / M**0.5, torch.randn(B, B * tu, P) / tu**0.5]


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


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
    model = build_model(PRESETS["tiny"], dtype="float32")
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


def test_only_monarch_gate_and_up_of_one_shape_are_fused():
    model = build_model(PRESETS["tiny"], dtype="float32")
    assert fuse_monarch_mlps(model) == 0                                           # dense MLPs
    mlp = tiny_monarch_model().model.layers[0].mlp
    assert fusable(mlp)
    mlp.gate_proj.permute_output = True
    assert not fusable(mlp)
