"""Probe: where the time of ``memfit compress --method blast`` goes, per Llama-3.2-1B weight shape at BLAST's rank for
half the parameters (16 blocks), and what the descent's solve settings change, all in one run on the GPU it runs on.

Each shape's ``blast_factorize`` of one random bf16 weight is timed at 0 steps (the start) and at ``STEPS`` steps, so
one descent step's time is their difference over ``STEPS``, under each of ``SETTINGS``: ``before`` (torch's own
choice of back end for the Cholesky solves, and the S step's exact solve, as before 4dc1da1; the rest of the descent
is the checkout's, so from b92f983 on with its Gram sums) and ``now`` (the module's settings). At 4dc1da1 ``before``
forced cuSOLVER for the factors and the triangular solves alike, where torch's own choice had solved the triangular
systems by MAGMA (the kernels of da462fa's file): that file's ``before`` is slower than memfit was. The whole
compress's projections are estimated per setting as the sum over the model's matrices of start + 300 steps. At the q
and gate shapes it also records each setting's relative error after 300 steps, on the Gaussian weight and on one
whose k-th singular value is 1/k (a trained weight's spectrum falls off like that), and times the damped solves
alone: Cholesky by cuSOLVER and by MAGMA (U step: one weight's systems and four weights' at once; S step likewise),
and by torch's own choice, and the S step's conjugate-gradient iterations. At 4dc1da1 the U step's right-hand sides
numbered in/16 (the V step's count), out/16 since. Writes OUT/blast_step_time_<commit>[_cpu].json:

    MEMFIT_COMMIT=<sha> OUT=/some/dir python benchmarks/probes/blast_step_time.py [--device cpu] [--model PRESET]
        [--kinds q_proj ...] [--skip-accuracy]

(``--device cpu --model tiny`` checks the code path; the solves alone are timed on CUDA only.) A copy of this file in
another checkout times that checkout's memfit, as ``compress_memory.py`` says, from 4dc1da1 on (its settings) with
``memfit/measure/variants.py`` copied beside it where the checkout predates d8d2e17. The file of da462fa, before the
change, lists instead the CUDA kernels that took the most time in five steps and the start.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from memfit.compress import projection as proj  # noqa: E402
from memfit.compress.plan import plan_kinds  # noqa: E402
from memfit.measure.results import environment  # noqa: E402
from memfit.measure.timing import best_wall_seconds  # noqa: E402
from memfit.measure.variants import module_settings  # noqa: E402
from memfit.models import PRESETS  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
MODEL, BLOCKS, RATIO, STEPS, DEFAULT_STEPS, REPEATS = "llama-3.2-1b", 16, 0.5, 20, 300, 3
SETTINGS = {"before": {"CUDA_CHOLESKY_LIBRARY": None, "S_STEP_CG_ITERATIONS": 0},
            "now": {"CUDA_CHOLESKY_LIBRARY": proj.CUDA_CHOLESKY_LIBRARY,
                    "S_STEP_CG_ITERATIONS": proj.S_STEP_CG_ITERATIONS}}
ACCURACY_KINDS = ("q_proj", "gate_proj")


def timed(fn, device: torch.device) -> float:
    """Best of REPEATS synchronised wall times of ``fn()``, after one untimed call."""
    return best_wall_seconds(fn, REPEATS, device)[0]


def falling_spectrum(out: int, inp: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A random bf16 matrix at rms 0.02 whose k-th singular value is proportional to 1/k."""
    n = min(out, inp)
    left = torch.linalg.qr(torch.randn(out, n, generator=gen, device=device))[0]
    right = torch.linalg.qr(torch.randn(inp, n, generator=gen, device=device))[0]
    W = (left / torch.arange(1, n + 1, device=device)) @ right.T
    return (W * (0.02 / W.square().mean().sqrt())).bfloat16()


def relative_error(weight: torch.Tensor, rank: int) -> float:
    W = weight.float()
    return (proj.relative_weight_error(W, proj.blast_dense(*proj.blast_factorize(W, rank, BLOCKS,
                                                                                 steps=DEFAULT_STEPS)))).item()


