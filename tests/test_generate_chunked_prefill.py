"""A long prompt prefills in chunks of queries: under a mask where prompts are padded
(memfit.infer.generate.PREFILL_MASK_BYTES), with none where they are not (PREFILL_ACTIVATION_BYTES). The same tokens,
logits and partial-FFN selection as in one chunk and as each other, and a peak without the whole prompt's mask."""
import logging

import pytest
import torch
from conftest import MEASURES_A_CPU_RUN, load_on_test_device, seeded

import memfit.log
from memfit.infer import generate
from memfit.infer.calibrate import calibrate
from memfit.infer.generate import Generator
from memfit.infer.partial_load import PartialConfig
from memfit.measure.memory import PeakMeter
from memfit.models import PRESETS, build_model, save_model_dir

MASK_FREE_CAUSAL_KERNEL = generate.mask_free_causal_kernel
SPEC = PRESETS["tiny"].with_(num_layers=3)          # hidden 64, GQA 4/2 (G = 2), vocab 512
G = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = save_model_dir(SPEC, tmp_path_factory.mktemp("tiny"))
    batches = [(torch.randint(0, 512, (2, 20), generator=seeded(1)), torch.ones(2, 20, dtype=torch.long), None)]
    calibrate(load_on_test_device(directory), batches).save(directory / "rankings.safetensors")
    return directory


def _budget_for(chunk: int, batch: int, keys: int, dtype_bytes: int = 4) -> int:
    """The PREFILL_MASK_BYTES that makes ``chunk``-token chunks of an fp32 prefill whose last attends over ``keys``
    cache slots (its end rounded up to KEY_ALIGN within the cache)."""
    return chunk * batch * keys * (1 + (1 + G) * dtype_bytes)


def test_chunks_cover_the_prompt_in_order_each_within_the_budget(model_dir, monkeypatch):
    gen = Generator(load_on_test_device(model_dir), 48, batch=2, fused=False)
    assert gen.prefill_chunks(40) == [(0, 40)]                       # the default budget: one chunk at this size
    monkeypatch.setattr(generate, "PREFILL_MASK_BYTES", _budget_for(7, 2, 40) + 1)
    assert gen.prefill_chunks(40) == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 35), (35, 40)]
    assert gen.prefill_chunks(38, 20) == [(20, 27), (27, 34), (34, 38)]     # score's rest: slots 20..37, 40 keys
    monkeypatch.setattr(generate, "PREFILL_MASK_BYTES", _budget_for(7, 2, 48) + 1)
    assert gen.prefill_chunks(41)[0] == (0, 7)                       # 41 keys round up to 48, the whole cache
    monkeypatch.setattr(generate, "PREFILL_MASK_BYTES", 1)
    assert gen.prefill_chunks(3) == [(0, 1), (1, 2), (2, 3)]         # at least one token a chunk
    assert gen.prefill_chunks(0) == []
    assert gen.prefill_chunks(40, masked=False) == [(0, 40)]         # no mask: its default budget, one chunk
    monkeypatch.setattr(generate, "PREFILL_ACTIVATION_BYTES", 7 * 2 * gen.token_bytes + 1)
    assert gen.prefill_chunks(40, masked=False) == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 35), (35, 40)]
    assert gen.prefill_chunks(48, 41, masked=False) == [(41, 48)]    # however many keys the chunks attend over
    monkeypatch.setattr(generate, "PREFILL_ACTIVATION_BYTES", 1)
    assert gen.prefill_chunks(2, masked=False) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("partial", [None, PartialConfig(load=0.7, compute=0.4, full_first=1, full_last=1)])
