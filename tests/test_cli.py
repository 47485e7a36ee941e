"""The memfit command: outputs, --json schema, and clear errors (exit 2, no traceback)."""
import json

import pytest
from conftest import MEASURES_A_CPU_RUN

import memfit
from memfit.cli import COMMANDS, main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_presets_lists_every_required_shape(capsys):
    code, out, _ = run(capsys, "presets", "--json")
    assert code == 0
    presets = json.loads(out)
    for name in ("tiny", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-2-7b", "qwen2.5-0.5b",
                 "qwen2.5-1.5b", "qwen2.5-7b", "mistral-7b"):
        assert name in presets
    assert presets["llama-3.2-1b"]["params"] == 1_235_814_400


def test_presets_table_shortens_no_cell_in_a_pipe(capsys, monkeypatch):
    """Piped (rich's 80 columns) the table had cut names to 'lla…', and tiny's size read 0.00B."""
    from memfit.models import PRESETS

    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "presets")
    assert code == 0 and "…" not in out
    assert all(f" {name} " in out for name in PRESETS) and " 158.0K " in out


def test_parameter_counts_keep_a_readable_unit():
    from memfit.units import format_count

    counts = (1_235_814_400, 13_200_000, 158_016, 999_950, 999_995_000, 940)
    assert [format_count(n) for n in counts] == ["1.24B", "13.2M", "158.0K", "1.0M", "1.00B", "940"]


def test_plan_json_schema(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama-3.2-1b", "--task", "lora", "--seq", "2048",
                       "--gpu-memory", "12GiB", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"job", "budget_bytes", "asked", "plans"}
    assert data["budget_bytes"] == 12 * 2**30
    assert data["plans"], "a 1B LoRA job fits 12 GiB"
    times = [p["relative_time"] for p in data["plans"]]
    assert times == sorted(times)
    for plan in data["plans"]:
        assert plan["device_bytes"] <= data["budget_bytes"]
        assert plan["peak_bytes"] == sum(plan["components"].values())
        assert {"techniques", "phases", "peak_phase", "knobs", "recompute_fraction"} <= set(plan)


@pytest.mark.parametrize("extra, message, built", [
    (("--gpu-memory", "eight gigs"), "cannot read the memory size 'eight gigs'", True),
    (("--seq", "0"), "seq (--seq) must be a positive integer, got 0", False),
    (("--model", "nope"), "unknown model 'nope'", False),
    (("--task", "infer", "--optimizer", "sgd"), "--optimizer does nothing with --task infer", False),
    (("--model", "llama-3.1-8b", "--gpu-memory", "2GiB"), "no plan fits 2.00 GiB", True),
])
def test_plan_json_reports_every_error_on_stdout(capsys, extra, message, built):
    """Not only the planner's own: a bad budget, job or model is a JSON object too, the job null where it could not
    be built; stderr and the exit status are as without --json."""
    code, out, err = run(capsys, "plan", "--json", *extra)
    assert code == 2 and err.startswith("memfit plan: error: ") and message in err
    data = json.loads(out)
    assert data == {"job": data["job"], "budget_bytes": data["budget_bytes"], "asked": None, "plans": [],
                    "error": err.removeprefix("memfit plan: error: ").rstrip("\n")}
    assert (data["job"] is not None) == built
    assert data["budget_bytes"] == (2 * 2**30 if "no plan fits" in message else None)


@pytest.mark.parametrize("extra, message, built", [
    (("--seq", "0"), "seq (--seq) must be a positive integer, got 0", False),
    (("--warmup", "0"), "warmup (--warmup) must be an integer of at least 1", True),
    (("--tolerance", "nan"), "tolerance (--tolerance) must be a positive, finite fraction", True),
])
def test_verify_json_reports_its_errors_on_stdout(capsys, extra, message, built):
    """As plan --json: the error as a JSON object, the job null where it could not be built; stderr and the exit
    status are as without --json."""
    code, out, err = run(capsys, "verify", "--model", "tiny", "--device", "cpu", "--json", *extra)
    assert code == 2 and err.startswith("memfit verify: error: ") and message in err
    data = json.loads(out)
    assert data == {"job": data["job"], "error": err.removeprefix("memfit verify: error: ").rstrip("\n")}
    assert (data["job"] is not None) == built


