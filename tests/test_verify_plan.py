"""`memfit verify --plan FILE --pick N`: the job and techniques of a plan `memfit plan --json` wrote, measured, and
the records that carry them (Job.from_dict, Knobs.from_dict); what it refuses, each in one line before any work."""
import dataclasses
import json

import pytest
from conftest import MEASURES_A_CPU_RUN

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.ledger.job import Job, Knobs
from memfit.models import PRESETS

PLAN = ["plan", "--model", "tiny", "--task", "lora", "--seq", "64", "--device", "cpu", "--gpu-memory", "1GiB",
        "--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--json"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A plan file of the tiny LoRA job on the CPU: the job as asked (fused loss off) and the plans that fit."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(PLAN) == 0
    path = tmp_path_factory.mktemp("plan") / "plans.json"
    path.write_text(out.getvalue())
    return path


@pytest.fixture
def measured(monkeypatch):
    """The job and knobs verify is asked to measure (nothing is run; the test of a real run is below)."""
    from memfit.ledger import verify as ledger_verify

    calls = []

    def fake(job, knobs, **kwargs):
        calls.append((job, knobs))
        raise MemfitError("measured")                 # ends the command before it prints a result

    monkeypatch.setattr(ledger_verify, "verify", fake)
    return calls


@pytest.mark.parametrize("job, knobs", [
    (Job(PRESETS["tiny"], task="infer", seq=40, batch=2, new_tokens=7, device="cpu"),
     Knobs(dtype="float16", partial_load=0.5, partial_compute=0.25)),
    (Job(PRESETS["tiny"], task="lora", seq=64, loss_fraction=0.3),
     Knobs(lora_rank=4, lora_targets=("q_proj", "down_proj"), checkpoint_layers=2, offload_layers=1, fused_ce=True,
           optimizer="adamw8bit", micro_batch=1)),
    (Job(PRESETS["tiny"], task="full"), Knobs(blr_method="monarch", blr_ratio=0.4, blr_blocks=4, attention="memfit")),
    (Job(dataclasses.replace(PRESETS["tiny"], num_layers=6)), Knobs()),
    (Job(dataclasses.replace(PRESETS["tiny"], name="my-model", extra={"rope_scaling": {"factor": 8.0}})), Knobs()),
])
def test_a_record_reads_back_as_the_job_and_knobs_it_was_written_from(job, knobs):
    """A spec built or changed in Python carries its fields (a preset's record only its name): a 6-layer copy of
    tiny had read back as tiny, and a model named my-model not at all."""
    record = json.loads(json.dumps(job.to_dict()))
    back = Job.from_dict(record)
    assert back == job and back.spec.extra == job.spec.extra
    assert ("spec" in record) == (job.spec != PRESETS["tiny"] or job.spec.extra != PRESETS["tiny"].extra)
    assert Knobs.from_dict(json.loads(json.dumps(knobs.to_dict()))) == knobs


def test_a_window_turned_off_in_config_json_stays_off_in_the_built_model_and_the_record(tmp_path):
    """"sliding_window": null (Mistral v0.2 on) had been dropped with the other nulls: the model built from the spec
    took MistralConfig's default window of 4096, and verify measured another model than the user's."""
    from memfit.models import build_model, load_spec

    config = {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "sliding_window": None}
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(config))
    spec = load_spec(tmp_path / "mistral")
    assert spec.sliding_window is None and build_model(spec).config.sliding_window is None
    for job, by_name in ((Job(spec, seq=8192), True), (Job(dataclasses.replace(spec, name="renamed")), False)):
        record = json.loads(json.dumps(job.to_dict()))
        assert ("spec" in record) != by_name                 # read again from its directory, or from its record
        back = Job.from_dict(record).spec
        assert back.extra == {"sliding_window": None} and back.sliding_window is None


@pytest.mark.parametrize("change, message", [
    (lambda job, knobs: job.pop("seq"), "the job record lacks seq"),
    (lambda job, knobs: job.update(budget=1), "the job record holds budget, which this memfit does not know"),
    (lambda job, knobs: knobs.update(checkpoint_layers="2"), r"checkpoint_layers \(--checkpoint-layers\) must be "
                                                             "an integer, got '2'"),
    (lambda job, knobs: knobs.update(lora_targets="q_proj"), "lora_targets is a list of module names, got 'q_proj'"),
    (lambda job, knobs: knobs.update(new_knob=True), "the knobs record holds new_knob"),
    (lambda job, knobs: job.update(spec={"name": "x", "layers": 2}), "the job record's spec holds layers"),
    (lambda job, knobs: job.update(spec={"name": "x"}), "the job record's spec: .*missing"),
])
def test_a_record_that_is_not_one_is_refused_by_name(change, message):
    job, knobs = Job(PRESETS["tiny"]).to_dict(), Knobs().to_dict()
    change(job, knobs)
    with pytest.raises(MemfitError, match=message):
        Job.from_dict(job), Knobs.from_dict(knobs)


@pytest.mark.parametrize("pick", [0, 1, 3])
def test_verify_measures_the_picked_plans_job_and_knobs(plans, measured, capsys, pick):
    record = json.loads(plans.read_text())
    entry = record["asked"] if pick == 0 else record["plans"][pick - 1]
    assert main(["verify", "--plan", str(plans), "--pick", str(pick)]) == 2
    assert "measured" in capsys.readouterr().err
    (job, knobs), = measured
    assert job.to_dict() == entry["job"] and knobs.to_dict() == entry["knobs"]


def test_the_plans_differ_so_that_the_pick_is_seen(plans):
    """The test above could not tell its picks apart if their entries held the same knobs."""
    record = json.loads(plans.read_text())
    knobs = [record["asked"]["knobs"], record["plans"][0]["knobs"], record["plans"][2]["knobs"]]
    assert len({json.dumps(k, sort_keys=True) for k in knobs}) == 3


