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


def test_a_resumed_run_measures_only_the_plans_it_has_no_row_for(tmp_path, monkeypatch):
    from memfit.measure import results

    here = {"gpu": None, "torch": torch.__version__, "triton": None, "commit": "abc1234", "date": "today"}
    monkeypatch.setattr(results, "environment", lambda: dict(here))
    plan_fits = load_benchmark("plan_fits")
    measured = []
    monkeypatch.setattr(plan_fits, "run_child", lambda path, pick, cap, allocator: measured.append(pick) or
                        {"status": "ran", "peak_bytes": 1})
    assert plan_fits.main(["--smoke", "--out", str(tmp_path)]) == 0
    path = tmp_path / "plan_fits_smoke.json"
    stopped = json.loads(path.read_text())
    path.write_text(json.dumps({**stopped, "rows": stopped["rows"][:1], "complete": False}))
    assert plan_fits.main(["--smoke", "--out", str(tmp_path), "--resume"]) == 0
    assert measured == [1, 2, 2]
    assert [row["pick"] for row in json.loads(path.read_text())["rows"]] == [1, 2]
