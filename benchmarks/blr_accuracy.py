"""Accuracy of block-low-rank compression: perplexity before/after, and after a short recovery.

Takes the small byte-level Llama of benchmarks/train_small_model.py (trained first if
--model does not exist), compresses its q/o/gate/up/down projections to ~50% of the
linear parameters (GQA k/v stay dense) with each method (low-rank, Monarch, BLAST), each
by the plain weight-space projection and by the activation-aware (whitened) one
calibrated on training text, and measures validation perplexity: dense, right after
projection, and after a short recovery fine-tune of only the structured factors (each
fine-tune, the dense control's too, ends at its best step on a dev half of the held-out
text; perplexities are on the other half). Rows
also carry the per-layer relative weight and output errors. The summary says where BLAST
does not beat low-rank. Writes benchmarks/results/blr_accuracy.json and .png, with the run's
settings and the model's train_info.json.

    python benchmarks/blr_accuracy.py                 # H200: ~1-2 min after the model exists
    python benchmarks/blr_accuracy.py --smoke         # CPU, tiny, seconds
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from memfit.compress import compress_model
from memfit.data import dev_test_split, token_splits
from memfit.data.lm import perplexity, train_lm
from memfit.layers import StructuredLinear
from memfit.measure.results import RESULTS_DIR, check_out_dir, parse_smoke_defaults, target, write_results

METHODS = ("lowrank", "monarch", "blast")
SMOKE_SETTINGS = {"blocks": 4, "blast_steps": 10, "recovery_steps": 4, "batch": 4, "seq": 64, "calib_samples": 4}


def load_or_train(model_dir: Path, smoke: bool, device: str):
    from transformers import AutoModelForCausalLM

    if not (model_dir / "config.json").is_file():
        import train_small_model

        print(f"{model_dir} missing: training it first", flush=True)
        train_small_model.main(["--out", str(model_dir), *(["--smoke"] if smoke else [])])
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).to(device).eval()


def recover(model, params, args, train, dev) -> dict:
    """The short recovery fine-tune: only ``params`` train, same recipe for every row (dense control
    included), ending at the step with the best dev perplexity (the corpus is small enough to overfit)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return train_lm(model, train, args.recovery_steps, args.batch, args.seq, args.recovery_lr,
                    warmup=args.recovery_steps // 10, weight_decay=0.0, params=params, seed=1,
                    validate=lambda: perplexity(model, dev, args.seq), validate_every=args.validate_every)


def dense_control(base, kinds: set[str], args, train, dev, val) -> dict:
    """The dense model given the same recovery steps on the weights of the projection ``kinds`` the
    compression replaced: the fair reference for "after recovery" (the small model is not trained to
    convergence, so extra steps help it too)."""
    model = copy.deepcopy(base)
    targets = [m.weight for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in kinds]
    ft = recover(model, targets, args, train, dev)
    return {"method": "dense", "projection": "recovery control", "linear_ratio": 1.0,
            "ppl_projected": perplexity(base, val, args.seq), "ppl_recovered": perplexity(model, val, args.seq),
            "recovery_steps": ft["steps"], "recovery_best_step": ft.get("best_step"), "recovery_s": ft["seconds"]}


def run_case(base, method, aware, args, calib, train, dev, val) -> dict:
    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    result = compress_model(model, method, args.ratio, args.blocks, calibration=calib, activation_aware=aware,
                            steps=args.blast_steps)
    project_s = time.perf_counter() - t0
    ppl = perplexity(model, val, args.seq)
    factors = [p for m in model.modules() if isinstance(m, StructuredLinear) for p in m.parameters()]
    ft = recover(model, factors, args, train, dev)
    rows = result.report
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {"method": method, "projection": "activation-aware" if aware else "weight-space",
            "linear_ratio": result.summary()["linear_ratio"], "ranks": result.summary()["ranks"],
            "blocks": result.blocks, "project_s": project_s, "ppl_projected": ppl,
            "ppl_recovered": perplexity(model, val, args.seq), "recovery_steps": ft["steps"],
            "recovery_best_step": ft.get("best_step"), "recovery_s": ft["seconds"],
            "mean_weight_error": mean("weight_error"), "mean_output_error": mean("output_error"), "layers": rows}


def _targets(rows: list[dict], control: dict, dense_ppl: float) -> list[dict]:
    """BLAST against the dense model given the same recovery, against low-rank, and the projection kinds."""
    best = {m: min(r["ppl_recovered"] for r in rows if r["method"] == m) for m in METHODS}
    aware = {r["method"]: r for r in rows if r["projection"] == "activation-aware"}
    plain = {r["method"]: r for r in rows if r["projection"] == "weight-space"}
    return [
        target("BLAST recovered ppl / dense ppl after the same recovery", best["blast"] / control["ppl_recovered"],
               1.25, "x", "lower"),
        target("BLAST recovered ppl / dense ppl (no recovery)", best["blast"] / dense_ppl, 1.25, "x", "lower"),
        target("BLAST / low-rank recovered ppl", best["blast"] / best["lowrank"], 1.0, "x", "lower"),
        target("activation-aware / weight-space projected ppl (BLAST)",
               aware["blast"]["ppl_projected"] / plain["blast"]["ppl_projected"], 1.0, "x", "lower"),
    ]