def test_a_prompt_in_chunks_decodes_as_in_one(model_dir, partial, monkeypatch, caplog):
    """Batch 2, the second prompt left-padded across the first chunk boundary: the first token's logits equal to
    fp32 rounding, the same tokens, and each partial layer selects the same neurons (its counts skip the padding
    of every chunk)."""
    model = load_on_test_device(model_dir, partial)
    x = torch.randint(0, 512, (2, 23), generator=seeded(2)).to(model.device)
    mask = torch.ones_like(x)
    mask[1, :9] = 0

    def run():
        gen = Generator(model, 30, batch=2, fused=False)
        logits = gen._prefill(x, mask)[0]
        return gen, logits, gen.generate(x, 6, attention_mask=mask)

    whole, whole_logits, whole_out = run()
    monkeypatch.setattr(generate, "PREFILL_MASK_BYTES", _budget_for(4, 2, 24))
    caplog.set_level(logging.DEBUG, logger="memfit")
    chunked, chunked_logits, chunked_out = run()
    assert "23 tokens forward in 6 chunks of queries" in caplog.text           # what -v shows
    assert len(whole.prefill_chunks(23)) == 6
    error = (chunked_logits - whole_logits).norm() / whole_logits.norm()
    assert error < 1e-5 and torch.equal(chunked_out.tokens, whole_out.tokens)
    assert len(chunked_out.selected) == (1 if partial else 0)          # the middle layer of three
    assert all(torch.equal(a, b) for a, b in zip(chunked_out.selected, whole_out.selected))


def test_a_partial_layer_counts_each_chunks_real_tokens_against_its_slice_of_the_prompt_mask():
    """Observed a chunk at a time, a partial layer's counts equal count_top_activations over the whole prompt under its
    mask: padding skipped in every chunk (a layer that ignored the mask would count the padded tokens too)."""
    from memfit.infer.selection import PartialMLP, count_top_activations

    k = 24
    mlp = PartialMLP.__new__(PartialMLP)
    mlp.counts, mlp.token_mask, mlp.observed = torch.zeros(k, dtype=torch.int64), None, 0
    h = torch.randn(2, 11, k, generator=seeded(6))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :7] = False
    mlp.token_mask = mask
    for start in range(0, 11, 4):
        mlp.observe(h[:, start:start + 4])
    assert mlp.observed == 11 and torch.equal(mlp.counts, count_top_activations(h, token_mask=mask))
    assert not torch.equal(mlp.counts, count_top_activations(h))


def _force_mask(monkeypatch, on: bool = True) -> None:
    """Generators attending under a mask even where their prompts have no padding (``on``), as on a GPU where SDPA
    has no mask-free causal kernel for the model (every kernel the CPU has takes one); else as they choose."""
    monkeypatch.setattr(generate, "mask_free_causal_kernel", (lambda *args: False) if on else MASK_FREE_CAUSAL_KERNEL)


def _spy(monkeypatch, name):
    """Calls of memfit.infer.generate's ``name`` recorded as they run: (the calls' arguments, their results)."""
    calls, real = [], getattr(generate, name)
    monkeypatch.setattr(generate, name, lambda *args: calls.append(args) or real(*args))
    return calls


# The tiny model in float32 with grouped KV heads: on CUDA no SDPA kernel attends to it mask-free (flash takes 16-bit
# dtypes, memory-efficient no groups), so it prefills under the mask there (gpu_tests_unpadded_af4fc90.log); the bf16
# CUDA test below covers the GPU's mask-free path.
NO_FP32_MASK_FREE_ON_CUDA = pytest.mark.cpu_only(reason="no CUDA kernel attends fp32 grouped heads mask-free")


@NO_FP32_MASK_FREE_ON_CUDA
@pytest.mark.parametrize("partial", [None, PartialConfig(load=0.7, compute=0.4, full_first=1, full_last=1)])
def test_unpadded_prompts_attend_with_no_mask_as_under_one(model_dir, partial, monkeypatch, caplog):
    """Prompts with no padding: no mask is built, the logits equal to fp32 rounding those of the masked attention and
    of one chunk, the same tokens and partial-FFN selection; forced under a mask (a GPU without a mask-free kernel),
    it says so once."""
    model = load_on_test_device(model_dir, partial)
    x = torch.randint(0, 512, (2, 23), generator=seeded(8)).to(model.device)

    def run():
        attended = _spy(monkeypatch, "_causal_attention")
        gen = Generator(model, 30, batch=2, fused=False)
        logits = gen._prefill(x, None)[0]
        out = gen.generate(x, 6)
        return logits, out.tokens, out.selected, len(attended)

    monkeypatch.setattr(memfit.log, "_said", set())
    caplog.set_level(logging.DEBUG, logger="memfit")
    _force_mask(monkeypatch)
    masked_logits, masked_tokens, masked_selected, calls = run()
    assert calls == 0 and "prompts without padding prefill under an attention mask" in caplog.text
    _force_mask(monkeypatch, on=False)
    whole_logits, whole_tokens, whole_selected, calls = run()
    assert calls == 2 * SPEC.num_layers                         # a prefill, then generate's own
    monkeypatch.setattr(generate, "PREFILL_ACTIVATION_BYTES", 4 * 2 * Generator(model, 30, batch=2).token_bytes)
    chunked_logits, chunked_tokens, chunked_selected, calls = run()
    assert calls == 2 * 6 * SPEC.num_layers and "23 tokens forward in 6 chunks of queries (no mask" in caplog.text
    for logits in (whole_logits, chunked_logits):
        assert (logits - masked_logits).norm() / masked_logits.norm() < 1e-5
    assert torch.equal(whole_tokens, masked_tokens) and torch.equal(chunked_tokens, masked_tokens)
    assert len(masked_selected) == (1 if partial else 0)        # the middle layer of three
    for selected in (whole_selected, chunked_selected):
        assert all(torch.equal(a, b) for a, b in zip(selected, masked_selected, strict=True))


