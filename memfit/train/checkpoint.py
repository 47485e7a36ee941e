"""Per-decoder-layer activation checkpointing whose saved inputs may leave the GPU.

A checkpointed layer keeps only its *input* (batch x tokens x hidden) from the forward
pass and recomputes everything else during backward. Where that input lives is chosen
per layer by a :class:`CheckpointPolicy` (so a planner can decide):

* ``"none"``  no checkpoint: the layer saves all its activations as usual;
* ``"gpu"``   checkpoint, input stays on the GPU;
* ``"cpu"``   checkpoint, input copied to pinned host memory on a side CUDA stream
  (asynchronous, overlapping the next layers' forward) and prefetched back on that
  stream while the layer *after* it (in backward order) recomputes, so the copy hides
  behind compute; ``prefetch`` layers are brought back ahead of time;
* ``"disk"``  checkpoint, input written to a file by a background thread and read back
  ahead of time the same way.

On CPU tensors "cpu" offload has nothing to move to: it becomes a copy (said once).

The layer's other arguments (rotary cos/sin, mask, position ids) are shared by all
layers and small; they are kept by reference and receive no gradient, which is right for
Llama/Qwen2/Mistral decoder layers. RNG state is restored for the recompute so dropout
masks match.

Each forward saves into its own host buffer or file, so several forwards may precede one
backward (micro-batches summed, chosen and rejected): the stores had kept one per layer,
and a second forward overwrote the first's inputs, whose backward then recomputed from
the wrong ones, unsaid. Gradients reach the layers' parameters by ``.backward()`` only:
the recompute runs its own backward into ``.grad``, which ``torch.autograd.grad`` (or
``backward(inputs=...)``) could neither stop nor see, so a call that reaches a checkpointed
layer that way is refused, as torch's own reentrant checkpoint refuses it, and so is a double
backward (``create_graph=True``). As there, a call toward the layers' own parameters does not
reach them (they are not the checkpoint's inputs): it finds them unused.
"""
from __future__ import annotations

import itertools
import operator
import os
import shutil
import tempfile
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from memfit.errors import MemfitError
from memfit.log import warn_once

PLACES = ("none", "gpu", "cpu", "disk")


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where each decoder layer's checkpoint lives: one of PLACES per layer, in order."""

    places: tuple[str, ...]
    prefetch: int = 1
    disk_dir: str | None = None

    def __post_init__(self):
        bad = [p for p in self.places if p not in PLACES]
        if bad:
            raise MemfitError(f"checkpoint place {bad[0]!r} is not one of {', '.join(PLACES)}")
        if _whole_number(self.prefetch) is None or self.prefetch < 1:
            raise MemfitError(f"prefetch must be a whole number of layers, at least 1, got {self.prefetch!r}")

    @classmethod
    def build(cls, num_layers: int, checkpoint: str = "layer", offload_layers="none", offload_to: str = "cpu",
              prefetch: int = 1, disk_dir: str | None = None) -> "CheckpointPolicy":
        """A policy from the user-facing knobs.

        ``checkpoint``: ``"none"`` or ``"layer"``. ``offload_layers``: ``"none"``, ``"all"``,
        an int n (the first n layers: their inputs live longest, and the last layers'
        inputs are needed first in backward, so keeping those on the GPU costs no wait),
        or an iterable of layer indices. ``offload_to``: ``"cpu"`` or ``"disk"``.
        """
        if checkpoint not in ("none", "layer"):
            raise MemfitError(f"checkpoint={checkpoint!r}: use 'none' or 'layer'")
        if offload_to not in ("cpu", "disk"):
            raise MemfitError(f"offload_to={offload_to!r}: use 'cpu' or 'disk'")
        offloaded = _offload_set(offload_layers, num_layers)
        if checkpoint == "none":
            if offloaded:
                raise MemfitError("offloading layers needs checkpoint='layer' (only checkpoint inputs are offloaded)")
            return cls(("none",) * num_layers, prefetch, disk_dir)
        return cls(tuple(offload_to if i in offloaded else "gpu" for i in range(num_layers)), prefetch, disk_dir)

    @classmethod
    def first_layers(cls, num_layers: int, checkpointed: int, offloaded: int = 0,
                     prefetch: int = 1) -> "CheckpointPolicy":
        """Checkpoint the first ``checkpointed`` layers, the first ``offloaded`` of them in pinned CPU memory
        (the shape of a ledger plan: the earliest inputs wait longest for their backward)."""
        if not 0 <= offloaded <= checkpointed <= num_layers:
            raise MemfitError(f"{offloaded} offloaded of {checkpointed} checkpointed layers: need 0 <= offloaded <= "
                              f"checkpointed <= {num_layers} layers")
        return cls(tuple("cpu" if i < offloaded else "gpu" if i < checkpointed else "none" for i in range(num_layers)),
                   prefetch)

    @property
    def active(self) -> bool:
        return any(p != "none" for p in self.places)


