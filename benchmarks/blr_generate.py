"""Benchmark: decode tokens/s of a block-low-rank model in memfit's own loop, the one ``memfit generate`` runs.

``blr_e2e.py`` times transformers' model compiled with CUDA graphs, the issue's setting. A user who compresses a
model and runs ``memfit generate DIR`` gets memfit's decode loop instead (static KV cache, one CUDA graph per
step, memfit's decode attention): this times that loop, without the command's per-token streaming to the
terminal, on a Llama-3.2-1B-shaped model (random init, bf16) at batch 1, a 128-token prompt and 256 new tokens,
with ``partial_ffn.speed_case`` (decode tokens/s, median of 3 runs after a warm-up; memory from before the load;
the weight-read floor: the row's own weight bytes per token at the copy bandwidth measured in this run). Cases:

* dense, loaded by ``memfit.infer.load_model``: q/k/v and gate/up each one matmul (memfit's fused layout), and
  each decode matmul shape by cuBLAS or memfit's GEMV, whichever its pick times faster;
* dense with the model's own modules (``fused=False``): separate projections as the compressed models run them,
  q/k/v, o and the head by the pick, the MLP's own module by cuBLAS;
* Monarch and BLAST at the paper's ranks (q/o 256, gate 512, up/down 768, b = 16; k/v, the embedding and the head
  dense), random factors (speed depends on shapes only) saved by ``memfit.compress.save_compressed`` and loaded
  by ``load_compressed``, as ``memfit generate`` loads them; their layers run their own ops, k/v and the head
  the pick's path.

"x dense" is against the fused dense row. No target: the issue's decode target is set against the compiled
transformers model (``blr_e2e.py``).

    python benchmarks/blr_generate.py            # H200: a few minutes
    python benchmarks/blr_generate.py --smoke    # CPU, tiny shapes, same code path
"""
from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from partial_ffn import Recorder, speed_case  # noqa: E402

from memfit.compress import PAPER_RANKS_LLAMA_1B, load_compressed, save_compressed, structure_model  # noqa: E402
from memfit.infer.partial_load import load_model  # noqa: E402
from memfit.measure.results import check_out_dir  # noqa: E402
from memfit.models import PRESETS, build_model  # noqa: E402

METHODS = ("monarch", "blast")


def save_structured(spec, method: str, blocks: int, ranks: dict | None, directory: Path) -> Path:
    """A random-init model of ``spec`` with ``method``'s layers at ``ranks`` (half the parameters where None), saved
    as ``memfit compress`` saves (built on the CPU, so that loading it is what a load measures)."""
    torch.manual_seed(0)
    model = build_model(spec, dtype="bfloat16", device="cpu")
    result = structure_model(model, method, ratio=None if ranks else 0.5, blocks=blocks, ranks=ranks)
    return save_compressed(model, directory, result.layers, {"source": spec.name, **result.summary()})


def run(args, device, ceilings, rec: Recorder) -> None:
    smoke = args.smoke
    spec = PRESETS["tiny"] if smoke else PRESETS["llama-3.2-1b"]
    blocks, ranks = (4, None) if smoke else (16, PAPER_RANKS_LLAMA_1B)
    prompt_len, new, reps = (16, 8, 1) if smoke else (128, 256, 3)
    prompt = torch.randint(0, spec.vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0), device="cpu")
    loop = {"graphs": False} if smoke else {}
    tmp = Path(tempfile.mkdtemp(prefix="memfit-blr-generate-"))
    try:
        torch.manual_seed(0)
        build_model(spec, dtype="bfloat16", device=device).save_pretrained(tmp / "dense")
        cases = [("dense", lambda: load_model(tmp / "dense", device=device), loop),
                 ("dense, unfused loop (separate projections)", lambda: load_model(tmp / "dense", device=device),
                  {**loop, "fused": False})]
        saved = {method: save_structured(spec, method, blocks, ranks, tmp / method) for method in METHODS}
        cases += [(method, functools.partial(load_compressed, saved[method], device=device), loop)
                  for method in METHODS]
        for name, load, kwargs in cases:
            row = rec.attempt(name, functools.partial(speed_case, name, load, prompt, new, ceilings, device, reps,
                                                      **kwargs))
            if row is not None:
                rec.add({**row, "model": spec.name})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dense = next((r for r in rec.rows if r.get("case") == "dense" and r.get("available")), None)
    for row in rec.rows:
        if dense is not None and row.get("available") and row is not dense:
            row["speedup_vs_dense"] = row["decode_tokens_per_s"] / dense["decode_tokens_per_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, same code path")
    parser.add_argument("--out", help="results directory (default benchmarks/results)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU; --smoke runs the same code path on the CPU at tiny shapes")
    device = torch.device("cpu" if args.smoke else "cuda")
    rec = Recorder.for_run(args.out, args.smoke, device, "blr_generate")
    rec.attempt("speed", run, args, device, rec.rates, rec)
    path = rec.finish()
    for row in rec.rows:
        if row.get("available"):
            ratio = f", {row['speedup_vs_dense']:.3f}x dense" if "speedup_vs_dense" in row else ""
            print(f"[blr_generate] {row['case']}: {row['decode_tokens_per_s']:.0f} tokens/s "
                  f"({row['fraction_of_floor']:.2f} of its floor){ratio}")
    failed = [row["case"] for row in rec.rows if row.get("error")]
    print(f"[blr_generate] wrote {path}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
