"""Linear cross-entropy: memfit against torch (logits materialised, eager and compiled),
Liger Kernel's fused linear cross-entropy and Cut Cross-Entropy, all in one run.

Vocabulary 128256, half the tokens ignored (-100), bf16, mean reduction, (tokens, hidden) =
(8192, 2048), (16384, 3072), (32768, 4096). Inputs: hidden ~ N(0, 1), weight ~ N(0, (LOGIT_STD /
sqrt(H))^2), so the logits' spread (std ~0.9) is the same at every shape. It matters for Cut
Cross-Entropy, whose backward skips vocabulary blocks where every softmax value is below
bf16 eps / 32: with a fixed weight std of 0.02 the logit std grows as sqrt(H) (0.9 / 1.1 / 1.3)
and the share of blocks it can skip falls from ~83% to ~14% to 0%, which made it look 3x slower
at the two larger shapes than its own reference numbers. Per method and shape: forward+backward time,
extra peak memory (max_memory_allocated above inputs + parameters, gradients included),
relative error of the loss and of both gradients against an fp32 reference (IEEE fp32
matmuls, chunked over tokens so it fits). The roofline floor is the exact work on the loss
tokens, 8 N V H FLOPs (forward 2NVH, backward 4NVH plus 2NVH recompute), at the matmul rate
measured in this run; the frozen-weight row (LoRA: no weight gradient) needs 6NVH.

Variants: besides the default, memfit is timed with each alternative of ``VARIANTS`` (one
keyword or module knob of memfit.kernels.linear_ce changed; the same inputs), so one run picks
the defaults: vocab chunk 2048 instead of 8192; the weight-gradient matmul by the Triton kernel
that reads the loss rows through the index, or by cuBLAS on a gathered copy of them held in a
tensor of its own, instead of cuBLAS on a copy held in the weight gradient's last rows; a
separate fp32 hidden-gradient accumulator instead of the one inside the gradient's buffer; the
steps after the gathered copy (the last ~5-16% of the vocabulary at these shapes) with their
chunks in an N x C side buffer instead of the weight gradient's unwritten rows, i.e. a few wide
steps instead of many narrow ones (what the narrow steps cost; the copied steps ignore
TAIL_ELEMENTS, so this row is not the cost of keeping every chunk in the gradient); plus the
frozen-weight (LoRA) case. Each memfit row carries the op's memory model (``backward_memory``
under that variant's settings: peak above inputs, side buffer, where the accumulator lives)
next to the measured extra peak.

Targets, per shape: memfit (default) faster than Cut Cross-Entropy, extra peak no larger than
Cut Cross-Entropy's, each gradient's error no worse than Liger's, and the memory model
within 5% of the measured extra peak.

    python benchmarks/linear_ce.py            # H200: about 3-4 minutes
    python benchmarks/linear_ce.py --smoke    # CPU, tiny shapes, same code path
    python benchmarks/linear_ce.py --profile  # H200: where memfit's time goes, per kernel (2-3 minutes)
Competitors are optional (pip wheels liger-kernel, cut-cross-entropy); a missing one gives a
"not available" row.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # before Triton is imported: the kernels run through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from memfit.kernels import linear_ce  # noqa: E402
from memfit.kernels.linear_ce import backward_memory, linear_cross_entropy  # noqa: E402
from memfit.measure.kernel_profile import kernel_profile  # noqa: E402
from memfit.measure.results import check_out_dir, target, write_results  # noqa: E402
from memfit.measure.timing import device_ms  # noqa: E402
from memfit.measure.variants import module_settings  # noqa: E402

IGNORE = -100
LOGIT_STD = 0.02 * math.sqrt(2048)  # the logit std of the first shape with weight std 0.02, kept at every shape
# memfit alternatives, each timed as its own row: name -> (linear_cross_entropy keywords, linear_ce knobs)
VARIANTS = {
    "memfit (vocab_chunk=2048)": ({"vocab_chunk": 2048}, {}),
    "memfit (dW by Triton through the index)": ({}, {"DW_MATMUL": "triton"}),
    "memfit (dW by cuBLAS on gathered rows)": ({}, {"DW_MATMUL": "cublas"}),
    "memfit (separate dH accumulator)": ({}, {"HIDDEN_ACC": "separate"}),
    "memfit (steps after the copy in an N x C side buffer)": ({}, {"TAIL_ELEMENTS": 1 << 62}),
}
DEFAULT_WHY = ("vocab chunk: 2048 with a frozen weight (fastest of C = 512/1024/2048 in the H200 run at 39f85a3), "
               "8192 when the weight trains, and the weight-gradient matmul by cuBLAS on a copy of the loss rows "
               "kept in the weight gradient's last rows: from the H200 profile at 88652d2 (linear_ce_profile.json); "
               "the variant rows time the alternatives")
SHAPES = [(8192, 2048), (16384, 3072), (32768, 4096)]
VOCAB = 128256


# ---- methods: each returns loss(hidden, weight, labels) with mean reduction ------------------


def _torch_eager(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE)


def _methods(device: str) -> dict:
    """name -> loss function, or the reason it is not available."""
    methods = {
        "memfit": lambda h, w, y: linear_cross_entropy(h, w, y),
        **{name: (lambda h, w, y, kw=kw: linear_cross_entropy(h, w, y, **kw)) for name, (kw, _) in VARIANTS.items()},
        "torch eager": _torch_eager,
        "torch.compile": torch.compile(_torch_eager, dynamic=False),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="mean")
        methods["liger"] = lambda h, w, y: liger(w, h, y)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        methods["liger"] = f"not available: {type(exc).__name__}: {exc}"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        methods["cut cross-entropy"] = lambda h, w, y: cce(h, w, y, ignore_index=IGNORE, reduction="mean")
    except Exception as exc:  # noqa: BLE001
        methods["cut cross-entropy"] = f"not available: {type(exc).__name__}: {exc}"
    if device != "cuda":  # the competitors' kernels need CUDA
        for name in ("liger", "cut cross-entropy"):
            if callable(methods[name]):
                methods[name] = "not available: needs CUDA"
    return methods


# ---- fp32 reference (independent of memfit: token chunks, logits materialised per chunk) -----


def _reference_fp32(hidden, weight, labels, chunk_tokens):
    """Loss (mean), dH and dW in fp32 with IEEE fp32 matmuls."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        w = weight.float()
        count = (labels != IGNORE).sum().clamp(min=1).float()
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        d_weight = torch.zeros_like(w)
        loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
        for t0 in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[t0:t0 + chunk_tokens].float()
            y = labels[t0:t0 + chunk_tokens]
            logits = h @ w.T
            loss += F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum").double()
            grad = torch.softmax(logits, dim=1)
            valid = y != IGNORE
            grad[valid, y[valid]] -= 1.0
            grad[~valid] = 0.0
            grad /= count
            d_hidden[t0:t0 + chunk_tokens] = grad @ w
            d_weight += grad.T @ h
            del logits, grad
        return (loss / count).float(), d_hidden, d_weight
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _rel(a, b):
    return float((a.float() - b).norm() / b.norm())


