"""Where a batch-1 decode step's time goes: the kernels of one CUDA-graph step, by name.

The partial-FFN benchmark (``partial_ffn.py``) reports decode tokens/s against the
weight-read floor; this diagnostic says why a step misses it. It loads the
Llama-3.2-3B-shaped model (random init, fp16) dense and partial (gamma 0.7, phi 0.4),
captures memfit's decode step, replays it under ``torch.profiler`` and writes, per case,
every kernel name with its calls and GPU microseconds per step, the sum of kernel time
and the step's wall time (their difference is launch gaps between kernels).

    python benchmarks/decode_profile.py --out DIR     # H200: about a minute
"""
from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from partial_ffn import _calibrate, _save_random

from memfit.infer.generate import Generator, weight_bytes_per_token
from memfit.infer.partial_load import PartialConfig, load_model
from memfit.measure.results import write_results
from memfit.models import PRESETS

STEPS = 20


def profile_case(name: str, model, prompt: torch.Tensor) -> list[dict]:
    """Kernel table of ``STEPS`` replayed decode steps of ``model`` after ``prompt``."""
    gen = Generator(model, prompt.shape[1] + 3 * STEPS + 8)
    gen.generate(prompt, STEPS)                   # capture + warm-up
    gen.prefill(prompt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen.decode(STEPS)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / STEPS * 1e6
    gen.prefill(prompt)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gen.decode(STEPS)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += 1
            kernels[event.name][1] += event.device_time
    rows = [{"case": name, "kernel": k[:160], "calls_per_step": c / STEPS, "us_per_step": us / STEPS}
            for k, (c, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    total = sum(r["us_per_step"] for r in rows)
    rows.insert(0, {"case": name, "kernel": "(all)", "calls_per_step": sum(r["calls_per_step"] for r in rows),
                    "us_per_step": total, "wall_us_per_step": wall_us, "graph": gen.graph is not None,
                    "weight_bytes_per_token": weight_bytes_per_token(model)})
    for r in rows[:25]:
        print(f"[decode_profile] {name:24s} {r['us_per_step']:8.1f} us {r['calls_per_step']:6.1f}x  {r['kernel']}"
              + (f"  wall {wall_us:.1f} us" if r["kernel"] == "(all)" else ""), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("decode_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    spec = PRESETS["llama-3.2-3b"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, spec.vocab, (1, 128), generator=gen)
    tmp = Path(tempfile.mkdtemp(prefix="memfit-decode-profile-"))
    rows: list[dict] = []
    try:
        model_dir = _save_random(spec, tmp / "model", device)
        _calibrate(model_dir, device, torch.randint(0, spec.vocab, (8, 128), generator=gen))
        cases = [("dense", None), ("partial 0.7/0.4", PartialConfig(load=0.7, compute=0.4, full_first=2, full_last=2))]
        for name, partial in cases:
            model = load_model(model_dir, partial, device=device)
            rows += profile_case(name, model, prompt.to(device))
            del model
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[decode_profile] wrote {write_results('decode_profile', rows, [], out_dir=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
