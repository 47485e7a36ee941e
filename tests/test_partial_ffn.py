"""Partial FFN loading/computation (memfit.infer): exactness, counts, the selection rule, loading, errors."""
import argparse
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import default_device, load_on_test_device, seeded

from memfit.errors import MemfitError
from memfit.infer import partial_load
from memfit.infer.calibrate import Rankings, calibrate, prompt_batches, read_prompts
from memfit.infer.generate import Generator, weight_bytes_per_token
from memfit.infer.partial_load import PartialConfig, expected_ffn_params, ffn_params, load_model, partial_rankings
from memfit.infer.selection import PartialMLP, choose_neurons, count_top_activations, partial_mlps
from memfit.models import PRESETS, build_model, save_model_dir

SPEC = PRESETS["tiny"].with_(num_layers=5)          # hidden 64, intermediate 176, GQA 4/2, vocab 512
PARTIAL = dict(full_first=1, full_last=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    directory = save_model_dir(SPEC, tmp_path_factory.mktemp("tiny"))
    dense = load_on_test_device(directory)
    gen = seeded(1)
    batches = [(torch.randint(0, 512, (3, 24), generator=gen), torch.ones(3, 24, dtype=torch.long), task)
               for task in (None, "code")]
    calibrate(dense, batches).save(directory / "rankings.safetensors")
    return directory


@pytest.fixture(scope="module")
def dense(model_dir):
    return load_on_test_device(model_dir)


def _ids(shape, seed):
    return torch.randint(0, 512, shape, generator=seeded(seed))


@pytest.mark.parametrize("fused", [False, True])
def test_gamma_phi_one_equals_dense_exactly(model_dir, dense, fused):
    """gamma = phi = 1 equals the dense model bit for bit through the same path: the Hugging Face forward,
    and the decode loop with separate matmuls (``fused=False``) or fused ones (one q/k/v and one gate/up matmul,
    the same shapes for the partial and the dense model). The fused loop against the *unfused* one agrees only
    to rounding (other matmul shapes may sum in another order): ``test_fused_decode_matches_unfused``."""
    full = load_on_test_device(model_dir, PartialConfig(load=1.0, compute=1.0, **PARTIAL))
    assert len(partial_mlps(full)) == 3
    x = _ids((2, 11), 2)
    assert torch.equal(full(x).logits, dense(x).logits)
    out_full = Generator(full, 24, fused=fused).generate(x[:1], 12).tokens
    out_dense = Generator(dense, 24, fused=fused).generate(x[:1], 12).tokens
    assert torch.equal(out_full, out_dense)
    assert torch.equal(Generator(full, 24, batch=2, fused=fused).score(x, 5), Generator(dense, 24, batch=2, fused=fused).score(x, 5))


def test_fused_decode_matches_unfused(model_dir, dense):
    """The fused layout shares storage (no extra bytes) and the fused loop equals the unfused one to fp32 rounding."""
    for layer in dense.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_proj.weight.untyped_storage().data_ptr()
    plain = load_on_test_device(model_dir, fuse=False)
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in dense.parameters())
    config = PartialConfig(load=0.7, compute=0.4, **PARTIAL)
    seq = _ids((2, 16), 9)
    for model in (dense, load_on_test_device(model_dir, config)):
        fused, unfused = Generator(model, 20, batch=2), Generator(model, 20, batch=2, fused=False)
        assert fused.fused_layers == SPEC.num_layers and unfused.fused_layers == 0
        got, ref = fused.score(seq, 7), unfused.score(seq, 7)
        assert 0 < (got - ref).norm() / ref.norm() < 1e-5 or torch.equal(got, ref)
        assert torch.equal(fused.generate(seq, 4).tokens, unfused.generate(seq, 4).tokens)
    assert Generator(plain, 20).fused_layers == 0                     # separate tensors: decodes unfused, same result
    assert torch.equal(Generator(plain, 20, fused=False).score(seq[:1], 7), Generator(dense, 20, fused=False).score(seq[:1], 7))