def test_plan_default_job_runs(capsys):
    code, out, _ = run(capsys)
    assert code == 0 and "plans that fit" in out


def test_plan_shows_the_ledgers_notes(capsys):
    """The ledger's notes (a job past the model's length, 8-bit AdamW's bitsandbytes) had reached --json only."""
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--seq", "5000", "--device", "cpu")
    assert code == 0 and "note: 5000 positions pass the model's max_position_embeddings (4096)" in " ".join(out.split())


def test_plan_shows_the_notes_of_the_plans_it_proposes(capsys):
    """A plan's own techniques can add a note (8-bit AdamW needs bitsandbytes): said once, with the plans it is of."""
    code, out, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--gpu-memory", "12GiB")
    notes = [line for line in out.splitlines() if line.startswith("note (plan")]
    assert code == 0 and len(notes) == 1 and notes[0].endswith("8-bit AdamW needs bitsandbytes on CUDA")


def test_verify_shows_a_tolerance_under_one_percent(capsys):
    """--tolerance 0.004 had read 'the tolerance of 0%'."""
    code, out, _ = run(capsys, "verify", "--model", "tiny", "--seq", "64", "--device", "cpu", "--tolerance", "0.004")
    assert code in (0, 1) and "the tolerance of 0.4%" in " ".join(out.split())


def test_a_cpu_plan_shows_no_cuda_context(capsys):
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--seq", "64", "--device", "cpu")
    assert code == 0 and "CUDA context" not in out and "needs of the CPU job" in out and "GPU" not in out
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--seq", "64")
    assert code == 0 and "CUDA context" in out and "needs of the GPU" in out


def test_global_flag_without_a_verb_runs_the_default_plan(capsys):
    code, out, _ = run(capsys, "-v")
    assert code == 0 and "plans that fit" in out


@MEASURES_A_CPU_RUN
def test_verify_tiny_on_cpu(capsys):
    code, out, _ = run(capsys, "verify", "--model", "tiny", "--task", "infer", "--seq", "32", "--new-tokens", "4",
                       "--device", "cpu", "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] and abs(data["relative_error"]) < 0.05 and "error" not in data


@MEASURES_A_CPU_RUN
def test_verify_a_block_low_rank_model_on_cpu(capsys, monkeypatch):
    """verify --blr measures the BLR model the plan describes: its weights as predicted, the title names it."""
    monkeypatch.setenv("MEMFIT_KERNELS", "reference")    # the path the ledger counts on the CPU, quicker than the interpreter
    code, out, _ = run(capsys, "verify", "--model", "tiny", "--task", "full", "--seq", "64", "--device", "cpu",
                       "--blr", "monarch", "--blr-blocks", "4", "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["knobs"]["blr_method"] == "monarch"
    assert abs(data["measured"]["weights"] - data["components"]["weights"]) <= 64        # the rotary buffer
    code, out, _ = run(capsys, "verify", "--model", "tiny", "--task", "infer", "--seq", "32", "--new-tokens", "2",
                       "--device", "cpu", "--blr", "lowrank")
    assert code == 0 and "lowrank block-low-rank, 0.5" in out


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "meta-llama/Llama-3.2-1B"], "unknown model"),
    (["plan", "--seq", "-5"], "seq (--seq) must be a positive integer"),
    (["plan", "--batch", "0"], "batch (--batch) must be a positive integer"),
    (["plan", "--gpu-memory", "eight gigs"], "cannot read the memory size"),
    (["plan", "--gpu-memory", "2GiB", "--model", "llama-3.1-8b"], "no plan fits 2.00 GiB; the smallest needs"),
    (["plan", "--batch", "3", "--micro-batch", "2"], "not a multiple"),
    (["verify", "--model", "tiny", "--device", "cpu", "--optimizer", "adamw8bit", "--task", "full"], "CUDA only"),
])
def test_bad_input_gets_a_clear_error(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_malformed_config_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = run(capsys, "plan", "--model", str(tmp_path))
    assert code == 2 and "malformed config.json" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    code, _, err = run(capsys, "plan", "--model", str(tmp_path))
    assert code == 2 and "lacks" in err


@pytest.mark.parametrize("given, read", [("0.05", 0.05), ("5%", 0.05), ("2.5 %", 0.025)])
def test_verify_reads_a_tolerance_as_a_fraction_or_a_percentage(given, read):
    from memfit.cli import build_parser

    assert build_parser().parse_args(["verify", "--tolerance", given]).tolerance == pytest.approx(read)


def test_a_tolerance_that_is_no_number_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["verify", "--tolerance", "five"])
    assert stop.value.code == 2 and "expected a fraction (0.05) or a percentage (5%), got 'five'" in capsys.readouterr().err