@pytest.mark.skipif(torch.get_default_device().type != "cuda", reason="flash attention runs on CUDA (MEMFIT_TEST_DEVICE)")
def test_on_cuda_an_unpadded_bf16_prefill_runs_flash_attention_in_chunks(model_dir, monkeypatch):
    """The mask-free path's kernel on a GPU: with SDPA allowed flash attention alone (a chunk it could not take would
    stop with no kernel to run), the chunks' first-token logits equal the masked whole prompt's to bf16 rounding.
    With only the math kernel allowed (switched after the Generator was built), it attends under the mask instead:
    torch would have materialised every score."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = load_on_test_device(model_dir).to(torch.bfloat16)
    x = torch.randint(0, 512, (2, 40), generator=seeded(9))
    gen = Generator(model, 48, batch=2, fused=False)
    monkeypatch.setattr(generate, "PREFILL_ACTIVATION_BYTES", 7 * 2 * gen.token_bytes)
    attended = _spy(monkeypatch, "_causal_attention")
    with sdpa_kernel([SDPBackend.MATH]):
        masked = gen._prefill(x, None)[0].float()
    assert attended == []
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        chunked = gen._prefill(x, None)[0].float()
    assert len(attended) == 6 * SPEC.num_layers
    assert (chunked - masked).norm() / masked.norm() < 2e-2


@pytest.mark.parametrize("mask_free", [pytest.param(True, marks=NO_FP32_MASK_FREE_ON_CUDA), False])
def test_scoring_runs_its_teacher_forced_rest_in_chunks_too(model_dir, mask_free, monkeypatch):
    """score()'s rest (tokens after the prompt, all their logits) had run as one forward with a quadratic mask. With no
    mask, each chunk attends over exactly the keys up to its end (lower-right causal: a key rounded up would be
    seen)."""
    model = load_on_test_device(model_dir)
    x = torch.randint(0, 512, (2, 40), generator=seeded(4)).to(model.device)
    _force_mask(monkeypatch)
    whole = Generator(model, 40, batch=2, fused=False).score(x, 6)
    _force_mask(monkeypatch, on=not mask_free)
    masks = []
    real = Generator._mask
    monkeypatch.setattr(Generator, "_mask", lambda self, *args: masks.append(real(self, *args)) or masks[-1])
    attended = _spy(monkeypatch, "_causal_attention")
    monkeypatch.setattr(generate, "PREFILL_MASK_BYTES", _budget_for(5, 2, 40))
    monkeypatch.setattr(generate, "PREFILL_ACTIVATION_BYTES", 5 * 2 * Generator(model, 40, batch=2).token_bytes)
    gen = Generator(model, 40, batch=2, fused=False)
    chunked = gen.score(x, 6)
    assert chunked.shape == whole.shape == (2, 34, 512)
    assert (chunked - whole).norm() / whole.norm() < 1e-5
    if mask_free:
        shapes = [(q.shape[2], k.shape[2]) for q, k, *_ in attended[::SPEC.num_layers]]
        assert masks == [] and shapes == [(5, 5), (1, 6)] + [(5, end) for end in range(11, 39, 5)] + [(3, 39)]
    else:
        assert attended == [] and masks[0].shape[2] == G * 6       # the 6-token prompt over its 8 keys: one chunk
        assert len(masks) == 8 and max(m.shape[2] for m in masks[1:]) == G * 5    # the rest: 33 queries, 5 at a time


def test_every_mask_spans_a_multiple_of_8_keys(model_dir, monkeypatch):
    """The cache holds max_len slots rounded up to KEY_ALIGN: a max_len of 13 had given the prefill and every
    non-kernel decode step a 13-key mask, which SDPA's memory-efficient kernel copies into a padded one."""
    masks = []
    real = Generator._mask
    monkeypatch.setattr(Generator, "_mask", lambda self, *args: masks.append(real(self, *args)) or masks[-1])
    gen = Generator(load_on_test_device(model_dir), 13, batch=1, fused=False, fast=False)
    prompt = torch.randint(0, 512, (1, 9), generator=seeded(7))
    out = gen.generate(prompt, 4, attention_mask=torch.ones_like(prompt).index_fill_(1, torch.tensor([0]), 0))
    assert gen.cache_len == 16 and out.tokens.shape == (1, 4)
    assert len(masks) >= 4 and all(m.shape[-1] % generate.KEY_ALIGN == 0 for m in masks)


