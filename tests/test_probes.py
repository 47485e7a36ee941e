"""The generator-peak probe's replay of CUDA's allocation history (the probe itself needs a GPU)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))

from generator_peak import summarize  # noqa: E402


def _alloc(addr, size, line):
    return {"action": "alloc", "addr": addr, "size": size, "frames": [{"filename": "/x/memfit/a.py", "line": line,
                                                                        "name": "f"}]}


def test_the_peak_holds_the_blocks_live_at_it_grouped_by_their_memfit_frames():
    trace = [_alloc(1, 10, 1), _alloc(2, 100, 2), _alloc(4, 5, 2), {"action": "free_requested", "addr": 2},
             {"action": "free_completed", "addr": 2}, _alloc(3, 50, 3)]
    got = summarize(trace)
    assert got["event"] == 2 and got["peak_GB"] == 115e-9
    assert [(g["where"], g["GB"], g["blocks"]) for g in got["groups"]] == [("a.py:2:f", 105e-9, 2), ("a.py:1:f", 10e-9, 1)]