# ---- measuring --------------------------------------------------------------------------------


def _extra_peak_mib(fn, device):
    """Peak allocated above what exists before the step (inputs, parameters), in MiB."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _inputs(tokens, hdim, vocab, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(tokens, hdim, generator=gen).to(device, torch.bfloat16)
    weight = (LOGIT_STD / math.sqrt(hdim) * torch.randn(vocab, hdim, generator=gen)).to(device, torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[torch.randperm(tokens, generator=gen)[: tokens // 2]] = IGNORE
    return hidden.requires_grad_(), weight.requires_grad_(), labels.to(device)


def _memory_model(name, tokens, n_loss, hdim, vocab, frozen):
    """The op's own memory model for a memfit row under the current knobs ({} for the others)."""
    if not name.startswith("memfit"):
        return {}
    chunk = VARIANTS.get(name, ({}, {}))[0].get("vocab_chunk")
    model = backward_memory(tokens, n_loss, hdim, vocab, 2, weight_grad=not frozen, vocab_chunk=chunk)
    return {"model_peak_mib": model["peak"] / 2**20, "model_transient_mib": model["transient"] / 2**20,
            "model_side_buffer_mib": model["side_buffer"] / 2**20, "vocab_chunk": model["vocab_chunk"],
            "accumulator": model["accumulator"],
            "knobs": {k: getattr(linear_ce, k) for k in ("DW_MATMUL", "HIDDEN_ACC", "TAIL_ELEMENTS", "COPY_MIN_WIDTH")}}


