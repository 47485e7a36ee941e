"""benchmarks/plan_fits.py on the CPU: the plans come from `memfit plan --json`, each is read back as `memfit verify
--plan` reads it and measured in a process of its own, and an allocator that refuses a plan is recorded with the
phase it refused in."""
import json

import torch
from conftest import load_benchmark


def test_the_smoke_run_measures_each_plan_the_planner_listed(tmp_path):
    plan_fits = load_benchmark("plan_fits")
    assert plan_fits.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "plan_fits_smoke.json").read_text())
    rows = result["rows"]
    assert [row["pick"] for row in rows] == [1, 2] and result["complete"]
    assert rows[0]["knobs"] != rows[1]["knobs"]          # two plans, not one measured twice
    assert all(row["within_prediction"]["status"] == "ran" and row["within_prediction"]["peak_bytes"] > 0
               for row in rows)
    assert result["targets"][0]["measured"] == 2 and result["targets"][0]["met"]


def test_a_plan_the_allocator_refuses_is_recorded_with_its_phase(tmp_path, monkeypatch, capsys):
    plan_fits = load_benchmark("plan_fits")
    path = plan_fits.plan_file("tiny", "lora", 64, 2, "4MiB", 1, "cpu", tmp_path)
    from memfit.ledger import verify

    def refuse(job, knobs, warmup, progress):
        progress("building the random-init model")
        progress("warm-up step 1/1")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB\nmore")

    monkeypatch.setattr(verify, "measure", refuse)
    plan_fits.child(str(path), 1, 0)
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["status"] == "out of memory" and row["at"] == "warm-up step 1/1"
    assert row["message"] == "CUDA out of memory. Tried to allocate 2.00 MiB"