@MEASURES_A_CPU_RUN
def test_verify_runs_the_fastest_plan_and_says_which(plans, capsys, monkeypatch):
    """A real measurement of plan 1 on the CPU, its techniques named; --json carries the plan beside the result. The
    fused loss runs its CPU reference, as on a CPU outside the tests (the interpreter's kernel holds other buffers)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    record = json.loads(plans.read_text())
    assert main(["verify", "--plan", str(plans), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan"] == {"file": str(plans), "pick": 1, "techniques": record["plans"][0]["techniques"]}
    assert result["knobs"] == record["plans"][0]["knobs"] and result["ok"]
    assert main(["verify", "--plan", str(plans)]) == 0
    said = " ".join(capsys.readouterr().out.split())     # rich wraps at the terminal's width
    assert f"plan 1 of {plans}: {', '.join(record['plans'][0]['techniques'])}" in said


@pytest.mark.parametrize("argv, message", [
    (["--seq", "128", "--task", "full"], "--task, --seq: --plan {plans} sets the job; leave out the job options"),
    (["--device", "cuda", "--attention", "sdpa"], "--device, --attention: --plan {plans} sets the job"),  # defaults
    (["--pick", "99"], "--pick 99: {plans} holds plans 1-"),
    (["--pick", "-1"], "--pick -1: {plans} holds plans 1-"),
])
def test_verify_refuses_job_options_and_a_pick_the_file_lacks(plans, measured, capsys, argv, message):
    assert main(["verify", "--plan", str(plans), *argv]) == 2
    assert message.format(plans=plans) in capsys.readouterr().err
    assert measured == []


def test_verify_refuses_a_pick_without_a_plan(measured, capsys):
    assert main(["verify", "--pick", "2"]) == 2
    assert "--pick chooses among a --plan file's plans; pass --plan FILE too" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("not json", "is not JSON"),
    ('{"ok": 1}', 'is not `memfit plan --json` output (it has no "job", "asked" and "plans")'),
    ('{"job": null, "budget_bytes": null, "asked": null, "plans": [], "error": "seq must be positive"}',
     "holds a plan that failed: seq must be positive"),
    ('{"job": {}, "budget_bytes": 1, "asked": {}, "plans": [{"knobs": {}}]}',
     "its entry 1 is not a plan's record (KeyError: 'job')"),
    ('{"job": {}, "budget_bytes": 1, "asked": {}, "plans": [{"job": 1, "knobs": {}}]}',
     "entry 1: a job record is a JSON object, got int"),
    ('{"job": {}, "budget_bytes": 1, "asked": {}, "plans": {"1": {}}}', 'its "plans" is not a list of plans'),
    ('{"job": {}, "budget_bytes": 1, "asked": {}, "plans": null}', 'its "plans" is not a list of plans'),
])
def test_verify_refuses_a_file_that_holds_no_plan(tmp_path, measured, capsys, text, message):
    path = tmp_path / "plans.json"
    path.write_text(text)
    assert main(["verify", "--plan", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert measured == []


def test_verify_refuses_a_plan_file_that_is_not_there(tmp_path, measured, capsys):
    assert main(["verify", "--plan", str(tmp_path / "missing.json")]) == 2
    assert "does not exist; pass what `memfit plan --json` printed" in capsys.readouterr().err


def test_verify_refuses_techniques_that_are_not_names(plans, tmp_path, measured, capsys):
    record = json.loads(plans.read_text())
    record["plans"][0]["techniques"] = "abc"
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(record))
    assert main(["verify", "--plan", str(path)]) == 2
    assert 'entry 1: its "techniques" is not a list of names' in capsys.readouterr().err


def test_a_cuda_plan_on_a_machine_without_one_is_not_told_to_use_device_cpu(plans, tmp_path, measured, capsys,
                                                                            monkeypatch):
    """check_runnable's own line says "use --device cpu here", an option --plan refuses."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    record = json.loads(plans.read_text())
    for entry in (record["asked"], *record["plans"]):
        entry["job"]["device"] = "cuda"
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(record))
    assert main(["verify", "--plan", str(path)]) == 2
    assert "its job runs on cuda and this machine has no CUDA GPU; run it on one, or plan again with --device cpu" \
        in capsys.readouterr().err


def test_a_model_directory_reads_back_from_anywhere_and_not_as_a_preset(tmp_path, monkeypatch, measured, capsys):
    """A directory given relative to where `memfit plan` ran had been recorded as typed, so verify run elsewhere did
    not find it; one named like a preset had read back as the preset."""
    import contextlib
    import io

    from memfit.models import save_model_dir

    save_model_dir(PRESETS["tiny"], tmp_path / "llama-3.2-1b", dtype="float32")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--json", "--model", "./llama-3.2-1b", "--device", "cpu", "--seq", "64"]) == 0
    (tmp_path / "plans.json").write_text(out.getvalue())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["verify", "--plan", "../plans.json"]) == 2      # the fake measure ends it
    (job, _), = measured
    assert job.spec.hidden == PRESETS["tiny"].hidden and job.spec.name == str(tmp_path / "llama-3.2-1b")


def test_a_plan_whose_knobs_do_not_fit_its_job_is_refused_naming_the_file(plans, tmp_path, measured, capsys):
    """The file's values are checked as the options' are (the check had been unreachable, after a raise)."""
    record = json.loads(plans.read_text())
    record["plans"][0]["job"]["task"] = "infer"              # its knobs keep LoRA rank 4
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(record))
    assert main(["verify", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--plan file '{path}', entry 1: " in err and "lora_rank" in err
    assert measured == []
