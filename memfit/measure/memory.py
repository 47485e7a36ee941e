"""Peak memory of a region of code, on CUDA (the caching allocator's counters) or on CPU.

On CPU there is no allocator counter, so ``CpuAllocationTracker`` reads the allocator's
own events off ``torch.profiler`` (``profile_memory``): every allocation and free made
inside the region, op scratch included, as the CUDA counter sees them. Storages that
existed before the region (weights, optimizer states) are counted as a fixed baseline.

Why not a ``TorchDispatchMode`` that follows each op's outputs (memfit's first CPU
tracker): while any Python dispatch mode is active, autograd takes every tensor for a
subclass and never adds a second gradient of one tensor into the first in place
(``InputBuffer``'s ``can_accumulate_inplace``), so it measured a backward that allocates
a buffer for every such sum where the real one, on either device, often allocates none.
The profiler hooks the allocator and leaves autograd as it is.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from memfit.errors import MemfitError


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class CpuAllocationTracker:
    """``with CpuAllocationTracker(baseline_tensors) as t: ...`` then ``t.peak``: the most bytes live at once, the
    baseline tensors' CPU storages (``t.baseline``) plus what the region allocated and had not yet freed.

    Only the region's own allocations count, matched by address: the allocator also reports the free of a storage
    that an earlier profiled region allocated, which would take bytes the region never added off its count. One
    profiler at a time: inside another profiler's session this refuses to start, and a profiler started and
    stopped inside the region (which ends this one's session too) is an error, not a peak of zero."""

    def __init__(self, baseline_tensors=()):
        self.baseline_tensors = [t for t in baseline_tensors if t is not None and t.device.type == "cpu"
                                 and not t.is_meta]
        self.baseline = self.peak = storage_bytes(self.baseline_tensors)

    def __enter__(self):
        if torch._C._autograd._profiler_enabled():
            raise MemfitError("CPU memory is measured with torch.profiler: it cannot run inside another profiler "
                              "session; end that one first")
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # else the profiler prints two lines on stderr per region
        self.peak = self.baseline
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        ended_inside = not torch._C._autograd._profiler_enabled()
        self._profile.__exit__(*exc)
        if ended_inside and exc[0] is None:
            raise MemfitError("a profiler started and stopped inside a CPU memory measurement ended it: measure "
                              "that code without its own profiler")
        live, born = 0, set()
        for event in sorted(_cpu_allocations(self._profile.profiler.kineto_results), key=lambda e: e.start_time_ns):
            fields = event.extra_fields
            if fields.alloc_size > 0:
                born.add(fields.ptr)
            elif fields.ptr in born:
                born.discard(fields.ptr)
            else:
                continue                        # a storage from before the region
            live += fields.alloc_size
            self.peak = max(self.peak, self.baseline + live)
        return False


def _cpu_allocations(results):
    """The allocation and free events (negative sizes) of CPU memory in a profiler's results."""
    from torch._C._profiler import _EventType

    stack = list(results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            yield event


@dataclass
class PeakMeter:
    """``with PeakMeter(device, baseline) as m: ...`` then ``m.peak`` (bytes) and ``m.reserved``."""

    device: str
    baseline_tensors: tuple = ()
    peak: int = 0
    reserved: int = 0

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self._tracker = CpuAllocationTracker(self.baseline_tensors)
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
            self.reserved = torch.cuda.max_memory_reserved()
        else:
            self._tracker.__exit__(*exc)
            self.peak = self._tracker.peak
            self.reserved = self.peak
        return False
