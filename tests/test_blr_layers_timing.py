"""blr_layers' case timing: every implementation checked first, then timed by turns in rounds."""
import math
import os

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
    times, failures = blr_layers.time_rounds(impls, timer, lambda: calls.append(("between rounds", 0)))
    one_round, back = [("a", 0), ("b", 0)], [("b", 0), ("a", 0)]
    pause = [("between rounds", 0)]
    assert [c for c in calls if c[1] == 0] == (one_round + pause + back + pause) * (blr_layers.TIMING_ROUNDS // 2 - 1) \
        + one_round + pause + back
    assert times["a"][:2] == [1 / 2, 4 / 2] and times["b"][:2] == [2.0, 3.0]   # a's clock over its 2 copies
    assert len(times["c"]) == blr_layers.TIMING_ROUNDS and all(map(math.isnan, times["c"]))
    assert failures == {"c": "RuntimeError: capture"}


def test_check_flags_a_wrong_result_and_a_failure_against_the_first_impl(blr_layers):
    """Against the first impl: close is right, double is wrong, a NaN in the output is wrong, a raise is recorded; an
    impl's layout function maps its output to the first impl's layout before the comparison."""
    x = torch.arange(1.0, 5.0)
    checks = blr_layers.check_impls({"ref": lambda i: x, "close": lambda i: x * 1.001, "off": lambda i: x * 2,
                                     "nan": lambda i: x.clone().fill_(math.nan), "broken": lambda i: 1 / 0,
                                     "reversed": lambda i: x.flip(0)}, {"reversed": lambda y: y.flip(0)})
    assert checks["ref"] == (0.0, None) and checks["close"][1] is None and checks["reversed"] == (0.0, None)
    assert checks["close"][0] == pytest.approx(1e-3, rel=1e-3)
    assert checks["off"][1] == "wrong result: relative error 1 to ref" and checks["nan"][1].startswith("wrong result")
    assert checks["broken"] == (pytest.approx(math.nan, nan_ok=True), "ZeroDivisionError: division by zero")


def test_a_failed_first_impl_leaves_the_others_unchecked_not_checked_against_another(blr_layers):
    x = torch.ones(4)
    checks = blr_layers.check_impls({"ref": lambda i: 1 / 0, "a": lambda i: x, "b": lambda i: x * 2}, {})
    assert checks["ref"][1].startswith("ZeroDivisionError")
    assert all(math.isnan(checks[k][0]) and checks[k][1] is None for k in ("a", "b"))


@pytest.mark.parametrize("checked,times,failure,want", [
    (None, [3.0, 1.0, 2.0, 4.0], None, (2.5, None)),
    ("wrong result: x", [1.0, 1.0], None, (math.nan, "wrong result: x (ran in 1.0000 ms)")),
    ("wrong result: x", [1.0, math.nan], "E: e", (math.nan, "wrong result: x")),
    ("ValueError: v", [], None, (math.nan, "ValueError: v")),
    (None, [1.0, math.nan, 1.0, 1.0], "RuntimeError: r", (math.nan, "timing failed: RuntimeError: r")),
])
def test_row_time_is_the_median_of_the_rounds_or_nan_with_the_reason(blr_layers, checked, times, failure, want):
    ms, error = blr_layers.row_time(checked, times, failure)
    assert (math.isnan(ms) if math.isnan(want[0]) else ms == want[0]) and error == want[1]


def test_run_state(blr_layers, tmp_path):
    path = tmp_path / "blr_layers.json"
    assert blr_layers.run_state(path) == "missing"
    path.write_text("{not json")
    assert blr_layers.run_state(path) == "unreadable"
    path.write_text('{"complete": false}')
    assert blr_layers.run_state(path) == "stopped"
    path.write_text('{"complete": true}')
    assert blr_layers.run_state(path) == "complete"


def test_pick_check_lists_the_cases_where_the_pick_trails_its_fastest_pipeline(blr_layers):
    """Only the pick's own structure's pipelines count (not the reference, not the permuted layout, not another
    structure, not a failed row), and only past PICK_SLACK."""
    def row(impl, ms, structure="monarch", n=16):
        return {"shape": "s", "n": n, "structure": structure, "impl": impl, "ms": ms}

    rows = [row("monarch_two_stage", math.nan), row("monarch_reference", 5.0), row("monarch_bmm", 10.0),
            row("monarch_permuted", 6.0), row("monarch_ours", 11.0), row("blast_z_mixgemm", 1.0, "blast"),
            row("blast_ours", 1.01, "blast"), row("monarch_bmm", 10.0, n=1), row("monarch_ours", 10.1, n=1),
            row("monarch_bmm", 1.0, n=128), row("monarch_ours", math.nan, n=128)]
    assert blr_layers.pick_check(rows) == [{"shape": "s", "n": 16, "structure": "monarch", "ours_ms": 11.0,
                                            "fastest": "monarch_bmm", "fastest_ms": 10.0, "ratio": 1.1}]


def test_never_close_lists_pipelines_no_case_of_any_file_had_near_its_fastest(blr_layers):
    """A pipeline within NEVER_CLOSE of its case's fastest in one case of one file is not listed; the pick, the
    reference, the permuted layout, dense and failed rows are not pipelines; a listed one counts its rows."""
    def row(impl, ms, n=16, structure="monarch"):
        return {"shape": "s", "n": n, "structure": structure, "impl": impl, "ms": ms}

    first = {"rows": [row("monarch_bmm", 1.0), row("monarch_fused", 1.2), row("monarch_torch", 1.3),
                      row("monarch_ours", 9.0), row("monarch_reference", 9.0), row("monarch_permuted", 9.0),
                      row("dense_eager", 0.1, structure="dense"), row("monarch_tbmm", math.nan)]}
    second = {"rows": [row("monarch_bmm", 1.0, n=1), row("monarch_fused", 1.06, n=1), row("monarch_torch", 1.04, n=1),
                       row("blast_torch", 2.0, structure="blast"), row("blast_bmm_mix_bmm", 1.0, structure="blast")]}
    assert blr_layers.never_close({"a": first, "b": second}) == [("blast_torch", 1), ("monarch_fused", 2)]
    assert "never fastest nor within 5% of it in these 2 files: blast_torch (1 rows), monarch_fused (2 rows)" in \
        blr_layers.summarize({"a": {**first, "commit": "x"}, "b": {**second, "commit": "y"}})


def test_gpu_state_reads_nvidia_smi_and_is_none_where_it_cannot(monkeypatch):
    import subprocess

    import memfit.log
    from memfit.measure import timing

    asked = []

    def smi(command, **kwargs):
        asked.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="1980, 651.25, 55\n")

    class Properties:
        uuid = "5e7f-ab"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)      # the CPU test machine's answer
    assert timing.gpu_state() is None                          # no GPU here: nothing asked, nothing said
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(subprocess, "run", smi)
    assert timing.gpu_state() == {"sm_clock_mhz": 1980.0, "power_w": 651.25, "temperature_c": 55.0}
    assert asked[0] == ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                        "--format=csv,noheader,nounits", "--id=GPU-5e7f-ab"]

    def missing(command, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    warned = []
    monkeypatch.setattr(memfit.log, "warn_once", lambda key, message: warned.append(message))
    monkeypatch.setattr(subprocess, "run", missing)
    assert timing.gpu_state() is None and "FileNotFoundError" in warned[-1]
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(command, 0, "[N/A]"))
    assert timing.gpu_state() is None and "ValueError" in warned[-1]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: object())     # no uuid
    assert timing.gpu_state() is None and "AttributeError" in warned[-1] and len(warned) == 3


