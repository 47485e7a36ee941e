"""What `memfit finetune --resume` may change (the learning rate, said once) and what it refuses (the settings that
change what the saved state means), old and newer progress.json files, and training with float16 or bfloat16
weights where a norm or the output head is trained (float32 master weights)."""
import argparse
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from memfit.data.jsonl import DEFAULT_DATA, load_jsonl
from memfit.data.tokenizer import ByteTokenizer
from memfit.errors import MemfitError
from memfit.models import PRESETS, build_model
from memfit.train.finetune import TrainConfig, check_resumable, train
from memfit.train.patch import patch


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    """One thread (the test machine is shared); the fused loss runs its CPU reference."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def said(monkeypatch):
    """What the training loop says once (warn_once), in order."""
    from memfit.train import finetune as loop

    messages = []
    monkeypatch.setattr(loop, "warn_once", lambda key, message: messages.append(message))
    return messages


def _run(out, steps, *, lr=1e-2, dtype="float32", lora=None, max_len=128, fused_ce=True, resume=False):
    tok = ByteTokenizer()
    examples = load_jsonl(DEFAULT_DATA, tok, max_len)[:24]
    model = build_model(PRESETS["tiny"], dtype=dtype, device=torch.get_default_device())   # CUDA under MEMFIT_TEST_DEVICE
    model = patch(model, fused_ce=fused_ce, lora={"r": 4, **(lora or {})})
    config = TrainConfig(steps=steps, batch_size=2, lr=lr, save_every=1)
    return train(model, examples, tok.pad_token_id, config, out, resume=resume)


def _latest(out):
    return out / "checkpoints" / (out / "checkpoints" / "latest").read_text()


def _optimizer_lrs(out):
    return {group["lr"] for group in torch.load(_latest(out) / "state.pt", weights_only=False)["optimizer"]["param_groups"]}


def _cli(argv):
    from memfit.commands import finetune

    parser = argparse.ArgumentParser()
    finetune.add_parser(parser.add_subparsers())
    return finetune.run(parser.parse_args(["finetune", *argv]))


def test_a_resume_trains_at_the_lr_it_is_given_and_says_so_once(tmp_path, said):
    """The optimizer's saved param_groups had put the checkpoint's lr back, so a resume with --lr 1e-6 after 0.05
    went on at 0.05, unsaid."""
    _run(tmp_path, 2, lr=5e-2)
    before = load_file(str(_latest(tmp_path) / "trainable.safetensors"))
    _run(tmp_path, 3, lr=1e-6, resume=True)
    assert _optimizer_lrs(tmp_path) == {1e-6}
    after = load_file(str(_latest(tmp_path) / "trainable.safetensors"))
    assert max(float((after[name] - value).abs().max()) for name, value in before.items()) < 1e-4   # 0.05 moves ~0.05
    assert said == ["--resume: the steps after step 2 train with lr 0.05 -> 1e-06 (the checkpoint's -> this run's)"]


def test_a_resume_without_lr_keeps_the_checkpoints(tmp_path, said):
    """--lr left out of a resumed run is the checkpoint's, not the preset's default (5e-2 for tiny), and nothing is
    said."""
    out = tmp_path / "run"
    common = ["--device", "cpu", "--out", str(out), "--batch-size", "2", "--max-len", "64"]
    assert _cli([*common, "--steps", "1", "--lr", "1e-3"]) == 0
    assert _cli([*common, "--steps", "2", "--resume"]) == 0
    assert _optimizer_lrs(out) == {1e-3}
    assert said == []


@pytest.mark.parametrize("change,message", [
    ({"lora": {"lora_alpha": 1}}, r"lora_alpha=8, this run asks for 1 \(another --lora-alpha\?\)"),
    ({"lora": {"modules_to_save": ["model.norm"]}},
     r"modules_to_save=None, this run asks for \['model.norm'\] \(--train-norm or --no-train-norm\?\)"),
    ({"lora": {"target_modules": ["q_proj", "v_proj"]}}, r"lora_targets=\['down_proj', .*'v_proj'\], this run asks for "
                                                         r"\['q_proj', 'v_proj'\]"),
    ({"dtype": "bfloat16"}, r"dtype=float32, this run asks for bfloat16 \(another --dtype\?\)"),
    ({"max_len": 16}, r"other data \(24 examples, \d+ tokens, sha256 \w+\) than this run's \(24 examples, \d+ tokens, "
                      r"sha256 \w+\); another --data, --max-len or tokenizer\?"),
], ids=["lora_alpha", "train_norm", "targets", "dtype", "max_len"])
def test_a_resume_refuses_what_changes_the_saved_states_meaning(tmp_path, change, message):
    """The adapter trained at alpha 8 had been resumed (and saved) at alpha 1, and another dtype or data let through;
    another --train-norm or targets had been refused without saying which setting."""
    _run(tmp_path, 2)
    with pytest.raises(MemfitError, match="cannot resume .*step-0000002: it was trained .*" + message):
        _run(tmp_path, 3, resume=True, **change)


@pytest.mark.parametrize("change, message", [(["--batch-size", "3"], r"batch_size=2, this run asks for 3"),
                                             (["--seed", "7"], r"seed=0, this run asks for 7"),
                                             (["--max-len", "16"], r"trained on other data"),
                                             (["--lora-r", "4"], r"lora_r=16, this run asks for 4 \(another --lora-r\?\)"),
                                             (["--lora-alpha", "3"], r"lora_alpha=32, this run asks for 3"),
                                             (["--no-train-norm"], r"modules_to_save=\['model.norm'\], this run asks "
                                                                   r"for None"),
                                             (["--dtype", "bfloat16"], r"dtype=float32, this run asks for bfloat16")])
def test_the_cli_refuses_a_resume_before_it_loads_the_model(tmp_path, monkeypatch, change, message):
    """Another batch size, seed, data, LoRA setting or dtype is refused from progress.json, the tokenized data and
    the asked settings, before the model loads: the CLI had loaded the model first (the LoRA settings and dtype until
    this test named them)."""
    from memfit.commands import finetune

    common = ["--device", "cpu", "--out", str(tmp_path / "run"), "--batch-size", "2", "--max-len", "64"]
    assert _cli([*common, "--steps", "1"]) == 0
    monkeypatch.setattr(finetune, "load_model", lambda *a: pytest.fail("loaded the model first"))
    with pytest.raises(MemfitError, match="cannot resume .*step-0000001: it was .*" + message):
        _cli([*common, "--steps", "2", "--resume", *change])


def test_the_cli_resumes_a_run_with_settings_other_than_the_defaults(tmp_path):
    """The settings the CLI asks for before loading the model are those the model records once built and patched,
    for a command line that differs from the defaults everywhere the early check looks: a resume with the same
    arguments is not refused."""
    common = ["--device", "cpu", "--out", str(tmp_path / "run"), "--batch-size", "2", "--max-len", "64",
              "--dtype", "bfloat16", "--lora-r", "4", "--lora-alpha", "7.5", "--no-train-norm"]
    assert _cli([*common, "--steps", "1"]) == 0
    assert _cli([*common, "--steps", "2", "--resume"]) == 0
    assert json.loads((_latest(tmp_path / "run") / "progress.json").read_text())["step"] == 2


def test_a_4bit_bases_digest_reads_its_block_scales():
    """NF4 codes do not change when a block is rescaled; its absmax does (a review). A stand-in for Params4bit."""
    from memfit.train.finetune import base_digest

    model = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
    model.weight.quant_state = type("QuantState", (), {"absmax": torch.ones(2)})()
    before = base_digest(model)
    model.weight.quant_state.absmax *= 1.5
    assert base_digest(model) != before


def _scale_a_frozen_weight(model):
    with torch.no_grad():
        model.get_base_model().model.layers[1].mlp.down_proj.weight.mul_(1.5)


@pytest.mark.parametrize("setting, change, message", [
    ("four_bit", lambda model: setattr(model.get_base_model(), "is_loaded_in_4bit", True),   # patch(four_bit=True)'s
     r"four_bit=False, this run asks for True \(--four-bit, --no-four-bit or another --gpu-memory\?\)"),  # mark
    ("base", _scale_a_frozen_weight,
     r"base=[0-9a-f]{16}, this run asks for [0-9a-f]{16} \(another model, the same one changed, or a preset built "
     r"on another device\?\)"),
])
def test_a_resume_refuses_another_base(tmp_path, said, setting, change, message):
    """An adapter trained against a dense base had resumed on a 4-bit NF4 one (and the reverse), and one trained on a
    model onto another of the same shapes (another directory, or the same one changed), its losses mixed with the
    first's, unsaid. run_settings reads both from the model (``is_loaded_in_4bit``, which memfit's patch and
    transformers set; a digest of the frozen weights), so the library loop is held to them; a checkpoint of a memfit
    that did not record one resumes with the assumption said."""
    def resume():
        tok = ByteTokenizer()
        model = patch(build_model(PRESETS["tiny"], device=torch.get_default_device()), lora={"r": 4})
        change(model)
        config = TrainConfig(steps=3, batch_size=2, lr=1e-2, save_every=1)
        return train(model, load_jsonl(DEFAULT_DATA, tok, 128)[:24], tok.pad_token_id, config, tmp_path, resume=True)

    _run(tmp_path, 2)
    with pytest.raises(MemfitError, match=r"step-0000002: it was trained with " + message):
        resume()
    progress_file = _latest(tmp_path) / "progress.json"
    progress = json.loads(progress_file.read_text())
    del progress["settings"][setting]                      # as the memfit before this test wrote version 2
    progress_file.write_text(json.dumps(progress))
    assert len(resume()) == 3
    assert said == [f"--resume: {_latest(tmp_path).parent / 'step-0000002'} does not record {setting} (an earlier "
                    "memfit wrote it); assuming this run's"]


def test_the_cli_checks_the_base_precision_before_it_loads_the_model(tmp_path, monkeypatch):
    """The CLI asks for the 4-bit base its techniques choose (the flags, or a --gpu-memory plan), checked against
    the checkpoint before the model loads. NF4 needs CUDA, so the techniques are made to choose it here."""
    from dataclasses import replace

    from memfit.commands import finetune

    common = ["--device", "cpu", "--out", str(tmp_path / "run"), "--batch-size", "2", "--max-len", "64"]
    assert _cli([*common, "--steps", "1"]) == 0
    chosen = finetune.choose_techniques
    monkeypatch.setattr(finetune, "choose_techniques", lambda *a: replace(chosen(*a), four_bit=True))
    monkeypatch.setattr(finetune, "load_model", lambda *a: pytest.fail("loaded the model first"))
    with pytest.raises(MemfitError, match=r"step-0000001: it was trained with four_bit=False, this run asks for True"):
        _cli([*common, "--steps", "2", "--resume"])


def test_a_resume_keeps_the_checkpoints_base_unless_a_flag_names_one(tmp_path, monkeypatch, capsys):
    """Without --four-bit or --no-four-bit a resume takes the base its checkpoint recorded: a --gpu-memory plan made
    again (another memfit's ledger, say) could choose the other, and the resume was refused for a setting the user
    never gave. With a flag, the flag is what the checkpoint is held to."""
    from memfit.commands import finetune

    common = ["--device", "cpu", "--out", str(tmp_path / "run"), "--batch-size", "2", "--max-len", "64"]
    assert _cli([*common, "--steps", "1"]) == 0
    progress_file = _latest(tmp_path / "run") / "progress.json"
    progress = json.loads(progress_file.read_text())
    progress["settings"]["four_bit"] = True                # as a run on a 4-bit base records it
    progress_file.write_text(json.dumps(progress))

    def reached(name, spec, dtype, device):
        raise RuntimeError(f"loading on {device}")

    monkeypatch.setattr(finetune, "load_model", reached)
    with pytest.raises(RuntimeError, match="loading on cpu"):     # the checks passed; a 4-bit base loads on the CPU
        _cli([*common, "--steps", "2", "--resume"])
    assert "--resume: on a 4-bit base, as the checkpoint was trained (--four-bit or --no-four-bit chooses)" in \
        " ".join(capsys.readouterr().err.split())
    with pytest.raises(MemfitError, match=r"four_bit=True, this run asks for False"):
        _cli([*common, "--steps", "2", "--resume", "--no-four-bit"])


def test_check_resumable_refuses_a_setting_run_settings_does_not_have(tmp_path):
    """Its settings had been the data entry alone: passed that way, each of the entry's fields was compared as a
    setting the checkpoint lacked ("trained with examples=None")."""
    from memfit.train.finetune import data_settings

    _run(tmp_path, 1)
    examples = load_jsonl(DEFAULT_DATA, ByteTokenizer(), 128)[:24]
    with pytest.raises(ValueError, match="examples, name, sha256, tokens are not run_settings' entries"):
        check_resumable(_latest(tmp_path), TrainConfig(steps=2, batch_size=2), data_settings(examples))


def test_the_cli_refuses_a_resume_with_nothing_to_resume_before_it_loads_the_model(tmp_path, monkeypatch):
    from memfit.commands import finetune

    monkeypatch.setattr(finetune, "load_model", lambda *a: pytest.fail("loaded the model first"))
    with pytest.raises(MemfitError, match="--resume: .*run holds no checkpoint to resume from"):
        _cli(["--device", "cpu", "--out", str(tmp_path / "run"), "--steps", "2", "--resume"])


def test_a_resumes_progress_bar_starts_at_its_checkpoint(tmp_path, capsys):
    """The bar had started at 0/N on a resume, and stayed there where the checkpoint left nothing to train."""
    common = ["--device", "cpu", "--out", str(tmp_path / "run"), "--batch-size", "2", "--max-len", "32"]
    assert _cli([*common, "--steps", "1"]) == 0
    capsys.readouterr()
    assert _cli([*common, "--steps", "1", "--resume"]) == 0
    bar = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("finetune "))
    assert " 1/1 " in bar, bar


def test_a_failed_adapter_save_says_the_checkpoint_holds_the_training(tmp_path, monkeypatch):
    """A full disk at the adapter save had ended the command with the disk's error alone, after the training that
    the last checkpoint still holds; the error now says so and how to write the adapter from it."""
    import errno

    from memfit.commands import finetune

    def full(model, out):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(finetune, "_save_adapter", full)
    with pytest.raises(OSError, match=r"^\[Errno 28\] No space left on device; the 1 trained steps are saved in "
                                      r".*checkpoints: once the cause is fixed, the same command with --resume "
                                      r"writes adapter/ without training again$"):
        _cli(["--device", "cpu", "--out", str(tmp_path / "run"), "--batch-size", "2", "--max-len", "32", "--steps", "1"])


def test_a_progress_record_without_its_step_or_data_cannot_be_read(tmp_path):
    """progress.json missing a field is 'cannot be read' before any other refusal (another seed here), and a
    recorded data entry without its digest too (it had raised a bare KeyError while naming the data)."""
    _run(tmp_path, 1)
    progress_file = _latest(tmp_path) / "progress.json"
    progress = json.loads(progress_file.read_text())
    for broken in ({k: v for k, v in progress.items() if k != "step"},
                   {**progress, "settings": {**progress["settings"], "data": {"name": "x"}}}):
        progress_file.write_text(json.dumps(broken))
        with pytest.raises(MemfitError, match=r"the checkpoint cannot be read \(KeyError"):
            check_resumable(_latest(tmp_path), TrainConfig(steps=2, batch_size=2, seed=7), None)


def test_a_model_trained_whole_records_the_dtype_it_was_given(tmp_path):
    """Nothing frozen: the dtype recorded is the model's as given, not the float32 of its master weights, so a
    bfloat16 run resumed in float16 is refused (it had read float32 both times)."""
    tok = ByteTokenizer()
    examples = load_jsonl(DEFAULT_DATA, tok, 64)[:8]

    def run(model, steps, resume):
        config = TrainConfig(steps=steps, batch_size=2, lr=1e-3, save_every=1)
        return train(model, examples, tok.pad_token_id, config, tmp_path, resume=resume)

    model = build_model(PRESETS["tiny"], dtype="bfloat16")
    run(model, 1, False)
    run(model, 2, True)                       # the same model again, its master weights float32 by now: same dtype
    with pytest.raises(MemfitError, match=r"dtype=bfloat16, this run asks for float16"):
        run(build_model(PRESETS["tiny"], dtype="float16"), 3, True)


def test_an_old_progress_file_loads_and_a_newer_one_is_refused(tmp_path, said):
    """A checkpoint written before the settings were recorded (no "version") resumes as before, the assumption said;
    one from a newer memfit is refused before its other files are read."""
    _run(tmp_path, 2)
    progress_file = _latest(tmp_path) / "progress.json"
    progress = json.loads(progress_file.read_text())
    progress_file.write_text(json.dumps({key: progress[key] for key in ("step", "losses", "config")}))
    assert len(_run(tmp_path, 3, resume=True)) == 3
    assert "does not record the LoRA settings, dtype and data" in said[0] and "assuming they are this run's" in said[0]
    progress_file = _latest(tmp_path) / "progress.json"
    progress_file.write_text(json.dumps({**json.loads(progress_file.read_text()), "version": 99}))
    with pytest.raises(MemfitError, match="progress.json is version 99, written by a newer memfit"):
        _run(tmp_path, 4, resume=True)


def test_float16_training_of_the_norm_stays_finite(tmp_path):
    """--dtype float16 with --train-norm (the tiny preset's default) had made the weights NaN at the first step at any
    lr: the trained copy of model.norm stayed float16, and so did AdamW's state, where grad**2 underflows and eps
    rounds to 0. It trains in float32 now, its output still float16, and the adapter keeps it in float32 as peft keeps
    the LoRA weights."""
    out = tmp_path / "run"
    assert _cli(["--device", "cpu", "--dtype", "float16", "--out", str(out), "--steps", "2", "--batch-size", "2",
                 "--max-len", "64", "--lr", "1e-4"]) == 0
    losses = json.loads((_latest(out) / "progress.json").read_text())["losses"]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    norm = adapter["base_model.model.model.norm.weight"]
    assert norm.dtype == torch.float32 and torch.isfinite(norm).all() and not torch.equal(norm, torch.ones_like(norm))


def test_bfloat16_keeps_a_norms_small_updates(tmp_path):
    """In bfloat16 the norm's weight (1.0, spaced 2**-7 there) had lost every update of an lr of 1e-3: two steps left
    it at exactly 1."""
    _run(tmp_path, 2, lr=1e-3, dtype="bfloat16", lora={"modules_to_save": ["model.norm"]})
    norm = load_file(str(_latest(tmp_path) / "trainable.safetensors"))[
        "base_model.model.model.norm.modules_to_save.default.weight"]
    assert norm.dtype == torch.float32 and 1e-3 < float((norm - 1).abs().max()) < 1e-2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fused_ce", [True, False])
def test_a_trained_output_head_in_half_precision_matches_float32(tmp_path, dtype, fused_ce):
    """The output head as a peft modules_to_save (a library caller's choice) trains on float32 master weights; the
    fused loss, which reads its weight rather than calling it, casts it to the hidden states' dtype. The comparison
    means something because training moves the last step's loss by far more than the tolerance: a run at an lr of
    1e-9 stands for one whose weights did not train. (Each step's loss is another batch's, so the losses of one run
    are not compared with each other.)"""
    lora = {"modules_to_save": ["lm_head"]}
    reference = _run(tmp_path / "fp32", 3, lora=lora, fused_ce=fused_ce)
    untrained = _run(tmp_path / "untrained", 3, lr=1e-9, lora=lora, fused_ce=fused_ce)
    half = _run(tmp_path / dtype, 3, dtype=dtype, lora=lora, fused_ce=fused_ce)
    tolerance = 2e-2 if dtype == "bfloat16" else 2e-3
    assert untrained[-1] - reference[-1] > 2 * tolerance
    torch.testing.assert_close(torch.tensor(half), torch.tensor(reference), rtol=0, atol=tolerance)


def test_a_non_finite_loss_before_any_update_does_not_blame_the_lr(tmp_path):
    """A loss that is NaN at the first step, before the optimizer has moved anything, had been reported as a
    divergence to cure with a lower --lr."""
    tok = ByteTokenizer()
    model = patch(build_model(PRESETS["tiny"], dtype="float16"), lora={"r": 4})
    with torch.no_grad():
        model.get_base_model().model.embed_tokens.weight.fill_(float("nan"))
    config = TrainConfig(steps=2, batch_size=2, lr=1e-9)
    with pytest.raises(MemfitError, match=r"at step 1 the loss is nan .*no update has been made yet, so the learning "
                                          r"rate is not the cause; check the model and the data \(float16 overflows"):
        train(model, load_jsonl(DEFAULT_DATA, tok, 64)[:8], tok.pad_token_id, config, tmp_path)


def test_a_new_run_leaves_an_out_directory_it_did_not_write_alone(tmp_path, monkeypatch):
    """A run into a directory holding an adapter/ of the user's had replaced it at its end (the user's files gone),
    and written beside anything else there; now it is refused before the model loads, and nothing is touched."""
    from memfit.commands import finetune

    monkeypatch.setattr(finetune, "load_model", lambda *a: pytest.fail("loaded the model first"))
    out = tmp_path / "run"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "notes.txt").write_text("precious")
    (out / "memfit_compress.json").write_text("{}")
    (out / ".DS_Store").write_text("")                # hidden names are not counted
    with pytest.raises(MemfitError, match=r"--out .*run holds adapter, memfit_compress.json and no run to resume"):
        _cli(["--device", "cpu", "--out", str(out), "--steps", "1", "--batch-size", "2", "--max-len", "64"])
    assert (out / "adapter" / "notes.txt").read_text() == "precious"
    assert sorted(path.name for path in out.iterdir()) == [".DS_Store", "adapter", "memfit_compress.json"]


@pytest.mark.parametrize("pointer", [None, "", "../elsewhere"], ids=["removed", "empty", "foreign"])
def test_checkpoints_without_their_pointer_are_resumed_not_removed(tmp_path, pointer):
    """A run killed after its first checkpoint was made whole but before ``latest`` named it left a checkpoint that a
    resume did not find ("holds no checkpoint"), and a new run then removed at its first save; an empty pointer had
    named the checkpoints directory itself. The newest checkpoint directory is the one to resume, and a new run is
    refused as for any run there."""
    out = tmp_path / "run"
    common = ["--device", "cpu", "--out", str(out), "--batch-size", "2", "--max-len", "64", "--save-every", "1"]
    assert _cli([*common, "--steps", "2"]) == 0
    (out / "checkpoints" / "latest").unlink()
    if pointer is not None:
        (out / "checkpoints" / "latest").write_text(pointer)
    with pytest.raises(MemfitError, match="already holds a run; pass --resume"):
        _cli([*common, "--steps", "3"])
    assert _cli([*common, "--steps", "3", "--resume"]) == 0
    assert json.loads((_latest(out) / "progress.json").read_text())["step"] == 3


def test_a_batch_is_picked_from_one_permutation_an_epoch(monkeypatch):
    """The same examples as a permutation drawn for each example (resumed runs depend on it), with one permutation
    drawn per epoch: drawn for each example of each batch, a step cost n x batch size of host time."""
    from memfit.train import finetune as loop

    examples = list(range(23))                 # stand-ins: batch_at only indexes them

    def drawn_per_example(step, batch_size, seed):
        picked = []
        for position in range(step * batch_size, (step + 1) * batch_size):
            epoch, offset = divmod(position, len(examples))
            generator = torch.Generator().manual_seed(seed * 100003 + epoch)
            picked.append(examples[int(torch.randperm(len(examples), generator=generator, device="cpu")[offset])])
        return picked

    expected = {(step, seed): drawn_per_example(step, 8, seed) for step in range(9) for seed in (0, 5)}
    loop._epoch_order.cache_clear()
    draws = []
    real = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: draws.append(a) or real(*a, **k))
    assert {(step, seed): loop.batch_at(examples, 8, seed, step) for seed in (0, 5) for step in range(9)} == expected
    assert len(draws) == 2 * 4                 # 72 positions of 23 examples: epochs 0 to 3, for each seed


def test_the_library_refuses_a_new_run_over_an_earlier_one_and_a_save_removes_a_killed_saves_temporary(tmp_path):
    """train() without resume had removed an earlier run's checkpoints at its first save (only the command refused
    it); a run killed while it saved left .step-N.tmp for good, since a save removed only its own step's."""
    out = tmp_path / "run"
    _run(out, 2)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(MemfitError, match="already holds a run; pass --resume \\(resume=True\\)"):
        _run(out, 3)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    killed = out / "checkpoints" / ".step-0000009.tmp"      # a step this run does not save
    killed.mkdir()
    (killed / "trainable.safetensors").write_bytes(b"half")
    _run(out, 4, resume=True)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-0000004"]