def _measure(name, loss_fn, hidden, weight, labels, ref, device, frozen=False):
    with module_settings(linear_ce, VARIANTS.get(name, ({}, {}))[1]):
        return _measure_step(name, loss_fn, hidden, weight, labels, ref, device, frozen)


def _measure_step(name, loss_fn, hidden, weight, labels, ref, device, frozen):
    weight.requires_grad_(not frozen)

    def step():
        hidden.grad = None
        weight.grad = None
        loss = loss_fn(hidden, weight, labels)
        loss.backward()
        return loss

    loss = step()  # warm-up: compiles, autotunes
    errors = {"loss_rel_err": _rel(loss.detach(), ref[0]), "dhidden_rel_err": _rel(hidden.grad, ref[1]),
              "dweight_rel_err": None if frozen else _rel(weight.grad, ref[2])}
    hidden.grad = weight.grad = None
    del loss
    gc.collect()
    peak = _extra_peak_mib(step, device)
    hidden.grad = weight.grad = None
    ms = device_ms(step, device)
    hidden.grad = weight.grad = None
    weight.requires_grad_(True)
    model = _memory_model(name, hidden.shape[0], int((labels != IGNORE).sum()), hidden.shape[1], weight.shape[0],
                          frozen)
    return {"method": name, "ms": ms, "extra_peak_mib": peak, **errors, **model}


