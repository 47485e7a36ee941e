"""Bad CLI input ends in one clear ``memfit <verb>: error: ...`` line and exit status 2, before any work starts."""
import json
import sys

import pytest
import torch

import memfit.models
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.models import PRESETS, save_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A saved tiny model (2 layers): config.json + model.safetensors."""
    return save_model_dir(PRESETS["tiny"], tmp_path_factory.mktemp("tiny"), dtype="float32")


@pytest.fixture
def no_weights(tmp_path, tiny_dir):
    """A directory with the tiny model's config.json but no weight files."""
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((tiny_dir / "config.json").read_text())
    return tmp_path / "noweights"


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command gets as far as building or loading a model (a preset, a Hugging Face directory,
    memfit's dense or partial loader, a compressed directory)."""
    import transformers

    from memfit import compress
    from memfit.infer import partial_load

    def forbidden(*args, **kwargs):
        raise AssertionError("the bad input was not caught before the model was built")

    monkeypatch.setattr(memfit.models, "build_model", forbidden)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)
    monkeypatch.setattr(partial_load, "load_model", forbidden)
    monkeypatch.setattr(compress, "load_compressed", forbidden)


def _fails(capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err
    assert err.startswith(f"memfit {argv[0]}: error: ")


def _compress(tmp_path, *extra, model="tiny"):
    return ["compress", str(model), "--out", str(tmp_path / "out"), "--device", "cpu", *extra]


def _finetune(tmp_path, *extra, model="tiny"):
    return ["finetune", str(model), "--out", str(tmp_path / "ft"), "--device", "cpu", "--steps", "1", *extra]


@pytest.mark.parametrize("extra, message", [
    (("--blocks", "0"), "blocks must be a positive integer, got 0"),
    (("--blocks=-4",), "blocks must be a positive integer, got -4"),
    (("--calib-builtin", "--calib-samples", "0"), "--calib-samples must be a positive integer, got 0"),
    (("--calib-builtin", "--calib-seq", "0"), "--calib-seq must be a positive integer, got 0"),
    (("--calib-builtin", "--calib-samples=-1"), "--calib-samples must be a positive integer, got -1"),
    (("--steps", "0"), "--steps (BLAST's descent steps per matrix) must be a positive integer, got 0"),
    (("--steps=-3",), "--steps (BLAST's descent steps per matrix) must be a positive integer, got -3"),
])
def test_compress_bad_numbers(tmp_path, capsys, no_model_load, extra, message):
    _fails(capsys, _compress(tmp_path, *extra), message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_compress_cuda_without_gpu(tmp_path, capsys, no_model_load, device):
    argv = _compress(tmp_path)
    argv[argv.index("--device") + 1] = device
    _fails(capsys, argv, "this machine has no CUDA GPU")


@pytest.mark.parametrize("device", ["gpu", "mps", "xpu", "meta"])
@pytest.mark.parametrize("verb", ["compress", "finetune"])
def test_a_device_memfit_does_not_run_on_is_refused(tmp_path, capsys, no_model_load, verb, device):
    """mps, xpu and meta are devices torch parses: they had gone through to fail inside torch (a dispatcher dump, an
    assertion) or, on meta, with a message about missing tensors."""
    argv = _compress(tmp_path) if verb == "compress" else _finetune(tmp_path)
    argv[argv.index("--device") + 1] = device
    _fails(capsys, argv, f"unknown device '{device}': use auto, cpu, cuda or cuda:N")


@pytest.mark.parametrize("device, message", [
    ("cuda:1", "for GPU 1 of several, run with CUDA_VISIBLE_DEVICES=1 and --device cuda"),
    ("auto", "auto would make the job depend on this machine: the job is for cuda or cpu"),
    ("mps", "expected cuda or cpu, got 'mps'"),
])
@pytest.mark.parametrize("verb", ["plan", "verify"])
def test_plan_and_verify_say_what_device_to_pass(capsys, no_model_load, verb, device, message):
    """The job's --device is a kind of device; the other verbs take auto and cuda:N, which here had met argparse's
    bare "invalid choice"."""
    with pytest.raises(SystemExit) as raised:          # argparse's own error: usage, then the line
        main([verb, "--model", "tiny", "--device", device])
    err = capsys.readouterr().err
    assert raised.value.code == 2
    assert err.splitlines()[-1].startswith(f"memfit {verb}: error: argument --device: ")
    assert message in err.splitlines()[-1]


def test_a_cuda_device_past_the_machines_gpus_is_refused(monkeypatch):
    from memfit.local import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(MemfitError, match=r"device 'cuda:2' asked for, but this machine has 2 CUDA GPUs \(cuda:0 to"):
        resolve_device("cuda:2")


def test_compress_existing_out_names_the_flag_and_is_left_alone(tmp_path, capsys, no_model_load):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _fails(capsys, _compress(tmp_path), "exists and is not the output of an earlier memfit compress")
    assert "force=True" not in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("command", [_compress, _finetune])
def test_model_dir_without_weights(tmp_path, capsys, no_weights, command):
    _fails(capsys, command(tmp_path, model=no_weights), "no model.safetensors or model.safetensors.index.json")


@pytest.mark.parametrize("command", [_compress, _finetune])
def test_config_file_is_not_a_model(tmp_path, capsys, no_model_load, no_weights, command):
    _fails(capsys, command(tmp_path, model=no_weights / "config.json"), "is not a model directory (it is a file")


@pytest.mark.parametrize("command", [_compress, _finetune])
def test_missing_model(tmp_path, capsys, no_model_load, command):
    _fails(capsys, command(tmp_path, model=tmp_path / "nope"), "unknown model")


def test_finetune_out_is_a_file(tmp_path, capsys, no_model_load):
    (tmp_path / "ft").write_text("not a directory")
    _fails(capsys, _finetune(tmp_path), "exists and is not a directory")
    assert (tmp_path / "ft").read_text() == "not a directory"


@pytest.mark.parametrize("extra, message", [
    (("--lora-r", "0"), "LoRA rank r (--lora-r) must be a positive integer, got 0"),
    (("--lora-alpha", "0"), "lora_alpha (--lora-alpha) must be a positive number, got 0.0"),
    (("--lora-alpha", "nan"), "lora_alpha (--lora-alpha) must be a positive number, got nan"),
    (("--lr", "0"), "learning rate lr (--lr) must be positive and finite, got 0.0"),
    (("--lr=-1e-3",), "learning rate lr (--lr) must be positive and finite, got -0.001"),
    (("--lr", "inf"), "learning rate lr (--lr) must be positive and finite, got inf"),
    (("--max-len=-5",), "max_len (--max-len) must be an integer >= 2"),
    (("--max-len", "1"), "max_len (--max-len) must be an integer >= 2"),
    (("--steps", "0"), "steps (--steps) must be at least 1, got 0"),
    (("--batch-size", "0"), "batch_size (--batch-size) must be at least 1, got 0"),
    (("--data", "/etc"), "data file '/etc' is a directory"),
    (("--offload", "all"), "--offload all needs --checkpoint layer"),
    (("--checkpoint", "layer", "--offload-to", "disk"), "--offload-to disk needs --offload all or N"),
    (("--checkpoint", "layer", "--offload", "0", "--offload-to", "disk"), "--offload-to disk needs --offload all or N"),
    (("--checkpoint", "layer", "--offload", "al"), "--offload must be none, all or a number of first layers, got 'al'"),
    (("--checkpoint", "layer", "--offload", "²"), "--offload must be none, all or a number of first layers, got '²'"),
    (("--checkpoint", "layer", "--offload", "00", "--offload-to", "disk"), "--offload-to disk needs --offload all or N"),
    (("--checkpoint", "layer", "--offload", "3"), "--offload 3: tiny has 2 layers"),      # had been found after the load
])
def test_finetune_bad_settings(tmp_path, capsys, no_model_load, extra, message):
    _fails(capsys, _finetune(tmp_path, *extra), message)


def test_generate_full_load_on_a_two_layer_model(tiny_dir, capsys):
    """--load 1 needs no partial layers, so a model with fewer than full_first + full_last layers runs."""
    assert main(["generate", str(tiny_dir), "--prompt", "hi", "--max-new", "2", "--load", "1", "--device", "cpu",
                 "--no-graphs"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_generate_shows_a_batch_as_it_shows_one_prompt(tiny_dir, capsys, monkeypatch):
    """Several prompts had printed prompt + continuation and gone on past the end-of-text token; one prompt prints
    the continuation alone and stops there. Now a batch prints each continuation under its prompt, cut at EOS."""
    from memfit.infer import generate as loop
    from memfit.infer.text import load_codec

    codec = load_codec(tiny_dir, 512)
    real = loop.Generator.generate

    def with_an_eos(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        result.tokens[0, :3] = torch.tensor([codec.encode("A")[0], *codec.stops, codec.encode("B")[0]])   # "A", EOS
        return result

    monkeypatch.setattr(loop.Generator, "generate", with_an_eos)
    assert main(["generate", str(tiny_dir), "--prompt", "QW", "--prompt", "zz", "--max-new", "4", "--device", "cpu",
                 "--no-graphs"]) == 0
    out = capsys.readouterr().out.split("\n")
    first = out.index("--- prompt 1: 'QW' (stopped at the model's end-of-text token after 1 token)")
    second = next(i for i, line in enumerate(out) if line.startswith("--- prompt 2: 'zz' ("))
    assert second == first + 2 and out[first + 1] == "A" and not out[second + 1].startswith("zz")


def test_generate_partial_load_still_needs_the_layers(tiny_dir, capsys):
    _fails(capsys, ["generate", str(tiny_dir), "--prompt", "hi", "--load", "0.5", "--device", "cpu"],
           "partial loading keeps the first 2 and last 2 layers whole (full_first, full_last: --full-first, "
           "--full-last), 4 layers, and the model has 2: ask for fewer whole layers (e.g. --full-first 1 --full-last 0)")


@pytest.mark.parametrize("extra", [("--task", "qa"), ("--rankings", "r.safetensors"), ("--base", "0.2"),
                                   ("--compute-all-layers",), ("--full-first", "0"), ("--full-last", "1")])
def test_generate_refuses_a_neuron_choice_with_every_neuron(tiny_dir, capsys, extra):
    """With every FFN neuron loaded and computed, the options that choose neurons or partial layers had been dropped
    unsaid."""
    _fails(capsys, ["generate", str(tiny_dir), "--prompt", "hi", "--device", "cpu", *extra],
           f"{extra[0]}: only for partial layers; at --load 1 and --compute 1 every one of the 176 FFN neurons")
    _fails(capsys, ["generate", str(tiny_dir), "--prompt", "hi", "--device", "cpu", "--load", "0.99", *extra],
           "at --load 0.99 and --compute 0.99 every one of the 176 FFN neurons is loaded and computed")


@pytest.mark.parametrize("extra, message", [
    (("--load", "nan"), "load (gamma) must be a fraction in (0, 1], got nan"),
    (("--compute", "nan"), "compute (phi) must be a fraction in (0, 1], got nan"),
    (("--load", "0.5", "--base", "nan"), "base (delta=nan) must be in [0, compute=0.5]"),
])
def test_generate_refuses_a_fraction_that_is_not_a_number(tiny_dir, capsys, extra, message):
    """5e24930 asked whether every neuron is loaded before checking the fractions: NaN had crashed in round()."""
    _fails(capsys, ["generate", str(tiny_dir), "--prompt", "hi", "--device", "cpu", *extra], message)


@pytest.mark.parametrize("value", ["nan", "inf", "-0.5"])
def test_generate_bad_temperature(tiny_dir, capsys, value):
    _fails(capsys, ["generate", str(tiny_dir), "--prompt", "hi", f"--temperature={value}", "--device", "cpu"],
           "--temperature must be a finite number >= 0")


def test_save_adapter_replaces_a_leftover_old_adapter(tmp_path):
    """A crash between the two renames leaves OUT/.adapter.old-<hex> (memfit.files.atomic_dir), one while it saved
    OUT/.adapter.tmp; the next save must not trip over them nor keep them."""
    from memfit.commands.finetune import _save_adapter

    class Model:
        def save_pretrained(self, directory):
            directory.mkdir(exist_ok=True)             # peft: os.makedirs(..., exist_ok=True)
            (directory / "adapter_model.safetensors").write_text("new")

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_model.safetensors").write_text("previous")
    for leftover in (".adapter.old-0123456789abcdef", ".adapter.tmp"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "stale").write_text("crash")
    final = _save_adapter(Model(), tmp_path)
    assert (final / "adapter_model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_byte_tokenizer_save_is_atomic(tmp_path, monkeypatch):
    import memfit.data.tokenizer as tokenizer
    import memfit.files

    path = tokenizer.ByteTokenizer().save_pretrained(tmp_path)
    assert json.loads(path.read_text())["tokenizer"] == "memfit-bytes"
    before = path.read_text()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(memfit.files.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        tokenizer.ByteTokenizer().save_pretrained(tmp_path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == [tokenizer.CONFIG_NAME]


def test_rankings_save_replaces_only_a_rankings_file(tmp_path):
    """As calibrate --force: a library caller's mistyped path had replaced the model's own weights."""
    from safetensors.torch import save_file

    from memfit.infer.calibrate import Rankings

    rankings = Rankings({"general": torch.rand(2, 16)}, {"general": 5})
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(3)}, str(weights))
    before = weights.read_bytes()
    with pytest.raises(MemfitError, match="model.safetensors exists and is not a rankings file; Rankings.save "
                                          "replaces only an earlier one"):
        rankings.save(weights)
    assert weights.read_bytes() == before
    rankings.save(tmp_path / "r.safetensors")
    Rankings({"general": torch.rand(2, 16)}, {"general": 7}).save(tmp_path / "r.safetensors")     # an earlier one
    assert Rankings.load(tmp_path / "r.safetensors").tokens["general"] == 7


def test_rankings_save_leaves_no_temp_file_on_failure(tmp_path, monkeypatch):
    import safetensors.torch

    from memfit.infer.calibrate import Rankings

    rankings = Rankings({"general": torch.rand(2, 16)}, {"general": 5})
    rankings.save(tmp_path / "r.safetensors")

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        rankings.save(tmp_path / "r.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["r.safetensors"]
    assert Rankings.load(tmp_path / "r.safetensors").tokens["general"] == 5


@pytest.fixture(scope="module")
def compressed_dir(tmp_path_factory, tiny_dir):
    """The tiny model compressed by memfit (low-rank): a directory whose config.json is the dense model's."""
    import memfit

    out = tmp_path_factory.mktemp("compressed") / "lowrank"
    memfit.compress(str(tiny_dir), out, method="lowrank", ratio=0.5, progress=False)
    return out


@pytest.mark.parametrize("verb", ["plan", "plan config.json", "verify", "compress", "finetune", "calibrate"])
def test_a_compressed_directory_is_refused_where_a_dense_model_is_read(tmp_path, capsys, no_model_load, compressed_dir,
                                                                        verb):
    """transformers would build the dense model from its config.json and run on random weights."""
    (tmp_path / "prompts.jsonl").write_text('{"text": "def f(): pass"}\n')
    argv = {"plan": ["plan", "--model", str(compressed_dir)],
            "plan config.json": ["plan", "--model", str(compressed_dir / "config.json")],
            "verify": ["verify", "--model", str(compressed_dir), "--device", "cpu"],
            "calibrate": ["calibrate", str(compressed_dir), "--data", str(tmp_path / "prompts.jsonl"), "--device", "cpu"],
            "compress": _compress(tmp_path, model=compressed_dir),
            "finetune": _finetune(tmp_path, model=compressed_dir)}[verb]
    _fails(capsys, argv, f"{compressed_dir} is a memfit-compressed model (lowrank of ")


def test_generate_runs_a_compressed_model(capsys, compressed_dir):
    """memfit generate reads the directory memfit compress wrote (every other verb refuses it, above)."""
    assert main(["generate", str(compressed_dir), "--prompt", "hi", "--max-new", "3", "--device", "cpu",
                 "--no-graphs"]) == 0
    err = capsys.readouterr().err
    assert "decode " in err and "tokens/s per sequence (2 steps, eager)" in err and "Traceback" not in err


def test_generate_says_what_it_waits_on_before_the_first_token(capsys, monkeypatch, compressed_dir):
    """Building the loop (kernel picks, compiles, a CUDA graph) and a compressed model's first prefill (its layers'
    picks) can take a minute on a GPU before anything prints: each runs under a status line, and the prefill's
    ends before the first token is written."""
    from rich.console import Console

    said, events, real = [], [], Console.status

    def status(self, message, **kwargs):
        said.append(message)
        shown = real(self, message, **kwargs)
        stop = shown.stop
        shown.stop = lambda: events.append(f"stop {message[:7]}") or stop()
        return shown

    monkeypatch.setattr(Console, "status", status)
    write = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda text: events.append("write") or write(text))
    assert main(["generate", str(compressed_dir), "--prompt", "hi", "--max-new", "3", "--device", "cpu",
                 "--no-graphs"]) == 0
    assert said[0] == "loading the compressed model" and said[1].startswith("preparing the decode loop")
    assert said[2].startswith("prefill of 2 prompt tokens: a compressed model's first prompt")
    assert "write" in events and events.index("stop prefill") < events.index("write")


@pytest.mark.parametrize("extra", [("--load", "0.5"), ("--compute", "0.5"), ("--base", "0.1"), ("--task", "qa"),
                                   ("--rankings", "r.safetensors"), ("--compute-all-layers",)])
def test_generate_refuses_partial_ffn_options_for_a_compressed_model(capsys, monkeypatch, compressed_dir, extra):
    import memfit.compress

    monkeypatch.setattr(memfit.compress, "load_compressed", lambda *a, **k: pytest.fail("refused before the load"))
    _fails(capsys, ["generate", str(compressed_dir), "--prompt", "hi", "--device", "cpu", *extra],
           f"{extra[0]}: partial FFN load and compute are for dense models; {compressed_dir} is a memfit-compressed "
           "model")


@pytest.mark.parametrize("damage, shown", [
    ("drop", "(first: model.layers.1.mlp.down_proj.weight)"),
    ("reshape", "(first: model.layers.1.mlp.down_proj.weight saved as (64, 100), needed (64, 176))")])
def test_compress_refuses_weights_that_lack_tensors_or_change_their_shape(tmp_path, capsys, tiny_dir, damage, shown):
    """Such a checkpoint would be compressed from transformers' random initialisation (a reshaped one raised)."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    tensors = load_file(weights)
    name = "model.layers.1.mlp.down_proj.weight"
    if damage == "drop":
        tensors.pop(name)
    else:
        tensors[name] = tensors[name][:, :100].contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    _fails(capsys, _compress(tmp_path, "--method", "lowrank", model=broken),
           f"lack 1 tensor(s) the model needs, or hold them in another shape {shown}")
    assert not (tmp_path / "out").exists()


def test_compress_out_is_checked_before_any_work(tmp_path, capsys, no_model_load):
    """A name, a parent that is a directory, and --force only over an earlier memfit output (never other data)."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "thesis.tex").write_text("keep me")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    for out, extra, message in ((".", (), "--out needs a directory name"),
                                (tmp_path / "afile" / "sub", (), "is a file, not a directory"),
                                (tmp_path / "data", ("--force",), "is not the output of an earlier memfit compress"),
                                (tmp_path / "data", (), "is not the output of an earlier memfit compress"),
                                (tmp_path / "link", ("--force",), "is a symbolic link")):
        _fails(capsys, ["compress", "tiny", "--out", str(out), "--device", "cpu", *extra], message)
    assert (tmp_path / "data" / "thesis.tex").read_text() == "keep me"


@pytest.mark.parametrize("extra, message", [
    (("--blr-ratio", "0.3"), "--blr-ratio: only for a --blr model"),
    (("--blr", "blast", "--task", "infer", "--partial-load", "0.5"), "does not apply to a block-low-rank model"),
    (("--blr", "blast", "--task", "lora", "--lora-targets", "q_proj,k_proj"),
     "LoRA targets (--lora-targets) q_proj are block-low-rank in this --blr model"),
    (("--blr", "blast", "--task", "lora", "--lora-targets", ","), "--lora-targets ',' names no module"),
    (("--blr", "monarch", "--blr-blocks", "7"), "--blr monarch --blr-ratio 0.5 --blr-blocks 7: monarch: q_proj "
                                                "in_features=2048 is not divisible by blocks=7"),
    (("--blr", "lowrank", "--blr-ratio", "1.5"), "--blr lowrank --blr-ratio 1.5: ratio must be"),   # no blocks
    (("--blr", "lowrank", "--blr-blocks", "5"), "--blr-blocks: a low-rank layer has no blocks"),
    (("--model", "llama-2-7b", "--blr", "monarch"), "plan --task full or --task infer for it"),     # no GQA: no dense kind
])
def test_plan_blr_options_that_cannot_go_together(capsys, extra, message):
    _fails(capsys, ["plan", "--model", "llama-3.2-1b", *extra], message)


@pytest.mark.parametrize("extra,message", [
    (("--method", "lowrank", "--blocks", "5"), "--blocks: a low-rank layer has no blocks"),
    (("--method", "monarch", "--steps", "10"), "--steps: monarch's projection is closed-form"),
    (("--method", "lowrank", "--steps", "10"), "--steps: lowrank's projection is closed-form"),
    (("--calib-samples", "4", "--calib-seq", "64"), "--calib-samples, --calib-seq: shape the calibration windows"),
])
def test_compress_refuses_options_it_would_not_read(capsys, no_model_load, tmp_path, extra, message):
    _fails(capsys, ["compress", "tiny", *extra, "--out", str(tmp_path / "o"), "--device", "cpu"], message)


def test_plan_blr_lora_adapts_the_layers_kept_dense(capsys):
    """With --blr, LoRA's default targets are the projections the plan keeps dense (peft wraps nn.Linear only), and
    the planner proposes no partial-FFN loading (it reads dense FFN rows)."""
    assert main(["plan", "--model", "llama-3.2-1b", "--blr", "blast", "--task", "lora", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["asked"]["knobs"]["lora_targets"] == ["k_proj", "v_proj"]
    assert main(["plan", "--model", "llama-3.2-1b", "--blr", "blast", "--task", "infer", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["knobs"]["partial_load"] == 1.0 for p in plans)
    assert main(["plan", "--model", "llama-3.2-1b", "--task", "infer", "--json"]) == 0    # dense: it is proposed
    assert any(p["knobs"]["partial_load"] < 1.0 for p in json.loads(capsys.readouterr().out)["plans"])


def test_an_os_error_is_one_line_with_status_1(capsys, monkeypatch):
    """A full disk or a permission the checks could not foresee: the system's message, no traceback."""
    from memfit.commands import plan

    def disk_full(args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plan, "run", disk_full)
    assert main(["plan"]) == 1
    err = capsys.readouterr().err
    assert err == "memfit plan: error: [Errno 28] No space left on device\n"


def test_the_ledger_refuses_what_a_blr_model_cannot_run():
    """The rules hold for library callers too: memfit.plan / predict with Knobs(blr_method=...) refuse LoRA on the
    BLR layers (Knobs' default targets all seven) and partial FFN loading; LoRA on the kept-dense ones is planned."""
    from memfit.errors import MemfitError
    from memfit.ledger.job import Job, Knobs
    from memfit.ledger.predict import predict

    spec = PRESETS["llama-3.2-1b"]
    with pytest.raises(MemfitError, match=r"LoRA targets \(--lora-targets\) q_proj,o_proj,gate_proj"):
        predict(Job(spec, task="lora", seq=256), Knobs(blr_method="blast"))
    with pytest.raises(MemfitError, match="partial FFN loading"):
        predict(Job(spec, task="infer", seq=256), Knobs(blr_method="blast", partial_load=0.7, partial_compute=0.4))
    assert predict(Job(spec, task="lora", seq=256), Knobs(blr_method="blast", lora_targets=("k_proj", "v_proj"))).total


@pytest.fixture
def broken_weights(tmp_path, tiny_dir):
    """The tiny model with its model.safetensors cut to its first 1000 bytes."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes()[:1000])
    return broken


@pytest.mark.parametrize("verb", ["generate", "calibrate", "finetune"])
def test_a_truncated_weights_file_is_one_line(verb, broken_weights, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "hello"}\n')
    argv = {"generate": ["generate", str(broken_weights), "--prompt", "hi", "--device", "cpu"],
            "calibrate": ["calibrate", str(broken_weights), "--data", str(prompts), "--out", str(tmp_path / "r.st"),
                          "--device", "cpu"],
            "finetune": _finetune(tmp_path, model=broken_weights)}[verb]
    _fails(capsys, argv, "its weights cannot be read")


def test_a_sharded_index_without_a_weight_map_is_one_line(tmp_path, tiny_dir, capsys):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tiny_dir / "config.json").read_text())
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    _fails(capsys, ["generate", str(sharded), "--prompt", "hi", "--device", "cpu"], "its weights cannot be read")


def test_a_garbage_tokenizer_is_one_line(tmp_path, tiny_dir):
    from memfit.errors import MemfitError
    from memfit.local import load_hf_tokenizer

    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(MemfitError, match="its tokenizer cannot be read"):
        load_hf_tokenizer(tmp_path)


@pytest.mark.parametrize("where", ["under a file", "a file"])
def test_finetune_checks_its_output_before_training(where, tmp_path, capsys, no_model_load):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "sub" if where == "under a file" else tmp_path / "afile"
    _fails(capsys, ["finetune", "tiny", "--out", str(out), "--device", "cpu", "--steps", "1"], str(tmp_path / "afile"))


def test_calibrate_refuses_a_directory_as_its_output_before_loading(tiny_dir, tmp_path, capsys, no_model_load):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "hello"}\n')
    _fails(capsys, ["calibrate", str(tiny_dir), "--data", str(prompts), "--out", str(tmp_path), "--device", "cpu"],
           "is a directory: name the rankings file")


def test_calibrate_force_replaces_only_a_rankings_file(tiny_dir, tmp_path, capsys, no_model_load):
    """--out MODEL/model.safetensors --force had written the rankings over the model's weights (a usage audit)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "hello"}\n')
    weights = tiny_dir / "model.safetensors"
    before = weights.read_bytes()
    for force in (["--force"], []):                       # without it, no advice to pass it (a review)
        _fails(capsys, ["calibrate", str(tiny_dir), "--data", str(prompts), "--out", str(weights), *force, "--device",
                        "cpu"], "exists and is not a rankings file an earlier memfit calibrate wrote, so it is never "
                                "replaced (not even with --force)")
    assert weights.read_bytes() == before


def test_data_files_may_start_with_a_byte_order_mark_and_must_be_utf8(tmp_path):
    from memfit.data.jsonl import text_lines
    from memfit.errors import MemfitError

    marked, utf16 = tmp_path / "bom.jsonl", tmp_path / "u16.jsonl"
    marked.write_bytes('{"text": "hi"}\n'.encode("utf-8-sig"))
    utf16.write_bytes('{"text": "hi"}\n'.encode("utf-16"))
    assert text_lines(marked) == ['{"text": "hi"}']
    with pytest.raises(MemfitError, match="is not UTF-8 text"):
        text_lines(utf16)


@pytest.mark.parametrize("extra, message", [
    (("--gpu-memory", "24"), "has no unit, so it reads as 24 bytes"),
    (("--gpu-memory", "-8GiB"), "memory size must be a positive, finite number of bytes, got '-8GiB'"),
    (("--gpu-memory=-8GiB",), "memory size must be a positive, finite number of bytes, got '-8GiB'"),
    (("--seq", "-5"), "must be a positive integer, got -5"),
    (("--lora-targets", ",,"), "names no module"),
    (("--micro-batch", "0"), "--micro-batch must be at least 1, got 0"),
])
def test_plan_refuses_what_it_used_to_take_silently(extra, message, capsys):
    _fails(capsys, ["plan", "--model", "tiny", *extra], message)


def test_verify_keeps_the_partial_options_out_of_its_help_and_says_why_it_refuses_them(capsys):
    """verify builds no partial-FFN model: its --help had listed --partial-load and --partial-compute as plan's does."""
    helps = {}
    for verb in ("plan", "verify"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        helps[verb] = capsys.readouterr().out
    assert "--partial-load" in helps["plan"] and "--partial" not in helps["verify"]
    for task in ("infer", "lora"):          # at lora it had said "for --task infer", which then refused it too
        _fails(capsys, ["verify", "--model", "tiny", "--task", task, "--partial-load", "0.5", "--device", "cpu"],
               "verify does not build partial-FFN models")


@pytest.mark.parametrize("tolerance", ["nan", "inf"])
def test_verify_needs_a_finite_tolerance(tolerance, capsys):
    _fails(capsys, ["verify", "--model", "tiny", "--seq", "64", "--device", "cpu", "--tolerance", tolerance],
           "tolerance (--tolerance) must be a positive, finite fraction")


@pytest.mark.parametrize("tolerance", ["5", "1"])
def test_verify_reads_the_tolerance_as_a_fraction(tolerance, capsys):
    """--tolerance 5, meant as 5%, had been held as 500%: a tolerance of 1 or more is refused, in one line, before
    anything is measured."""
    _fails(capsys, ["verify", "--model", "tiny", "--seq", "64", "--device", "cpu", "--tolerance", tolerance],
           f"tolerance (--tolerance) is a fraction (0.05 is 5%), below 1; got {float(tolerance)}\n")


@pytest.mark.parametrize("extra, message", [
    (("--seq", "0"), "seq (--seq) must be a positive integer, got 0"),
    (("--task", "infer", "--new-tokens", "0"), "new_tokens (--new-tokens) must be a positive integer, got 0"),
    (("--lora-rank", "0"), "lora_rank (--lora-rank) must be a positive integer, got 0"),
    (("--loss-fraction", "0"), "loss_fraction (--loss-fraction) must be in (0, 1], got 0.0"),
    (("--checkpoint-layers=-1",), "checkpoint_layers (--checkpoint-layers) must be >= 0, got -1"),
    (("--checkpoint-layers", "1", "--offload-layers", "2"),
     "offload_layers (--offload-layers) must be between 0 and checkpoint_layers (--checkpoint-layers), got 2 and 1"),
    (("--task", "infer", "--partial-load", "1.5"),
     "need 0 < partial_compute (--partial-compute) <= partial_load (--partial-load) <= 1, got 1.5 and 1.5"),
    (("--lora-targets", "q_proj,qkv"), "unknown lora_targets (--lora-targets) ['qkv']"),
])
@pytest.mark.parametrize("verb", ["plan", "verify"])
def test_plan_and_verify_errors_name_the_flags(verb, extra, message, capsys, no_model_load):
    """The job's checks live in the library (memfit.Job, memfit.Knobs), whose callers set fields: each message names
    the field and the option that sets it."""
    _fails(capsys, [verb, "--model", "tiny", "--device", "cpu", *extra], _verify_partial_or(verb, extra, message))


@pytest.mark.parametrize("change, message", [
    ({"rms_norm_eps": None}, "config.json's rms_norm_eps is None, not a number"),
    ({"rope_theta": "abc"}, "config.json's rope_theta is 'abc', not a number"),
    ({"max_position_embeddings": None}, "config.json's max_position_embeddings is None, not a number"),
    ({"hidden_size": 65, "head_dim": None}, "hidden_size 65 is not a multiple of num_attention_heads"),
])
def test_plan_names_a_config_value_it_cannot_read(change, message, tmp_path, tiny_dir, capsys):
    config = json.loads((tiny_dir / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    _fails(capsys, ["plan", "--model", str(tmp_path)], message)


def test_a_rope_parameters_value_that_is_no_mapping_keeps_the_default_theta(tmp_path, tiny_dir):
    from memfit.models import load_spec

    config = json.loads((tiny_dir / "config.json").read_text())
    config.pop("rope_theta", None)
    (tmp_path / "config.json").write_text(json.dumps(config | {"rope_parameters": "default"}))
    assert load_spec(tmp_path).rope_theta == 10000.0


def test_calibration_data_given_as_a_directory_is_called_one(tiny_dir, tmp_path, capsys):
    _fails(capsys, ["calibrate", str(tiny_dir), "--data", str(tmp_path), "--out", str(tmp_path / "r.st"),
                    "--device", "cpu"], "is a directory")
    _fails(capsys, _compress(tmp_path, "--calib", str(tmp_path)), "is a directory; pass a text file")


def test_finetune_refuses_an_empty_out_or_the_model_directory(tiny_dir, tmp_path, capsys, no_model_load):
    _fails(capsys, ["finetune", "tiny", "--out", "", "--device", "cpu"], "--out is empty")
    _fails(capsys, ["finetune", str(tiny_dir), "--out", str(tiny_dir), "--device", "cpu"], "is the model directory")


def test_a_truncated_shard_is_named(tmp_path, tiny_dir, capsys):
    from safetensors import safe_open

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tiny_dir / "config.json").read_text())
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    shard = "model-00001-of-00001.safetensors"
    (sharded / shard).write_bytes((tiny_dir / "model.safetensors").read_bytes()[:1000])
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    _fails(capsys, ["generate", str(sharded), "--prompt", "hi", "--device", "cpu"], f"{shard}: its weights cannot be read")


def test_jsonl_lines_split_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028 or NEL unescaped (json.dumps(..., ensure_ascii=False) writes them so)."""
    from memfit.data.jsonl import text_lines

    record = json.dumps({"prompt": "a\u2028b", "response": "c\x85d"}, ensure_ascii=False)
    (tmp_path / "x.jsonl").write_text(record + "\n", encoding="utf-8")
    assert [json.loads(line) for line in text_lines(tmp_path / "x.jsonl") if line.strip()][0]["prompt"] == "a\u2028b"


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_a_hidden_size_the_heads_do_not_divide_is_taken_where_transformers_takes_it(model_type, tmp_path, tiny_dir):
    from memfit.models import load_spec

    config = json.loads((tiny_dir / "config.json").read_text()) | {"model_type": model_type, "hidden_size": 66,
                                                                    "head_dim": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_spec(tmp_path)
    assert spec.head_dim == 66 // spec.num_heads


@pytest.mark.parametrize("extra, message", [
    (("--four-bit",), "four_bit (--four-bit): the 4-bit NF4 base (bitsandbytes) runs on CUDA only"),
    (("--task", "infer", "--four-bit"), "four_bit (--four-bit): the 4-bit NF4 base (bitsandbytes) runs on CUDA only"),
    (("--checkpoint-layers", "2", "--offload-layers", "1"), "offload_layers (--offload-layers): checkpoint inputs are"),
    (("--task", "full", "--optimizer", "adamw8bit"), "8-bit AdamW (bitsandbytes) runs on CUDA only"),
    (("--attention", "memfit"), "attention (--attention) memfit is modelled as its Triton kernel"),
])
@pytest.mark.parametrize("verb", ["plan", "verify"])
def test_what_runs_on_cuda_only_is_refused_on_cpu(verb, extra, message, capsys, no_model_load):
    """plan used to predict these on cpu (e.g. NF4 weights memfit's 4-bit base refuses to build off CUDA) without a
    word; verify refused them. The ledger refuses them now, for library callers too."""
    from memfit.errors import MemfitError
    from memfit.ledger.job import Job, Knobs
    from memfit.ledger.predict import predict

    _fails(capsys, [verb, "--model", "tiny", "--device", "cpu", *extra], message)
    with pytest.raises(MemfitError, match="runs on CUDA only"):
        predict(Job(PRESETS["tiny"], device="cpu"), Knobs(four_bit=True))


def test_a_plan_that_fits_nothing_is_one_line(capsys):
    """The progress bar is drawn on a terminal only: elsewhere rich ended it with an empty line before the error."""
    _fails(capsys, ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "2GiB"], "no plan fits 2.00 GiB")


def test_a_cpu_plan_that_fits_nothing_names_no_cuda_context(capsys):
    _fails(capsys, ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "2GiB", "--device", "cpu"], "+ allocator) with")


@pytest.mark.parametrize("option, task", [
    (("--lora-targets", "q_proj,v_proj"), "full"), (("--lora-rank", "8"), "infer"), (("--optimizer", "sgd"), "infer"),
    (("--checkpoint-layers", "1"), "infer"), (("--offload-layers", "0"), "infer"), (("--micro-batch", "1"), "infer"),
    (("--fused-ce",), "infer"), (("--loss-fraction", "0.5"), "infer"), (("--new-tokens", "4"), "lora"),
    (("--partial-load", "1"), "full"), (("--partial-compute", "0.5"), "lora"),
])
@pytest.mark.parametrize("verb", ["plan", "verify"])
def test_an_option_the_task_does_not_use_is_refused(verb, option, task, capsys, no_model_load):
    """Each was taken and dropped without a word (--task infer --optimizer adamw8bit planned plain inference); verify
    refuses the partial-FFN options at every task, with its own reason."""
    _fails(capsys, [verb, "--model", "tiny", "--device", "cpu", "--task", task, *option],
           _verify_partial_or(verb, option, f"{option[0]} does nothing with --task {task}: "))


def _verify_partial_or(verb: str, options: tuple, message: str) -> str:
    """``message``, or verify's refusal of every partial-FFN option (memfit.ledger.verify.NO_PARTIAL_FFN)."""
    partial = verb == "verify" and any(option.startswith("--partial-") for option in options)
    return "verify does not build partial-FFN models" if partial else message


def test_generate_refuses_a_decode_past_the_sliding_window_before_reading_weights(tmp_path, capsys, no_model_load):
    """A Mistral with an 8-token window, asked for more: refused from config.json (the architecture on the meta
    device), where it had been refused only after every weight was loaded."""
    from transformers import MistralConfig, MistralForCausalLM

    MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=8)).save_pretrained(tmp_path / "mistral")
    capsys.readouterr()                                  # transformers' progress bar while it saved
    _fails(capsys, ["generate", str(tmp_path / "mistral"), "--prompt", "hi", "--max-new", "20", "--device", "cpu"],
           "sliding window of the last 8 tokens")


def test_generate_refuses_more_positions_than_the_model_has_before_reading_weights(capsys, tiny_dir, no_model_load):
    positions = PRESETS["tiny"].max_position
    _fails(capsys, ["generate", str(tiny_dir), "--prompt", "hi", "--max-new", str(positions), "--device", "cpu"],
           f"exceeds the model's {positions} positions")


def test_generate_refuses_a_compressed_model_too_many_positions_before_loading_it(capsys, compressed_dir, no_model_load):
    positions = PRESETS["tiny"].max_position
    _fails(capsys, ["generate", str(compressed_dir), "--prompt", "hi", "--max-new", str(positions), "--device", "cpu"],
           f"exceeds the model's {positions} positions")


@pytest.mark.parametrize("extra, message", [(["--dtype", "float64x"], "unknown dtype 'float64x'"),
                                            (["--load", "0.5", "--full-first", "0", "--full-last", "0"],
                                             "rankings.safetensors")])
def test_generate_checks_its_options_before_the_decode_length(capsys, tiny_dir, no_model_load, extra, message):
    """A bad --dtype, or a partial load without rankings, is named even where --max-new is also too long: the
    options are checked first, not after the length refusal."""
    _fails(capsys, ["generate", str(tiny_dir), "--prompt", "hi", "--max-new", str(PRESETS["tiny"].max_position),
                    "--device", "cpu", *extra], message)


def test_an_empty_out_is_refused_by_name(tiny_dir, tmp_path, capsys, no_model_load):
    """compress had said "got '.'" (Path("") is the current directory) and calibrate wrote its default file."""
    _fails(capsys, ["compress", "tiny", "--out", "", "--device", "cpu"], "--out is empty: name the directory")
    (tmp_path / "prompts.jsonl").write_text('{"text": "hello"}\n')
    _fails(capsys, ["calibrate", str(tiny_dir), "--data", str(tmp_path / "prompts.jsonl"), "--out", " ",
                    "--device", "cpu"], "--out is empty: name the rankings file")


TERMINATED = """
import os, signal, sys
from memfit.cli import main
from memfit.commands import presets
def run(args):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
    finally:
        print("cleanup", flush=True)
presets.run = run
if sys.argv[1] == "ignored":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    presets.run = lambda args: os.kill(os.getpid(), signal.SIGTERM)
status = main(["presets"])
print("handler back:", signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN), flush=True)
sys.exit(status)
"""


@pytest.mark.parametrize("parent", ["default", "ignored"])
def test_sigterm_ends_a_command_after_its_cleanups_unless_the_process_ignores_it(parent):
    """kill's default SIGTERM had ended a run without its writers' cleanups (their temporary files stayed); it now
    ends as Ctrl-C does, with 143 and one line, and the default action comes back after. A process that ignores
    SIGTERM (as its parent set it) keeps ignoring it."""
    import subprocess

    run = subprocess.run([sys.executable, "-c", TERMINATED, parent], capture_output=True, text=True, timeout=120)
    if parent == "default":
        assert (run.returncode, run.stdout, run.stderr) == (143, "cleanup\nhandler back: True\n", "memfit: terminated\n")
    else:
        assert (run.returncode, run.stdout, run.stderr) == (0, "handler back: True\n", "")


def test_the_command_runs_from_another_thread():
    """Setting a signal handler is for the main thread only: a caller's thread had got a ValueError."""
    import threading

    results = []
    worker = threading.Thread(target=lambda: results.append(main(["presets"])))
    worker.start()
    worker.join(timeout=120)
    assert results == [0]


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`memfit plan --json | head -c 1` had printed "error: [Errno 32] Broken pipe" and exited 1; it now exits as a
    command killed by SIGPIPE does, 141, and says nothing."""
    import subprocess

    run = subprocess.Popen([sys.executable, "-m", "memfit", "plan", "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    run.stdout.close()                                 # before the command has written anything
    assert run.stderr.read() == b"" and run.wait(timeout=120) == 141


@pytest.mark.parametrize("verb", ["finetune", "generate"])
@pytest.mark.parametrize("value", ["99999999999999999999", "-1"])
def test_a_seed_out_of_range_is_a_usage_error(verb, value, capsys):
    """A seed of 2**64 or more had ended the run in torch's ValueError traceback ("Overflow when unpacking long")."""
    with pytest.raises(SystemExit) as exited:
        main([verb, "tiny", "--prompt", "hi", "--seed", value] if verb == "generate" else [verb, "--seed", value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument --seed: a seed is from 0 to 4294967295, got {int(value)}" in err, err
