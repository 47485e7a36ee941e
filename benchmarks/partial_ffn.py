"""Benchmark: partial FFN loading (gamma) and computation (phi) against dense fp16 and bitsandbytes 4-bit.

Speed and memory (GPU): a Llama-3.2-3B-shaped model (random init, saved first as fp16
safetensors in a temp dir) at batch 1, a 128-token prompt and 256 new tokens. Dense,
partial (gamma 0.7, phi 0.4) and bitsandbytes NF4 all decode through memfit's loop
(static KV cache, one CUDA graph per step); plain transformers ``generate`` on the dense
model is the outside baseline. Each case reports peak memory from before loading to the
end of generation, decode tokens/s (median of 3 runs after a warm-up) and the roofline
floor: bytes of weights one decode step reads / copy bandwidth measured in this run.

Accuracy: the small byte-level Llama of ``benchmarks/train_small_model.py`` (shared
with the BLR work; ``--small-model DIR`` to point elsewhere; else one trained here for
45 s on the same offline Python-docs corpus), perplexity and next-token
agreement with the dense model on held-out text, for gamma in {1, .85, .7} x phi in
{1, .6, .4} (phi > gamma means "compute every loaded neuron"). Each validation
sequence is its own prompt: its first half is the prefill that selects the neurons,
its second half is scored through the decode path.

Rows are written to the JSON as they are measured: a section that fails becomes a row
with its error, and the rows measured before it are kept.

    python benchmarks/partial_ffn.py            # H200: < 4 minutes
    python benchmarks/partial_ffn.py --smoke    # CPU, tiny shapes, same code path
"""
from __future__ import annotations

import argparse
import gc
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memfit.data.corpus import token_splits                                 # noqa: E402
from memfit.infer.calibrate import calibrate                               # noqa: E402
from memfit.infer.generate import Generator, weight_bytes_per_token         # noqa: E402
from memfit.infer.partial_load import PartialConfig, load_model             # noqa: E402
from memfit.measure.results import check_out_dir, target, write_results     # noqa: E402
from memfit.measure.timing import Ceilings, measure_ceilings                # noqa: E402
from memfit.models import PRESETS, build_model                              # noqa: E402

GAMMAS, PHIS = (1.0, 0.85, 0.7), (1.0, 0.6, 0.4)


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_reset(device) -> int:
    """Free what can be freed and restart the peak; returns the bytes still allocated (leftovers of earlier cases)."""
    _free()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _mem(device, peak=False):
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


def _save_random(spec, directory: Path, device) -> Path:
    """Random-init model of ``spec`` built on ``device`` (fast), saved as fp16 safetensors."""
    model = build_model(spec, dtype="float16", device=device)
    model.save_pretrained(directory)
    del model
    _free()
    return directory


def _calibrate(model_dir: Path, device, prompts: torch.Tensor) -> None:
    model = load_model(model_dir, device=device)
    batches = [(chunk, torch.ones_like(chunk), None) for chunk in prompts.split(4)]
    calibrate(model, batches).save(model_dir / "rankings.safetensors")
    del model
    _free()


def _load_bnb(model_dir: Path, device):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), quantization_config=quant, dtype=torch.float16,
                                                device_map={"": device.index or 0}).eval()


class Recorder:
    """Rows and targets of this run, rewritten to the JSON after every row, so a later crash loses nothing; the file
    says ``"complete": false`` until :meth:`finish` writes it for the last time (README marks a stopped run)."""

    def __init__(self, out, smoke: bool, ceilings: Ceilings, ceiling_note: str, name: str = "partial_ffn"):
        self.name = name
        self.rows: list[dict] = []
        self.targets: list[dict] = []
        self.out, self.smoke, self.rates = out, smoke, ceilings
        self.ceilings = {"matmul_flops": ceilings.matmul_flops, "bandwidth": ceilings.bandwidth, "note": ceiling_note}
        self.start = time.perf_counter()
        self.complete = False

    @classmethod
    def for_run(cls, out, smoke: bool, device: torch.device, name: str) -> "Recorder":
        """A recorder with this run's ceilings (measured on a GPU; assumed on the CPU, where no floor means anything)
        and results directory (a smoke run's goes to a temp dir, never over the GPU results)."""
        if device.type == "cuda":
            ceilings, note = measure_ceilings(), "measured in this run"
        else:
            ceilings, note = Ceilings(matmul_flops=1e12, bandwidth=50e9), "assumed (CPU smoke run: no floor is meaningful)"
        out = out or (Path(tempfile.gettempdir()) / "memfit-smoke" if smoke else None)
        return cls(out, smoke, ceilings, note, name)

    def finish(self) -> Path:
        """The last write, of the whole run."""
        self.complete = True
        return self.write()

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        print(f"[{self.name}] {time.perf_counter() - self.start:5.0f} s {row}", flush=True)
        self.write()
        return row

    def write(self) -> Path:
        return write_results(self.name, self.rows, self.targets, out_dir=self.out, smoke=self.smoke, ceilings=self.ceilings,
                             seconds=time.perf_counter() - self.start, complete=self.complete)

    def attempt(self, case: str, fn, *args, **extra):
        """Run ``fn(*args)``; a failure becomes a row naming the error (and is printed), not the end of the run."""
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001 - every failure is recorded in the results, then the run goes on
            traceback.print_exc()
            _free()
            self.add({"case": case, "available": False, "error": f"{type(err).__name__}: {err}", **extra})
            return None


