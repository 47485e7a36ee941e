"""benchmarks/finetune_steps.py: the 8-bit row step by step. A smoke run on the CPU alternates the fused SwiGLU off
and on (``--ab``), times every step on its own, profiles one step of each setting and summarises both settings;
bad arguments are usage errors before any model is built."""
import json

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def finetune_steps():
    return load_benchmark("finetune_steps")


def test_ab_smoke_run_alternates_the_settings_and_profiles_each(finetune_steps, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_KERNELS", "reference")   # the run's logic, not the kernels: 56 s under the interpreter
    assert finetune_steps.main(["--smoke", "--contexts", "40", "--dtypes", "float32", "--steps", "3", "--ab",
                                "--profile", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "finetune_steps_ab_smoke.json").read_text())
    assert written["complete"] is True
    steps = [r for r in written["rows"] if "step" in r]
    assert [(r["step"], r["fused_swiglu"]) for r in steps] == [(0, False), (1, True), (2, False)]
    assert all(r["step_ms"] > 0 and r["context"] == 40 for r in steps)
    profiles = [r for r in written["rows"] if r.get("profile")]
    assert [r["fused_swiglu"] for r in profiles] == [False, True]
    assert all(r["kernels"] and r["host"] and "idle_ms" in r["gpu_idle"] for r in profiles)
    summary = {r["fused_swiglu"]: r for r in written["summary"]}
    assert summary[False]["steps"] == 2 and summary[True]["steps"] == 1
    times = [r["step_ms"] for r in steps if not r["fused_swiglu"]]
    assert summary[False]["min_ms"] == min(times) and summary[False]["max_ms"] == max(times)


@pytest.mark.parametrize("arguments,message", [(["--steps", "0"], "positive count"),
                                               (["--contexts", "1k"], "comma-separated token counts"),
                                               (["--contexts", "0"], "positive token counts"),
                                               (["--dtypes", "fp8"], "float32 and/or bfloat16"),
                                               (["--history"], "run it on a GPU machine"),
                                               (["--resident"], "run it on a GPU machine"),
                                               (["--history", "--resident"], "give one")])
def test_bad_arguments_are_usage_errors(finetune_steps, arguments, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        finetune_steps.main(["--smoke", *arguments])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_smoke_run_takes_small_defaults_and_keeps_the_options_given(finetune_steps, tmp_path, monkeypatch):
    """--smoke had kept the GPU's contexts (1K-4K), dtypes and steps: 294 s of a tiny model on a 2-core CPU."""
    monkeypatch.setenv("MEMFIT_KERNELS", "reference")   # the run's defaults, not the kernels (36 s interpreted)
    assert finetune_steps.main(["--smoke", "--steps", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "finetune_steps_smoke.json").read_text())["rows"]
    assert {r["context"] for r in rows} == {64, 128} and {r["dtype"] for r in rows} == {"torch.float32"}
    assert len(rows) == 2                                   # --steps 1: one timed step per context
