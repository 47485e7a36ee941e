"""Fused-loss patch, JSONL loading, the training loop's exact resume and `memfit finetune`."""
import argparse
import json
import re

import pytest
import torch
from conftest import seeded

from memfit.data.jsonl import DEFAULT_DATA, IGNORE_INDEX, load_jsonl
from memfit.data.tokenizer import ByteTokenizer
from memfit.errors import MemfitError
from memfit.models import PRESETS, build_model
from memfit.train.finetune import TrainConfig, save_checkpoint, train
from memfit.train.patch import patch


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    """One thread (the test machine is shared); the loss kernel's own tests cover it under the interpreter,
    here it runs its CPU reference (the interpreter is slow at these sizes)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _loss_and_grads(fused: bool, num_items=None):
    model = build_model(PRESETS["tiny"], dtype="float32", device=torch.get_default_device())
    model = patch(model, fused_ce=fused, lora={"r": 4, "init_lora_weights": False})
    model.train()
    ids = torch.randint(0, 259, (3, 19), generator=seeded(3))
    labels = ids.clone()
    labels[0, :11] = IGNORE_INDEX
    labels[2, 5:9] = IGNORE_INDEX
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    out = model(input_ids=ids, labels=labels, use_cache=False, **extra)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("num_items", [None, 40])
def test_fused_loss_matches_hf_loss(num_items):
    plain, grads0 = _loss_and_grads(False, num_items)
    fused, grads1 = _loss_and_grads(True, num_items)
    assert plain.logits is not None and fused.logits is None  # the fused path never builds logits
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads0.items():
        assert grad.abs().sum() > 0, name
        # atol on the gradient's scale: entries near zero differ by the two sums' float32 rounding (5.5e-7 where the
        # largest entry is 0.68, in one draw of the weights)
        torch.testing.assert_close(grads1[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name)


def test_four_bit_needs_cuda_and_says_so():
    model = build_model(PRESETS["tiny"], dtype="float32")
    with pytest.raises(MemfitError, match="4-bit base"):
        patch(model, four_bit=True)


def _record_quantizing(monkeypatch):
    """Replace the NF4 quantizer (bitsandbytes, CUDA) by one that records, at each call, which of the tiny model's
    parts are on the meta device (the stand-in GPU here) and leaves the layer as it is."""
    from memfit.train import four_bit

    seen = []

    def record(layer, compute_dtype):
        decoder = record.model.model
        seen.append(([next(each.parameters()).device.type for each in decoder.layers],
                     decoder.embed_tokens.weight.device.type, layer is decoder.layers[len(seen)]))
        return 0

    monkeypatch.setattr(four_bit, "quantize_linears_4bit", record)
    return seen, record


def test_a_4bit_base_reaches_the_gpu_one_dense_layer_at_a_time(monkeypatch):
    """Each decoder layer is moved, then quantized, before the next one moves; the embeddings and head follow. The
    model had been moved whole, in its dense dtype, before patch quantized it."""
    from memfit.train.four_bit import to_device_4bit

    seen, record = _record_quantizing(monkeypatch)
    record.model = build_model(PRESETS["tiny"], dtype="float32")
    moved = to_device_4bit(record.model, "meta", torch.float32)
    layers = len(moved.model.layers)
    assert seen == [(["meta"] * (done + 1) + ["cpu"] * (layers - done - 1), "cpu", True) for done in range(layers)]
    assert {p.device.type for p in moved.parameters()} == {"meta"}


def test_finetune_and_verify_load_a_4bit_base_through_the_cpu(monkeypatch, tmp_path):
    """The finetune command loads the model on the CPU when its techniques take a 4-bit base, and verify builds it so,
    inference included: verify had measured an inference job's dense weights against the ledger's NF4 ones. The run's
    device is the meta device here (finetune) and a CUDA job (verify), so a model built on it is told apart."""
    from dataclasses import replace

    from memfit import local
    from memfit.commands import finetune
    from memfit.ledger import verify
    from memfit.ledger.job import Job, Knobs
    from memfit.train import four_bit

    moved = []

    def to_device(model, device, dtype):
        moved.append((next(model.parameters()).device.type, str(device), dtype))
        raise MemfitError("stop")

    monkeypatch.setattr(four_bit, "to_device_4bit", to_device)
    monkeypatch.setattr(local, "resolve_device",              # the run's device (auto); a model built on the CPU too
                        lambda name: torch.device("meta") if name == "auto" else torch.device(name))
    chosen = finetune.choose_techniques
    monkeypatch.setattr(finetune, "choose_techniques", lambda *a: replace(chosen(*a), four_bit=True))
    with pytest.raises(MemfitError, match="stop"):
        _cli(["--out", str(tmp_path / "run"), "--steps", "1"])
    with pytest.raises(MemfitError, match="stop"):
        verify._prepare(Job(PRESETS["tiny"], task="infer", device="cuda"), Knobs(dtype="bfloat16", four_bit=True))
    assert moved == [("cpu", "meta", torch.float32), ("cpu", "cuda", torch.bfloat16)]


def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a", "response": "b"', "data.jsonl:2: not valid JSON"),
    ('{"prompt": "a"}', "data.jsonl:2: 'response' must be a string"),
    ('{"text": "a"}', "data.jsonl:2: expected keys 'prompt' and 'response', or 'messages'"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "data.jsonl:2: messages\\[0\\] has role 'robot'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "data.jsonl:2: the conversation has no assistant"),
    ('[1, 2]', "data.jsonl:2: expected a JSON object"),
    ('{"prompt": "a", "response": "b", "messages": []}', "data.jsonl:2: the record has both 'messages' and 'prompt'"),
    ('[' * 100_000, "data.jsonl:2: the JSON is nested too deeply to read"),          # a RecursionError
    ('{"prompt": "\\ud800", "response": "b"}', r"data.jsonl:2: the text holds half a surrogate pair \('\\ud800' at "
                                               "character 0\\)"),              # a UnicodeEncodeError at tokenizing
])
def test_bad_jsonl_names_the_line(tmp_path, line, message):
    path = _write(tmp_path, ['{"prompt": "ok", "response": "fine"}', line])
    with pytest.raises(MemfitError, match=message):
        load_jsonl(path, ByteTokenizer(), 64)


def test_examples_cut_short_are_said(tmp_path, monkeypatch):
    """An example cut at max_len loses its end and the EOS that teaches the model to stop: that had gone unsaid
    (only examples cut down to no response token were)."""
    from memfit.data import jsonl

    said = []
    monkeypatch.setattr(jsonl, "warn_once", lambda key, message: said.append(message))
    path = _write(tmp_path, ['{"prompt": "ab", "response": "cdefgh"}', '{"prompt": "ab", "response": "c"}',
                             '{"prompt": "abcdefgh", "response": "i"}'])
    assert len(load_jsonl(path, ByteTokenizer(), 6)) == 2
    assert said == [f"{path}: 1 example(s) were cut at 6 tokens, so their end and its EOS are not trained; a longer "
                    "--max-len keeps them whole",
                    f"{path}: 1 example(s) lost all response tokens to truncation at 6 tokens and were skipped"]


def _sentencepiece_like(directory):
    """A BPE tokenizer that starts every text it encodes with a word boundary, as Llama-2's and Mistral's do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.train_from_iterator(["upper: abc\nABC", "reverse: abc\ncba"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=list("abcdefghijklmnopqrstuvwxyz:\n ")))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def test_a_response_is_tokenized_as_it_reads_after_its_prompt(tmp_path):
    """Each piece had been encoded alone, so a SentencePiece tokenizer put a word boundary token before every
    response: the model learnt to start its answers with a space. The text up to the EOS is encoded as one now, the
    prompt's tokens as memfit generate encodes an adapter's prompt (the prompt text alone)."""
    tok = _sentencepiece_like(tmp_path / "tok")
    path = _write(tmp_path, ['{"prompt": "upper: abc", "response": "abc"}'])
    example = load_jsonl(path, tok, 64)[0]
    prompt = tok.encode("upper: abc\n", add_special_tokens=False)
    whole = tok.encode("upper: abc\nabc", add_special_tokens=False)
    assert whole[:len(prompt)] == prompt and len(whole) > len(prompt)
    assert list(example.input_ids) == [*whole, tok.eos_token_id]
    assert list(example.labels) == [IGNORE_INDEX] * len(prompt) + [*whole[len(prompt):], tok.eos_token_id]
    # "upper: a" + "bc" reads "upper: abc", whose ":\u2581ab" token crosses the boundary: "bc" is encoded alone there
    from memfit.data.jsonl import _piece_tokens, encode_text

    assert _piece_tokens([("upper: a", False), ("bc", True)], tok) == [
        encode_text(tok, "upper: a"), [*encode_text(tok, "bc"), tok.eos_token_id]]


