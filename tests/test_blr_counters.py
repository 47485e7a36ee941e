"""benchmarks/blr_counters.py off the GPU: its cases are pipelines the ops offer, and ncu's raw CSV is read into
per-case DRAM traffic (units converted, kernels grouped by the marker before each case)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import blr_counters  # noqa: E402
import blr_layers  # noqa: E402


def test_every_case_is_a_pipeline_its_op_offers():
    shapes = {name: (d_in, d_out, rank) for name, d_in, d_out, rank in blr_layers.SHAPES}
    for kind, shape, n, variant in blr_counters.CASES:
        if kind != "dense":
            d_in, d_out, rank = shapes[shape]
            offered = blr_layers.structures(d_in, d_out, rank, blr_layers.BLOCKS, n, None, "cpu", [kind])[kind][2]
            assert variant in offered, (kind, shape, n, variant)


def _csv(kernels_per_case, time_unit="nsecond", byte_unit="Kbyte"):
    lines = ['"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"',
             f'"","","{byte_unit}","{byte_unit}","{time_unit}"']
    kid = 0
    for count in kernels_per_case:
        lines.append(f'"{kid}","_case_marker","0","0","1,000"')
        kid += 1
        for k in range(count):
            lines.append(f'"{kid}","kernel_{k}(int)","1,500","{k}","2,000"')
            kid += 1
    return "==PROF== a line ncu prints first\n" + "\n".join(lines) + "\n"


def test_the_raw_csv_becomes_per_case_traffic():
    counts = [1 + i % 3 for i in range(len(blr_counters.CASES))]
    rows = blr_counters.read_profile(_csv(counts))
    assert [len(r["kernels"]) for r in rows] == counts
    first = rows[1]                                                # Monarch gate N = 1, two_stage: two kernels
    assert first["kernels"][0] == {"kernel": "kernel_0(int)", "us": 2.0, "dram_read": 1.5e6, "dram_write": 0.0}
    assert first["dram_bytes"] == 1.5e6 * 2 + 1e3 and first["us"] == 4.0
    assert first["dram_over_ideal"] == pytest.approx(first["dram_bytes"] / first["ideal_bytes"])
    seconds = blr_counters.read_profile(_csv(counts, time_unit="usecond", byte_unit="byte"))
    assert seconds[1]["kernels"][0]["us"] == 2000.0 and seconds[1]["kernels"][0]["dram_read"] == 1500.0


def test_a_profile_that_does_not_hold_the_cases_is_an_error():
    with pytest.raises(ValueError, match="cases"):
        blr_counters.read_profile(_csv([1] * (len(blr_counters.CASES) - 1)))
    with pytest.raises(ValueError, match="no kernel table"):
        blr_counters.read_profile("==ERROR== the profiler could not start\n")
    run_cases = blr_counters.CASES[:2]                         # a --parse reads the cases its run recorded
    assert [r["variant"] for r in blr_counters.read_profile(_csv([1, 2]), run_cases)] == ["cublas", "two_stage"]
    stray = _csv([1] * len(blr_counters.CASES)).replace('"0","_case_marker"', '"0","stray_kernel"', 1)
    with pytest.raises(ValueError, match="before the first"):
        blr_counters.read_profile(stray)


def test_parse_takes_only_a_csv_this_benchmark_saved(monkeypatch, capsys, tmp_path):
    """--parse needs the file, and its first line the run's environment (blr_counters.RUN_LINE); a profile that does
    not hold the run's cases is a one-line error too."""
    (tmp_path / "bare.csv").write_text(_csv([1]))
    for path, said in ((tmp_path / "none.csv", "no such file"), (tmp_path / "bare.csv", "not a CSV this benchmark")):
        monkeypatch.setattr(sys, "argv", ["blr_counters.py", "--parse", str(path)])
        with pytest.raises(SystemExit) as raised:
            blr_counters.parse_args()
        assert raised.value.code == 2 and said in capsys.readouterr().err
    short = tmp_path / "short.csv"
    short.write_text(blr_counters.RUN_LINE + '{"gpu": "H200"}\n' + _csv([1]))
    monkeypatch.setattr(sys, "argv", ["blr_counters.py", "--parse", str(short), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="the profile holds 1 cases"):
        blr_counters.main()


def test_the_saved_csv_makes_the_committed_json_again(tmp_path, monkeypatch):
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    monkeypatch.setattr(sys, "argv", ["blr_counters.py", "--parse", str(results / "blr_counters.csv"),
                                      "--out", str(tmp_path)])
    assert blr_counters.main() == 0
    made, committed = (json.loads(p.read_text()) for p in (tmp_path / "blr_counters.json", results / "blr_counters.json"))
    assert made["commit"] == committed["commit"] and made["gpu"] == committed["gpu"]
    assert [r["dram_bytes"] for r in made["rows"]] == [r["dram_bytes"] for r in committed["rows"]]
