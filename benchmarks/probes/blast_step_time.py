"""Probe: where the time of ``memfit compress --method blast`` goes, per Llama-3.2-1B weight shape at BLAST's rank for
half the parameters (16 blocks), on the GPU it runs on. For each shape it times ``blast_factorize`` of one random bf16
weight at 0 steps (the start) and at ``STEPS`` steps, so one descent step's time is their difference over ``STEPS``;
then the whole compress's projections are estimated as the sum over the model's matrices of start + 300 steps. It
profiles ``PROFILED_STEPS`` steps of each shape and lists the CUDA kernels that took the most time, and times the
damped solves by torch's two linear-algebra back ends (cuSOLVER, MAGMA) at the U and S steps' shapes, in batches of
one weight's systems and of four weights'. Writes OUT/blast_step_time_<commit>.json:

    MEMFIT_COMMIT=<sha> OUT=/some/dir python benchmarks/probes/blast_step_time.py [cuda|cpu [preset]]

(``cpu tiny`` checks the code path; the back ends are timed on CUDA only.)
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from memfit.compress import projection as proj  # noqa: E402
from memfit.compress.plan import plan_kinds  # noqa: E402
from memfit.measure.results import environment  # noqa: E402
from memfit.models import PRESETS  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
MODEL, BLOCKS, RATIO, STEPS, PROFILED_STEPS, DEFAULT_STEPS, REPEATS = "llama-3.2-1b", 16, 0.5, 20, 5, 300, 3


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Best of REPEATS synchronised wall times of ``fn()``, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(REPEATS):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def top_kernels(fn, count: int = 12) -> list[dict]:
    """The ``count`` CUDA kernels with the most device time in one call of ``fn``, with their share (none on the
    CPU)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    events.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:120], "calls": e.count, "ms": e.device_time_total / 1e3,
             "share": e.device_time_total / total} for e in events[:count]]


def solve_times(gram: torch.Tensor, rhs: torch.Tensor) -> dict:
    """Seconds of ``_damped_solve`` by Cholesky under each linear-algebra back end."""
    times = {}
    for library in ("cusolver", "magma"):
        torch.backends.cuda.preferred_linalg_library(library)
        times[library] = timed(lambda: proj._damped_solve(gram, rhs, torch.tensor(0.1, device=gram.device), "cholesky"))
    torch.backends.cuda.preferred_linalg_library("default")
    return times


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    model = sys.argv[2] if len(sys.argv) > 2 else MODEL
    gen = torch.Generator(device=device).manual_seed(0)
    spec = PRESETS[model]
    kinds = plan_kinds(spec.linear_shapes(), "blast", RATIO, BLOCKS)
    record = {"probe": "blast_step_time", "model": model, "device": str(device), "blocks": BLOCKS, "ratio": RATIO,
              **environment(), "shapes": [], "solves": []}
    total = 0.0
    for kind, kp in kinds.items():
        if kp.rank is None:
            continue
        weight = torch.randn(kp.out_features, kp.in_features, generator=gen, device=device).bfloat16()

        def factorize(steps: int, weight=weight, rank=kp.rank) -> None:
            proj.blast_factorize(weight, rank, BLOCKS, steps=steps)

        start = timed(lambda: factorize(0))
        stepped = timed(lambda: factorize(STEPS))
        step = (stepped - start) / STEPS
        matrices = spec.num_layers
        total += matrices * (start + DEFAULT_STEPS * step)
        row = {"kind": kind, "out": kp.out_features, "in": kp.in_features, "rank": kp.rank, "start_s": start,
               "step_s": step, "matrices": matrices, "default_steps_s_per_matrix": start + DEFAULT_STEPS * step,
               "top_kernels": top_kernels(lambda: factorize(PROFILED_STEPS))}
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
        record["shapes"].append(row)
        if device.type == "cuda" and kind in ("q_proj", "gate_proj"):
            r, b = kp.rank, BLOCKS
            for batch in (1, 4):
                unit = torch.nn.functional.normalize(torch.randn(batch, b, kp.out_features // b, r, generator=gen,
                                                                 device=device), dim=-2)
                gram_u = unit.transpose(-1, -2) @ unit
                s_gram = gram_u.unsqueeze(-3) * gram_u.unsqueeze(-4)                 # (batch, i, j, r, r)
                rhs_u = torch.randn(batch, b, r, kp.in_features // b, generator=gen, device=device)
                cases = {"U step": (gram_u, rhs_u),
                         "S step": (s_gram, torch.randn(batch, b, b, r, 1, generator=gen, device=device))}
                for name, (gram, rhs) in cases.items():
                    solve = {"kind": kind, "step": name, "weights": batch, "rank": r, **solve_times(gram, rhs)}
                    print(json.dumps(solve), flush=True)
                    record["solves"].append(solve)
                del s_gram
    record["estimated_projection_s"] = total
    print(f"estimated projections at {DEFAULT_STEPS} steps: {total:.1f} s", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"blast_step_time_{record['commit']}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
