"""benchmarks/ledger_repredict.py: every stored GPU ledger measurement is predicted again on the CPU, each row
carrying the measured bytes, the new prediction and its error (which must be recomputable from the two)."""
import json

from conftest import MEASURES_A_CPU_RUN, ROOT, load_benchmark

from memfit.measure.results import recorded_error


def test_every_stored_measurement_is_predicted_again(tmp_path):
    assert load_benchmark("ledger_repredict").main(["--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "ledger_repredict.json").read_text())
    stored = sum(1 for name in ("ledger_accuracy", "ledger_accuracy_blr", "ledger_accuracy_loop")
                 for row in json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())["rows"]
                 if recorded_error(row) is not None)
    assert len(written["rows"]) == stored > 0
    for row in written["rows"]:
        assert row["error"] == row["predicted_bytes"] / row["measured_bytes"] - 1
    assert written["targets"][0]["measured"] == 100 * max(abs(r["error"]) for r in written["rows"])


@MEASURES_A_CPU_RUN
def test_the_accuracy_smoke_run_reads_the_relative_error_verify_records_now(tmp_path):
    """verify's records name their error "relative_error" since 19b5e6a, and ledger_accuracy had kept reading
    "error": its smoke run ended in statistics.StatisticsError (no median of no jobs)."""
    assert load_benchmark("ledger_accuracy").main(["--smoke", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "ledger_accuracy_smoke.json").read_text())
    assert written["targets"][2]["measured"] == len(written["rows"]) > 0
    assert all(isinstance(row["relative_error"], float) and "error" not in row for row in written["rows"])


def test_a_record_holds_its_error_under_either_name():
    assert recorded_error({"relative_error": 0.01}) == recorded_error({"error": 0.01}) == 0.01
    assert recorded_error({"error": "a message"}) is None and recorded_error({"skipped": "x"}) is None
