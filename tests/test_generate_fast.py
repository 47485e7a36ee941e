"""The decode loop with memfit's decode kernels (``fast=True``: fused rope/cache/attention, GEMV, argmax), run
through the Triton interpreter on CPU, against the previous loop (``fast=False``)."""
import pytest
import torch
from conftest import load_on_test_device, seeded
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit import log
from memfit.errors import MemfitError
from memfit.infer.calibrate import calibrate
from memfit.infer.generate import Generator, use_decode_kernels
from memfit.infer.partial_load import PartialConfig, load_model
from memfit.kernels import gemv
from memfit.kernels.decode import ATTENTION_VARIANTS
from memfit.models import PRESETS, build_model, save_model_dir

SPEC = PRESETS["tiny"].with_(num_layers=3)          # hidden 64, GQA 4/2 heads of 16, intermediate 176


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = save_model_dir(SPEC, tmp_path_factory.mktemp("tiny-fast"))
    prompts = torch.randint(0, 512, (3, 16), generator=seeded(1))
    rankings = calibrate(load_on_test_device(directory), [(prompts, torch.ones_like(prompts), None)])
    rankings.save(directory / "rankings.safetensors")
    return directory


def _prompts():
    x = torch.randint(0, 512, (2, 9), generator=seeded(2))
    mask = torch.ones_like(x)
    mask[1, :3] = 0                                   # left padding of the second prompt
    return x, mask


def _strided(w):
    return w.stride(0) != w.shape[1]


def _step_logits(gen, x, mask, steps=2):
    """Logits of the first ``steps`` decode steps after the prompts."""
    gen.prefill(x, mask)
    rows = []
    for _ in range(steps):
        rows.append(gen._forward(gen.tok, gen.pos, gen.slot, gen.cache_len, "last", decode=True)[:, -1])
        gen.decode(1)
    return torch.stack(rows)


@pytest.mark.parametrize("partial", [None, PartialConfig(load=0.7, compute=0.4, full_first=1, full_last=1)])
def test_fast_decode_matches_previous_loop(model_dir, partial, monkeypatch):
    """Same greedy tokens, and decode-step logits equal to fp32 rounding, batch 2 with padding. The partial
    model's strided down[:, :a] runs the GEMV kernel (forced: on CPU the pick is cuBLAS), reading it at its
    row stride; the other matmuls stay cuBLAS (the interpreter is slow; forced too, as a GPU's pick is timed)."""
    model = load_on_test_device(model_dir, partial)
    x, mask = _prompts()
    slow = Generator(model, 16, batch=2, fast=False)
    strided_path = gemv.CUBLAS if partial is None else "gemv_n16_k256_w4"
    monkeypatch.setattr(gemv, "pick_path", lambda x, weights: strided_path if _strided(weights[0][0]) else gemv.CUBLAS)
    fast = Generator(model, 16, batch=2, fast=True)
    strided = {key for key, path in fast.matmul_paths.items() if path != gemv.CUBLAS}
    assert strided == ({"M2 N64 K72 ld120 float32 bias0"} if partial else set())
    assert len(fast.matmul_paths) == (5 if partial is None else 7)      # q/k/v, o, gate/up, down, head (+ partial shapes)
    assert gemv.shape_key(2, model.lm_head.weight, None) in fast.matmul_paths
    # the default off the GPU; on it, the variant pick_attention timed fastest
    assert fast.attention_variant == "split64" or (x.is_cuda and fast.attention_variant in ATTENTION_VARIANTS)
    assert torch.equal(fast.generate(x, 4, attention_mask=mask).tokens, slow.generate(x, 4, attention_mask=mask).tokens)
    got, ref = _step_logits(fast, x, mask), _step_logits(slow, x, mask)
    assert 0 < (got - ref).norm() / ref.norm() < 1e-5 or torch.equal(got, ref)


def test_a_tied_head_is_computed_from_the_embedding_by_the_gemv(monkeypatch):
    """The head that shares the embedding's weight takes the decode GEMV path (forced here) and gives the tokens
    of the previous loop."""
    model = build_model(SPEC.with_(num_layers=1, tied_embeddings=True), device=torch.get_default_device()).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    x, mask = _prompts()
    slow = Generator(model, 16, batch=2, fast=False)
    monkeypatch.setattr(gemv, "pick_path", lambda x, weights: "gemv_n16_k256_w4")
    fast = Generator(model, 16, batch=2, fast=True)
    assert fast.matmul_paths[gemv.shape_key(2, model.lm_head.weight, None)] == "gemv_n16_k256_w4"
    assert torch.equal(fast.generate(x, 4, attention_mask=mask).tokens, slow.generate(x, 4, attention_mask=mask).tokens)


def test_fast_needs_a_triton_device(model_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(MemfitError, match="Triton path was forced"):
        Generator(load_model(model_dir), 16, fast=True)      # on the CPU by name, on either machine


@pytest.mark.parametrize("heads, kv_heads, head_dim, env, expect", [
    (4, 2, 16, None, True),
    (4, 2, 16, "reference", False),                  # MEMFIT_KERNELS overrides the default, as for every op
    (4, 2, 24, None, False),                         # head_dim not a power of two
    (4, 2, 8, None, False),                          # below tl.dot's 16
    (6, 4, 16, None, False),                         # heads not a multiple of KV heads
])
def test_default_on_cuda_falls_back_and_says_so(monkeypatch, caplog, heads, kv_heads, head_dim, env, expect):
    """fast=None on a CUDA model (a fake CUDA tensor: no GPU here) takes the kernels only where they run; else it
    logs why, once, instead of failing to build the Generator."""
    monkeypatch.setattr(log, "_said", set())
    if env:
        monkeypatch.setenv("MEMFIT_KERNELS", env)
    with FakeTensorMode():
        embed = torch.empty(8, 64, device="cuda")
    assert use_decode_kernels(None, embed, heads, kv_heads, head_dim) is expect
    assert ("without memfit's decode kernels" in caplog.text) is not expect


def test_default_off_cuda_and_false_take_the_previous_loop(caplog):
    assert not use_decode_kernels(None, torch.empty(8, 64, device="cpu"), 4, 2, 16)
    assert not use_decode_kernels(False, torch.empty(8, 64, device="cpu"), 4, 2, 16)
    assert "decode kernels" not in caplog.text


@pytest.mark.parametrize("changes", [{"head_dim": 24}, {"head_dim": 8}])
def test_fast_refuses_heads_the_kernel_cannot_take(changes):
    """fast=True on such a model is a clear error at construction, not a failure at the first decode step;
    the default builds (the previous loop)."""
    model = build_model(SPEC.with_(num_layers=1, **changes), device=torch.get_default_device())
    with pytest.raises(MemfitError, match="fast=True.*power of two"):
        Generator(model, 16, fast=True)
    assert not Generator(model, 16).fast