def test_turn_orders_go_forward_and_back():
    from memfit.measure.timing import turn_orders

    assert turn_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert turn_orders([], 2) == [[], []]


def test_summarize_reads_the_noise_and_pick_misses_of_results_files(blr_layers):
    def row(impl, ms, n=8192, rounds=None, structure="monarch"):
        return {"shape": "s", "n": n, "structure": structure, "impl": impl, "ms": ms, "ms_rounds": rounds or [],
                "in": 4, "out": 6, "rank": 4}

    first = {"commit": "a", "complete": True, "rows": [row("dense_eager", 10.0, structure="dense"),
                                                        row("monarch_bmm", 1.0), row("monarch_ours", 1.5)]}
    second = {"commit": "b", "complete": False,
              "rows": [row("dense_eager", 12.0, rounds=[1.0, 1.1, 1.2, 1.0], structure="dense"),
                       row("monarch_bmm", 1.0, rounds=[1.0, 1.0, 1.0, 1.0]), row("monarch_ours", 1.0)],
              "pick_timings": {                       # Monarch's key: (N, b, in / b, rank, out / b, permuted, dtype)
                  "monarch_linear (8192, 2, 2, 4, 3, False, 'torch.bfloat16')": {"finalists": {"bmm": 1.1}},
                  "monarch_linear (8192, 2, 2, 4, 3, True, 'torch.bfloat16')": {"finalists": {"bmm": 9.0}},
                  "monarch_linear (16, 2, 2, 4, 3, False, 'torch.bfloat16')": {"pick": "bmm", "cached": True}},
              "gpu_states": [{"shape": "s", "n": 8192, "before": None, "after": {"sm_clock_mhz": 1600.0},
                              "between_rounds": [{"sm_clock_mhz": 1980.0}, None, {"sm_clock_mhz": 1700.0}]},
                             {"shape": "s", "n": 16, "before": None, "after": {"sm_clock_mhz": 1950.0}}],
              "case_seconds": [{"shape": "s", "n": 16, "prepare_s": 4.0, "rounds_s": 1.0},
                               {"shape": "s", "n": 8192, "prepare_s": 30.0, "rounds_s": 6.0}]}
    text = blr_layers.summarize({"one.json": first, "two.json": second})
    assert "one.json (commit a, 3 rows, complete: True)" in text and "rounds' spread" not in text.split("two.json")[0]
    assert "monarch s N=8192: 50.0% (monarch_bmm)" in text and "at 0 cases" in text.split("two.json")[1]
    assert "rounds' spread, N = 8192: median 10.0%, 90th percentile 20.0%, largest 20.0%" in text
    assert ("finalists over the table's time of the same pipeline, N >= 1024, 1 timings: median 1.100, 10th-90th "
            "percentile 1.100-1.100, from 1.100 to 1.100") in text and "pipeline, N <= 128" not in text
    assert "2 cases took 34 s to build, check, tune and pick and 7 s to time; the slowest, s N=8192, 30 s and 6 s" in text
    assert "SM clock after timing rounds, N <= 128: 1950-1950 MHz (1 readings)" in text
    assert "SM clock after timing rounds, N >= 1024: 1600-1980 MHz (3 readings)" in text
    assert "largest SM clock change within one case's rounds: 380 MHz" in text and "SM clock" not in text.split("two")[0]
    assert blr_layers.pick_case("blast_linear (1, 2, 3, 4, 5, 'torch.bfloat16')") == ("blast", 1, 10, 6, 4)
    assert blr_layers.pick_case("lowrank_linear (1, 6, 4, 10, 'torch.bfloat16')") == ("lowrank", 1, 10, 6, 4)
    assert blr_layers.pick_case("gemv ('x', 'x1')") is None
    assert "dense eager at N = 8192 read up to 20.0% apart between two files (s: one.json, two.json)" in text