def solve_times(gram: torch.Tensor, rhs: torch.Tensor, cg: bool) -> dict:
    """Seconds of ``_damped_solve`` by Cholesky under each linear-algebra back end and under torch's own choice, and
    with ``cg`` of the S step's conjugate-gradient iterations."""
    ridge = torch.tensor(0.1, device=gram.device)
    times = {}
    for library in ("cusolver", "magma"):
        with module_settings(proj, {"CUDA_CHOLESKY_LIBRARY": library}):
            times[library] = timed(lambda: proj._damped_solve(gram, rhs, ridge, "cholesky"), gram.device)
    with module_settings(proj, {"CUDA_CHOLESKY_LIBRARY": None}):
        times["torch's choice"] = timed(lambda: proj._damped_solve(gram, rhs, ridge, "cholesky"), gram.device)
    if cg:
        times["cg"] = timed(lambda: proj._damped_cg(gram, rhs, ridge, proj.S_STEP_CG_ITERATIONS), gram.device)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default=MODEL, choices=sorted(PRESETS))
    parser.add_argument("--kinds", nargs="+", default=None, help="only these projection kinds (default: every one "
                        "BLAST compresses; the whole compress's estimate then counts only these)")
    parser.add_argument("--skip-accuracy", action="store_true", help="no 300-step errors")
    args = parser.parse_args()
    device, model = torch.device(args.device), args.model
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: --device cpu times this CPU")
    gen = torch.Generator(device=device).manual_seed(0)
    spec = PRESETS[model]
    kinds = plan_kinds(spec.linear_shapes(), "blast", RATIO, BLOCKS)
    compressed = [kind for kind, kp in kinds.items() if kp.rank is not None]
    if unknown := sorted(set(args.kinds or ()) - set(compressed)):
        parser.error(f"--kinds {unknown}: BLAST compresses {compressed} of {model}")
    record = {"probe": "blast_step_time", "model": model, "device": str(device), "blocks": BLOCKS, "ratio": RATIO,
              **environment(), "settings": SETTINGS, "kinds": args.kinds, "shapes": [], "solves": []}
    totals = dict.fromkeys(SETTINGS, 0.0)
    for kind, kp in kinds.items():
        if kp.rank is None or (args.kinds and kind not in args.kinds):
            continue
        weight = torch.randn(kp.out_features, kp.in_features, generator=gen, device=device).bfloat16() * 0.02

        def factorize(steps: int, weight=weight, rank=kp.rank) -> None:
            proj.blast_factorize(weight, rank, BLOCKS, steps=steps)

        row = {"kind": kind, "out": kp.out_features, "in": kp.in_features, "rank": kp.rank,
               "matrices": spec.num_layers}
        weights = {"gaussian": weight, "falling spectrum": falling_spectrum(kp.out_features, kp.in_features, gen,
                                                                            device)} \
            if kind in ACCURACY_KINDS and not args.skip_accuracy else {}
        for name, values in SETTINGS.items():
            with module_settings(proj, values):
                start = timed(lambda: factorize(0), device)
                step = (timed(lambda: factorize(STEPS), device) - start) / STEPS
                errors = {which: relative_error(w, kp.rank) for which, w in weights.items()}
            per_matrix = start + DEFAULT_STEPS * step
            totals[name] += spec.num_layers * per_matrix
            row[name] = {"start_s": start, "step_s": step, "default_steps_s_per_matrix": per_matrix,
                         **({"relative_error_at_default_steps": errors} if errors else {})}
        row["step_before_over_now"] = row["before"]["step_s"] / row["now"]["step_s"]
        print(json.dumps(row), flush=True)
        record["shapes"].append(row)
        if device.type == "cuda" and kind in ACCURACY_KINDS:
            r, b = kp.rank, BLOCKS
            for batch in (1, 4):
                unit = torch.nn.functional.normalize(torch.randn(batch, b, kp.out_features // b, r, generator=gen,
                                                                 device=device), dim=-2)
                gram_u = unit.transpose(-1, -2) @ unit
                s_gram = gram_u.unsqueeze(-3) * gram_u.unsqueeze(-4)                 # (batch, i, j, r, r)
                rhs_u = torch.randn(batch, b, r, kp.out_features // b, generator=gen, device=device)
                cases = {"U step": (gram_u, rhs_u),
                         "S step": (s_gram, torch.randn(batch, b, b, r, 1, generator=gen, device=device))}
                for name, (gram, rhs) in cases.items():
                    solve = {"kind": kind, "step": name, "weights": batch, "rank": r,
                             **solve_times(gram, rhs, cg=name == "S step")}
                    print(json.dumps(solve), flush=True)
                    record["solves"].append(solve)
                del s_gram
    record["estimated_projection_s"] = totals
    print(f"estimated projections at {DEFAULT_STEPS} steps: {json.dumps(totals)} s", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"blast_step_time_{record['commit']}{'' if device.type == 'cuda' else '_' + device.type}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