def run(shapes, vocab, device, out_dir, results_name: str = "linear_ce"):
    ceilings = None
    if device == "cuda":
        from memfit.measure.timing import measure_ceilings

        ceilings = measure_ceilings()
    methods = _methods(device)
    rows, targets = [], []
    for tokens, hdim in shapes:
        hidden, weight, labels = _inputs(tokens, hdim, vocab, device)
        n_loss = int((labels != IGNORE).sum())
        ref = _reference_fp32(hidden.detach(), weight.detach(), labels, chunk_tokens=max(1, 2**31 // (4 * vocab)))
        case = {"tokens": tokens, "loss_tokens": n_loss, "hidden": hdim, "vocab": vocab, "dtype": "bfloat16"}
        if ceilings:
            nvh = n_loss * vocab * hdim
            io = 2 * (2 * vocab * hdim) + 2 * (2 * tokens * hdim)
            case["floor_ms"] = ceilings.floor_ms(8 * nvh, io)
            case["floor_frozen_weight_ms"] = ceilings.floor_ms(6 * nvh, io)
        results = {}
        for name, fn in methods.items():
            if isinstance(fn, str):
                rows.append({**case, "method": name, "status": fn})
                continue
            try:
                results[name] = _measure(name, fn, hidden, weight, labels, ref, device)
                rows.append({**case, **results[name], "status": "ok"})
            except torch.OutOfMemoryError as exc:
                rows.append({**case, "method": name, "status": f"out of memory: {exc}"[:200]})
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append({**case, **_measure("memfit (frozen weight)", methods["memfit"], hidden, weight, labels, ref,
                                        device, frozen=True), "status": "ok"})
        print_rows(rows[-len(methods) - 1:])
        mine, cce, liger = results.get("memfit"), results.get("cut cross-entropy"), results.get("liger")
        tag = f"T={tokens} H={hdim}"
        if mine and cce:
            targets.append(target(f"time vs Cut Cross-Entropy, {tag}", mine["ms"], cce["ms"], "ms", "lower"))
            if mine["extra_peak_mib"] is not None:
                targets.append(target(f"extra peak vs Cut Cross-Entropy, {tag}", mine["extra_peak_mib"],
                                      cce["extra_peak_mib"], "MiB", "lower"))
        if mine and liger:
            for grad in ("dhidden_rel_err", "dweight_rel_err"):
                targets.append(target(f"{grad} vs Liger, {tag}", mine[grad], liger[grad], "relative", "lower"))
        if mine and mine["extra_peak_mib"] is not None:
            err = abs(mine["model_peak_mib"] - mine["extra_peak_mib"]) / mine["extra_peak_mib"]
            targets.append(target(f"memory model error, {tag}", err, 0.05, "relative", "lower"))
        del hidden, weight, labels, ref
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    extra = {"ceilings": None if not ceilings else {"matmul_tflops": ceilings.matmul_flops / 1e12,
                                                    "bandwidth_gbs": ceilings.bandwidth / 1e9},
             "inputs": {"hidden_std": 1.0, "weight_std": f"{LOGIT_STD:.4f} / sqrt(H)"},
             "default_backward": {"vocab_chunk": linear_ce.VOCAB_CHUNK,
                                  "trained_vocab_chunk": linear_ce.TRAINED_VOCAB_CHUNK, "dw_matmul": linear_ce.DW_MATMUL,
                                  "hidden_acc": linear_ce.HIDDEN_ACC, "copy_min_width": linear_ce.COPY_MIN_WIDTH,
                                  "tail_elements": linear_ce.TAIL_ELEMENTS, "why": DEFAULT_WHY,
                                  "variants": {name: {**kw, **knobs} for name, (kw, knobs) in VARIANTS.items()}}}
    path = write_results(results_name, rows, targets, out_dir, **extra)
    _plot(rows, path.with_suffix(".png"))
    return path


# --profile: memfit only, per backward setting: total time and CUDA time per kernel (and per kernel
# and grid, so the shrinking steps near the end of the vocabulary show apart from the full ones)
PROFILE_CASES = [  # (label, linear_cross_entropy keywords, linear_ce knobs)
    ("chunk 2048, per-chunk tiles, dW by Triton", {"vocab_chunk": 2048}, {"STEP_TILES": "per-chunk", "DW_MATMUL": "triton"}),
    ("chunk 8192, dW by Triton", {"vocab_chunk": 8192}, {"DW_MATMUL": "triton"}),
    ("chunk 8192, dW by cuBLAS on a copy in dW (default)", {"vocab_chunk": 8192}, {}),
    ("chunk 8192, dW by cuBLAS on a copy in dW down to 16 columns", {"vocab_chunk": 8192},
     {"DW_MATMUL": "cublas-in-grad", "COPY_MIN_WIDTH": 16}),
    ("chunk 8192, dW by cuBLAS on gathered rows", {"vocab_chunk": 8192}, {"DW_MATMUL": "cublas"}),
]


def profile_run(shapes, vocab, device, out_dir):
    """Per shape and PROFILE_CASES setting: total time, extra peak and per-kernel CUDA time."""
    rows = []
    for tokens, hdim in shapes:
        hidden, weight, labels = _inputs(tokens, hdim, vocab, device)
        n_loss = int((labels != IGNORE).sum())
        for label, kwargs, knobs in PROFILE_CASES:
            def step(kwargs=kwargs, inputs=(hidden, weight, labels)):
                inputs[0].grad = inputs[1].grad = None
                linear_cross_entropy(*inputs, **kwargs).backward()

            with module_settings(linear_ce, knobs):
                step()  # compiles and tunes
                total = device_ms(step, device)
                peak = _extra_peak_mib(step, device)
                kernels, groups, idle = kernel_profile(step, device)
                plan = linear_ce._backward_plan(vocab, hdim, n_loss, kwargs["vocab_chunk"], True,
                                                linear_ce._copy_rows(n_loss, True))[0]
            row = {"tokens": tokens, "loss_tokens": n_loss, "hidden": hdim, "vocab": vocab, "case": label,
                   "knobs": knobs, **kwargs, "ms": total, "extra_peak_mib": peak, "steps": len(plan),
                   "steps_narrower_than_chunk": sum(v1 - v0 < kwargs["vocab_chunk"] for v0, v1, *_ in plan),
                   "steps_with_copy": sum(copied for *_, copied in plan),
                   "gpu_idle": idle, "kernels": kernels, "largest_groups": groups}
            rows.append(row)
            top = ", ".join(f"{k[:24]} {v['ms']:.2f}" for k, v in list(kernels.items())[:4])
            print(f"{tokens:>6} {hdim:>5}  {label:<44} {total:8.2f} ms  steps {row['steps']:>3}  "
                  f"idle {idle['idle_ms']:.2f} of {idle['span_ms']:.2f} ms  {top}", flush=True)
            hidden.grad = weight.grad = None
        del hidden, weight, labels
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    suffix = "" if device == "cuda" else "_smoke"
    return write_results(f"linear_ce_profile{suffix}", rows, [], out_dir)


def print_rows(rows):
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['tokens']:>6} {r['hidden']:>5}  {r['method']:<42} {r['status'][:60]}")
            continue
        peak = "-" if r["extra_peak_mib"] is None else f"{r['extra_peak_mib']:9.0f} MiB"
        dw = "-" if r["dweight_rel_err"] is None else f"{r['dweight_rel_err']:.1e}"
        model = f"  model {r['model_peak_mib']:7.0f} MiB" if "model_peak_mib" in r else ""
        print(f"{r['tokens']:>6} {r['hidden']:>5}  {r['method']:<42} {r['ms']:9.2f} ms {peak}  "
              f"loss {r['loss_rel_err']:.1e} dH {r['dhidden_rel_err']:.1e} dW {dw}{model}")


def _plot(rows, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if r.get("status") == "ok"]
    cases = sorted({(r["tokens"], r["hidden"]) for r in ok})
    names = list(dict.fromkeys(r["method"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        for ax, key in zip(axes, ("ms", "extra_peak_mib")):
            vals = [next((r[key] for r in ok if r["method"] == name and (r["tokens"], r["hidden"]) == c), None)
                    for c in cases]
            xs = [j + i * width for j, v in enumerate(vals) if v is not None]
            ax.bar(xs, [v for v in vals if v is not None], width, label=name)
    floors = [next((r.get("floor_ms") for r in ok if (r["tokens"], r["hidden"]) == c), None) for c in cases]
    for j, f in enumerate(floors):
        if f:
            axes[0].hlines(f, j - 0.1, j + 0.9, colors="k", linestyles="--", label="roofline floor" if j == 0 else None)
    for ax, label in zip(axes, ("forward+backward (ms)", "extra peak memory (MiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"T={t}\nH={h}" for t, h in cases])
        ax.set_ylabel(label)
        if ax.has_data():
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"linear cross-entropy, vocab {ok[0]['vocab'] if ok else '?'}, half the tokens ignored, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--profile", action="store_true",
                        help="memfit only: per-kernel CUDA time of each backward setting (linear_ce_profile.json)")
    args = parser.parse_args()
    check_out_dir(parser, args.out)
    if args.profile:
        if args.smoke:
            path = profile_run([(64, 48)], 1037, "cpu", args.out)
        else:
            path = profile_run(SHAPES, VOCAB, "cuda", args.out)
    elif args.smoke:
        path = run([(64, 48)], 1037, "cpu", args.out, results_name="linear_ce_smoke")        # default: the smoke directory
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/linear_ce.py needs a CUDA GPU (use --smoke on CPU)")
        path = run(SHAPES, VOCAB, "cuda", args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