def test_the_table_keeps_its_own_pick_cache(blr_layers, tmp_path, monkeypatch):
    """Beside the results, started afresh by a new run and kept by --resume; a cache the user names is left alone."""
    from memfit.kernels import autotune

    results = tmp_path / "blr_layers.json"
    picks = tmp_path / "blr_layers_picks.json"
    picks.write_text("{}")
    monkeypatch.setenv("MEMFIT_AUTOTUNE_CACHE", "")                  # records the variable's state for teardown
    monkeypatch.delenv("MEMFIT_AUTOTUNE_CACHE")
    monkeypatch.setattr(autotune, "_CACHE", {"a pick": "loaded from elsewhere"})
    monkeypatch.setattr(autotune, "_UNTIMED", {"a pick untimed elsewhere"})
    monkeypatch.setattr(autotune, "CHAIN_TILE_MEMO", {"a chain": "paired elsewhere"})
    monkeypatch.setattr(autotune, "_VARIANT_MEMO", {"an op": "picked elsewhere"})
    assert blr_layers.own_pick_cache(results, resume=True) == picks and picks.exists()
    assert autotune._CACHE is None                                  # the next pick loads the table's own file
    held = (autotune._UNTIMED, autotune.CHAIN_TILE_MEMO, autotune._VARIANT_MEMO)
    assert not any(held)                                              # and nothing held from before is reused
    assert os.environ["MEMFIT_AUTOTUNE_CACHE"] == str(picks)
    monkeypatch.delenv("MEMFIT_AUTOTUNE_CACHE")
    assert blr_layers.own_pick_cache(results, resume=False) == picks and not picks.exists()
    monkeypatch.setenv("MEMFIT_AUTOTUNE_CACHE", "/users/cache.json")
    assert blr_layers.own_pick_cache(results, resume=False) is None
    assert os.environ["MEMFIT_AUTOTUNE_CACHE"] == "/users/cache.json"


