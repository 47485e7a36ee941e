"""Peak memory of a region of code, on CUDA (the caching allocator's counters) or on CPU.

On CPU there is no allocator counter, so ``TensorLifetimeTracker`` follows every storage
created by an op (a ``TorchDispatchMode`` sees forward, backward on the calling thread,
and optimizer ops) and notices when it is freed (a finalizer on the storage object,
which PyTorch keeps for the storage's whole life). Storages that existed before the
region (weights, optimizer states) are registered as the baseline.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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


class TensorLifetimeTracker(TorchDispatchMode):
    """Live bytes of storages created inside the mode, and their peak, plus a fixed baseline."""

    def __init__(self, baseline_tensors=()):
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = self.peak = 0
        for t in baseline_tensors:
            self._register(t, finalize=False)
        self.baseline = self.current
        self.peak = self.current

    def _register(self, tensor: torch.Tensor, finalize: bool = True) -> None:
        if tensor.device.type != "cpu" or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._live or storage.nbytes() == 0:
            return
        self._live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        if finalize:
            weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._register(item)
        return out


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
            self._tracker = TensorLifetimeTracker(self.baseline_tensors)
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
