"""Regenerate README's performance section from ``benchmarks/results/*.json``.

Every number in that section comes from a results file written by a benchmark run;
nothing is typed. The section lives between two markers in README.md:

    python benchmarks/report.py            # rewrite README.md (a temp file renamed over it)
    python benchmarks/report.py --check    # exit 1 if README.md is out of date, a results file it is
                                           # rendered from is missing, or a target's stored ``met`` is wrong
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

from memfit.files import atomic_path
from memfit.measure.results import recorded_error

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _load(name: str) -> dict | None:
    """The results file ``name``, or None where it is missing (said on stderr: what it would show is left out)."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        print(f"{path.relative_to(ROOT)} is missing: README leaves out what it would show", file=sys.stderr)
        return None
    return json.loads(path.read_text())


def _short(commit: str) -> str:
    """A full sha (a run given MEMFIT_COMMIT's full sha records it; "-dirty" kept) in git's short form; anything else
    as it is."""
    full = re.fullmatch(r"([0-9a-f]{40})(-dirty)?", commit)
    return full[1][:7] + (full[2] or "") if full else commit


def _header(data: dict, command: str) -> str:
    """The section's run: GPU, versions, commit, date and command; a run that stopped before it finished (its file
    says ``"complete": false``: the benchmarks that write as they go) is marked, its missing rows and targets
    otherwise silent."""
    stopped = " **A stopped run: its file is incomplete.**" if data.get("complete") is False else ""
    return (f"_{data['gpu']}, torch {data['torch']}, triton {data['triton']}, commit {_short(data['commit'])}, "
            f"{data.get('date', '')[:10]}; `{command}`_{stopped}\n")


def _all_met(data: dict) -> bool:
    """Whether the file meets every target it sets (a heading says so from this, never typed)."""
    return all(t["met"] for t in data["targets"])


def _targets(data: dict) -> str:
    lines = []
    for t in data["targets"]:
        mark = "met" if t["met"] else "**not met**"
        lines.append(f"- {t['name']}: {t['measured']:.4g} {t['unit']} (target {t['better']} than {t['target']:.4g}) {mark}")
    return "\n".join(lines) + "\n"


