"""blr_layers' case timing: every implementation checked first, then timed by turns in rounds."""
import math

import pytest
import torch
from conftest import load_benchmark


@pytest.fixture(scope="module")
def blr_layers():
    return load_benchmark("blr_layers")


def test_rounds_alternate_forward_and_reverse_order(blr_layers):
    """Each round times every implementation once, over all its copies; rounds go forward and backward by turns, so
    a steady drift of the GPU's speed reaches every implementation alike; a timing that raises is NaN."""
    calls, clock = [], iter(range(1, 100))

    def timer(run):
        run()
        return float(next(clock))

    def failing(i):
        raise RuntimeError("capture")

    impls = {"a": (lambda i: calls.append(("a", i)), 2), "b": (lambda i: calls.append(("b", i)), 1), "c": (failing, 1)}
    times = blr_layers.time_rounds(impls, timer)
    assert [c for c in calls if c[1] == 0] == [("a", 0), ("b", 0), ("b", 0), ("a", 0)] * (blr_layers.TIMING_ROUNDS // 2)
    assert times["a"][:2] == [1 / 2, 4 / 2] and times["b"][:2] == [2.0, 3.0]   # a's clock over its 2 copies
    assert len(times["c"]) == blr_layers.TIMING_ROUNDS and all(map(math.isnan, times["c"]))


def test_check_flags_a_wrong_result_and_a_failure_against_the_first_impl(blr_layers):
    x = torch.ones(4)
    checks = blr_layers.check_impls({"ref": lambda i: x, "close": lambda i: x * 1.001, "off": lambda i: x * 2,
                                     "broken": lambda i: 1 / 0}, {})
    assert checks["ref"] == (0.0, None) and checks["close"][1] is None
    assert checks["close"][0] == pytest.approx(1e-3, rel=1e-3)
    assert checks["off"][1].startswith("wrong result") and checks["broken"][1].startswith("ZeroDivisionError")


def test_pick_check_lists_the_cases_where_the_pick_trails_its_fastest_pipeline(blr_layers):
    """Only the pick's own structure's pipelines count (not the reference, not the permuted layout, not another
    structure, not a failed row), and only past PICK_SLACK."""
    def row(impl, ms, structure="monarch", n=16):
        return {"shape": "s", "n": n, "structure": structure, "impl": impl, "ms": ms}

    rows = [row("monarch_reference", 5.0), row("monarch_bmm", 10.0), row("monarch_two_stage", math.nan),
            row("monarch_permuted", 6.0), row("monarch_ours", 11.0), row("blast_z_mixgemm", 1.0, "blast"),
            row("blast_ours", 1.01, "blast"), row("monarch_bmm", 10.0, n=1), row("monarch_ours", 10.1, n=1)]
    assert blr_layers.pick_check(rows) == [{"shape": "s", "n": 16, "structure": "monarch", "ours_ms": 11.0,
                                            "fastest": "monarch_bmm", "fastest_ms": 10.0, "ratio": 1.1}]