def speed_case(name: str, load, prompt: torch.Tensor, new: int, ceilings: Ceilings, device, reps: int,
               optional: bool = False, **loop) -> dict:
    """Load with ``load()``, generate ``new`` tokens ``reps`` times after a warm-up, measure memory and speed.

    Memory is counted above what was allocated before loading. ``optional``: a competitor whose failure
    (missing package, unsupported GPU) is recorded as a "not available" row instead of stopping the run.
    ``loop``: Generator options, e.g. ``fused=False`` (the model's own modules) or ``fast=False`` (the loop
    before memfit's decode kernels: cuBLAS matmuls, compiled rope/cache writes, SDPA under a mask).
    """
    try:
        return _speed_case(name, load, prompt, new, ceilings, device, reps, loop)
    except Exception as err:  # noqa: BLE001 - any failure of an optional competitor is reported, not raised
        if not optional:
            raise
        _free()
        return {"case": name, "available": False, "reason": f"not available: {type(err).__name__}: {err}"}


def _speed_case(name, load, prompt, new, ceilings, device, reps, loop) -> dict:
    before = _peak_reset(device)
    t0 = time.perf_counter()
    model = load()
    load_s = time.perf_counter() - t0
    resident = _mem(device) - before if device.type == "cuda" else None
    gen = Generator(model, prompt.shape[1] + new, **loop)
    gen.generate(prompt, new)                                      # warm-up (and, for partial, a first selection)
    runs = [gen.generate(prompt, new) for _ in range(reps)]
    tps = statistics.median(r.tokens_per_s for r in runs)
    read = weight_bytes_per_token(model)
    floor_ms = ceilings.floor_ms(flops=2 * read / 2, bytes_moved=read)   # batch 1: ~1 multiply-add per fp16 weight
    ms = 1e3 / tps
    peak = _mem(device, peak=True) - before if device.type == "cuda" else None
    row = {"case": name, "available": True, "load_s": load_s, "resident_bytes": resident, "peak_bytes": peak,
           "kv_cache_bytes": sum(t.numel() * t.element_size() for t in gen.k_cache + gen.v_cache),
           "weight_bytes_per_token": read, "decode_tokens_per_s": tps, "decode_ms_per_token": ms, "floor_ms": floor_ms,
           "fraction_of_floor": floor_ms / ms, "prefill_ms": 1e3 * statistics.median(r.prefill_s for r in runs),
           "cuda_graph": runs[0].graphs, "fused_layers": gen.fused_layers, "layers": len(model.model.layers),
           "new_tokens": new, "prompt_tokens": prompt.shape[1], "decode_kernels": gen.fast,
           "attention_variant": gen.attention_variant, "matmul_paths": gen.matmul_paths}
    del gen, model, runs
    _free()
    return row