def test_plan_lists_each_plan_only_where_it_needs_less_than_those_above(capsys):
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--task", "full", "--seq", "64", "--gpu-memory", "8GiB",
                       "--json")
    needs = [p["device_bytes"] for p in json.loads(out)["plans"]]
    assert code == 0 and len(needs) > 1 and needs == sorted(set(needs), reverse=True)


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"memfit {memfit.__version__}\n"


def test_verbose_plan_says_how_the_search_went(capsys, caplog):
    """-v had shown nothing: no debug message existed. A caller's level of the memfit logger comes back after."""
    import logging

    logging.getLogger("memfit").setLevel(logging.WARNING)
    code, _, _ = run(capsys, "-v", "plan", "--model", "tiny", "--task", "full", "--seq", "64", "--gpu-memory", "8GiB")
    assert code == 0 and "candidate technique sets ranked by predicted time" in caplog.text
    assert logging.getLogger("memfit").level == logging.WARNING
    logging.getLogger("memfit").setLevel(logging.NOTSET)


@pytest.mark.parametrize("verb", [["plan", "--model"], ["finetune"], ["compress"]])
def test_a_data_file_passed_as_the_model_is_named_as_such(capsys, tmp_path, verb):
    """A JSONL file where the model goes had read as a malformed config.json."""
    data = tmp_path / "chat.jsonl"
    out = ["--out", str(tmp_path / "out")] if verb == ["compress"] else []
    data.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n')
    code, _, err = run(capsys, *verb, str(data), *out)
    assert code == 2 and "is a file that is not JSON" in err and "malformed config.json" not in err
    data.write_text('{"prompt": "a", "response": "b"}\n')                   # one record: JSON, but no config
    code, _, err = run(capsys, *verb, str(data), *out)
    assert code == 2 and "is a JSON file but not a model's config.json" in err


def test_local_model_directory(capsys, tmp_path):
    from memfit.models import PRESETS, save_model_dir

    save_model_dir(PRESETS["tiny"], tmp_path / "m")
    code, out, _ = run(capsys, "plan", "--model", str(tmp_path / "m"), "--device", "cpu", "--seq", "64",
                       "--gpu-memory", "1GiB", "--json")
    assert code == 0
    assert json.loads(out)["asked"]["trainable_params"] > 0


def test_help_and_import_do_not_load_torch():
    """`memfit --help` and `import memfit` stay fast: torch (2+ s to import) loads only when a verb needs it."""
    import subprocess
    import sys

    code = ("import sys, memfit; from memfit.cli import build_parser; build_parser().format_help(); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('memfit'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_python_dash_m_memfit_is_the_command():
    """`python -m memfit` runs the same command (for an environment whose scripts directory is not on PATH)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "memfit", "plan", "--model", "tiny", "--bogus"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr
    assert subprocess.run([sys.executable, "-m", "memfit", "--help"], capture_output=True, text=True,
                          check=True).stdout.startswith("usage: memfit")


REQUIRED = {"compress": ["tiny", "--out", "x"], "calibrate": ["m", "--data", "d"], "generate": ["m", "--prompt", "hi"]}


@pytest.mark.parametrize("verb", COMMANDS)
def test_verbose_goes_before_or_after_the_verb(verb, monkeypatch):
    """`memfit -v VERB` and `memfit VERB -v` both turn on debug messages; leaving it out leaves them off."""
    import importlib

    seen = []
    monkeypatch.setattr(importlib.import_module(f"memfit.commands.{verb}"), "run", lambda args: seen.append(args.verbose))
    for argv in (["-v", verb], [verb, "-v"], [verb, "--verbose"], [verb]):
        assert main([*argv, *REQUIRED.get(verb, [])]) == 0
    assert seen == [True, True, True, False]