def ledger_section(data: dict) -> str:
    rows = [r for r in data["rows"] if recorded_error(r) is not None]
    flag, subtitle = {"ledger_accuracy_blr": (" --blr", ", block-low-rank models"),
                      "ledger_accuracy_loop": (" --loop", ", inference by memfit's decode loop (`memfit generate`)")
                      }.get(data["benchmark"], ("", ""))
    title = "### Memory ledger: predicted vs measured peak" + subtitle
    out = [title + "\n", _header(data, "python benchmarks/ledger_accuracy.py" + flag),
           "| model | task | seq x batch | techniques | predicted GiB | measured GiB | error |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        job, knobs = r["job"], r["knobs"]
        extra = [f"{knobs['blr_method']} {knobs['blr_ratio']:g}" if knobs.get("blr_method") else "",
                 f"ckpt {knobs['checkpoint_layers']}" if knobs["checkpoint_layers"] else "",
                 knobs["optimizer"] if job["task"] != "infer" and knobs["optimizer"] != "adamw" else "",
                 f"micro-batch {knobs['micro_batch']}" if knobs["micro_batch"] != job["batch"] else "",
                 knobs["dtype"] if knobs["dtype"] != "bfloat16" else ""]
        out.append(f"| {job['model']} | {job['task']} | {job['seq']} x {job['batch']} "
                   f"| {', '.join(e for e in extra if e) or '-'} | {r['peak_bytes'] / 2**30:.3f} "
                   f"| {r['measured']['peak_bytes'] / 2**30:.3f} | {100 * recorded_error(r):+.2f}% |")
    return "\n".join(out) + "\n\n" + _targets(data)


def plan_fits_section(data: dict) -> str:
    """The planner's plans run under an allocator capped at their predicted share; and, from the run with torch's
    default allocator, how many of its plans the same cap refused."""
    gib = 2 ** 30
    out = ["### Planner: do the plans fit what they predict?\n",
           _header(data, "python benchmarks/plan_fits.py"),
           "Each plan run as `memfit verify --plan` runs it, the caching allocator capped at the plan's predicted share "
           "(its device total less the predicted CUDA context), both as the ledger of the run's commit predicted them.\n",
           "| model | task | seq x batch | budget | plan | techniques | predicted GiB | cap GiB | result | max reserved GiB "
           "| outside the allocator MiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        case, result = r["case"], r.get("within_prediction", {})
        status = result.get("status", "not run")
        reserved = f"{result['max_reserved_bytes'] / gib:.2f}" if "max_reserved_bytes" in result else "-"
        outside = f"{result['outside_allocator_bytes'] / 2**20:.0f}" if "outside_allocator_bytes" in result else "-"
        cap = f"{r['cap_bytes'] / gib:.2f}" if "cap_bytes" in r else "-"
        out.append(f"| {case['model']} | {case['task']} | {case['seq']} x {case['batch']} | {case['budget']} | {r['pick']} "
                   f"| {', '.join(r['techniques']) or 'as asked'} | {r['predicted']['device_bytes'] / gib:.2f} | {cap} "
                   f"| {status} | {reserved} | {outside} |")
    text = "\n".join(out) + "\n" + ("\n" + _targets(data) if data["targets"] else "")
    default = _load(PLAN_FITS_DEFAULT)
    if default is not None:
        ran = [r for r in default["rows"] if "within_prediction" in r]
        refused = sum(r["within_prediction"]["status"] != "ran" for r in ran)
        held = sum(r.get("within_budget", {}).get("status") == "ran" for r in ran)
        text += (f"\nWith torch's default allocator and the ledger of commit {_short(default['commit'])} (before its "
                 f"allocator slack and context were measured here), {refused} of {len(ran)} plans ran out of memory "
                 "under their cap of then (that ledger's device total less its context), and "
                 f"{held} of those {refused} ran under their budget (`{PLAN_FITS_DEFAULT}.json`).\n")
    return text


def linear_ce_section(data: dict) -> str:
    out = ["### Fused linear cross-entropy (vocab 128256, half the tokens ignored, bf16)\n",
           _header(data, "python benchmarks/linear_ce.py"),
           "| tokens x hidden | method | fwd+bwd ms | extra peak MiB | dH rel. error | dW rel. error |",
           "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if r.get("status") != "ok":
            continue
        dw = f"{r['dweight_rel_err']:.1e}" if r.get("dweight_rel_err") is not None else "-"
        out.append(f"| {r['tokens']} x {r['hidden']} | {r['method']} | {r['ms']:.1f} | {r['extra_peak_mib']:.0f} "
                   f"| {r['dhidden_rel_err']:.1e} | {dw} |")
    return "\n".join(out) + "\n\n" + _targets(data)


def attention_section(data: dict) -> str:
    out = ["### Attention forward+backward TFLOP/s (16K tokens per batch, 32 heads, head dim 128, bf16)\n",
           _header(data, "python benchmarks/attention.py"),
           "| impl | " + " | ".join(f"{n} {'causal' if c else 'full'}" for n in (1024, 4096, 16384)
                                   for c in (False, True)) + " |",
           "|---|" + "---|" * 6]
    impls = sorted({r["impl"] for r in data["rows"]})
    for impl in impls:
        cells = []
        for n in (1024, 4096, 16384):
            for causal in (False, True):
                row = next((r for r in data["rows"] if r["impl"] == impl and r["seq"] == n and r["causal"] == causal
                            and r.get("fwd_bwd_tflops")), None)
                cells.append(f"{row['fwd_bwd_tflops']:.0f}" if row else "-")
        out.append(f"| {impl} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\n" + _targets(data) + "\nThe contention study: `benchmarks/attention_study.md`.\n"


def finetune_section(data: dict, command: str = "python benchmarks/finetune_memory.py",
                     title: str = "LoRA fine-tuning peak memory, Llama-3.2-3B shape, batch 1 (GB)") -> str:
    out = [f"### {title}\n", _header(data, command)]
    for dtype in sorted({r["dtype"] for r in data["rows"]}):
        rows = [r for r in data["rows"] if r["dtype"] == dtype]
        contexts = sorted({r["context"] for r in rows})
        out += [f"\n{dtype.replace('torch.', '')}: total peak (peak above the frozen base weights)\n",
                "| configuration | " + " | ".join(str(c) for c in contexts) + " |", "|---|" + "---|" * len(contexts)]
        for name in dict.fromkeys(r["row"] for r in rows):
            cells = []
            for c in contexts:
                r = next((r for r in rows if r["row"] == name and r["context"] == c), None)
                if r is None or not isinstance(r.get("peak_gb"), (int, float)):
                    cells.append(str(r.get("peak_gb", "-")) if r else "-")
                else:
                    cells.append(f"{r['peak_gb']:.2f} ({r['peak_above_frozen_weights_gb']:.2f})")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\n" + _targets(data)


def finetune_ledger_section(data: dict, command: str = "python benchmarks/finetune_ledger.py",
                            title: str = "The ledger on the fine-tuning table (predicted vs measured above)") -> str:
    src = data.get("measured_in", {})
    out = [f"### {title}\n",
           f"_prediction: `{command}` at commit {data['commit']}; measured: "
           f"{src.get('gpu', '?')}, commit {src.get('commit', '?')}_\n",
           "| dtype | configuration | " + " | ".join(str(c) for c in sorted({r["context"] for r in data["rows"]})) + " |"]
    contexts = sorted({r["context"] for r in data["rows"]})
    out.append("|---|---|" + "---|" * len(contexts))
    for dtype in sorted({r["dtype"] for r in data["rows"]}):
        for name in dict.fromkeys(r["row"] for r in data["rows"] if r["dtype"] == dtype):
            cells = []
            for c in contexts:
                r = next((r for r in data["rows"] if r["dtype"] == dtype and r["row"] == name and r["context"] == c),
                         None)
                cells.append(f"{100 * r['error']:+.1f}%" if r else "-")
            out.append(f"| {dtype} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\n" + _targets(data)


def partial_ffn_section(data: dict) -> str:
    out = ["### Partial-load / partial-compute decode, Llama-3.2-3B shape, fp16, batch 1\n",
           _header(data, "python benchmarks/partial_ffn.py"),
           "| case | tokens/s | ms/token | weight-read floor ms | fraction of floor | peak GB |",
           "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if r.get("decode_tokens_per_s") is None:
            continue
        floor = f"{r['floor_ms']:.2f}" if r.get("floor_ms") else "-"
        fraction = f"{r['fraction_of_floor']:.2f}" if r.get("fraction_of_floor") else "-"
        ms = f"{r['decode_ms_per_token']:.2f}" if r.get("decode_ms_per_token") else "-"
        out.append(f"| {r['case']} | {r['decode_tokens_per_s']:.0f} | {ms} | {floor} | {fraction} "
                   f"| {r['peak_bytes'] / 1e9:.2f} |")
    return "\n".join(out) + "\n\n" + _targets(data) + _partial_speedup_bound(data["rows"])


def _partial_speedup_bound(rows: list[dict], wanted: float = 1.5) -> str:
    """Least-squares fit ms/token = a * floor + F over the fused decode-kernel cases (one loop, several
    weight-byte counts), and what the fixed part F would have to be for partial / dense >= ``wanted``."""
    same_loop = [r for r in rows if r.get("decode_kernels") and r.get("floor_ms") and r.get("fused_layers")
                 and r["fused_layers"] == r.get("layers")]
    dense = next((r for r in same_loop if r["case"] == "dense fp16"), None)
    partial = next((r for r in same_loop if r["case"] == "partial fp16 (gamma 0.7, phi 0.4)"), None)
    if len(same_loop) < 3 or dense is None or partial is None:
        return ""
    xs, ys = [r["floor_ms"] for r in same_loop], [r["decode_ms_per_token"] for r in same_loop]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - a * mx
    fd, fp = dense["floor_ms"], partial["floor_ms"]
    needed = a * (fd - wanted * fp) / (wanted - 1)
    return (f"\nThe {len(same_loop)} cases through the fused loop fit ms/token = {a:.3f} x floor + {fixed:.3f} ms "
            f"(least squares). For partial to reach {wanted}x dense, the fixed part would have to be at most "
            f"{needed:.3f} ms; with no fixed part at all the weight bytes cap the ratio at {fd / fp:.3f}x.\n")


def blr_generate_section(data: dict) -> str:
    """``memfit generate``'s loop on dense and compressed models (``benchmarks/blr_generate.py``)."""
    model = next((r["model"] for r in data["rows"] if r.get("model")), "?")
    out = [f"### Block-low-rank decode in memfit's own loop (`memfit generate`), {model} shape, bf16, batch 1\n",
           _header(data, "python benchmarks/blr_generate.py"),
           "| case | tokens/s | x dense | ms/token | weight-read floor ms | fraction of floor | fused layers | peak GB |",
           "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if not r.get("available"):
            out.append(f"| {r['case']} | {r.get('error') or r.get('reason')} | | | | | | |")
            continue
        speedup = f"{r['speedup_vs_dense']:.3f}" if "speedup_vs_dense" in r else "-"
        peak = f"{r['peak_bytes'] / 1e9:.2f}" if r.get("peak_bytes") is not None else "-"
        out.append(f"| {r['case']} | {r['decode_tokens_per_s']:.0f} | {speedup} | {r['decode_ms_per_token']:.3f} "
                   f"| {r['floor_ms']:.3f} | {r['fraction_of_floor']:.2f} | {r['fused_layers']} of {r['layers']} "
                   f"| {peak} |")
    return "\n".join(out) + ("\n\nx dense: against the first (fused) dense row. Each row's floor is its own weight "
                             "bytes per token at the measured copy bandwidth (the compressed rows keep k/v, the "
                             "embedding and the head dense). Memory is counted from before the load.\n\n")


def partial_ffn_accuracy_section(data: dict) -> str:
    rows = [r for r in data["rows"] if r.get("case") == "accuracy" and r.get("perplexity") is not None]
    out = ["### Partial FFN accuracy: the small byte-level Llama of `benchmarks/train_small_model.py`\n",
           _header(data, "python benchmarks/partial_ffn.py --skip-speed --small-model DIR"),
           "| gamma (loaded) | phi (computed) | every layer partial | perplexity | next-token agreement with dense |",
           "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['gamma']} | {r['phi_effective']} | {'yes' if r['compute_all_layers'] else 'no'} "
                   f"| {r['perplexity']:.2f} | {r['next_token_agreement']:.3f} |")
    return "\n".join(out) + "\n"


def blr_layers_section(data: dict) -> str:
    """Per shape and N: dense and each structure's default path (what a user gets), in microseconds and x floor."""
    kinds = ("dense_eager", "lowrank_ours", "monarch_ours", "blast_ours")
    cells = {}
    for r in data["rows"]:
        if r.get("impl") in kinds and r.get("ms") is not None:
            cells[(r["shape"], r["n"], r["impl"])] = r
    keys = sorted({(shape, n) for shape, n, _ in cells}, key=lambda k: (list(dict.fromkeys(
        r["shape"] for r in data["rows"])).index(k[0]), k[1]))
    blocks = f", b = {data['blocks']}" if "blocks" in data else ""
    out = [f"### Block-low-rank layer kernels, bf16{blocks}"
           + ("" if _all_met(data) else " (work in progress: targets not met)") + "\n",
           _header(data, "python benchmarks/blr_layers.py"),
           "us per call, and in brackets the ratio to that structure's roofline floor.\n",
           "| shape | N | dense cuBLAS | low-rank | Monarch | BLAST |", "|---|---|---|---|---|---|"]
    for shape, n in keys:
        row = [f"{1e3 * c['ms']:.0f} ({c['x_floor']:.1f}x)" if (c := cells.get((shape, n, k))) else "-" for k in kinds]
        out.append(f"| {shape} | {n} | " + " | ".join(row) + " |")
    profile = _load(BLR_PROFILE)
    profiled = len({(r["shape"], r["n"]) for r in profile["rows"]}) if profile else 0
    plotted = (RESULTS / "blr_layers_roofline.png").exists()   # f969028's stopped run drew none (drawn at the end then)
    return ("\n".join(out) + "\n\n" + _decode_floor_note(data) + _pick_note(data) + _targets(data)
            + "\nEvery variant's row" + (", and the roofline plot" if plotted else "")
            + ": `benchmarks/results/blr_layers.json`" + (", `blr_layers_roofline.png`" if plotted else "")
            + f"; each pipeline split into its kernels at {profiled} of these cases "
              f"(commit {profile['commit'] if profile else '-'}): `blr_layers_profile.json` (`--profile-only`).\n")


def _decode_floor_note(data: dict) -> str:
    """Which decode-sized 2x-floor targets sit below one empty kernel's time (no kernel can meet those)."""
    empty = data.get("ceilings", {}).get("empty_kernel_ms")
    checks = data.get("decode_floor_check") or []
    if not empty or not checks:
        return ""
    out_of_reach = sorted({f"{c['structure']} {c['shape']} N={c['n']}" for c in checks if not c["reachable"]})
    where = ", ".join(out_of_reach) if out_of_reach else "none of the decode cases"
    return (f"One empty kernel, replayed back to back in a CUDA graph as these layers are timed, takes "
            f"{1e3 * empty:.2f} us. Twice the floor is below that for {where}: no kernel can meet the "
            "N <= 16 target there.\n\n")


EARLY_PICK_SLACK = 1.02  # blr_layers' PICK_SLACK in every file written before the table recorded it (dbc9619)


def _pick_note(data: dict) -> str:
    """Where the variant pick (the "ours" rows) read over the file's pick slack slower than the fastest pipeline it
    chooses among."""
    if "pick_check" not in data:                       # a file written before the table recorded it
        return ""
    slack = data.get("pick_slack", EARLY_PICK_SLACK)
    misses = [f"{c['structure']} {c['shape']} N={c['n']} ({c['ratio']:.3f}x {c['fastest']})" for c in data["pick_check"]]
    return (f"The pick read over {slack - 1:.0%} slower than the fastest pipeline of its structure at "
            f"{', '.join(misses) if misses else 'no case'}.\n\n")


def blr_e2e_section(data: dict) -> str:
    memfit_attention = data.get("attention") == "memfit"
    methods = [r["model"] for r in data["rows"] if r["mode"] == "compiled" and r["model"] not in ("dense", "free")]
    command = ("python benchmarks/blr_e2e.py" + (" --attention memfit" if memfit_attention else "")
               + ("" if not methods or sorted(methods) == ["blast", "monarch"] else f" --methods {','.join(methods)}")
               + (" --inductor-pdl" if data.get("inductor_pdl") else "")
               + (" --decode-gemv" if data.get("decode_gemv") else ""))
    attention = "memfit's attention" if memfit_attention else "transformers' SDPA attention"
    compiler = (", compiled with inductor's PDL" if data.get("inductor_pdl") else "") + \
        (", linear layers by memfit's decode GEMV pick" if data.get("decode_gemv") else "")
    queued = any(f"{step}_gpu_{field}" in r for r in data["rows"] for step in ("prefill", "decode")
                 for field in ("ms", "error"))
    gpu_only = " prefill / decode GPU only ms (host's ms to issue it) |" if queued else ""
    lengths = {r.get("prefill_tokens") for r in data["rows"]}
    prefill = f"prefill {lengths.pop()} tokens" if len(lengths) == 1 and None not in lengths else "prefill"
    out = [f"### Block-low-rank end to end, {data.get('model', '?')} shape, bf16, batch 1, {attention}{compiler}"
           + ("" if _all_met(data) else " (targets not met)") + "\n", _header(data, command),
           f"| model | mode | {prefill} ms (floor) | decode ms/token (floor) | decode tokens/s |{gpu_only} "
           "graph breaks |", "|---|---|---|---|---|---|" + ("---|" if queued else "")]
    for r in data["rows"]:
        gpu_cell = (" " + " / ".join(f"{r[f'{step}_gpu_ms']:.{places}f} ({r[f'{step}_host_ms']:.{places}f})"
                                     if f"{step}_gpu_ms" in r else "-" for step, places in (("prefill", 2), ("decode", 3)))
                    + " |" if queued else "")
        out.append(f"| {r['model']} | {r['mode']} | {r['prefill_ms']:.2f} ({r['prefill_floor_ms']:.2f}) "
                   f"| {r['decode_ms']:.3f} ({r['decode_floor_ms']:.3f}) | {r['decode_tokens_per_s']:.0f} |{gpu_cell}"
                   f" {r.get('graph_breaks', 'not recorded') if r['mode'] == 'compiled' else '-'} |")
    errors = [f"{r['model']} {r['mode']} {step}: {r[f'{step}_gpu_error']}" for r in data["rows"]
              for step in ("prefill", "decode") if f"{step}_gpu_error" in r]
    note = ("\nGPU only: the step's calls queued behind a sleep kernel, so the GPU never waits for the host "
            "(`memfit.measure.timing.queued_ms`); the first columns time each call as a caller gets it, and the "
            "targets below compare those. Where the host takes longer to issue a step than the GPU takes to run it, "
            "the two part. The queued calls run without the L2 flush between calls, so they need not be the faster."
            + "".join(f" No GPU-only time for {error}." for error in errors) + "\n" if queued else "")
    return "\n".join(out) + "\n" + note + "\n" + _blr_e2e_bound(data) + _blr_e2e_profile(data) + _targets(data)


def _blr_e2e_bound(data: dict) -> str:
    """The ``free`` row: the dense model with the compressed layers at no cost, the most BLR could gain;
    and the speedup if each compressed layer instead ran at its roofline floor, the rest as measured."""
    compiled = {r["model"]: r for r in data["rows"] if r["mode"] == "compiled"}
    free, dense = compiled.get("free"), compiled.get("dense")
    if free is None or dense is None or "prefill_speedup" not in free:
        return ""
    gpu = "_gpu" if all(f"{step}_gpu_ms" in row for step in ("prefill", "decode") for row in (free, dense)) else ""
    text = (f"`free` is the dense model with every layer the BLR models compress replaced by one that costs "
            f"nothing: the most any BLR kernel could speed these steps up is {free[f'prefill{gpu}_speedup']:.2f}x in "
            f"prefill and {free[f'decode{gpu}_speedup']:.2f}x in decode (dense / free, same run"
            + (", GPU only" if gpu else "") + ").")
    at_floor = []
    for name, row in compiled.items():
        if name in ("dense", "free") or row.get("prefill_floor_ms") is None:
            continue
        speedups = [dense[f"{step}{gpu}_ms"] / (free[f"{step}{gpu}_ms"] + row[f"{step}_floor_ms"]
                                                  - free[f"{step}_floor_ms"])
                    for step in ("prefill", "decode")]
        at_floor.append(f"{name} {speedups[0]:.3f}x and {speedups[1]:.3f}x")
    if at_floor:
        text += (" With the rest of each step as `free` measured it" + (" (GPU only)" if gpu else "")
                 + " and every compressed layer at its roofline floor (the model's floor minus free's), prefill and "
                 "decode would be at most: "
                 + "; ".join(at_floor) + " dense.")
    return text + "\n\n"


def _blr_e2e_profile(data: dict) -> str:
    """Where each compiled step's GPU time goes (``--profile``): BLR kernels, cuBLAS, attention, the rest, idle."""
    profiled = [r for r in data["rows"] if r.get("prefill_profile")]
    if not profiled:
        return ""
    kinds = ("blr", "matmul", "attention", "other")
    gemv = (" (here also memfit's GEMV kernel, which the BLR pipelines' GEMV stages run too: the dense layers, k/v "
            "and the head count here wherever the decode pick took it)"
            if data.get("decode_gemv") else "")
    cublas = ("what the pick left to cuBLAS" if data.get("decode_gemv") else "dense layers, k/v, the head") + \
        ", and the BLR pipelines' cuBLAS stages"
    out = [f"GPU ms per step by kernel kind, from one profiled replay (`--profile`): memfit's BLR kernels{gemv}, "
           f"cuBLAS matmuls ({cublas}), attention "
           "(with its mask), everything else, and the GPU's idle time between kernels.\n",
           "| model | mode | step | BLR | cuBLAS | attention | other | idle |", "|---|---|---|---|---|---|---|---|"]
    for r in profiled:
        for step in ("prefill", "decode"):
            prof = r[f"{step}_profile"]
            cells = " | ".join(f"{prof['ms_by_kind'].get(k, 0.0):.3f}" for k in kinds)
            out.append(f"| {r['model']} | {r['mode']} | {step} | {cells} | {prof['idle_ms']:.3f} |")
    return "\n".join(out) + "\n\n"


def blr_accuracy_section(data: dict) -> str:
    settings = data.get("settings", {})
    info = data.get("model_train_info") or {}
    run = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items()
                   if k in ("ratio", "blocks", "blast_steps", "recovery_steps", "recovery_lr", "batch", "seq",
                            "calib_samples", "validate_every"))
    out = ["### Block-low-rank accuracy: the small byte-level Llama compressed to half its linear parameters\n",
           _header(data, f"python benchmarks/blr_accuracy.py --model DIR {run}"),
           f"Model: {info.get('params', '?')} parameters, {info.get('steps', '?')} training steps "
           f"({info.get('tokens', '?')} tokens) on {settings.get('device', '?')}"
           + (f", kept at step {info['best_step']} (best dev perplexity); perplexity in bytes on the held-out "
              "test half, recovery fine-tunes also stopped at their best dev step.\n" if "best_step" in info
              else "; validation perplexity in bytes.\n"),
           "| method | projection | linear params kept | perplexity after projection | after recovery | "
           "recovery step kept | mean layer output error |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        err = f"{r['mean_output_error']:.3f}" if r.get("mean_output_error") is not None else "-"
        kept = r.get("recovery_best_step")
        out.append(f"| {r['method']} | {r['projection'] or '-'} | {r['linear_ratio']:.3f} | {r['ppl_projected']:.3f} "
                   f"| {r['ppl_recovered']:.3f} | {'-' if kept is None else kept} | {err} |")
    findings = "".join(f"- {f}\n" for f in data.get("findings", []))
    return "\n".join(out) + "\n\n" + findings + "\n" + _targets(data)


def swiglu_section(data: dict) -> str:
    """Per case: each way's time per step, then (files from 2f772b1 on) its GPU and host times with the steps queued,
    and the fused op's host time through its two custom ops."""
    queued = all("fused_gpu_ms" in r for r in data["rows"])
    step_floor = all(r.get("step_floor_ms") for r in data["rows"])
    columns = ["dtype", "tokens x width", "unfused ms", "fused ms", "op floor ms"]
    columns += ["step floor ms"] if step_floor else []
    if queued:
        columns += ["GPU ms, queued: unfused / fused", "host ms, queued: unfused / fused / through the custom ops"]
    out = ["### Fused SwiGLU against the unfused pair, forward + backward\n", _header(data, "python benchmarks/swiglu.py"),
           "| " + " | ".join(columns + ["peak above inputs, unfused -> fused (MiB)"]) + " |",
           "|" + "---|" * (len(columns) + 1)]
    for r in data["rows"]:
        floor = f"{r['floor_ms']:.3f}" if r.get("floor_ms") else "-"
        cells = [r["dtype"].removeprefix("torch."), f"{r['tokens']} x {r['width']}", f"{r['unfused_ms']:.3f}",
                 f"{r['fused_ms']:.3f}", floor] + ([f"{r['step_floor_ms']:.3f}"] if step_floor else [])
        if queued:
            cells += [f"{r['unfused_gpu_ms']:.3f} / {r['fused_gpu_ms']:.3f}",
                      f"{r['unfused_host_ms']:.3f} / {r['fused_host_ms']:.3f} / {r['fused_custom_ops_host_ms']:.3f}"]
        cells.append(f"{r['unfused_peak_bytes'] / 2**20:.0f} -> {r['fused_peak_bytes'] / 2**20:.0f}")
        out.append("| " + " | ".join(cells) + " |")
    floors = ("The op floor is the op's 8 tensor passes at the copy bandwidth measured in the run; the timed step "
              "makes 12 more around it (two clones, two multiplies by 1 and their backward), which "
              + ("the step floor counts." if step_floor else "this file's floor leaves out (files from ba395f5 on "
                 "record a step floor with them)."))
    return "\n".join(out) + "\n\n" + floors + "\n\n" + _targets(data)


def swiglu_step_section(data: dict) -> str:
    """The 8-bit AdamW row against the same with the fused SwiGLU, each on a model of its own: peak and median step."""
    out = ["### Fused SwiGLU in a fine-tuning step: the two rows beyond the paper, median of repeated steps\n",
           _header(data, f"python benchmarks/finetune_memory.py --rows 'beyond the paper' --repeats {REPEATS}"),
           "| dtype | context | peak above frozen weights, 8-bit AdamW -> + fused SwiGLU (GB) | step ms, 8-bit AdamW | "
           "step ms, + fused SwiGLU | time ratio |", "|---|---|---|---|---|---|"]
    for dtype in dict.fromkeys(r["dtype"] for r in data["rows"]):
        for context in sorted({r["context"] for r in data["rows"] if r["dtype"] == dtype}):
            pair = [next((r for r in data["rows"] if r["dtype"] == dtype and r["context"] == context
                          and r.get("fused_swiglu") == fused and "step_ms" in r), None) for fused in (False, True)]
            if None in pair:
                continue
            plain, fused = pair
            out.append(f"| {dtype.removeprefix('torch.')} | {context} | {plain['peak_above_frozen_weights_gb']:.3f} -> "
                       f"{fused['peak_above_frozen_weights_gb']:.3f} | {plain['step_ms']:.0f} | {fused['step_ms']:.0f} | "
                       f"{fused['step_ms'] / plain['step_ms']:.3f}x |")
    return "\n".join(out) + "\n\n" + _targets(data)


REPEATS = 5
PLAN_FITS_DEFAULT = "plan_fits_expandable_segments_false"   # plan_fits' section adds a paragraph from it
BLR_PROFILE = "blr_layers_profile"                           # blr_layers' section names its profiled cases
SWIGLU_STEPS = f"finetune_memory_rows_beyond_the_paper_repeats{REPEATS}"
SWIGLU_ROWS = "finetune_memory_bfloat16_rows_fused_SwiGLU"
SECTIONS = [("ledger_accuracy", ledger_section), ("ledger_accuracy_blr", ledger_section),
            ("ledger_accuracy_loop", ledger_section), ("plan_fits", plan_fits_section),
            ("linear_ce", linear_ce_section), ("attention", attention_section),
            ("finetune_memory", finetune_section), ("finetune_ledger", finetune_ledger_section),
            (SWIGLU_ROWS, functools.partial(
                finetune_section, command="python benchmarks/finetune_memory.py --dtypes bfloat16 --rows 'fused SwiGLU'",
                title="The bf16 fused-SwiGLU row, on a model of its own (GB)")),
            ("finetune_ledger" + SWIGLU_ROWS.removeprefix("finetune_memory"), functools.partial(
                finetune_ledger_section,
                command=f"python benchmarks/finetune_ledger.py --measured benchmarks/results/{SWIGLU_ROWS}.json",
                title="The ledger on that row")),
            ("swiglu", swiglu_section), (SWIGLU_STEPS, swiglu_step_section),
            ("finetune_ledger" + SWIGLU_STEPS.removeprefix("finetune_memory"), functools.partial(
                finetune_ledger_section,
                command=f"python benchmarks/finetune_ledger.py --measured benchmarks/results/{SWIGLU_STEPS}.json",
                title="The ledger on those two rows")),
            ("partial_ffn", partial_ffn_section), ("partial_ffn_accuracy", partial_ffn_accuracy_section),
            ("blr_layers", blr_layers_section), ("blr_e2e", blr_e2e_section),
            ("blr_e2e_memfit_attention", blr_e2e_section), ("blr_e2e_memfit_attention_inductor_pdl", blr_e2e_section),
            ("blr_e2e_memfit_attention_decode_gemv", blr_e2e_section), ("blr_generate", blr_generate_section),
            ("blr_accuracy", blr_accuracy_section)]


def results_read() -> list[str]:
    """Every results file README's section is rendered from: each section's own, and the two that add to one."""
    return [name for name, _ in SECTIONS] + [PLAN_FITS_DEFAULT, BLR_PROFILE]


def results_problems() -> list[str]:
    """Why the results files cannot stand behind README's section, one line each, naming the file: one it is
    rendered from that is missing (rendering would just leave it out), or a target whose stored ``met`` is not
    what its measured value, target and direction make it (the section prints the stored flag)."""
    from memfit.measure.results import target  # imports torch: only --check pays for it

    problems = []
    for name in results_read():
        path = RESULTS / f"{name}.json"
        if not path.exists():
            problems.append(f"{path.relative_to(ROOT)}: missing")
            continue
        for t in json.loads(path.read_text())["targets"]:
            met = target(t["name"], t["measured"], t["target"], t["unit"], t["better"])["met"]
            if met != t["met"]:
                problems.append(f"{path.relative_to(ROOT)}: target {t['name']!r} stored met {t['met']}, but "
                                f"{t['measured']:.4g} {t['unit']} against {t['better']} than {t['target']:.4g} is "
                                f"met {met}")
    return problems


def render() -> str:
    parts = [START, "", "Generated by `python benchmarks/report.py` from `benchmarks/results/`; do not edit by hand.", ""]
    for name, section in SECTIONS:
        data = _load(name)
        if data is not None:
            parts.append(section(data))
    parts.append(END)
    return "\n".join(parts)


def _rendered(readme: str) -> str:
    """README's text with the section between the markers rendered anew."""
    return readme[:readme.index(START)] + render() + readme[readme.index(END) + len(END):]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if README.md's section is out of date, a results file it reads is missing, or a "
                        "target's stored met is wrong")
    args = parser.parse_args(argv)
    readme = ROOT / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        print(f"README.md lacks the markers {START} ... {END}", file=sys.stderr)
        return 2
    if args.check:
        problems = results_problems() or ([] if _rendered(text) == text else
                                          ["README.md: its performance section is out of date; run "
                                           "python benchmarks/report.py"])
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    with atomic_path(readme) as tmp:
        tmp.write_text(_rendered(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