def test_loss_only_on_response_tokens(tmp_path):
    path = _write(tmp_path, ['{"prompt": "ab", "response": "cd"}',
                             '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}'])
    tok = ByteTokenizer()
    pair, chat = load_jsonl(path, tok, 64)
    assert pair.input_ids == tuple(b"ab\ncd") + (tok.eos_token_id,)
    assert pair.labels == (IGNORE_INDEX,) * 3 + tuple(b"cd") + (tok.eos_token_id,)
    assert [t for t in chat.labels if t != IGNORE_INDEX] == [ord("r"), tok.eos_token_id]


def _run(tmp_path, steps, resume=False, rank=4, lr=1e-2):
    tok = ByteTokenizer()
    examples = load_jsonl(DEFAULT_DATA, tok, 128)[:40]
    model = patch(build_model(PRESETS["tiny"], dtype="float32"), lora={"r": rank})
    config = TrainConfig(steps=steps, batch_size=4, lr=lr, save_every=3)
    return train(model, examples, tok.pad_token_id, config, tmp_path, resume=resume)


def test_resumed_run_continues_exactly(tmp_path):
    straight = _run(tmp_path / "a", 6)
    first = _run(tmp_path / "b", 3)
    resumed = _run(tmp_path / "b", 6, resume=True)
    assert first == straight[:3]
    assert resumed == straight  # bit-identical losses, the resumed steps included
    assert len(set(straight)) == 6


