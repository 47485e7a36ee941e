"""Re-predict every stored GPU ledger measurement with the ledger as it is now (CPU, seconds).

``ledger_accuracy.py`` measures jobs on a GPU and stores, beside each measured peak, the prediction of the ledger
of that commit. When the ledger changes, this holds the new ledger against the same measurements without a GPU:
each row of ``results/ledger_accuracy.json``, ``_blr.json`` and ``_loop.json`` is predicted again, and the
file records the error then and now. (The fine-tuning table's rows are re-predicted by ``finetune_ledger.py``.)

    python benchmarks/ledger_repredict.py
"""
from __future__ import annotations

import argparse
import json
import time

from memfit.ledger.job import Job, Knobs
from memfit.ledger.predict import predict
from memfit.measure.results import RESULTS_DIR, check_out_dir, recorded_error, target, write_results

SOURCES = ("ledger_accuracy", "ledger_accuracy_blr", "ledger_accuracy_loop")


def repredict(row: dict) -> dict:
    """One stored measurement, predicted again: its job, the measured and predicted bytes, the errors then and now."""
    knob_fields = dict(row["knobs"])
    knob_fields["lora_targets"] = tuple(knob_fields["lora_targets"])
    job = Job.from_dict(row["job"])
    ledger = predict(job, Knobs(**knob_fields))
    measured = row["measured"]["peak_bytes"]
    return {"job": row["job"], "knobs": row["knobs"], "measured_bytes": measured, "predicted_bytes": ledger.total,
            "error": ledger.total / measured - 1, "error_then": recorded_error(row), "peak_phase": ledger.peak_phase,
            "peak_at": ledger.peak_where}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="results directory (default: benchmarks/results)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)
    started = time.perf_counter()
    rows, measured_in = [], {}
    for name in SOURCES:
        stored = json.loads((RESULTS_DIR / f"{name}.json").read_text())
        measured_in[name] = {key: stored[key] for key in ("gpu", "torch", "triton", "commit", "date")}
        rows += [{"source": name, **repredict(row)} for row in stored["rows"] if recorded_error(row) is not None]
    errors = [abs(r["error"]) for r in rows]
    mean = 100 * sum(errors) / len(errors)
    targets = [target("max |ledger error| over the stored GPU measurements", 100 * max(errors), 5, "%", "lower")]
    path = write_results("ledger_repredict", rows, targets, out_dir=args.out, measured_in=measured_in,
                         mean_abs_error_percent=mean, seconds=time.perf_counter() - started,
                         notes="each stored GPU measurement predicted again by this commit's ledger on the CPU")
    print(f"{len(rows)} measurements: max |error| {100 * max(errors):.2f}%, mean {mean:.2f}% -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
