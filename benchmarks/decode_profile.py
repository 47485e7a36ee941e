"""Where a batch-1 decode step's time goes: the kernels of one CUDA-graph step, by name.

The partial-FFN benchmark (``partial_ffn.py``) reports decode tokens/s against the
weight-read floor; this diagnostic says why a step misses it. It loads the
Llama-3.2-3B-shaped model (random init, fp16) dense and partial (gamma 0.7, phi 0.4),
captures memfit's decode step, replays it under ``torch.profiler`` and writes, per case,
every kernel name with its calls and GPU microseconds per step, the sum of kernel time
and the step's wall time (their difference is launch gaps between kernels). Dense runs
with memfit's decode kernels and with the previous loop (``fast=False``). For each case
it also times every candidate the Generator chose between (``case`` ".. variants"):
cuBLAS and each GEMV tile per decode matmul shape, over all layers of that shape, and
each decode-attention variant at the full cache length, with the bytes each reads.

    python benchmarks/decode_profile.py --out DIR     # H200: about a minute
"""
from __future__ import annotations

import argparse
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
from memfit.kernels import decode, gemv
from memfit.measure.kernel_profile import kernel_profile
from memfit.measure.results import check_out_dir, write_results
from memfit.measure.timing import graph_ms
from memfit.models import PRESETS

STEPS = 20


def _us(fn) -> float:
    return 1e3 * graph_ms(fn, 20)


def variant_rows(name: str, gen: Generator) -> list[dict]:
    """Every matmul path per decode shape and every attention variant, timed as the Generator's pick does."""
    rows = []
    for key, weights in gen.matmul_groups().items():
        x = torch.randn(gen.batch, weights[0][0].shape[1], dtype=gen.dtype, device=gen.device)
        nbytes = sum(w.shape[0] * w.shape[1] * w.element_size() for w, _ in weights)
        for path in gemv.PATHS if gemv.takes(x, weights[0][0]) else (gemv.CUBLAS,):
            run = gemv.over_group(path)
            us = _us(lambda run=run, x=x, weights=weights: run(x, weights))
            rows.append({"case": f"{name} variants", "op": "matmul", "shape": key, "layers": len(weights), "path": path,
                         "chosen": gen.matmul_paths.get(key) == path, "us": us, "bytes": nbytes, "GBps": nbytes / us / 1e3})
    caches = list(zip(gen.k_cache, gen.v_cache))
    args = decode.timing_args(caches, gen.heads, gen.model.model.layers[0].self_attn.scaling)
    nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in caches)
    for variant in decode.ATTENTION_VARIANTS:
        run = decode.over_layers(variant)
        us = _us(lambda run=run: run(*args))
        rows.append({"case": f"{name} variants", "op": "decode_attention", "shape": f"cache {tuple(gen.k_cache[0].shape)}",
                     "layers": len(caches), "path": variant, "chosen": gen.attention_variant == variant, "us": us,
                     "bytes": nbytes, "GBps": nbytes / us / 1e3})
    for r in rows:
        print(f"[decode_profile] {r['case']:28s} {r['op']:16s} {r['shape']:40s} {r['path']:18s} {r['us']:8.1f} us "
              f"{r['GBps']:6.0f} GB/s" + ("  <- chosen" if r["chosen"] else ""), flush=True)
    return rows


def profile_case(name: str, model, prompt: torch.Tensor, **loop) -> list[dict]:
    """Kernel table of ``STEPS`` replayed decode steps of ``model`` after ``prompt`` (``loop``: Generator options)."""
    gen = Generator(model, prompt.shape[1] + 3 * STEPS + 8, **loop)
    gen.generate(prompt, STEPS)                   # capture + warm-up
    gen.prefill(prompt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen.decode(STEPS)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / STEPS * 1e6
    gen.prefill(prompt)
    torch.cuda.synchronize()
    kernels = kernel_profile(lambda: gen.decode(STEPS), "cuda")[0]
    rows = [{"case": name, "kernel": k, "calls_per_step": v["launches"] / STEPS, "us_per_step": 1e3 * v["ms"] / STEPS}
            for k, v in kernels.items()]
    total = sum(r["us_per_step"] for r in rows)
    rows.insert(0, {"case": name, "kernel": "(all)", "calls_per_step": sum(r["calls_per_step"] for r in rows),
                    "us_per_step": total, "wall_us_per_step": wall_us, "graph": gen.graph is not None,
                    "weight_bytes_per_token": weight_bytes_per_token(model), "decode_kernels": gen.fast,
                    "attention_variant": gen.attention_variant, "matmul_paths": gen.matmul_paths})
    for r in rows[:25]:
        print(f"[decode_profile] {name:24s} {r['us_per_step']:8.1f} us {r['calls_per_step']:6.1f}x  {r['kernel']}"
              + (f"  wall {wall_us:.1f} us" if r["kernel"] == "(all)" else ""), flush=True)
    return rows + (variant_rows(name, gen) if gen.fast else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = parser.parse_args()
    check_out_dir(parser, args.out)
    if not torch.cuda.is_available():
        print("decode_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    spec = PRESETS["llama-3.2-3b"]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, spec.vocab, (1, 128), generator=gen, device="cpu")
    tmp = Path(tempfile.mkdtemp(prefix="memfit-decode-profile-"))
    rows: list[dict] = []
    try:
        model_dir = _save_random(spec, tmp / "model", device)
        _calibrate(model_dir, device, torch.randint(0, spec.vocab, (8, 128), generator=gen))
        partial = PartialConfig(load=0.7, compute=0.4, full_first=2, full_last=2)
        cases = [("dense", None, {}), ("partial 0.7/0.4", partial, {}), ("dense, previous loop", None, {"fast": False})]
        for name, config, loop in cases:
            model = load_model(model_dir, config, device=device)
            rows += profile_case(name, model, prompt.to(device), **loop)
            del model
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[decode_profile] wrote {write_results('decode_profile', rows, [], out_dir=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