def test_a_resume_with_another_lora_rank_or_a_broken_checkpoint_is_one_clear_error(tmp_path):
    _run(tmp_path, 3)
    with pytest.raises(MemfitError, match=r"another --lora-r"):
        _run(tmp_path, 6, resume=True, rank=8)
    state = next((tmp_path / "checkpoints").glob("step-*")) / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(MemfitError, match="the checkpoint cannot be read"):
        _run(tmp_path, 6, resume=True)


def test_a_checkpoint_save_removes_what_a_killed_save_left(tmp_path):
    """A save killed between atomic_dir's renames leaves .step-N.old-<hex>, one killed while it wrote .step-N.tmp;
    a name a save cannot have made stays (the globs before had removed any name after "step-")."""
    kept = ["step-notes", ".step-0000001.old-backup", "step-0000001.bak"]
    for leftover in (".step-0000001.old-0123456789abcdef", ".step-0000003.tmp", ".step-0000002.tmp", "step-0000002",
                     *kept):
        (tmp_path / "checkpoints" / leftover).mkdir(parents=True)
    model = torch.nn.Linear(2, 2)          # the save itself: train() refuses a new run where step-0000002 is
    save_checkpoint(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), 3, [1.0], TrainConfig())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted(["latest", "step-0000003", *kept])


def test_a_diverged_loss_stops_training_before_anything_is_saved(tmp_path):
    with pytest.raises(MemfitError, match="training diverged"):
        _run(tmp_path, 6, lr=1e30)
    assert not list((tmp_path / "checkpoints").glob("step-*"))


