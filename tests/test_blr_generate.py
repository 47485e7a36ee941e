"""benchmarks/blr_generate.py: memfit's decode loop on dense and compressed models (CPU smoke run), and its README
section."""
import json

import pytest
import torch
from conftest import load_benchmark


def test_smoke_run_times_dense_fused_unfused_and_each_compressed_model(tmp_path, monkeypatch):
    """... and writes after each row, marked incomplete until the last write. The BLR layers run their PyTorch
    references, as the smoke run does outside the tests: through the Triton interpreter (the tests' default) this
    one test took 100 s of the suite; test_blr_kernels checks the kernels."""
    import sys

    monkeypatch.setenv("MEMFIT_KERNELS", "reference")

    blr_generate = load_benchmark("blr_generate")
    recorder = sys.modules["partial_ffn"].Recorder
    marks, write = [], recorder.write
    monkeypatch.setattr(recorder, "write", lambda self: marks.append(self.complete) or write(self))
    assert blr_generate.main(["--smoke", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "blr_generate.json").read_text())
    assert marks == [False] * 4 + [True] and written["complete"] is True
    rows = {r["case"]: r for r in written["rows"]}
    dense, unfused = rows["dense"], rows["dense, unfused loop (separate projections)"]
    assert dense["fused_layers"] == dense["layers"] and unfused["fused_layers"] == 0
    for method in blr_generate.METHODS:
        row = rows[method]
        assert row["available"] and row["fused_layers"] == 0
        assert row["weight_bytes_per_token"] < dense["weight_bytes_per_token"]        # the BLR layers, not dense
        assert row["speedup_vs_dense"] == pytest.approx(dense["decode_ms_per_token"] / row["decode_ms_per_token"])
    assert "speedup_vs_dense" not in dense


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_a_gpu_run_without_a_gpu_is_a_usage_error(tmp_path, capsys):
    """It had run the tiny shapes on the CPU and written them, unmarked, where the GPU results go."""
    with pytest.raises(SystemExit) as raised:
        load_benchmark("blr_generate").main(["--out", str(tmp_path)])
    assert raised.value.code == 2 and "needs a CUDA GPU; --smoke runs" in capsys.readouterr().err
    assert not (tmp_path / "blr_generate.json").exists()


def test_report_section_shows_each_case_and_a_failed_one():
    report = load_benchmark("report")
    row = {"available": True, "model": "llama-3.2-1b", "decode_tokens_per_s": 500.0, "decode_ms_per_token": 2.0,
           "floor_ms": 0.5, "fraction_of_floor": 0.25, "fused_layers": 16, "layers": 16, "peak_bytes": 3e9}
    rows = [{**row, "case": "dense"}, {**row, "case": "monarch", "decode_tokens_per_s": 600.0, "fused_layers": 0,
                                        "speedup_vs_dense": 1.2},
            {"case": "blast", "available": False, "error": "RuntimeError: x"}]
    text = report.blr_generate_section({"gpu": "H200", "torch": "2.11", "triton": "3.6", "commit": "abc",
                                        "date": "2026-12-03T00:00", "rows": rows})
    assert "llama-3.2-1b shape" in text and "`python benchmarks/blr_generate.py`" in text
    assert "| dense | 500 | - | 2.000 | 0.500 | 0.25 | 16 of 16 | 3.00 |" in text
    assert "| monarch | 600 | 1.200 | 2.000 | 0.500 | 0.25 | 0 of 16 | 3.00 |" in text
    assert "| blast | RuntimeError: x |" in text and "x dense: against the first (fused) dense row" in text