def test_attention_output_in_the_gpu_kernels_layout(monkeypatch):
    """Regression: the memory-efficient/cuDNN SDPA kernels return (B, heads, rows, D) over (B, rows, heads, D) memory;
    merging heads with ``view`` crashed on it (small-model shape: 6 query / 2 KV heads, fp32 on the H200)."""
    from memfit.infer import generate

    spec = PRESETS["tiny"].with_(num_layers=2, hidden=96, intermediate=64, num_heads=6, num_kv_heads=2, head_dim=16, vocab=259)
    model = build_model(spec, dtype="float32", device=torch.get_default_device())
    seq = _ids((1, 12), 10) % 259

    def masked_score():       # an unpadded prompt attends with no mask where it can; the masked path is the one here
        monkeypatch.setattr(generate, "mask_free_causal_kernel", lambda *args: False)
        return Generator(model, 16, fused=False).score(seq, 5)

    expected = masked_score()
    original, seen = generate._attention, []

    def gpu_layout(*args):
        o = original(*args).transpose(1, 2).contiguous().transpose(1, 2)
        seen.append(o.shape)
        with pytest.raises(RuntimeError, match="view size"):       # what the old merge did
            o.view(o.shape[0], spec.num_heads, -1, o.shape[-1])
        return o
    monkeypatch.setattr(generate, "_attention", gpu_layout)
    assert torch.equal(masked_score(), expected)
    assert seen and all(shape[2] > 1 for shape in seen)                # grouped rows: G * T


def test_decode_loop_matches_hf_greedy_and_forward(dense):
    x = _ids((1, 7), 3)
    out = Generator(dense, 20).generate(x, 9).tokens
    ids = x
    for _ in range(9):
        ids = torch.cat([ids, dense(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ids[:, 7:].cpu())                   # generate returns its tokens on the CPU
    seq = _ids((2, 15), 4)
    ref = dense(seq).logits[:, 5:14]
    got = Generator(dense, 20, batch=2).score(seq, 6)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


def test_batch_left_padding_matches_single(dense):
    x = _ids((2, 9), 5)
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    both = Generator(dense, 20, batch=2).generate(x, 8, attention_mask=mask).tokens
    alone = Generator(dense, 20).generate(x[1:, 4:], 8).tokens
    assert torch.equal(both[1], alone[0])


@pytest.mark.parametrize("gamma", [0.5, 0.7])
def test_loaded_parameter_count_matches_gamma(model_dir, dense, gamma):
    config = PartialConfig(load=gamma, compute=0.4, **PARTIAL)
    model = load_on_test_device(model_dir, config)
    k = round(gamma * SPEC.intermediate / 8) * 8
    for mlp in partial_mlps(model):
        assert mlp.gate_weight.shape == mlp.up_weight.shape == (k, SPEC.hidden)
        assert mlp.down_weight.shape == (SPEC.hidden, k)
    assert ffn_params(model) == expected_ffn_params(SPEC, config) == 3 * SPEC.hidden * (3 * k + 2 * SPEC.intermediate)
    saved = 3 * 3 * SPEC.hidden * (SPEC.intermediate - k)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in dense.parameters()) - saved
    # loaded neurons hold exactly the dense weights of their ids
    mlp, layer = model.model.layers[2].mlp, dense.model.layers[2].mlp
    assert torch.equal(mlp.gate_weight, layer.gate_proj.weight[mlp.neuron_ids])
    assert torch.equal(mlp.down_weight, layer.down_proj.weight[:, mlp.neuron_ids])


def test_selection_rule_on_hand_made_activations():
    # 5 tokens x 10 neurons; keep = top ceil(0.2 * 10) = 2 per token, only if positive
    h = torch.tensor([
        [9., 8., 0., 0., 0., 0., 0., 0., 0., 0.],     # keeps 0, 1
        [9., 0., 7., 0., 0., 0., 0., 0., 0., 0.],     # keeps 0, 2
        [-1, -1, -1, -1, -1, -1, -1, -1, 3., -2],     # keeps 8 only (the second best is negative)
        [0., 5., 0., 0., 0., 0., 0., 0., 6., 0.],     # keeps 8, 1
        [9., 9., 9., 9., 9., 9., 9., 9., 9., 9.],     # padding: counts nothing
    ])
    mask = torch.tensor([True, True, True, True, False])
    counts = count_top_activations(h, token_mask=mask)
    assert counts.tolist() == [2, 2, 1, 0, 0, 0, 0, 0, 2, 0]
    base = torch.zeros(10, dtype=torch.bool)
    base[[5, 9]] = True
    # m = 5: base {5, 9} + the three most counted of {0, 1, 8} (count 2)
    assert choose_neurons(counts, base, 5).tolist() == [0, 1, 5, 8, 9]
    # m = 4: a tie among 0, 1, 8 for two places goes to the better calibration priority (lower)
    priority = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2, 1, 0])
    assert choose_neurons(counts, base, 4, priority).tolist() == [1, 5, 8, 9]
    with pytest.raises(MemfitError, match="base neurons"):
        choose_neurons(counts, base, 1)


