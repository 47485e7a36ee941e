"""Where a step's GPU time goes: per-kernel totals and the GPU's idle gaps, from ``torch.profiler``.

Benchmarks call :func:`kernel_profile` to explain a timing (``benchmarks/linear_ce.py
--profile``, ``benchmarks/decode_profile.py``). On a CPU it profiles operators instead, so
the same code path runs in a smoke test. :func:`host_profile` gives the other side of a step:
where the host's time goes (``benchmarks/finetune_steps.py --profile``), for host-bound steps.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_profile(step, device: str, name_chars: int = 160, groups: int = 12, gaps: int = 8
                   ) -> tuple[dict, list, dict]:
    """Profile one ``step()``. Returns

    * per name (cut to ``name_chars``), longest first: ``{"ms", "launches"}`` of every kernel,
      copy and memset (CPU: every operator);
    * the ``groups`` largest (name, grid) groups, so launches of one kernel at different grid
      sizes (e.g. narrow and wide steps) show apart;
    * the GPU's idle time inside the step: ``span_ms``, ``idle_ms``, the gap count and the
      ``gaps`` longest gaps with the activity before and after each."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    kinds = GPU_CATEGORIES if device == "cuda" else ("cpu_op",)
    timed = [ev for ev in events if ev.get("cat") in kinds and "dur" in ev]
    by_name, by_grid = {}, {}
    for ev in timed:
        name = ev["name"][:name_chars]
        entry = by_name.setdefault(name, {"ms": 0.0, "launches": 0})
        entry["ms"] += ev["dur"] / 1e3
        entry["launches"] += 1
        grid = tuple(ev.get("args", {}).get("grid", ()))
        group = by_grid.setdefault((name, grid), {"name": name, "grid": list(grid), "ms": 0.0, "launches": 0})
        group["ms"] += ev["dur"] / 1e3
        group["launches"] += 1
    found, end, prev = [], None, None
    for start, stop, name in sorted((ev["ts"], ev["ts"] + ev["dur"], ev["name"][:40]) for ev in timed):
        if end is not None and start > end:
            found.append({"us": start - end, "after": prev, "before": name})
        if end is None or stop > end:
            end, prev = stop, name
    first = min((ev["ts"] for ev in timed), default=0.0)
    idle = {"span_ms": (end - first) / 1e3 if timed else 0.0, "idle_ms": sum(g["us"] for g in found) / 1e3,
            "gaps": len(found), "longest": sorted(found, key=lambda g: -g["us"])[:gaps]}
    return (dict(sorted(by_name.items(), key=lambda kv: -kv[1]["ms"])),
            sorted(by_grid.values(), key=lambda g: -g["ms"])[:groups], idle)


def host_profile(step, top: int = 15) -> list[dict]:
    """One ``step()`` under torch.profiler (CPU and CUDA activity): the ``top`` operators and CUDA runtime calls by
    host time spent in themselves (a synchronisation's wait is there, under its runtime call)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
    ranked = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"name": e.key, "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ranked]
