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
    baseline tensors' storages (``t.baseline``) plus what the region allocated and had not yet freed."""

    def __init__(self, baseline_tensors=()):
        self.baseline = self.peak = storage_bytes(baseline_tensors)

    def __enter__(self):
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # else the profiler prints two lines on stderr per region
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)
        events = [event for event in self._profile.profiler.kineto_results.events()
                  if event.name() == "[memory]" and event.device_type() == torch._C._autograd.DeviceType.CPU]
        live = 0
        for event in sorted(events, key=lambda event: event.start_ns()):   # a free of a storage allocated before
            live += event.nbytes()                                           # the region has no event
            self.peak = max(self.peak, self.baseline + live)
        return False


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