@pytest.mark.cpu_only(reason="forces memfit's decode kernels, through the Triton interpreter on CPU tensors")
def test_a_one_token_chunk_is_prefilled_not_decoded(model_dir, monkeypatch):
    """A chunk of one token (a prompt's last, or a 1-token prompt) had taken the decode step's path: memfit's decode
    attention kernel, the decode matmul picks and the compiled helpers, which a new shape recompiles."""
    model = load_on_test_device(model_dir)
    gen = Generator(model, 16, batch=1, fast=True)
    calls = []
    real = generate.decode_attention
    monkeypatch.setattr(generate, "decode_attention", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(generate, "PREFILL_ACTIVATION_BYTES", 4 * gen.token_bytes)
    x = torch.randint(0, 512, (1, 9), generator=seeded(5)).to(model.device)
    assert gen.prefill_chunks(9, masked=False) == [(0, 4), (4, 8), (8, 9)]
    gen.prefill(x)
    gen.prefill(x[:, :1])
    assert calls == []
    gen.decode(1)
    assert len(calls) == SPEC.num_layers


@MEASURES_A_CPU_RUN
@pytest.mark.parametrize("padded", [True, False])
def test_a_prefill_in_chunks_never_holds_the_whole_prompts_mask(padded, monkeypatch):
    """On the CPU tracker: a padded batch's chunked prefill peaks below its whole prompt's by more than that prompt's
    G-fold additive mask alone (its scores shrink too); an unpadded batch's whole prompt, with no mask, peaks below
    the masked one's by most of that mask (0.8 of it: 0.85 since the loop frees a layer's attention locals before its
    MLP runs, above 0.9 before), and in chunks lower still (its activations shrink)."""
    torch.manual_seed(0)
    model = build_model(SPEC.with_(num_layers=2)).float().eval()
    B, T = 2, 384
    x = torch.randint(0, 512, (B, T), generator=seeded(3))
    attention_mask = torch.ones_like(x)
    attention_mask[1, 0] = 0

    def peak(masked=padded):
        _force_mask(monkeypatch, on=masked)
        gen = Generator(model, T + 2, batch=B, fused=False)
        baseline = tuple(model.parameters()) + tuple(model.buffers()) + tuple(gen.k_cache) + tuple(gen.v_cache)
        with PeakMeter("cpu", baseline) as meter:
            gen.prefill(x, attention_mask if padded else None)
        return meter.peak, len(gen.prefill_chunks(T, masked=masked))

    whole, one = peak()
    monkeypatch.setattr(generate, "PREFILL_MASK_BYTES", _budget_for(32, B, T))
    monkeypatch.setattr(generate, "PREFILL_ACTIVATION_BYTES", 32 * B * Generator(model, 8, batch=B).token_bytes)
    chunked, chunks = peak()
    assert (one, chunks) == (1, 12)
    if padded:
        assert whole - chunked > B * G * T * T * 4
    else:
        monkeypatch.setattr(generate, "PREFILL_MASK_BYTES", 2**62)
        masked_whole, _ = peak(masked=True)
        assert masked_whole - whole > 0.8 * B * G * T * T * 4 and chunked < whole