def findings(rows: list[dict]) -> list[str]:
    """Where BLAST does not beat low-rank (and where it does), in words."""
    notes = []
    for proj in ("weight-space", "activation-aware"):
        pick = {r["method"]: r for r in rows if r["projection"] == proj}
        for stage in ("ppl_projected", "ppl_recovered"):
            b, l = pick["blast"][stage], pick["lowrank"][stage]
            verdict = "beats" if b < l else "does NOT beat"
            notes.append(f"{proj}, {stage.split('_')[1]}: BLAST {verdict} low-rank (ppl {b:.3f} vs {l:.3f})")
        b, l = pick["blast"]["mean_output_error"], pick["lowrank"]["mean_output_error"]
        notes.append(f"{proj}: mean layer output error BLAST {b:.3f} vs low-rank {l:.3f}")
    return notes


def plot(rows, dense_ppl, control_ppl, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']}\n{r['projection'].split('-')[0]}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], [r["ppl_projected"] for r in rows], 0.4, label="after projection")
    ax.bar([i + 0.2 for i in x], [r["ppl_recovered"] for r in rows], 0.4, label="after recovery fine-tune")
    ax.axhline(dense_ppl, color="k", ls="--", label=f"dense {dense_ppl:.2f}")
    ax.axhline(control_ppl, color="k", ls=":", label=f"dense + same recovery {control_ppl:.2f}")
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("validation perplexity (bytes)")
    ax.set_title(f"BLR compression to ~{rows[0]['linear_ratio']:.0%} of linear parameters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv=None) -> argparse.Namespace:
    """The options, checked before any work (a bad one had failed after the model was trained and scored); --smoke
    gives SMOKE_SETTINGS to the options the user did not give, and --model a temp dir there (main makes it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="the small model (default benchmarks/results/small_llama; with --smoke, a new temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--blast-steps", type=int, default=300)
    parser.add_argument("--recovery-steps", type=int, default=200)
    parser.add_argument("--recovery-lr", type=float, default=5e-4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--validate-every", type=int, default=25,
                        help="recovery steps between dev-set scores; each model ends at its best")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, few steps, CPU (the options given keep their values)")
    args = parse_smoke_defaults(parser, argv, SMOKE_SETTINGS)
    check_out_dir(parser, args.out)
    if not 0 < args.ratio < 1:
        parser.error(f"--ratio is a fraction of the linear parameters, in (0, 1); got {args.ratio}")
    if not 0 < args.recovery_lr < math.inf:
        parser.error(f"--recovery-lr must be a positive number; got {args.recovery_lr}")
    for name in ("blocks", "blast_steps", "recovery_steps", "batch", "seq", "calib_samples", "validate_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer; got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.model is None:
        args.model = Path(tempfile.mkdtemp()) / "small_llama" if args.smoke else RESULTS_DIR / "small_llama"
    if args.smoke:
        torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    base = load_or_train(args.model, args.smoke, device)
    train, held_out = (t.to(device) for t in token_splits())
    if args.smoke:
        train, held_out = train[:20000], held_out[:2000]
    dev, val = dev_test_split(held_out)     # dev stops the recovery fine-tunes; every reported perplexity is on val
    calib = list(train[: args.calib_samples * args.seq].reshape(-1, args.seq).split(8))  # training text windows
    dense_ppl = perplexity(base, val, args.seq)
    print(f"dense val ppl {dense_ppl:.3f}", flush=True)
    out_dir = args.out or (args.model.parent if args.smoke else None)
    name = "blr_accuracy" + ("_smoke" if args.smoke else "")
    baseline = {"method": "dense", "projection": None, "linear_ratio": 1.0, "ppl_projected": dense_ppl,
                "ppl_recovered": dense_ppl}
    # The settings and the model's own training record go into the results: runs with reduced
    # steps/batch/seq (e.g. on a CPU) are otherwise indistinguishable from the default one.
    settings = {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "device": device}
    info_file = args.model / "train_info.json"
    model_info = json.loads(info_file.read_text()) if info_file.is_file() else None
    rows = []

    def save(complete: bool) -> Path:
        """Rewrite the results after every case, so a run stopped by its time limit keeps what it measured."""
        compressed = [r for r in rows if r["method"] != "dense"]
        notes = findings(compressed) if complete else []
        return write_results(name, [baseline, *rows], _targets(compressed, rows[0], dense_ppl) if complete else [],
                             out_dir=out_dir, findings=notes, dense_ppl=dense_ppl, complete=complete,
                             settings=settings, model_train_info=model_info)

    for method in METHODS:
        for aware in (False, True):
            row = run_case(base, method, aware, args, calib, train, dev, val)
            if not rows:            # the control trains what the first compression replaced
                rows.append(dense_control(base, {r["kind"] for r in row["layers"]}, args, train, dev, val))
                print(f"dense + {rows[0]['recovery_steps']} recovery steps (kept step {rows[0]['recovery_best_step']}): "
                      f"ppl {rows[0]['ppl_recovered']:.3f}",
                      flush=True)
            rows.append(row)
            save(complete=False)
            print(f"{method:8s} {row['projection']:16s} ratio {row['linear_ratio']:.3f}  ppl {row['ppl_projected']:9.3f} "
                  f"-> {row['ppl_recovered']:7.3f} after {row['recovery_steps']} steps (kept {row['recovery_best_step']})  "
                  f"(err w {row['mean_weight_error']:.3f} / out {row['mean_output_error']:.3f})", flush=True)
    path = save(complete=True)
    print("\n".join(findings(rows[1:])))
    plot(rows[1:], dense_ppl, rows[0]["ppl_recovered"], path.with_suffix(".png"))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
