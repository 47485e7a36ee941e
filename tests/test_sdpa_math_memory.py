"""benchmarks/sdpa_math_memory.py on the CPU: a row per mask and head grouping, the math kernel's backward holding
about two score tensors above what its forward left (the probabilities' gradient and the softmax's), which the
ledger's math-attention graph assumes."""
import json

from conftest import load_benchmark


def test_smoke_run_measures_every_mask_and_grouping(tmp_path):
    assert load_benchmark("sdpa_math_memory").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sdpa_math_memory_smoke.json").read_text())["rows"]
    assert {(r["mask"], r["grouping"]) for r in rows} == {(m, g) for m in ("float mask", "bool mask", "is_causal")
                                                         for g in ("enable_gqa", "repeat_kv")}
    for row in rows:
        assert 2.0 <= row["backward_peak_scores"] < 2.1 and 2.0 < row["forward_peak_scores"] < 3.0