def hf_generate_case(model_dir: Path, prompt: torch.Tensor, new: int, device) -> dict:
    """Plain transformers ``generate`` (dynamic cache, eager) on the dense model: the outside baseline."""
    before = _peak_reset(device)
    model = load_model(model_dir, device=device)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    model.generate(prompt.to(device), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(prompt.to(device), **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = _mem(device, peak=True) - before if device.type == "cuda" else None
    row = {"case": "dense fp16, transformers generate", "available": True, "peak_bytes": peak,
           "decode_tokens_per_s": new / seconds, "note": "includes the prefill; eager, dynamic cache"}
    del model
    _free()
    return row


def run_speed(args, device, ceilings, rec: Recorder) -> None:
    spec = PRESETS["llama-3.2-3b"] if not args.smoke else PRESETS["tiny"].with_(num_layers=6, name="tiny-6")
    prompt_len, new = (128, 256) if not args.smoke else (16, 8)
    reps = 3 if not args.smoke else 1
    partial = PartialConfig(load=0.7, compute=0.4, full_first=2, full_last=2)
    everywhere = PartialConfig(load=0.7, compute=0.4, full_first=2, full_last=2, compute_all_layers=True)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, spec.vocab, (1, prompt_len), generator=gen, device="cpu")
    calib = torch.randint(0, spec.vocab, (8, prompt_len), generator=gen, device="cpu")
    tmp = Path(tempfile.mkdtemp(prefix="memfit-partial-"))
    cases = [
        ("dense fp16", lambda: load_model(model_dir, device=device), {}),
        ("dense fp16, unfused loop (separate q/k/v, gate/up matmuls)", lambda: load_model(model_dir, device=device),
         {"fused": False}),
        (f"partial fp16 (gamma {partial.load}, phi {partial.phi})", lambda: load_model(model_dir, partial, device=device), {}),
        (f"partial fp16 (gamma {partial.load}, phi {partial.phi} in every layer)",
         lambda: load_model(model_dir, everywhere, device=device), {}),
        ("bitsandbytes nf4", lambda: _load_bnb(model_dir, device), {"optional": True}),
        ("dense fp16, previous loop (cuBLAS, SDPA; no decode kernels)", lambda: load_model(model_dir, device=device),
         {"fast": False}),
        (f"partial fp16 (gamma {partial.load}, phi {partial.phi}), previous loop (no decode kernels)",
         lambda: load_model(model_dir, partial, device=device), {"fast": False}),
    ]
    found = {}
    try:
        t0 = time.perf_counter()
        model_dir = _save_random(spec, tmp / "model", device)
        _calibrate(model_dir, device, calib)
        print(f"[partial_ffn] saved and calibrated {spec.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        for name, load, kwargs in cases:
            if name.startswith("bitsandbytes") and device.type != "cuda":
                row = {"case": name, "available": False, "reason": "not available: needs CUDA"}
            else:
                row = rec.attempt(name, lambda: speed_case(name, load, prompt, new, ceilings, device, reps, **kwargs))
                if row is None:
                    continue
            found[name] = rec.add({**row, "model": spec.name})
        row = rec.attempt("dense fp16, transformers generate", hf_generate_case, model_dir, prompt, new, device)
        if row is not None:
            rec.add({**row, "model": spec.name})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dense, part, bnb = (found.get(name, {}) for name, _, _ in (cases[0], cases[2], cases[4]))
    if dense.get("available") and part.get("available"):
        rec.targets.append(target("decode speed-up of partial (0.7, 0.4) over dense, same loop",
                                  part["decode_tokens_per_s"] / dense["decode_tokens_per_s"], 1.5, "x", "higher"))
        if device.type == "cuda":
            rec.targets.insert(0, target("peak memory of partial / dense", part["peak_bytes"] / dense["peak_bytes"], 0.87,
                                         "ratio", "lower"))
        if bnb.get("available"):
            rec.targets.append(target("decode speed of partial / bitsandbytes nf4",
                                      part["decode_tokens_per_s"] / bnb["decode_tokens_per_s"], 1.0, "ratio", "higher"))
    if dense.get("available"):
        rec.targets.append(target("dense decode as a fraction of its weight-read floor", dense["fraction_of_floor"], 0.6,
                                  "fraction", "higher"))
    rec.write()


# ---- accuracy ---------------------------------------------------------------------------------
def train_small(directory: Path, device, seconds: float, smoke: bool) -> Path:
    """The shared small model's shape (benchmarks/train_small_model.py) trained here for ``seconds`` only."""
    from benchmarks.train_small_model import small_spec
    from memfit.data.lm import train_lm

    spec = small_spec(smoke).with_(num_layers=4) if smoke else small_spec(smoke)   # smoke: leave partial layers between 1 + 1 full
    model = build_model(spec, dtype="float32", device=device)
    train, _ = token_splits()
    seq, batch = (512, 32) if not smoke else (64, 4)
    stats = train_lm(model, train.to(device), 1500 if not smoke else 5, batch, seq, warmup=50 if not smoke else 1,
                     max_seconds=seconds)
    print(f"[partial_ffn] trained the small model {stats['steps']} steps in {seconds:.0f} s at most", flush=True)
    model.eval().save_pretrained(directory)
    return directory


def _small_model(args, device, tmp: Path) -> tuple[Path, str]:
    """The shared small model (benchmarks/train_small_model.py's output) if present, else one trained here."""
    if args.small_model:
        return Path(args.small_model), "given"
    shared = Path(__file__).resolve().parent / "results" / "small_llama"
    if (shared / "config.json").is_file() and not args.smoke:
        return shared, "benchmarks/train_small_model.py"
    print("[partial_ffn] no shared small model (run benchmarks/train_small_model.py first): training one here", flush=True)
    seconds = 45 if not args.smoke else 3
    return train_small(tmp / "small", device, seconds, args.smoke), f"trained here ({seconds} s)"


def run_accuracy(args, device, rec: Recorder) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="memfit-partial-acc-"))
    try:
        model_dir, origin = _small_model(args, device, tmp)
        train, val = token_splits()
        seq, n_eval = (256, 64) if not args.smoke else (48, 3)
        gen = torch.Generator().manual_seed(1)
        calib_starts = torch.randint(0, train.numel() - seq, (32,), generator=gen, device="cpu").tolist()
        calib = torch.stack([train[i:i + seq] for i in calib_starts])
        dense = load_model(model_dir, device=device, dtype="float32")
        rankings = calibrate(dense, [(c, torch.ones_like(c), None) for c in calib.split(8)])
        starts = torch.linspace(0, val.numel() - seq - 1, n_eval).long().tolist()
        sequences = [val[s:s + seq][None] for s in starts]
        layers = dense.config.num_hidden_layers
        prompt = seq // 2

        def evaluate(model):
            g = Generator(model, seq, graphs=False)          # score runs eagerly: no graph to capture
            return [g.score(s, prompt).float() for s in sequences]

        reference = evaluate(dense)
        grid = [(PartialConfig(load=g, compute=min(p, g), full_first=1, full_last=1), p) for g in GAMMAS for p in PHIS]
        grid.append((PartialConfig(load=0.7, compute=0.4, full_first=1, full_last=1, compute_all_layers=True), 0.4))
        def measure(config, phi):
            model = load_model(model_dir, config, device=device, dtype="float32", rankings=rankings)
            nll, agree, count = 0.0, 0, 0
            for logits, ref, s in zip(evaluate(model), reference, sequences):
                targets = s[:, prompt:].to(device)
                nll += torch.nn.functional.cross_entropy(logits[0], targets[0], reduction="sum").item()
                agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
                count += targets.numel()
            return {"perplexity": math.exp(nll / count), "next_token_agreement": agree / count, "tokens": count}

        for config, phi in grid:
            where = {"gamma": config.load, "phi": phi, "phi_effective": config.phi, "compute_all_layers": config.compute_all_layers,
                     "full_layers": f"first 1, last 1 of {layers}", "small_model": origin}
            row = rec.attempt("accuracy", measure, config, phi, **where)
            if row is not None:
                rec.add({"case": "accuracy", **where, **row})
            _free()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, same code path")
    parser.add_argument("--out", help="results directory (default benchmarks/results)")
    parser.add_argument("--small-model", help="directory of the small trained model (else trained here)")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true",
                        help="accuracy grid only, written to partial_ffn_accuracy.json (the speed results stay)")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.out)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rec = Recorder.for_run(args.out, args.smoke, device, "partial_ffn_accuracy" if args.skip_speed else "partial_ffn")
    if not args.skip_speed:
        rec.attempt("speed section", run_speed, args, device, rec.rates, rec)
    if not args.skip_accuracy:
        rec.attempt("accuracy section", run_accuracy, args, device, rec)
    path = rec.finish()
    for t in rec.targets:
        print(f"[partial_ffn] target {t['name']}: {t['measured']:.3f} vs {t['target']} -> {'met' if t['met'] else 'NOT met'}")
    failed = [row["case"] for row in rec.rows if row.get("error")]
    print(f"[partial_ffn] wrote {path}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