def _whole_number(value) -> int | None:
    """``value`` as an int where it is an integer (a Python or numpy int; not a bool, a float or an array), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _offload_set(spec, num_layers: int) -> frozenset[int]:
    if spec is None or isinstance(spec, str) and spec == "none":
        return frozenset()
    if isinstance(spec, str) and spec == "all":
        return frozenset(range(num_layers))
    if (count := _whole_number(spec)) is not None:
        if not 0 <= count <= num_layers:
            raise MemfitError(f"offload_layers={spec}: the model has {num_layers} layers")
        return frozenset(range(count))
    usage = f"offload_layers={spec!r}: use 'none', 'all', a number of layers or a list of indices"
    if isinstance(spec, (str, bytes, bytearray, dict, bool)):
        raise MemfitError(usage)
    try:
        listed = list(spec)
    except TypeError:                       # not iterable (a float)
        raise MemfitError(usage) from None
    indices = frozenset(_whole_number(i) for i in listed)
    if None in indices:                     # an item that is no integer (a float, a string, a bool)
        raise MemfitError(usage)
    wrong = sorted(i for i in indices if not 0 <= i < num_layers)
    if wrong:
        raise MemfitError(f"offload_layers names layer {wrong[0]}, but the model has layers 0..{num_layers - 1}")
    return indices


# ---- stores: where a checkpointed input waits for its backward ---------------------------
class _Slot:
    """One saved layer input: its host/disk copy and, once prefetched, the device tensor."""

    __slots__ = ("index", "device", "host", "future", "ready", "event", "shape", "dtype", "path", "__weakref__")

    def __init__(self, index, device, shape, dtype):
        self.index, self.device, self.shape, self.dtype = index, device, shape, dtype
        self.host = self.future = self.ready = self.event = self.path = None


class GpuStore:
    """Keeps the input where it is (plain checkpointing)."""

    def put(self, index: int, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(index, tensor.device, tensor.shape, tensor.dtype)
        slot.ready = tensor
        return slot

    def prefetch(self, slot: _Slot) -> None:
        pass

    def take(self, slot: _Slot) -> torch.Tensor:
        tensor, slot.ready = slot.ready, None
        return tensor


class PinnedStore:
    """Pinned host buffers filled and drained on a side stream, one per saved input, from torch's caching pinned
    allocator (which reuses blocks of any fitting size once their copies are done)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def put(self, index: int, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(index, tensor.device, tensor.shape, tensor.dtype)
        slot.host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)  # any default device
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer has finished
        with torch.cuda.stream(self.stream):
            slot.host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)  # the allocator keeps the memory until the copy is done
        return slot

    def prefetch(self, slot: _Slot) -> None:
        if slot.ready is not None:
            return
        main = torch.cuda.current_stream(self.device)
        # Allocate on the main stream (one memory pool); the side stream waits for work
        # queued so far, so it never writes into a block that main is still reading.
        slot.ready = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            slot.ready.copy_(slot.host, non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(self.stream)

    def take(self, slot: _Slot) -> torch.Tensor:
        self.prefetch(slot)
        torch.cuda.current_stream(self.device).wait_event(slot.event)
        tensor, slot.ready, slot.host = slot.ready, None, None
        return tensor


class HostCopyStore(GpuStore):
    """CPU tensors have no slower memory to go to: the offload is a copy."""

    def put(self, index: int, tensor: torch.Tensor) -> _Slot:
        warn_once("checkpoint:cpu-offload-on-cpu",
                  "checkpoint offload: tensors are already in host memory, so offloading to 'cpu' is a plain copy")
        return super().put(index, tensor.detach().clone())


def _remove_own_directory(directory: str, owner_pid: int, pool: ThreadPoolExecutor) -> None:
    """A disk store's cleanup: let its pending writes finish, then remove its directory, only in the process that
    made it (a forked child exiting normally runs the parent's finalizers too)."""
    if os.getpid() == owner_pid:
        pool.shutdown(wait=True)
        shutil.rmtree(directory, ignore_errors=True)


def _remove_later(pool: ThreadPoolExecutor, path: str) -> None:
    """Remove ``path`` on the store's one background thread, after its write (a closed store removed it already)."""
    try:
        pool.submit(lambda: os.path.exists(path) and os.remove(path))
    except RuntimeError:                                 # the pool is shut down: the directory is being removed
        pass


class DiskStore:
    """Files in a private directory, written and read ahead by one background thread. A directory it made itself
    is removed when the store is closed, collected, or the interpreter exits (nothing calls the runner's close
    when a patched model is dropped, so the test suite alone had left many in /tmp)."""

    def __init__(self, directory: str | None):
        self.owned = not directory                     # None or "": a private directory of its own
        if directory and os.path.exists(directory) and not os.path.isdir(directory):
            raise MemfitError(f"checkpoint offload directory {directory} exists and is not a directory")
        self.directory = directory or tempfile.mkdtemp(prefix="memfit-ckpt-")
        os.makedirs(self.directory, exist_ok=True)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-disk")
        self.count = itertools.count()
        self.name = uuid.uuid4().hex[:12]              # another store may share a given directory
        self._remove = (weakref.finalize(self, _remove_own_directory, self.directory, os.getpid(), self.pool)
                        if self.owned else None)

    def put(self, index: int, tensor: torch.Tensor) -> _Slot:
        """Write the input to a file of its own (layer index and a running count), removed by the background thread
        once the slot is gone (taken, or its graph dropped without a backward)."""
        slot = _Slot(index, tensor.device, tensor.shape, tensor.dtype)
        slot.path = os.path.join(self.directory, f"{self.name}-layer{index:04d}-{next(self.count)}.pt")
        host = tensor.detach().to("cpu", copy=True)  # the device copy is synchronous; the write is not
        slot.future = self.pool.submit(torch.save, host, slot.path)
        weakref.finalize(slot, _remove_later, self.pool, slot.path)
        return slot

    def prefetch(self, slot: _Slot) -> None:
        if slot.ready is None and slot.host is None:
            write, path = slot.future, slot.path
            slot.host = self.pool.submit(lambda: (write.result(), torch.load(path))[1])

    def take(self, slot: _Slot) -> torch.Tensor:
        self.prefetch(slot)
        tensor = slot.host.result() if isinstance(slot.host, Future) else slot.host
        slot.host = None
        return tensor.to(slot.device, non_blocking=False)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self._remove:
            self._remove()


# ---- the runner: one per patched model --------------------------------------------------
@dataclass
class OffloadRunner:
    """Holds the policy, the stores and the slots of the step in flight."""

    policy: CheckpointPolicy
    _stores: dict = field(default_factory=dict)
    _slots: dict = field(default_factory=dict)

    def store(self, place: str, device: torch.device):
        key = (place, str(device))
        if key not in self._stores:
            if place == "gpu":
                store = GpuStore()
            elif place == "cpu":
                store = PinnedStore(device) if device.type == "cuda" else HostCopyStore()
            else:
                store = DiskStore(self.policy.disk_dir)
            self._stores[key] = store
        return self._stores[key]

    def save(self, index: int, tensor: torch.Tensor) -> tuple:
        place = self.policy.places[index]
        store = self.store(place, tensor.device)
        slot = store.put(index, tensor)
        self._slots[index] = (store, slot)
        return store, slot

    def prefetch_before(self, index: int) -> None:
        """Start bringing back the inputs of the ``prefetch`` layers whose backward follows ``index``'s."""
        for j in range(index - 1, max(index - 1 - self.policy.prefetch, -1), -1):
            entry = self._slots.get(j)
            if entry is not None:
                entry[0].prefetch(entry[1])

    def load(self, index: int, store, slot) -> torch.Tensor:
        if self._slots.get(index, (None, None))[1] is slot:
            del self._slots[index]
        return store.take(slot)

    def close(self) -> None:
        for store in self._stores.values():
            if isinstance(store, DiskStore):
                store.close()
        self._stores.clear()
        self._slots.clear()


class _GradientInto(torch.autograd.Function):
    """``_GradientInto.apply(out, grad)``: a one-element stand-in for ``out`` whose backward hands
    ``grad`` to ``out``'s graph. Backward through the stand-in instead of ``out`` lets the caller
    drop ``out`` first, so the recomputed layer output (batch x tokens x hidden) is not held while
    the layer's backward runs, where the peak of a checkpointed step sits."""

    @staticmethod
    def forward(ctx, out, grad):
        ctx.grad = grad
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grad, ctx.grad = ctx.grad, None
        return grad, None


class _CheckpointFunction(torch.autograd.Function):
    """Forward without saving activations; backward recomputes the layer from its stored input."""

    @staticmethod
    def forward(ctx, run, runner, index, hidden, anchor):
        ctx.run, ctx.runner, ctx.index = run, runner, index
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        ctx.store, ctx.slot = runner.save(index, hidden)
        with torch.no_grad():
            return run(hidden)

    @staticmethod
    def backward(ctx, grad_out):
        if not torch.autograd._is_checkpoint_valid() or torch.is_grad_enabled():
            raise MemfitError("memfit's checkpointed layers take loss.backward() only: under torch.autograd.grad, "
                              "backward(inputs=...) or create_graph=True their recompute's own backward would write "
                              "the layers' .grad, which that call neither asks for nor sees")
        ctx.runner.prefetch_before(ctx.index)
        wants_input_grad = ctx.needs_input_grad[3]     # not for frozen embeddings (LoRA): layer 0 skips that grad
        hidden = ctx.runner.load(ctx.index, ctx.store, ctx.slot).detach().requires_grad_(wants_input_grad)
        ctx.store = ctx.slot = None
        devices = [hidden.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=hidden.device.type if devices else "cuda"):
            torch.set_rng_state(ctx.cpu_rng)
            if devices:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            with torch.enable_grad():
                out = ctx.run(hidden)
                stand_in = _GradientInto.apply(out, grad_out) if out.requires_grad else None
        del out                                        # the stand-in holds only the gradient: the output is freed
        if stand_in is not None:                       # before the layer's backward (None: nothing in it
                                                       # trains, nothing to differentiate)
            stand_in.backward()
        ctx.run = None
        return None, None, None, hidden.grad if wants_input_grad else None, None


def checkpointed_forward(forward: Callable, index: int, runner: OffloadRunner) -> Callable:
    """Wrap a decoder layer's ``forward(hidden, *args, **kwargs)`` with the policy's checkpoint.

    Checkpointing applies only while autograd records (training); otherwise, or for a
    layer whose place is ``"none"``, the original forward runs unchanged.
    """
    anchors: dict[torch.device, torch.Tensor] = {}

    def wrapped(hidden_states, *args, **kwargs):
        if not torch.is_grad_enabled() or runner.policy.places[index] == "none":
            return forward(hidden_states, *args, **kwargs)
        if kwargs.get("use_cache") or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise MemfitError("checkpointed layers cannot fill a KV cache: call the model with use_cache=False in training")
        tupled = []

        def run(h):
            out = forward(h, *args, **kwargs)
            if isinstance(out, tuple):  # older transformers return (hidden, ...)
                tupled.append(out[1:])
                return out[0]
            return out

        device = hidden_states.device
        if device not in anchors:
            # A grad-requiring input makes autograd call our backward even when the layer
            # input itself needs no gradient (frozen embeddings under LoRA).
            anchors[device] = torch.zeros((), device=device, requires_grad=True)
        out = _CheckpointFunction.apply(run, runner, index, hidden_states, anchors[device])
        return (out, *tupled[0]) if tupled else out

    return wrapped


def install(layers: Sequence[torch.nn.Module], policy: CheckpointPolicy) -> OffloadRunner:
    """Wrap every layer's forward (in place, module names unchanged) and return the runner.

    The policy can be swapped later (``runner.policy = ...``); the wrappers read it per call.
    """
    if len(policy.places) != len(layers):
        raise MemfitError(f"checkpoint policy has {len(policy.places)} places for {len(layers)} layers")
    runner = OffloadRunner(policy)
    for index, layer in enumerate(layers):
        original = getattr(layer, "_memfit_original_forward", None) or layer.forward
        layer._memfit_original_forward = original
        layer.forward = checkpointed_forward(original, index, runner)
    return runner

