"""A symbolic replay of autograd's memory behaviour, used to derive activations and peaks.

Why simulate instead of writing one closed formula per model: what autograd keeps alive
depends on details a formula hides -- an op saves an input only if the gradient that
needs it is required (``mul(a, b)`` keeps ``b`` only when ``a`` needs a gradient), a
frozen weight makes its linear keep nothing, a cast to the same dtype is no copy, two
ops that save the same tensor keep one copy. Each op here states exactly those rules
(see ``graph.py``), and this module replays them:

* **forward**: outputs are allocated; each tensor is freed after its last use unless
  some op saved it for backward;
* **backward**: ops are walked in reverse; the gradient of each input that needs one is
  allocated, except an add's, which hands its output's gradient itself to each input of its
  size (one tensor, referenced twice); an op's saved tensors and its outputs' gradients are
  freed once it has run and nothing else references them; a leaf parameter's gradient
  becomes its ``.grad`` and stays;
* **a second gradient of one tensor** is allocated too, then added as autograd's input
  buffer adds it: into the first in place when the first is a plain tensor of its own,
  out of place (a third buffer, briefly) when the first is a view -- the gradient of
  ``F.linear``'s 3-D input is one (a reshape of a matrix product's; the op says so) -- or
  is referenced elsewhere too. The sum is a new tensor, so a third gradient goes in place;
* **checkpointed segments** keep only their inputs in forward and replay their forward
  (with saving) right before their backward; the inputs stay until the segment's backward is
  done. memfit's runner replays the whole segment and holds its output's gradient through
  the segment's backward; torch's non-reentrant checkpoint replays up to the segment's last
  saving op (see ``replay_backward``).

Every allocation carries a component tag (activations, logits, kv_cache, gradients,
workspace ...) so the live bytes at the peak break down by component.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

_ids = itertools.count()


@dataclass(eq=False)
class Sym:
    """A symbolic tensor: its size in bytes, whether it needs a gradient, its component."""

    name: str
    nbytes: int
    requires_grad: bool
    component: str = "temporaries"  # an activation becomes "activations" once an op saves it
    persistent: bool = False  # parameters, inputs held by the caller: never freed here
    element_size: int = 0  # parameters: bytes per element (optimizer states follow it)
    uid: int = field(default_factory=lambda: next(_ids))


@dataclass(eq=False)
class Op:
    """One autograd op: inputs, outputs, what it saves, and backward workspace."""

    name: str
    inputs: list[Sym]
    outputs: list[Sym]
    saves: list[Sym]
    backward_workspace: int = 0  # transient bytes its backward allocates beyond input grads
    forward_workspace: int = 0
    segment: int | None = None  # checkpointed segment id, or None
    holds: list[Sym] = field(default_factory=list)  # tensors a Python frame keeps alive until this op is done
    grads_over_saved: bool = False  # its backward writes each input's gradient over that input, which it saved
    input_grads_are_views: bool = False  # its backward returns views (no gradient can be added into them in place)
    input_grads_are_output_grad: bool = False  # an add: its backward hands the output's gradient itself to each input

    @functools.cached_property
    def needs_backward(self) -> bool:
        """Whether autograd records the op (asked once per op per replay: a graph's ops do not change once built)."""
        return any(o.requires_grad for o in self.outputs)


@dataclass(frozen=True, eq=False)
class Event:
    """Live bytes by component at one moment of the replay (not to be changed: its total is summed once, and a replay
    compares it at every op)."""

    phase: str
    where: str
    live: dict[str, int]

    @functools.cached_property
    def total(self) -> int:
        return sum(self.live.values())


class Memory:
    """Live storage bookkeeping with per-component totals and the peak moment.

    The live total is kept as it changes, so that a moment below both peaks costs one comparison: a training
    prediction marks every op of every replay, and the planner makes a hundred or more predictions at large batch.
    """

    def __init__(self, base: dict[str, int]):
        self.live: dict[int, str] = {}   # uid -> component
        self.by_component: dict[str, int] = dict(base)
        self.total = sum(base.values())
        self.peak: Event | None = None
        self.phase_peaks: dict[str, Event] = {}

    def alloc(self, sym: Sym) -> None:
        if sym.persistent or sym.uid in self.live:
            return
        self.live[sym.uid] = sym.component
        self.by_component[sym.component] = self.by_component.get(sym.component, 0) + sym.nbytes
        self.total += sym.nbytes

    def free(self, sym: Sym) -> None:
        component = self.live.pop(sym.uid, None)
        if component is not None:
            self.by_component[component] -= sym.nbytes
            self.total -= sym.nbytes

    def mark_saved(self, sym: Sym) -> None:
        """A live temporary that an op saved for backward now counts as an activation."""
        if self.live.get(sym.uid) == "temporaries":
            self.live[sym.uid] = "activations"
            self.by_component["temporaries"] -= sym.nbytes
            self.by_component["activations"] = self.by_component.get("activations", 0) + sym.nbytes

    def mark(self, phase: str, where: str, extra: dict[str, int] | None = None) -> None:
        total = self.total + (sum(extra.values()) if extra else 0)
        phase_peak = self.phase_peaks.get(phase)
        new_phase_peak = phase_peak is None or total > phase_peak.total
        new_peak = self.peak is None or total > self.peak.total
        if not (new_phase_peak or new_peak):
            return
        live = {k: v for k, v in self.by_component.items() if v}
        for key, value in (extra or {}).items():
            live[key] = live.get(key, 0) + value
        event = Event(phase, where, live)
        if new_phase_peak:
            self.phase_peaks[phase] = event
        if new_peak:
            self.peak = event


def _uses(ops: list[Op]) -> dict[int, int]:
    """Index of the last op that reads each storage (forward liveness)."""
    last: dict[int, int] = {}
    for index, op in enumerate(ops):
        for sym in op.inputs + op.holds:
            last[sym.uid] = index
    return last


def segment_inputs(ops: list[Op]) -> dict[int, tuple[Sym | None, list[Sym]]]:
    """What each checkpointed segment keeps from the forward until its backward is done: the layer's
    hidden states (its first op's first input; an offloaded segment keeps a CPU copy instead, brought
    back for the recompute) and every other non-parameter tensor its ops read from outside it (shared
    tables such as RoPE's cos/sin, which the checkpoint's closure holds by reference). Every segment of ``ops``
    (a training graph makes each layer one, checkpointed or not), found once per list of ops: a graph's ops do not
    change once built and the planner replays one graph many times, so callers share the result and must not change
    it."""
    return _segment_inputs(tuple(ops))


@functools.lru_cache(maxsize=64)
def _segment_inputs(ops: tuple[Op, ...]) -> dict[int, tuple[Sym | None, list[Sym]]]:
    kept: dict[int, tuple[Sym | None, dict[int, Sym]]] = {}
    made: dict[int, set[int]] = {}
    for op in ops:
        if op.segment is None:
            continue
        inside = made.setdefault(op.segment, set())
        if op.segment not in kept:    # a first op that reads nothing leaves the segment no layer input to checkpoint
            kept[op.segment] = (op.inputs[0] if op.inputs else None, {})
        layer_input, others = kept[op.segment]
        for sym in op.inputs:
            uid = sym.uid
            if uid not in inside and (layer_input is None or uid != layer_input.uid) and not sym.persistent:
                others.setdefault(uid, sym)
        inside.update(out.uid for out in op.outputs)
    return {segment: (layer_input, list(others.values())) for segment, (layer_input, others) in kept.items()}


def _checkpoint_inputs(kept: dict, segment: int, ops: list[Op]) -> tuple[Sym, list[Sym]]:
    """What checkpointed ``segment`` keeps (:func:`segment_inputs`); a segment whose first op reads no tensor has no
    layer input to keep, and cannot be checkpointed."""
    layer_input, others = kept[segment]
    if layer_input is None:
        first = next(op for op in ops if op.segment == segment)
        raise ValueError(f"segment {segment} starts with {first.name}, which reads no tensor: it cannot be checkpointed")
    return layer_input, others


def replay_forward(ops: list[Op], memory: Memory, phase: str, keep: set[int], save: bool = True,
                   checkpointed: set[int] = frozenset(), offloaded: set[int] = frozenset()) -> dict[int, int]:
    """Run ``ops`` forward. Returns saved-storage reference counts (uid -> count).

    ``keep``: storages the caller holds after the pass (e.g. the loss, the model output).
    ``checkpointed``: segment ids whose ops save nothing but their segment's inputs.
    ``offloaded``: checkpointed segments whose input goes to CPU memory instead (not kept here).
    """
    last_use = _uses(ops)
    saved: dict[int, int] = {}
    segments_seen: set[int] = set()
    kept = segment_inputs(ops) if checkpointed else {}
    for index, op in enumerate(ops):
        in_checkpoint = op.segment in checkpointed
        for out in op.outputs:
            memory.alloc(out)
        memory.mark(phase, op.name, {"workspace": op.forward_workspace} if op.forward_workspace else None)
        if save and op.needs_backward:
            if in_checkpoint:
                # the checkpoint keeps the segment's inputs alive instead of saved tensors
                if op.segment not in segments_seen:
                    segments_seen.add(op.segment)
                    layer_input, others = _checkpoint_inputs(kept, op.segment, ops)
                    for sym in others if op.segment in offloaded else [layer_input, *others]:
                        saved[sym.uid] = saved.get(sym.uid, 0) + 1
                        memory.mark_saved(sym)
            else:
                for sym in op.saves:
                    saved[sym.uid] = saved.get(sym.uid, 0) + 1
                    memory.mark_saved(sym)
        for sym in op.inputs + op.holds:
            uid = sym.uid
            if last_use.get(uid) == index and uid not in saved and uid not in keep:
                memory.free(sym)
        for out in op.outputs:  # outputs nobody reads (and nobody saved) die at once
            uid = out.uid
            if uid not in last_use and uid not in saved and uid not in keep:
                memory.free(out)
    return saved


def replay_backward(ops: list[Op], memory: Memory, saved: dict[int, int], grad_of: dict[int, Sym],
                    checkpointed: set[int] = frozenset(), grad_component: str = "temporaries",
                    param_grad_component: str = "gradients", existing_param_grads: bool = False,
                    offloaded: set[int] = frozenset(), memfit_checkpoints: bool = False) -> None:
    """Walk ``ops`` in reverse from the gradients in ``grad_of`` (storage uid -> grad sym).

    An offloaded segment's input comes back from CPU memory before its recompute, and the
    next offloaded segment's input is prefetched at the same time (one layer ahead).
    Checkpointed segments run through one of two runners, which differ twice:

    * ``memfit_checkpoints``: memfit's (memfit.train.checkpoint), a custom autograd Function whose backward
      recomputes the whole layer and runs the layer's backward inside its own. The engine keeps that backward's
      incoming gradient (the layer output's) referenced until it returns, so the tensor lives through the whole
      segment and a gradient it was handed on as (a residual add's) is summed out of place.
    * otherwise torch's non-reentrant checkpoint (transformers'): its recompute stops once the last tensor the
      segment saves is made (torch.utils.checkpoint's early stop), so the ops after it (a layer's last projection's
      output, the residual add) are not recomputed; and it holds no gradient.
    """
    _BackwardReplay(ops, memory, saved, grad_of, checkpointed, grad_component, param_grad_component,
                    existing_param_grads, offloaded, memfit_checkpoints).run()


class _BackwardReplay:
    """:func:`replay_backward`'s state and its steps at each op, in the engine's order: recompute a checkpointed
    segment when its backward needs it, make the op's input gradients, let its output gradients and saved tensors
    go, add the gradients that arrive second to the ones there, and close a segment whose backward is done."""

    def __init__(self, ops, memory, saved, grad_of, checkpointed, grad_component, param_grad_component,
                 existing_param_grads, offloaded, memfit_checkpoints):
        self.ops, self.memory, self.saved, self.grad_of = ops, memory, saved, grad_of
        self.checkpointed, self.offloaded, self.memfit_checkpoints = checkpointed, offloaded, memfit_checkpoints
        self.grad_component, self.param_grad_component = grad_component, param_grad_component
        self.existing_param_grads = existing_param_grads
        self.segments_done: set[int] = set()
        self.views: set[int] = set()  # uids whose gradient so far is a view: the next one is added out of place
        self.kept = segment_inputs(ops) if checkpointed else {}
        self.segment_ops: dict[int, list[Op]] = {}
        for op in ops:
            if op.segment is not None:
                self.segment_ops.setdefault(op.segment, []).append(op)
        self.held: dict[int, Sym] = {}  # segment -> its output's gradient, while its backward runs (memfit's runner)
        self.refs: dict[int, int] = {}  # gradient uid -> its references in grad_of and held (an add shares one tensor)
        for grad in grad_of.values():
            self.refs[grad.uid] = self.refs.get(grad.uid, 0) + 1
        segments = [s for s in checkpointed if s in self.segment_ops]
        self.output_of = {self.segment_ops[s][-1].outputs[0].uid: s for s in segments} if memfit_checkpoints else {}
        self.recomputed = {s: self.segment_ops[s] if memfit_checkpoints else _until_last_save(self.segment_ops[s])
                           for s in segments}

    def run(self) -> None:
        for op in reversed(self.ops):
            if self._recompute_due(op):
                self._recompute(op.segment)
            if op.needs_backward and any(o.uid in self.grad_of for o in op.outputs):
                self._backward(op)
            if op.segment in self.checkpointed and self.segment_ops[op.segment][0] is op:
                self._close_segment(op.segment)

    def _recompute_due(self, op: Op) -> bool:
        """Whether the segment's forward is replayed (with saving) before ``op``'s backward: memfit's runner before
        the segment's backward, torch's checkpoint at the first saved tensor the backward unpacks (the ops after the
        last save go first)."""
        return (op.segment in self.recomputed and op.segment not in self.segments_done
                and (self.memfit_checkpoints or op is self.recomputed[op.segment][-1]))

    def _recompute(self, segment: int) -> None:
        if segment in self.offloaded:
            for each in (segment, segment - 1):  # this input, and the prefetch of the next
                if each in self.offloaded:
                    layer_input = self.kept[each][0]
                    self.memory.alloc(layer_input)
                    self.saved[layer_input.uid] = self.saved.get(layer_input.uid, 0) + (each == segment)
        resaved = replay_forward(self.recomputed[segment], self.memory, "recompute", keep=set(self.saved), save=True)
        for uid, count in resaved.items():
            self.saved[uid] = self.saved.get(uid, 0) + count
        self.segments_done.add(segment)

    def _backward(self, op: Op) -> None:
        accumulate, second = self._input_gradients(op)
        workspace = op.backward_workspace + accumulate
        self.memory.mark("backward", op.name, {"workspace": workspace} if workspace else None)
        self._drop_output_gradients(op)
        if op.segment not in self.checkpointed or op.segment in self.segments_done:
            for sym in op.saves:
                _release(sym, self.saved, self.memory, keep_storage=self.grad_of.get(sym.uid) is sym)
        # the engine adds them after the op has let go of what it held, and lets the op's new gradients go
        # once all are added
        for sym, another in second:
            self._add_second_gradient(op, sym, another)
        for _, another in second:
            self.memory.free(another)

    def _input_gradients(self, op: Op) -> tuple[int, list[tuple[Sym, Sym]]]:
        """Make ``op``'s input gradients. Returns the bytes of the transient buffers from which existing .grad
        tensors get theirs added, and (input, its new gradient) for the inputs that have a gradient already."""
        accumulate = 0
        second: list[tuple[Sym, Sym]] = []
        for sym in op.inputs:
            if not sym.requires_grad:
                continue
            uid = sym.uid
            if uid in self.grad_of:
                if sym.persistent:
                    accumulate += sym.nbytes
                else:
                    another = Sym(f"grad:{sym.name} (another)", sym.nbytes, False, self.grad_of[uid].component)
                    self.memory.alloc(another)
                    second.append((sym, another))
                continue
            if sym.persistent:  # a leaf parameter: its grad becomes .grad
                grad = Sym(f"grad:{sym.name}", sym.nbytes, False, self.param_grad_component)
                if self.existing_param_grads:
                    accumulate += sym.nbytes
                else:
                    self.memory.alloc(grad)
            elif op.grads_over_saved:  # the saved input's storage now holds its gradient
                grad = sym
            elif op.input_grads_are_output_grad and _passed_through(op, sym, self.grad_of):
                grad = self.grad_of[op.outputs[0].uid]   # AddBackward returns grad as it is: no new buffer
                if op.outputs[0].uid in self.views:
                    self.views.add(uid)
            else:  # the loss path's gradients count with the logits they mirror
                component = "logits" if sym.component == "logits" else self.grad_component
                grad = Sym(f"grad:{sym.name}", sym.nbytes, False, component)
                self.memory.alloc(grad)
                if op.input_grads_are_views:
                    self.views.add(uid)
            self.grad_of[uid] = grad
            self.refs[grad.uid] = self.refs.get(grad.uid, 0) + 1
        return accumulate, second

    def _drop_output_gradients(self, op: Op) -> None:
        """``op``'s backward is done with its outputs' gradients: each loses a reference (moves to memfit's runner's
        frame where it is a checkpointed segment's output), and is freed with its last one (a .grad never)."""
        for out in op.outputs:
            grad = self.grad_of.pop(out.uid, None)
            if grad is None:
                continue
            if out.uid in self.output_of:
                self.held[self.output_of[out.uid]] = grad
            elif self._unreferenced(grad) and grad.component != self.param_grad_component:
                self.memory.free(grad)

    def _add_second_gradient(self, op: Op, sym: Sym, another: Sym) -> None:
        """Add ``sym``'s new gradient ``another`` to the one it has: in place, unless that one is not a tensor of its
        own (a view, or held elsewhere too), when the sum is a new buffer."""
        first = self.grad_of[sym.uid]
        if sym.uid in self.views or self.refs[first.uid] > 1:
            self.views.discard(sym.uid)
            total = Sym(f"grad:{sym.name} (sum)", sym.nbytes, False, another.component)
            self.memory.alloc(total)
            self.memory.mark("backward", f"{op.name} (gradient sum)")
            self.grad_of[sym.uid] = total
            self.refs[total.uid] = 1
            if self._unreferenced(first):
                self.memory.free(first)

    def _close_segment(self, segment: int) -> None:
        """The segment's backward is done: the checkpoint's frame lets its inputs go (none kept where the segment
        reads nothing and needs no backward), and memfit's runner its output's gradient."""
        layer_input, others = self.kept[segment]
        for sym in (layer_input, *others):
            if sym is not None:
                _release(sym, self.saved, self.memory)
        output_grad = self.held.pop(segment, None)
        if output_grad is not None and self._unreferenced(output_grad):
            self.memory.free(output_grad)

    def _unreferenced(self, grad: Sym) -> bool:
        """Drop one reference to ``grad``; whether none is left."""
        self.refs[grad.uid] -= 1
        return not self.refs[grad.uid]


def _until_last_save(ops: list[Op]) -> list[Op]:
    """``ops`` up to the last one that saves a tensor for backward: what torch's non-reentrant checkpoint recomputes
    before it stops, at the backward of that op (the first to unpack a saved tensor). Approximate at that op: torch
    packs its inputs before the kernel runs and stops there, so that op's output is never made, where the replay
    makes it and drops it; and the Python locals of the ops cut off live until the stop unwinds, where the replay
    frees them at their last use."""
    last = max((i for i, op in enumerate(ops) if op.saves and op.needs_backward), default=len(ops) - 1)
    return ops[:last + 1]


def _passed_through(op: Op, sym: Sym, grad_of: dict[int, Sym]) -> bool:
    """Whether an add's backward hands ``sym`` its output's gradient as it is: where the input has the output's
    size (the engine casts a gradient to an input of another dtype, a new buffer) and the output has a gradient."""
    out = op.outputs[0]
    return out.uid in grad_of and sym.nbytes == out.nbytes


def _release(sym: Sym, saved: dict[int, int], memory: Memory, keep_storage: bool = False) -> None:
    """Drop one saved reference to ``sym``; free it when none is left, unless ``keep_storage`` (its storage holds a
    gradient now, freed with that gradient)."""
    uid = sym.uid
    if uid not in saved:
        return
    saved[uid] -= 1
    if saved[uid] <= 0:
        del saved[uid]
        if not sym.persistent and not keep_storage:
            memory.free(sym)