def test_partial_mlp_permutes_contiguously_and_restores():
    k, hidden = 12, 7
    ids = torch.arange(0, 24, 2)
    mlp = PartialMLP(hidden, ids, torch.zeros(k, dtype=torch.bool), torch.arange(k), 4, F.silu)
    for p in mlp.parameters():
        p.data.normal_()
    gate, down = mlp.gate_weight.clone(), mlp.down_weight.clone()
    x = torch.randn(1, 6, hidden)
    mlp.begin_prompt()
    full = mlp(x)
    chosen = mlp.end_prompt()
    positions = torch.searchsorted(ids, chosen)
    assert mlp.active == 4 and torch.equal(mlp.gate_weight[:4], gate[positions])
    assert torch.equal(mlp.down_weight[:, :4], down[:, positions])
    expected = F.linear(F.silu(F.linear(x, gate[positions])) * F.linear(x, mlp.up_weight[:4]), down[:, positions])
    assert torch.allclose(mlp(x), expected, atol=1e-6)
    mlp.restore()
    assert torch.equal(mlp.gate_weight, gate) and torch.equal(mlp.down_weight, down) and torch.equal(mlp.neuron_ids, ids)
    assert torch.equal(mlp(x), full)


def _masked_reference(dense, config, model, seq, prompt_len):
    """Dense forward where partial layers use their loaded neurons on the prompt and the selected ones after it."""
    layers = config.partial_layers(SPEC.num_layers)
    originals = {}
    for index, mlp in zip(layers, partial_mlps(model)):
        loaded = torch.zeros(SPEC.intermediate)
        loaded[mlp.neuron_ids] = 1
        selected = torch.zeros(SPEC.intermediate)
        selected[mlp.neuron_ids[: mlp.active]] = 1
        dense_mlp = dense.model.layers[index].mlp
        originals[index] = dense_mlp.forward

        def forward(x, m=dense_mlp, loaded=loaded, selected=selected):
            h = m.act_fn(m.gate_proj(x)) * m.up_proj(x)
            h = torch.cat([h[:, :prompt_len] * loaded, h[:, prompt_len:] * selected], dim=1)
            return m.down_proj(h)
        dense_mlp.forward = forward
    try:
        return dense(seq).logits
    finally:
        for index, fn in originals.items():
            dense.model.layers[index].mlp.forward = fn


