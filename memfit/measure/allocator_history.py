"""What is live at a CUDA step's peak, read off the caching allocator's recorded history.

``torch.cuda.memory._record_memory_history`` keeps every allocation and free with the Python frames that made it;
:func:`live_at_peak` replays them to the moment of the largest live total and :func:`sites_at_peak` groups the
blocks live then by where they were allocated. Diagnostics for the ledger (``benchmarks/ledger_snapshot.py``,
``benchmarks/finetune_steps.py``): they say which tensors make a measured peak, where ``max_memory_allocated``
gives only its size.
"""
from __future__ import annotations

from collections import Counter

MIB = 2**20


def live_at_peak(snapshot: dict, since: int = 0) -> tuple[int, list[dict]]:
    """Replay the alloc/free events of the first device's trace; return the peak total and the blocks live then.
    Blocks allocated before recording began are not in the trace: the total counts what the recorded span added.
    ``since``: the index of the first event the peak may be at (:func:`first_alloc_in`), so that a span's later part
    (a measured step after its warm-up) is read with the blocks earlier events left live.

    A block stops counting at its ``free_requested``, where the caching allocator takes it off ``allocated_bytes``
    (the total ``max_memory_allocated`` peaks): a block used on another stream (``record_stream``, as the offload
    path's copies are) reaches ``free_completed`` only once that stream's work is done, and counting it until then
    had put the replayed peak above the allocator's on offload jobs."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for index, event in enumerate(snapshot["device_traces"][0]):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak and index >= since:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, at_peak


def first_alloc_in(snapshot: dict, function: str) -> int:
    """The index of the first allocation the Python function named ``function`` made in the first device's trace: a
    marker a caller allocates when a phase begins. A ValueError where there is none."""
    for index, event in enumerate(snapshot["device_traces"][0]):
        if event["action"] == "alloc" and any(f["name"] == function for f in event.get("frames", [])):
            return index
    raise ValueError(f"no allocation by {function} in the trace")


def where(event: dict, frames: int = 3) -> str:
    """The innermost ``frames`` Python frames of the code that allocated ``event``'s block, torch's own utilities
    and CUDA wrappers left out (a backward's allocations name only the ``backward()`` call: autograd runs in C++)."""
    kept = [f for f in event.get("frames", []) if f["filename"].endswith(".py")
            and "torch/utils" not in f["filename"] and "torch/cuda" not in f["filename"]]
    return " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in kept[:frames])


def live_at_end(snapshot: dict) -> list[dict]:
    """The blocks the recorded span allocated that are still live when it ends."""
    live: dict[int, dict] = {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    return list(live.values())


def group_sites(blocks: list[dict], top: int = 25) -> list[dict]:
    """Largest first, the ``top`` (allocation site, block size) groups of ``blocks``: ``{"site", "block_mib",
    "count", "mib"}``. Grouping by size too keeps apart tensors of different shapes made at one line."""
    groups = Counter((where(block), block["size"]) for block in blocks)
    ranked = sorted(groups.items(), key=lambda item: -item[0][1] * item[1])[:top]
    return [{"site": site, "block_mib": size / MIB, "count": count, "mib": size * count / MIB}
            for (site, size), count in ranked]


def sites_at_peak(snapshot: dict, top: int = 25, since: int = 0) -> tuple[int, list[dict]]:
    """The recorded span's peak (from event ``since`` on) and the ``top`` groups of blocks live then
    (:func:`group_sites`)."""
    peak, blocks = live_at_peak(snapshot, since)
    return peak, group_sites(blocks, top)