def test_a_resume_past_the_asked_steps_says_there_is_nothing_to_train(tmp_path, monkeypatch):
    from memfit.train import finetune as loop

    said = []
    monkeypatch.setattr(loop, "warn_once", lambda key, message: said.append(message))
    _run(tmp_path, 3)
    assert len(_run(tmp_path, 2, resume=True)) == 3 and "nothing to train" in said[0]


def _cli(argv):
    from memfit.commands import finetune

    parser = argparse.ArgumentParser()
    finetune.add_parser(parser.add_subparsers())
    return finetune.run(parser.parse_args(["finetune", *argv]))


def test_a_bad_data_file_is_found_before_the_model_loads(tmp_path, monkeypatch):
    """A typo in the JSONL had cost a full model load first (found by a usage audit)."""
    from memfit.commands import finetune

    monkeypatch.setattr(finetune, "load_model", lambda *a: pytest.fail("loaded the model first"))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n[1, 2]\n')
    with pytest.raises(MemfitError, match="data.jsonl:2: expected a JSON object"):
        _cli(["--data", str(data), "--out", str(tmp_path / "run")])


def test_examples_past_the_models_positions_are_said_before_it_loads(tmp_path, monkeypatch):
    """finetune had trained on examples past max_position_embeddings unsaid (a usage audit); they are said, as plan
    notes such a job, not refused: a RoPE model runs them, and a long-context one (rope_scaling) keeps its original
    max_position_embeddings. The tiny preset has 4096 positions; a byte-tokenized example of 5000 characters is past."""
    from memfit.commands import finetune

    class Loaded(Exception):
        pass

    said = []
    monkeypatch.setattr(finetune, "warn_once", lambda key, message: said.append(message))
    monkeypatch.setattr(finetune, "load_model", lambda *a: (_ for _ in ()).throw(Loaded()))
    data = tmp_path / "long.jsonl"
    for length, says in ((4000, False), (5000, True)):
        data.write_text(json.dumps({"prompt": "a", "response": "b" * length}) + "\n")
        with pytest.raises(Loaded):
            _cli(["--data", str(data), "--max-len", "8192", "--out", str(tmp_path / f"run{length}"), "--device", "cpu"])
        assert bool(said) == says
    assert re.fullmatch(r"--max-len 8192: .*long.jsonl has examples of 5003 tokens, past tiny's max_position_embeddings "
                        r"\(4096\): they train .*", said[0])


