"""Probe: what is live at the memory peak while memfit's decode loop (``Generator``) is built for a Monarch
Llama-3.2-1B (paper ranks, bf16, on a GPU): CUDA's allocation history from the Generator's start, replayed to its
peak, the live blocks grouped by their innermost memfit frames. Found the tile timings' L2 flush copying its buffer
to int64 (``autotune.l2_flush``). Writes OUT/peak.json:

    OUT=/some/dir python benchmarks/probes/generator_peak.py
"""
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

OUT = Path(os.environ.get("OUT", "/tmp"))


def live_at_peak(trace):
    """Replay alloc / free_requested events: (peak bytes, index, live blocks at the peak)."""
    live, total, peak, peak_i = {}, 0, -1, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e; total += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > peak:
            peak, peak_i = total, i
    live = {}
    for e in trace[:peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    return peak, peak_i, list(live.values())


def where(e, depth=7):
    frames = [f for f in e.get("frames", []) if "memfit" in f["filename"] or "probe" in f["filename"]]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:depth])


def summarize(trace, top=12):
    peak, i, blocks = live_at_peak(trace)
    groups = defaultdict(lambda: [0, 0])
    for b in blocks:
        g = groups[where(b)]; g[0] += b["size"]; g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_GB": peak / 1e9, "event": i, "events": len(trace),
            "groups": [{"GB": v[0] / 1e9, "blocks": v[1], "where": k} for k, v in rows]}


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from memfit.compress import PAPER_RANKS_LLAMA_1B, structure_model
    from memfit.infer.generate import Generator
    from memfit.models import PRESETS, build_model
    t0 = time.time()
    torch.manual_seed(0)
    model = build_model(PRESETS["llama-3.2-1b"], dtype="bfloat16", device="cpu")
    structure_model(model, "monarch", ratio=None, blocks=16, ranks=PAPER_RANKS_LLAMA_1B)
    model = model.to("cuda").eval()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    print("built", time.time() - t0, base / 1e9, flush=True)
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    gen = Generator(model, 384)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    out = {"resident_GB": base / 1e9, "peak_above_GB": (torch.cuda.max_memory_allocated() - base) / 1e9,
           "generator_s": time.time() - t0, "matmul_paths": gen.matmul_paths}
    print(json.dumps(out), flush=True)
    (OUT / "peak.json").write_text(json.dumps(out, indent=1))
    trace = [e for dev in snap["device_traces"] for e in dev]
    out["trace"] = summarize(trace)
    (OUT / "peak.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out["trace"], indent=1))


if __name__ == "__main__":
    main()
