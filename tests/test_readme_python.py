"""README's Python API example runs as printed (its second plan call had asked 8 GiB, which no plan of the techniques
it allows reaches, and raised); ``memfit.verify``, which needs the job's GPU, is recorded instead of run."""
import re
from pathlib import Path

import pytest

import memfit
from memfit.errors import MemfitError

README = Path(__file__).resolve().parents[1] / "README.md"


def python_api_example() -> str:
    section = README.read_text().split("## The Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_python_api_example_runs(monkeypatch, capsys):
    verified = []
    monkeypatch.setattr(memfit, "verify", lambda job, knobs: verified.append((job, knobs)), raising=False)
    names = {}
    exec(compile(python_api_example(), str(README), "exec"), names)
    assert len(verified) == 1 and names["plans"] and "GiB" in capsys.readouterr().out
    assert all(p.knobs.offload_layers == 0 for p in names["plans"])


def test_plan_refuses_a_technique_name_it_does_not_have():
    """A misspelt name had been left out of the search, unsaid: the job as asked was the only candidate."""
    job = memfit.Job(memfit.load_spec("llama-3.2-1b"), task="lora", seq=2048)
    with pytest.raises(MemfitError, match="no technique named 'checkpointing', 'fused-ce'; the techniques are "
                                          "checkpoint, fused_ce"):
        memfit.plan(job, memfit.Knobs(), memfit.parse_bytes("16GiB"), allowed=("checkpointing", "fused-ce"))
    _, plans = memfit.plan(job, memfit.Knobs(), memfit.parse_bytes("16GiB"), allowed="checkpoint", limit=30)
    assert {tuple(p.techniques) for p in plans} - {()} and all(
        all(t.startswith("checkpoint") for t in p.techniques) for p in plans)