def test_summarize_refuses_a_file_this_benchmark_did_not_write(blr_layers, tmp_path, monkeypatch, capsys):
    other = tmp_path / "linear_ce.json"
    other.write_text('{"benchmark": "linear_ce", "rows": [{"impl": "x"}]}')
    monkeypatch.setattr("sys.argv", ["blr_layers.py", "--summarize", str(other)])
    assert blr_layers.main() == 2 and "not a layer table written by this benchmark" in capsys.readouterr().err


@pytest.mark.cpu_only(reason="pick_cost --smoke runs through the interpreter, timing no candidates, only where no "
                              "GPU is; on a GPU machine it runs on the GPU and times them")
def test_pick_cost_smoke_run_writes_a_row_per_structure_shape_and_n(tmp_path):
    """benchmarks/pick_cost.py on the CPU (interpreter): every first and second call timed and written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "pick_cost.py"), "--smoke", "--tokens", "1", "40",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "pick_cost_smoke.json").read_text())
    rows = written["rows"]
    assert written["complete"] is True
    assert {(r["structure"], r["n"]) for r in rows} == {(k, n) for k in ("lowrank", "monarch", "blast") for n in (1, 40)}
    assert all(r["first_call_s"] > 0 and r["second_call_s"] > 0 and r["candidates_timed"] == 0 for r in rows)


def test_the_profile_is_saved_after_each_case(blr_layers, monkeypatch):
    """profile_cases hands its rows to ``save`` after every case, so a run stopped by a limit keeps them."""
    from memfit.measure import kernel_profile

    monkeypatch.setattr(blr_layers, "structures", lambda *args: {
        "lowrank": (lambda: torch.nn.Linear(48, 80, device="cpu"), lambda layer, x, **options: layer(x),
                    ["cublas", "bgemm"])})                       # on the device profile_cases is given
    monkeypatch.setattr(kernel_profile, "kernel_profile", lambda step, device, name_chars: (
        {"k": {"ms": 1.0, "launches": 1}}, None, {"span_ms": 1.0, "idle_ms": 0.0}))
    saved = []
    rows = blr_layers.profile_cases(torch, [("smoke 48->80", 1), ("smoke 48->80", 3)], 4, torch.float32, "cpu",
                                    ["lowrank"], save=lambda rows: saved.append(len(rows)))
    assert saved == [2, 4] and [(r["n"], r["variant"]) for r in rows] == [(1, "cublas"), (1, "bgemm"), (3, "cublas"),
                                                                         (3, "bgemm")]


def test_pick_cost_reads_the_pick_a_first_call_made():
    """first_call returns the one pick record the call added ({} where it added none) and refuses two."""
    pick_cost = load_benchmark("pick_cost")
    timings = {"earlier": {"pick": "old"}}

    def layer(new: dict):
        return lambda x: timings.update(new)

    seconds, record = pick_cost.first_call(torch, layer({"op (1,)": {"first": {"a": 1.0, "b": 2.0}, "pick": "a"}}),
                                           None, timings)
    assert seconds >= 0 and record == {"first": {"a": 1.0, "b": 2.0}, "pick": "a"}
    assert pick_cost.first_call(torch, layer({}), None, timings)[1] == {}
    with pytest.raises(RuntimeError, match="2 variant picks"):
        pick_cost.first_call(torch, layer({"op (2,)": {}, "op (3,)": {}}), None, timings)


def test_pick_cost_refuses_token_counts_that_share_a_pick(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "pick_cost.py"
    for tokens, message in ((["12", "16"], "share pick buckets"), (["0"], "must be positive")):
        done = subprocess.run([sys.executable, str(script), "--smoke", "--tokens", *tokens, "--out", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr


def test_structures_times_dense_and_only_the_structures_asked_for(blr_layers, monkeypatch):
    """--structures: the case builds only those structures, the targets skip the others (not a failure), the console
    table shows "-" for them, and --summarize refuses it (it reads files, it times nothing)."""
    from memfit.measure.results import target

    built = blr_layers.structures(48, 80, 12, 4, 1, torch.float32, "cpu", ["monarch"])
    assert list(built) == ["monarch"]

    def row(impl, structure, ms=1.0, x_floor=2.0, n=16):
        return {"shape": "s", "n": n, "structure": structure, "impl": impl, "ms": ms, "x_floor": x_floor}

    rows = [row("dense_eager", "dense"), row("monarch_ours", "monarch")]
    names = [t["name"] for t in blr_layers.make_targets(rows, target, smoke=False)]
    assert names and all(name.startswith("monarch") for name in names)
    assert blr_layers.cell({r["impl"]: r for r in rows}, "blast_ours", "ms", ".4f") == "-"
    assert blr_layers.cell({r["impl"]: r for r in rows}, "monarch_ours", "x_floor", ".2f") == "2.00"
    monkeypatch.setattr("sys.argv", ["blr_layers.py", "--structures", "monarch", "blast"])
    assert blr_layers.parse().kinds == ["monarch", "blast"]
    monkeypatch.setattr("sys.argv", ["blr_layers.py", "--summarize", "f.json", "--structures", "monarch"])
    with pytest.raises(SystemExit):
        blr_layers.parse()


@pytest.mark.parametrize("tokens", [["1", "1"], ["0"]])
def test_tokens_named_twice_or_not_positive_are_refused(blr_layers, monkeypatch, capsys, tokens):
    monkeypatch.setattr("sys.argv", ["blr_layers.py", "--smoke", "--tokens", *tokens])
    with pytest.raises(SystemExit):
        blr_layers.parse()
    assert "--tokens takes positive token counts, each once" in capsys.readouterr().err


def test_a_stopped_table_keeps_its_rows_and_its_roofline_plot(blr_layers, monkeypatch, tmp_path, capsys):
    """The table writes its JSON and roofline plot after every case: a run stopped by its time limit (here the
    second case raises) leaves both, the file marked incomplete, as ``--resume`` expects."""
    import json

    class Stopped(Exception):
        pass

    def one_case(torch, name, d_in, d_out, rank, blocks, n, *rest):
        if n != 1:
            raise Stopped
        cost = {"flops": 2 * n * d_in * d_out, "ideal_bytes": 2 * d_in * d_out, "floor_ms": 1e-3, "copies": 1}
        rows = [{"shape": name, "n": n, "structure": structure, "impl": impl, "ms": ms, "ms_rounds": [ms],
                 "x_floor": ms / 1e-3, "rel_err": 0.0, **cost}
                for structure, impl, ms in [("dense", "dense_eager", 2e-3), ("monarch", "monarch_ours", 3e-3)]]
        return rows, {}, {"prepare_s": 0.0, "rounds_s": 0.0}

    monkeypatch.setattr(blr_layers, "bench_case", one_case)
    monkeypatch.setenv("MEMFIT_COMMIT", "0123abc")                     # a resume continues its own commit's run only
    monkeypatch.setattr("sys.argv", ["blr_layers.py", "--smoke", "--tokens", "1", "16", "--out", str(tmp_path)])
    with pytest.raises(Stopped):
        blr_layers.main()
    written = json.loads((tmp_path / "blr_layers_smoke_subset.json").read_text())
    assert written["complete"] is False and {r["n"] for r in written["rows"]} == {1} and "tile_picks" in written
    assert (tmp_path / "blr_layers_smoke_subset_roofline.png").stat().st_size > 0
    written["tile_picks"] = ["edited"]                                   # a hand-edited file is refused up front
    (tmp_path / "blr_layers_smoke_subset.json").write_text(json.dumps(written))
    monkeypatch.setattr("sys.argv", ["blr_layers.py", "--smoke", "--tokens", "1", "16", "--out", str(tmp_path),
                                     "--resume"])
    assert blr_layers.main() == 2 and "its tile_picks is not kernel -> {key: tile}" in capsys.readouterr().err


def test_a_resumed_run_keeps_the_tile_picks_it_read_and_adds_its_own(blr_layers):
    earlier = {"_bgemm_kernel": {"(1,)": "a", "(2,)": "b"}, "_fused_kernel": {"(3,)": "c"}}
    now = {"_bgemm_kernel": {"(2,)": "B", "(4,)": "d"}, "_tmix_kernel": {"(5,)": "e"}}
    assert blr_layers.merged_tile_picks(earlier, now) == {"_bgemm_kernel": {"(1,)": "a", "(2,)": "B", "(4,)": "d"},
                                                          "_fused_kernel": {"(3,)": "c"}, "_tmix_kernel": {"(5,)": "e"}}


def test_resuming_a_complete_run_of_other_cases_is_refused(blr_layers, monkeypatch, tmp_path, capsys):
    """--resume on a finished file: "nothing to resume" (exit 0) only where it was written with this run's cases; a
    complete file of other tokens or structures had passed too, and the structures asked for were never timed."""
    import json

    monkeypatch.setattr(blr_layers, "bench_case", lambda *a: pytest.fail("a resume of a complete file times nothing"))
    (tmp_path / "blr_layers_smoke_subset.json").write_text(json.dumps(
        {"complete": True, "shapes": ["smoke 48->80"], "tokens": [1], "blocks": 4, "structures": ["lowrank"]}))
    argv = ["blr_layers.py", "--smoke", "--resume", "--out", str(tmp_path), "--tokens"]
    monkeypatch.setattr("sys.argv", [*argv, "40", "--structures", "monarch"])
    assert blr_layers.main() == 2
    assert "it was written with tokens [1], this run has [40]; structures ['lowrank'], this run has ['monarch']" \
        in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", [*argv, "1", "--structures", "lowrank"])
    assert blr_layers.main() == 0 and "is a complete run; nothing to resume" in capsys.readouterr().out


def test_a_failed_shape_is_the_worst_speedup_over_dense(blr_layers):
    """A failed row's NaN ms counts as a speedup of 0: min() over NaN depends on the order, and a failed shape
    sorted after a fast one had been dropped and the target reported met."""
    from memfit.measure.results import target

    rows = [{"shape": shape, "n": 16, "structure": structure, "impl": impl, "ms": ms, "x_floor": ms}
            for shape, ours in (("a", 0.5), ("b", math.nan))
            for structure, impl, ms in (("dense", "dense_eager", 1.0), ("monarch", "monarch_ours", ours))]
    speedup, = [t for t in blr_layers.make_targets(rows, target, smoke=False) if "speedup" in t["name"]]
    assert speedup["measured"] == 0.0 and not speedup["met"]


def test_floors_are_never_below_a_rate_a_row_reached(blr_layers):
    """The 8192^3 GEMM timed once was no ceiling: dense cuBLAS beat it, and its floor sat above its time (x_floor
    0.958 at Llama-7B down). The floors' matmul rate and bandwidth are raised to the best any row reached."""
    from memfit.measure.timing import Ceilings

    measured = Ceilings(matmul_flops=100e12, bandwidth=1e12)
    rows = [{"impl": "dense_eager", "flops": 2e9, "ideal_bytes": 1e3, "ms": 0.01, "floor_ms": 0.02, "x_floor": 0.5},
            {"impl": "monarch_ours", "flops": 1e9, "ideal_bytes": 1e3, "ms": 0.04, "floor_ms": 0.01, "x_floor": 4.0},
            {"impl": "blast_ours", "flops": 1e9, "ideal_bytes": 1e3, "ms": float("nan"), "floor_ms": 0.01,
             "x_floor": float("nan")}]
    floored, out = blr_layers.floors_at_least_reached(rows, measured)
    assert floored.matmul_flops == pytest.approx(200e12) and floored.bandwidth == measured.bandwidth
    assert [r["floor_ms"] for r in out[:2]] == pytest.approx([0.01, 0.005])
    assert [r["x_floor"] for r in out[:2]] == pytest.approx([1.0, 8.0]) and math.isnan(out[2]["x_floor"])
    assert blr_layers.floors_at_least_reached(rows[1:], measured) == (measured, rows[1:])
    copy = {"impl": "dense_eager", "flops": 0.0, "ideal_bytes": 2e9, "ms": 1.0, "floor_ms": 2.0, "x_floor": 0.5}
    floored, out = blr_layers.floors_at_least_reached([copy], measured)         # 2e12 B/s against the copy's 1e12
    assert floored.bandwidth == pytest.approx(2e12) and out[0]["x_floor"] == pytest.approx(1.0)
