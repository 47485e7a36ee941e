"""Probe: the time to build a random-init preset on the CPU, as transformers' ``from_config`` builds it (each linear's
weights drawn by torch's init, then again by the model's ``_init_weights``) against ``memfit.models.build_model``
(drawn once, 1b8b58b), in one process, each built twice, the faster kept. Writes OUT/build_model_time_<commit>.json:

    MEMFIT_COMMIT=<sha> OUT=/some/dir python benchmarks/probes/build_model_time.py [PRESET]   # default llama-3.2-1b
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from memfit.measure.results import environment  # noqa: E402
from memfit.models import PRESETS, build_model, dtype_of  # noqa: E402
from memfit.models.build import _default_dtype  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))


def from_config(spec) -> torch.nn.Module:
    """The preset as transformers builds it from its config (as build_model did before 1b8b58b), in the preset's dtype
    on the CPU."""
    from transformers import AutoModelForCausalLM

    config, dtype = spec.to_hf_config(), dtype_of(spec.dtype)
    config.dtype = str(dtype).removeprefix("torch.")
    with _default_dtype(dtype):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def best_seconds(build) -> float:
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        model = build()
        best = min(best, time.perf_counter() - start)
        del model
    return best


def main() -> None:
    spec = PRESETS[sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b"]
    record = {"probe": "build_model_time", "preset": spec.name, "params": spec.num_params(), **environment(),
              "threads": torch.get_num_threads(), "from_config_s": best_seconds(lambda: from_config(spec)),
              "build_model_s": best_seconds(lambda: build_model(spec))}
    record["from_config_over_build_model"] = record["from_config_s"] / record["build_model_s"]
    print(json.dumps(record), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"build_model_time_{record['commit']}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