def test_finetune_default_runs_and_loss_falls(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(["--out", str(out), "--steps", "40", "--save-every", "40"]) == 0
    said = " ".join(capsys.readouterr().err.split())   # the console is stderr's; rich wraps at the terminal's width
    assert re.search(r"over 40 steps, [\d,]+ tok/s over steps 2-40; adapter saved to", said)
    progress = json.loads(next((out / "checkpoints").glob("step-*/progress.json")).read_text())
    losses = progress["losses"]
    assert len(losses) == 40
    assert sum(losses[-8:]) / 8 < losses[0] - 0.3, losses
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and (out / "adapter" / "adapter_model.safetensors").is_file()
    from safetensors import safe_open

    with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as saved:   # --train-norm: the final norm only
        assert [name for name in saved.keys() if "norm" in name] == ["base_model.model.model.norm.weight"]
    with pytest.raises(MemfitError, match="--resume"):
        _cli(["--out", str(out), "--steps", "2"])


def test_the_summary_rate_leaves_out_the_first_step():
    """The summary's tok/s is the run's after its first step (kernel builds, optimizer state); the progress bar had
    been the only rate shown, each step's alone, and the last step's stayed on screen."""
    from memfit.commands.finetune import _throughput
    from memfit.train.finetune import StepReport

    reports = [StepReport(step, 1.0, tokens, seconds, 0) for step, tokens, seconds in ((5, 100, 10.0), (6, 100, 1.0),
                                                                                         (7, 300, 1.0))]
    assert _throughput(reports) == ", 200 tok/s over steps 6-7"
    assert _throughput(reports[:1]) == ""


def test_gpu_memory_plan_becomes_the_run_techniques():
    """--gpu-memory on CUDA takes the planner's fastest plan (checked here without a GPU)."""
    import argparse

    import torch
    from rich.console import Console

    from memfit.commands.finetune import choose_techniques
    from memfit.models import PRESETS

    spec = PRESETS["llama-3.2-3b"]
    args = argparse.Namespace(offload=None, checkpoint=None, offload_to="cpu", four_bit=False, fused_ce=True,
                              fused_swiglu=False, gpu_memory="8GiB", max_len=2048, batch_size=1, lora_r=16)
    techniques = choose_techniques(args, spec, torch.device("cuda"), torch.bfloat16, Console(file=None, quiet=True))
    assert techniques.fused_ce or techniques.four_bit or techniques.places is not None
    assert techniques.places is None or len(techniques.places) == spec.num_layers


def test_a_gpu_memory_plan_keeps_off_what_the_flags_turn_off():
    """--checkpoint none, --offload none (or 0), --no-fused-ce and --no-four-bit given with --gpu-memory keep the plan
    from those techniques (the plan had checkpointed, offloaded or fused the loss over them, unsaid): at 6 GiB, whose
    fastest plan offloads, checkpoints and takes the 4-bit base, no plan without any one of them fits; with room, the
    plan line says what was kept off."""
    import io

    from rich.console import Console

    from memfit.commands.finetune import choose_techniques
    from memfit.models import PRESETS

    def chosen(gpu_memory, **flags):
        said = io.StringIO()
        args = argparse.Namespace(**{"offload": None, "checkpoint": None, "fused_ce": True, "offload_to": "cpu",
                                     "four_bit": None, "fused_swiglu": False, "max_len": 4096, "batch_size": 2,
                                     "lora_r": 16,
                                     "gpu_memory": gpu_memory, **flags})
        techniques = choose_techniques(args, PRESETS["llama-3.2-3b"], torch.device("cuda"), torch.bfloat16,
                                       Console(file=said, width=300))
        return techniques, said.getvalue()

    free, said = chosen("6GiB")
    assert free.fused_ce and free.four_bit and not free.fused_swiglu and "cpu" in free.places and "as asked" not in said
    for refused in ({"offload": "none"}, {"offload": "0"}, {"offload": "00"}, {"checkpoint": "none"},
                    {"four_bit": False}):
        with pytest.raises(MemfitError, match="no plan fits 6.00 GiB"):
            chosen("6GiB", **refused)
    no_offload, said = chosen("8GiB", offload="none")
    assert "cpu" not in no_offload.places and "(no offload, as asked)" in said
    no_checkpoints, said = chosen("48GiB", checkpoint="none")
    assert no_checkpoints.places is None and no_checkpoints.fused_ce and "(no checkpoints, as asked)" in said
    unfused, said = chosen("60GiB", checkpoint="none", fused_ce=False)
    assert not unfused.fused_ce and "(no checkpoints, no fused loss, as asked)" in said
    full_precision, said = chosen("12GiB", four_bit=False)
    assert not full_precision.four_bit and "(no 4-bit base, as asked)" in said
    fused_mlp, said = chosen("12GiB", fused_swiglu=True)
    assert fused_mlp.fused_swiglu and "fused SwiGLU" not in said         # asked for, not a plan's addition


def test_the_run_banner_says_the_techniques_in_words():
    """The banner had printed the Techniques dataclass's repr."""
    from memfit.commands.finetune import Techniques

    assert str(Techniques("none", "none", "cpu", False, False)) == "no memory technique"
    assert (str(Techniques("layer", "all", "disk", True, False))
            == "checkpoints on every layer (all offloaded to disk), 4-bit base")
    assert (str(Techniques("layer", 3, "cpu", fused_swiglu=True))
            == "checkpoints on every layer (the first 3 offloaded to cpu), fused loss, fused SwiGLU")
    assert str(Techniques("layer", 0, "cpu")) == "checkpoints on every layer, fused loss"
    assert (str(Techniques("layer", "none", "cpu", False, True, ("gpu", "cpu", "none")))
            == "checkpoints on 2 of 3 layers (1 of them offloaded to cpu), fused loss")


def test_gpu_memory_refuses_the_flags_its_plan_sets():
    """On CUDA the plan for --gpu-memory sets checkpointing and offload; flags for them had been dropped unsaid."""
    from memfit.commands.finetune import check_technique_flags

    spec = PRESETS["llama-3.2-3b"]
    args = argparse.Namespace(offload="all", checkpoint="layer", offload_to="cpu", gpu_memory="8GiB",
                              fused_swiglu=False)
    with pytest.raises(MemfitError, match="--checkpoint layer, --offload all: with --gpu-memory on CUDA the plan"):
        check_technique_flags(args, spec, torch.device("cuda"))
    check_technique_flags(args, spec, torch.device("cpu"))     # on the CPU --gpu-memory plans nothing: the flags apply
    none = argparse.Namespace(offload="none", checkpoint="none", offload_to="cpu", gpu_memory="8GiB", fused_swiglu=False)
    check_technique_flags(none, spec, torch.device("cuda"))    # an explicit none keeps the plan from it instead


def test_finetune_plans_only_with_what_patch_applies():
    """A batch that micro-batching would fit must still get a plan the training loop can run."""
    from memfit.commands.finetune import APPLIED_BY_PATCH
    from memfit.ledger import Job, Knobs, plan
    from memfit.models import PRESETS
    from memfit.units import parse_bytes

    job = Job(PRESETS["llama-3.2-1b"], task="lora", seq=512, batch=8)
    _, plans = plan(job, Knobs(), parse_bytes("8GiB"), limit=3, allowed=APPLIED_BY_PATCH)
    for p in plans:
        assert (p.knobs.micro_batch, p.knobs.optimizer, p.knobs.dtype) == (None, "adamw", "bfloat16")


def test_peft_model_silences_only_pefts_own_deprecation_warning(monkeypatch):
    """peft.get_peft_model reads transformers' deprecated is_gradient_checkpointing (transformers 5.24), so every LoRA
    run printed a FutureWarning no user can act on; memfit's wrapper drops that one message and lets others through."""
    import warnings

    import peft

    from memfit.models.hf_calls import peft_model

    model = build_model(PRESETS["tiny"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))

    def warns(message):
        def get_peft_model(model, config):
            warnings.warn(message, FutureWarning, stacklevel=2)
            return model
        return get_peft_model

    monkeypatch.setattr(peft, "get_peft_model", warns("`is_gradient_checkpointing` is deprecated and will go"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peft_model(model, None)
    monkeypatch.setattr(peft, "get_peft_model", warns("something else"))
    with pytest.warns(FutureWarning, match="something else"):
        peft_model(model, None)


@pytest.mark.parametrize("lr, says", [(1e6, True), (10.0, False)])
def test_a_model_driven_to_a_uniform_guess_is_said_once(tmp_path, monkeypatch, lr, says):
    """--lr 1e6 sends the loss to ln(vocab) and keeps it there, finite: it had trained on without a word. A
    random-init model starts near ln(vocab) too (lr 10 moves it about there) and must not be taken for it."""
    from memfit.train import finetune as loop

    said = {}
    monkeypatch.setattr(loop, "warn_once", lambda key, message: said.setdefault(key, message))
    losses = _run(tmp_path, 8, lr=lr)
    assert len(losses) == 8
    if says:
        assert re.fullmatch(r"since step 2 the loss has been 6\.2383, ln 512: .*lower --lr \(1e\+06\)",
                            said.pop("finetune:uniform")), said
    assert said == {}