def test_partial_decode_computes_the_selected_neurons(model_dir, dense):
    config = PartialConfig(load=0.7, compute=0.4, **PARTIAL)
    model = load_on_test_device(model_dir, config)
    seq = _ids((1, 16), 6)
    got = Generator(model, 20).score(seq, 9)
    ref = _masked_reference(dense, config, model, seq, 9)[:, 8:15]
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()
    # decode really differs from the loaded-neuron model (the test can fail)
    assert not torch.allclose(got, dense(seq).logits[:, 8:15], atol=1e-3)
    dense_bytes = weight_bytes_per_token(dense)
    saved = 3 * 3 * SPEC.hidden * (SPEC.intermediate - 72) * 4   # 3 partial layers computing 72 of 176 neurons, fp32
    assert weight_bytes_per_token(model) == dense_bytes - saved


def test_compute_all_layers_selects_in_full_layers_too(model_dir):
    config = PartialConfig(load=0.7, compute=0.4, compute_all_layers=True, **PARTIAL)
    model = load_on_test_device(model_dir, config)
    mlps = partial_mlps(model)
    assert [m.loaded for m in mlps] == [176, 120, 120, 120, 176] and all(m.compute == 72 for m in mlps)
    assert ffn_params(model) == expected_ffn_params(SPEC, config)
    Generator(model, 16).generate(_ids((1, 8), 8), 2)
    assert all(m.active == 72 for m in mlps)


def test_saved_rankings_reload_with_same_selection(model_dir, dense, tmp_path):
    config = PartialConfig(load=0.7, compute=0.4, task="code", **PARTIAL)
    first = load_on_test_device(model_dir, config)
    again = load_on_test_device(model_dir, config, rankings=Rankings.load(model_dir / "rankings.safetensors"))
    for a, b in zip(partial_mlps(first), partial_mlps(again)):
        assert torch.equal(a.neuron_ids, b.neuron_ids) and torch.equal(a.base, b.base)
    prompt = _ids((1, 10), 7)
    sel_a = Generator(first, 16).generate(prompt, 3).selected
    sel_b = Generator(again, 16).generate(prompt, 3).selected
    assert all(torch.equal(a, b) for a, b in zip(sel_a, sel_b))
    # the task ranking's top-delta neurons are the base of each layer
    rank = Rankings.load(model_dir / "rankings.safetensors").rank("code")
    for index, mlp in zip(config.partial_layers(SPEC.num_layers), partial_mlps(first)):
        assert set(mlp.neuron_ids[mlp.base].tolist()) == set(rank[index, :56].tolist())


def test_loader_never_materialises_discarded_neurons(model_dir, monkeypatch):
    monkeypatch.setattr(partial_load, "CHUNK_BYTES", 64 * 4 * 2 * 16)   # 16 rows of the FFN at a time
    reads = []
    original = partial_load._Reader._slice

    def spy(self, name):
        sl = original(self, name)

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, key):
                part = sl[key]
                reads.append((name, tuple(part.shape)))
                return part
        return Slice()
    monkeypatch.setattr(partial_load._Reader, "_slice", spy)
    model = load_on_test_device(model_dir, PartialConfig(load=0.5, compute=0.5, **PARTIAL))
    ffn_reads = [shape for name, shape in reads if ".mlp." in name and not name.startswith(("model.layers.0.", "model.layers.4."))]
    assert ffn_reads and max(rows for rows, _ in ffn_reads) <= 16     # discarded rows pass only through small CPU chunks
    for mlp in partial_mlps(model):                                  # ...and the model holds the kept ones only
        assert mlp.gate_weight.shape == (88, SPEC.hidden) and mlp.down_weight.shape == (SPEC.hidden, 88)


@pytest.mark.parametrize("kwargs, match", [
    (dict(load=0.0), "load"), (dict(load=1.5), "load"), (dict(load=0.5, compute=0.7), "cannot exceed"),
    (dict(load=0.7, compute=0.4, base=0.5), "base"), (dict(full_first=3, full_last=3), "the model has 5"),
    (dict(full_first=-1), "full_first"),
])
def test_bad_options_are_memfit_errors(model_dir, kwargs, match):
    with pytest.raises(MemfitError, match=match):
        load_model(model_dir, PartialConfig(**kwargs))


