"""benchmarks/ledger_repredict.py: every stored GPU ledger measurement is predicted again on the CPU, each row
carrying the measured bytes, the new prediction and its error (which must be recomputable from the two)."""
import json

from conftest import ROOT, load_benchmark


def test_every_stored_measurement_is_predicted_again(tmp_path):
    assert load_benchmark("ledger_repredict").main(["--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "ledger_repredict.json").read_text())
    stored = sum(1 for name in ("ledger_accuracy", "ledger_accuracy_blr")
                 for row in json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())["rows"]
                 if "error" in row)
    assert len(written["rows"]) == stored > 0
    for row in written["rows"]:
        assert row["error"] == row["predicted_bytes"] / row["measured_bytes"] - 1
    assert written["targets"][0]["measured"] == 100 * max(abs(r["error"]) for r in written["rows"])
