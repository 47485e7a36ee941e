"""Probe: the ledger's two inference predictions against the peaks of the loops they model, on this machine's CPU,
for a small Llama-shaped model in float32 (4 layers, hidden 1024, vocab 32000). Per prompt length: the ledger of
transformers' loop (``generator="hf"``: a cache grown by ``torch.cat``) and the peak ``memfit verify`` measures of it
(after its one warm-up run); the ledger of memfit's own decode loop (``generator="memfit"``: ``memfit generate``'s
``Generator``, a cache allocated whole, the prompt in chunks) and that loop's peak (built and run once, cold, from a
model memfit's loader laid out); each with the model's weights counted. Writes OUT/generator_vs_ledger.json:

    OUT=/some/dir python benchmarks/probes/generator_vs_ledger.py
"""
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from memfit.infer.generate import Generator  # noqa: E402
from memfit.infer.partial_load import load_model  # noqa: E402
from memfit.ledger import Job, Knobs, predict  # noqa: E402
from memfit.ledger.verify import measure  # noqa: E402
from memfit.measure.memory import PeakMeter  # noqa: E402
from memfit.models import PRESETS, save_model_dir  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
SPEC = replace(PRESETS["llama-3.2-1b"], name="probe-llama-4x1024", num_layers=4, hidden=1024, intermediate=4096,
               num_heads=16, num_kv_heads=4, head_dim=64, vocab=32000, dtype="float32")
NEW_TOKENS = 16


@torch.no_grad()
def generator_peak(model, seq: int) -> int:
    """Peak bytes while a Generator is built for ``seq + NEW_TOKENS`` and generates ``NEW_TOKENS`` after a random
    ``seq``-token prompt, the model's parameters and buffers counted as the baseline."""
    ids = torch.randint(0, SPEC.vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    baseline = tuple(model.parameters()) + tuple(model.buffers())
    with PeakMeter("cpu", baseline) as meter:
        Generator(model, seq + NEW_TOKENS).generate(ids, NEW_TOKENS)
    return meter.peak


def main() -> None:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(save_model_dir(SPEC, Path(tmp) / "model", dtype="float32"), dtype="float32")
        for seq in (512, 2048, 4096):
            job, knobs = Job(SPEC, task="infer", seq=seq, new_tokens=NEW_TOKENS, device="cpu"), Knobs(dtype="float32")
            row = {"seq": seq, "new_tokens": NEW_TOKENS, "ledger_peak": predict(job, knobs).total,
                   "verify_measured_peak": measure(job, knobs).peak,
                   "loop_ledger_peak": predict(job, knobs.with_(generator="memfit")).total,
                   "generator_peak": generator_peak(model, seq)}
            row["verify_over_ledger"] = row["verify_measured_peak"] / row["ledger_peak"]
            row["generator_over_loop_ledger"] = row["generator_peak"] / row["loop_ledger_peak"]
            row["generator_over_ledger"] = row["generator_peak"] / row["ledger_peak"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    commit = os.environ.get("MEMFIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                               capture_output=True, text=True).stdout.strip()
    record = {"probe": "generator_vs_ledger", "device": f"cpu ({platform.machine()})", "threads": torch.get_num_threads(),
              "spec": SPEC.name, "torch": torch.__version__, "commit": commit, "rows": rows}
    (OUT / "generator_vs_ledger.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