def test_rankings_calibrated_on_other_weights_are_said(model_dir, tmp_path, monkeypatch):
    """A rankings file passed only the shape check: one calibrated on another model of the same shape (another seed,
    a fine-tune) chose neurons for weights it never saw, unsaid. It carries the calibrated weights' fingerprint now,
    compared with the model directory's; a file without one (older) is taken as before."""
    from memfit.infer import partial_load

    said = []
    monkeypatch.setattr(partial_load, "warn_once", lambda key, message: said.append(message))
    rankings = Rankings.load(model_dir / "rankings.safetensors")
    assert rankings.model is not None
    partial = PartialConfig(load=0.5, **PARTIAL)
    assert partial_rankings(model_dir, partial, SPEC) is not None and said == []
    other_dir = tmp_path / "other"
    build_model(SPEC, seed=123).save_pretrained(other_dir)
    partial_rankings(other_dir, partial, SPEC, model_dir / "rankings.safetensors")
    assert len(said) == 1 and said[0].startswith(f"the rankings were calibrated on a model with other weights than "
                                                 f"{other_dir} (fingerprint {rankings.model}, this model's ")
    rankings.model = None
    partial_rankings(other_dir, partial, SPEC, rankings)
    assert len(said) == 1


def test_bad_inputs_are_memfit_errors(model_dir, dense, tmp_path):
    other = Rankings(scores={"general": torch.rand(3, 100)})
    with pytest.raises(MemfitError, match="3 layers x 100"):
        load_model(model_dir, PartialConfig(load=0.5), rankings=other)
    with pytest.raises(MemfitError, match="memfit calibrate"):
        load_model(model_dir, PartialConfig(load=0.5), rankings=tmp_path / "none.safetensors")
    with pytest.raises(MemfitError, match="task 'nope'"):
        load_model(model_dir, PartialConfig(load=0.5, task="nope"))
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(MemfitError, match="p.jsonl:2"):
        read_prompts(bad)
    gen = Generator(dense, 8)
    with pytest.raises(MemfitError, match="fit in max_len"):
        gen.generate(_ids((1, 8), 0), 1)
    mask = torch.ones(1, 4, dtype=torch.long)
    mask[0, -1] = 0
    with pytest.raises(MemfitError, match="left"):
        gen.generate(_ids((1, 4), 0), 2, attention_mask=mask)


@pytest.mark.parametrize("prompt, match", [
    (torch.arange(5), r"input_ids must be an integer tensor of shape \(batch, prompt length >= 1\), got torch.int64 of "
                      r"shape \(5,\)"),
    (torch.zeros(1, 0, dtype=torch.long), r"got torch.int64 of shape \(1, 0\)"),
    (torch.zeros(1, 3), "got torch.float32"),
    (torch.tensor([[1, 512, 2]]), "input_ids hold ids from 1 to 512; the model's vocabulary is 0 to 511"),
    (torch.tensor([[-1, 2]]), "ids from -1 to 2"),
    (torch.zeros(0, 3, dtype=torch.long), "this generator was built for batch 1, got 0 prompts"),
])
def test_the_generator_refuses_prompts_it_cannot_read(dense, prompt, match):
    """Each had ended in an IndexError deep in the loop or the embedding (from an API audit)."""
    gen = Generator(dense, 8)
    for call in (lambda: gen.generate(prompt, 2), lambda: gen.prefill(prompt)):
        with pytest.raises(MemfitError, match=match):
            call()


