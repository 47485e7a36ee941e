"""Probe: LU against Cholesky for BLAST's damped solves (``projection._damped_solve``), which took 80 of the 112 s
that ``compress_model`` spent on the 1B model's BLAST projections at 20 descent steps on an H100 (d98126e's cProfile of
``compress_memory.py blast``; the default is 300 steps). Per Llama-3.2-1B shape at BLAST's rank for half the
parameters (16 blocks), it times the U step's solves (b systems of r x r, p right-hand sides) and the S step's (b^2
systems, one right-hand side) by each method on systems built as the descent builds them, with their largest
relative difference, then ``blast_factorize`` of one weight for a few descent steps under each method (time and
relative error). Writes OUT/damped_solve_time_<commit>.json:

    MEMFIT_COMMIT=<sha> OUT=/some/dir python benchmarks/probes/damped_solve_time.py [cuda|cpu]
"""
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
from memfit.models import PRESETS  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
MODEL, BLOCKS, RATIO, DESCENT_STEPS, REPEATS = "llama-3.2-1b", 16, 0.5, 10, 5


def timed(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    return best_wall_seconds(fn, REPEATS, device)


def systems(out: int, inp: int, rank: int, device: torch.device, gen: torch.Generator):
    """The U step's and the S step's Gram matrices, right-hand sides and ridge, from unit-column random factors as the
    descent's start has them (float32, as it runs on a bf16 weight)."""
    b, p, q = BLOCKS, out // BLOCKS, inp // BLOCKS
    U = torch.nn.functional.normalize(torch.randn(b, p, rank, generator=gen, device=device), dim=-2)
    V = torch.nn.functional.normalize(torch.randn(b, q, rank, generator=gen, device=device), dim=-2)
    S = torch.randn(b, b, rank, generator=gen, device=device)
    Vbar = (V.unsqueeze(-4) * S.unsqueeze(-2)).flatten(-3, -2)                     # (i, in, r)
    M = Vbar.transpose(-1, -2) @ Vbar
    gram = (U.transpose(-1, -2) @ U).unsqueeze(-3) * (V.transpose(-1, -2) @ V).unsqueeze(-4)
    ridge = 1e-2 * M.diagonal(dim1=-2, dim2=-1).mean()
    return {"U step": (M, torch.randn(b, rank, p, generator=gen, device=device), ridge),
            "S step": (gram, torch.randn(b, b, rank, 1, generator=gen, device=device), ridge)}


def main() -> None:
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    kinds = plan_kinds(PRESETS[MODEL].linear_shapes(), "blast", RATIO, BLOCKS)
    record = {"probe": "damped_solve_time", "model": MODEL, "blocks": BLOCKS, "ratio": RATIO, "device": str(device),
              **environment(), "solves": [], "descent": []}
    for kind, kp in kinds.items():
        if kp.rank is None or kind == "up_proj":                    # up has gate's shape
            continue
        for step, (gram, rhs, ridge) in systems(kp.out_features, kp.in_features, kp.rank, device, gen).items():
            times, results = {}, {}
            for solve in proj.SOLVES:
                times[solve], results[solve] = timed(lambda g=gram, b=rhs, d=ridge, m=solve: proj._damped_solve(g, b, d, m),
                                                     device)
            difference = ((results["cholesky"] - results["lu"]).norm() / results["lu"].norm()).item()
            row = {"kind": kind, "step": step, "rank": kp.rank, "systems": list(gram.shape[:-2]),
                   "rhs_columns": rhs.shape[-1], **{f"{solve}_s": t for solve, t in times.items()},
                   "lu_over_cholesky": times["lu"] / times["cholesky"], "relative_difference": difference}
            print(json.dumps(row), flush=True)
            record["solves"].append(row)
    kp = kinds["q_proj"]
    weight = torch.randn(kp.out_features, kp.in_features, generator=gen, device=device).bfloat16()
    chosen = proj.SOLVE_BY_DEVICE.get(device.type)
    for solve in proj.SOLVES:
        proj.SOLVE_BY_DEVICE[device.type] = solve
        seconds, (U, V, S) = timed(lambda: proj.blast_factorize(weight, kp.rank, BLOCKS, steps=DESCENT_STEPS), device)
        error = ((weight.float() - proj.blast_dense(U, V, S)).norm() / weight.float().norm()).item()
        row = {"kind": "q_proj", "solve": solve, "steps": DESCENT_STEPS, "seconds": seconds, "relative_error": error}
        print(json.dumps(row), flush=True)
        record["descent"].append(row)
    proj.SOLVE_BY_DEVICE[device.type] = chosen
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"damped_solve_time_{record['commit']}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