def test_the_generator_refuses_an_architecture_its_loop_does_not_implement():
    """The loop rebuilds Llama, Qwen2 and Mistral layers; a Qwen3 model (its attention normalises q and k) had
    decoded other greedy tokens than its own generate, silently (from an API audit)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(num_hidden_layers=1, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512)
    with pytest.raises(MemfitError, match="implements llama, qwen2, mistral models, not model_type 'qwen3'"):
        Generator(AutoModelForCausalLM.from_config(config).eval(), 8)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_the_generator_refuses_a_temperature_that_is_not_a_finite_number_from_0(dense, temperature):
    """NaN had been taken (every token 0); the CLI refused it, the library did not (from an API audit)."""
    with pytest.raises(MemfitError, match=f"temperature must be a finite number >= 0 .*got {temperature}"):
        Generator(dense, 8, temperature=temperature)


def test_a_tiny_temperature_samples_the_greedy_tokens_and_a_small_one_its_distribution():
    """logits / 1e-39 had overflowed float32 to inf, every token 0; sampling at T < 1 is computed as logits + T noise
    (the same argmax), whose limit at a tiny T is greedy. At T = 0.5 the tokens are drawn with softmax(logits / T)."""
    model = build_model(SPEC.with_(num_layers=1), device=torch.get_default_device()).eval()
    x = _ids((1, 5), 3)
    assert torch.equal(Generator(model, 12, temperature=1e-39).generate(x, 6).tokens,
                       Generator(model, 12).generate(x, 6).tokens)
    torch.manual_seed(0)
    logits = (0.5 * torch.tensor([1.0, 2.0, 3.0]).log()).expand(20000, 3).contiguous()
    drawn = torch.bincount(Generator(model, 12, temperature=0.5)._sample(logits), minlength=3) / 20000
    assert torch.allclose(drawn, torch.tensor([1 / 6, 2 / 6, 3 / 6]), atol=0.015)


def test_decode_refuses_steps_past_max_len_before_running_one(dense):
    """decode had no bound: a step past max_len indexed out of range (on CUDA a device-side assert in the replayed
    graph, which ends the CUDA context). The slots left are counted on the host; a refused call runs no step."""
    gen = Generator(dense, 8)
    with pytest.raises(MemfitError, match="call prefill"):
        gen.decode(1)
    gen.prefill(_ids((1, 5), 4))
    with pytest.raises(MemfitError, match=r"decode\(4\) takes an integer from 0 to 3, the cache slots left of max_len=8"):
        gen.decode(4)
    assert int(gen.slot) == 5
    gen.decode(2)
    with pytest.raises(MemfitError, match=r"decode\(-1\) takes an integer from 0 to 1"):
        gen.decode(-1)
    gen.decode(1)
    with pytest.raises(MemfitError, match="from 0 to 0"):
        gen.decode(1)
    assert int(gen.slot) == 8
    gen.prefill(_ids((1, 5), 4))                       # a new prompt: its slots counted afresh
    gen.decode(3)


def test_the_generator_and_loader_refuse_or_take_arguments_by_name(model_dir, dense):
    """A float max_len had ended in a TypeError at the cache's allocation; a preset's name in load_model in a
    network error (read as a hub id); device="auto" and dtype="auto", which load_compressed takes, in a RuntimeError
    and a refusal."""
    with pytest.raises(MemfitError, match="max_len must be an integer >= 2 .*got max_len=32.0"):
        Generator(dense, 32.0)
    with pytest.raises(MemfitError, match="'tiny' is not a model directory \\(a preset is a shape without weights"):
        load_model("tiny")
    model = load_model(model_dir, device="auto", dtype="auto")
    assert model.get_input_embeddings().weight.dtype == dense.get_input_embeddings().weight.dtype
    assert build_model("tiny", device="auto").config.num_hidden_layers == PRESETS["tiny"].num_layers


def test_the_command_records_its_directorys_fingerprint_whatever_dtype_it_reads(model_dir, tmp_path, monkeypatch):
    """A model read in float16 rounds its weights twice on the way to the fingerprint's bfloat16: the rankings of
    `memfit calibrate --dtype float16` had been said, at generate, to come from other weights (a review)."""
    from memfit.commands import calibrate as calibrate_cmd
    from memfit.infer import partial_load

    said = []
    monkeypatch.setattr(partial_load, "warn_once", lambda key, message: said.append(message))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"text": "hello there"}) + "\n")
    out = tmp_path / "r.safetensors"
    assert calibrate_cmd.run(argparse.Namespace(model=str(model_dir), data=str(data), out=str(out), force=False,
                                                max_tokens=64, batch_size=2, device="cpu", dtype="float16")) == 0
    partial_rankings(model_dir, PartialConfig(load=0.5, **PARTIAL), SPEC, out)
    assert said == []


def test_cli_calibrate_then_generate(model_dir, tmp_path, capsys):
    from memfit.commands import calibrate as calibrate_cmd
    from memfit.commands import generate as generate_cmd

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"text": t, "task": "qa"}) for t in ("hello there", "what is 2+2?")) + "\n")
    out = tmp_path / "r.safetensors"
    args = dict(model=str(model_dir), data=str(data), out=str(out), force=False, max_tokens=64, batch_size=2,
                device="cpu", dtype=None)
    assert calibrate_cmd.run(argparse.Namespace(**args)) == 0
    assert Rankings.load(out).tasks == ["qa"]
    with pytest.raises(MemfitError, match="--force"):
        calibrate_cmd.run(argparse.Namespace(**args))
    assert calibrate_cmd.run(argparse.Namespace(**(args | {"force": True}))) == 0    # an earlier rankings file
    gen_args = dict(model=str(model_dir), prompt=["hi"], max_new=4, load=0.7, compute=0.4, base=None, full_first=1,
                    full_last=1, task="qa", rankings=str(out), compute_all_layers=True, temperature=0.0, seed=None, device="cpu", dtype=None, no_graphs=False, raw_prompt=False,
                    adapter=None)
    capsys.readouterr()
    assert generate_cmd.run(argparse.Namespace(**gen_args)) == 0
    said = " ".join(capsys.readouterr().err.split())         # rich wraps the line at the console's width
    # load 0.7 and compute 0.4 of 176 neurons in blocks of 8: 15 and 9 blocks; base 0.3 (the default): 7 blocks
    assert ("partial FFN: layers 1..3 of 5: load 120/176 neurons (base 56); decode computes 72 in every layer"
            in said), said
    with pytest.raises(MemfitError, match="not a model directory"):
        generate_cmd.run(argparse.Namespace(**{**gen_args, "model": "tiny"}))


def test_prompt_batches_group_by_task():
    prompts = [{"text": "ab", "task": None}, {"text": "abcd", "task": "x"}, {"text": "abc", "task": None}]
    batches = list(prompt_batches(prompts, lambda t: list(t.encode()), max_tokens=3, batch_size=4))
    assert [(tuple(ids.shape), int(mask.sum()), task) for ids, mask, task in batches] == [((2, 3), 5, None), ((1, 3), 3, "x")]


def test_the_reader_reads_on_the_cpu_whatever_the_default_device(tmp_path):
    """safetensors builds a slice on torch's default device: under torch.set_default_device("cuda") partial loading's
    row chunks were CUDA tensors, indexed by CPU neuron ids. The meta device stands in for CUDA here (a read left on
    it has no data to copy)."""
    from safetensors.torch import save_file

    from memfit.infer.partial_load import _Reader

    weight = torch.arange(24.0, device="cpu").reshape(6, 4)
    save_file({"w": weight}, tmp_path / "a.safetensors")
    reader = _Reader({"w": tmp_path / "a.safetensors"})
    ids = torch.tensor([1, 3], device="cpu")
    rows, columns, whole = (torch.empty(shape, device="cpu") for shape in ((2, 4), (6, 2), (6, 4)))
    with default_device("meta"):
        reader.selected("w", ids, 0, rows)
        reader.selected("w", ids, 1, columns)
        reader.full("w", whole)
    assert torch.equal(rows, weight[ids]) and torch.equal(columns, weight[:, ids]) and torch.equal(whole, weight)
