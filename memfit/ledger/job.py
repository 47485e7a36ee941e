"""A job (what the user wants to run) and the knobs a plan sets (how memfit runs it)."""
from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from memfit.errors import MemfitError, is_count
from memfit.models.spec import PROJECTIONS, ModelSpec, dtype_name, load_spec

TASKS = ("full", "lora", "infer")
TRAINING_TASKS = ("full", "lora")   # the tasks that take optimizer steps
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
ATTENTIONS = ("sdpa", "memfit")
# The program that runs an inference job: transformers' forward with its DynamicCache (what ``generate`` runs), or
# memfit's decode loop (``memfit generate``, memfit.infer.generate.Generator: a static cache, prefill in chunks).
GENERATORS = ("hf", "memfit")
# Job and Knobs fields that some tasks only read: the tasks, and why the others ignore it. memfit plan/verify refuse the
# option for another task (memfit.commands.job_args), the ledger a Knobs value away from its default there
# (memfit.ledger.predict.check_knobs_fit_job): where it would do nothing, it is refused rather than dropped unsaid.
TASK_ONLY_FIELDS = {
    "new_tokens": (("infer",), "only inference generates tokens"),
    "partial_load": (("infer",), "only inference loads part of the FFN"),
    "partial_compute": (("infer",), "only inference computes part of the FFN"),
    "generator": (("infer",), "only inference runs a decode loop"),
    "lora_rank": (("lora",), "only LoRA has adapters"),
    "lora_targets": (("lora",), "only LoRA has adapters"),
    "optimizer": (TRAINING_TASKS, "inference takes no optimizer step"),
    "checkpoint_layers": (TRAINING_TASKS, "inference keeps no activations for a backward pass"),
    "offload_layers": (TRAINING_TASKS, "inference keeps no activations for a backward pass"),
    "micro_batch": (TRAINING_TASKS, "inference accumulates no gradients"),
    "fused_ce": (TRAINING_TASKS, "inference computes no loss"),
    "fused_swiglu": (TRAINING_TASKS, "inference keeps no activations for a backward pass"),
    "loss_fraction": (TRAINING_TASKS, "inference computes no loss"),
}
LORA_TARGETS_ALL = PROJECTIONS


FLAGS = {"blr_method": "--blr"}     # the fields whose option is not their name's


def field_flag(name: str) -> str:
    """How an error names a Job or Knobs field (or verify's tolerance and warmup): the field, as a library caller
    wrote it, and the option of ``memfit plan``/``memfit verify`` that sets it, as a user of the command typed it:
    ``seq (--seq)``."""
    return f"{name} ({FLAGS.get(name, '--' + name.replace('_', '-'))})"


def _record_fields(cls, data, keys: set[str], optional: frozenset[str] = frozenset()) -> dict:
    """``data`` as the keyword arguments of ``cls``, which :meth:`to_dict` wrote with ``keys`` (and perhaps some of
    ``optional``): a record that is not a JSON object, lacks one of them or holds another (a newer memfit's) is a
    MemfitError naming them."""
    name = cls.__name__.lower()
    if not isinstance(data, dict):
        raise MemfitError(f"a {name} record is a JSON object, got {type(data).__name__}")
    if missing := sorted(keys - set(data)):
        raise MemfitError(f"the {name} record lacks {', '.join(missing)}")
    if unknown := sorted(set(data) - keys - optional):
        raise MemfitError(f"the {name} record holds {', '.join(unknown)}, which this memfit does not know")
    return dict(data)


def _read_back_by_name(spec: ModelSpec) -> bool:
    """Whether ``load_spec(spec.name)`` gives ``spec`` again: a preset's or a directory's, unchanged. One built or
    changed in Python (``dataclasses.replace(preset, num_layers=6)``) had come back as the preset, unsaid, or not at
    all (an unknown name)."""
    try:
        named = load_spec(spec.name)
    except MemfitError:
        return False
    return named == spec and named.extra == spec.extra     # extra (rope scaling, windows) is left out of ==


def _spec_from_record(record) -> ModelSpec:
    if not isinstance(record, dict):
        raise MemfitError(f"the job record's spec is a JSON object, got {type(record).__name__}")
    known = {field.name for field in fields(ModelSpec)}
    if unknown := sorted(set(record) - known):
        raise MemfitError(f"the job record's spec holds {', '.join(unknown)}, which this memfit does not know")
    try:
        return ModelSpec(**record)
    except TypeError as err:                           # a required field missing
        raise MemfitError(f"the job record's spec: {err}") from None


_TYPE_NAMES = {"bool": "True or False", "int": "an integer", "float": "a number", "str": "a string"}


def _check_field_types(record) -> None:
    """Each bool, int, float and str field of a Job or Knobs of its annotated type (None where the annotation allows
    it), a numpy scalar taken as the Python number it is: ``fused_ce="no"`` had read as True, and a string or a
    fraction where a count goes ended in a TypeError in the ledger."""
    for f in fields(record):
        value, (kind, *rest) = getattr(record, f.name), f.type.split(" | ")
        if kind not in _TYPE_NAMES or (value is None and "None" in rest):
            continue
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "str":
            ok = isinstance(value, str)
        else:
            ok = isinstance(value, numbers.Integral if kind == "int" else numbers.Real) and not isinstance(value, bool)
            if ok:
                object.__setattr__(record, f.name, int(value) if kind == "int" else float(value))
        if not ok:
            raise MemfitError(f"{field_flag(f.name)} must be {_TYPE_NAMES[kind]}, got {value!r}")


def _positive(name: str, value) -> None:
    if not is_count(value):
        raise MemfitError(f"{field_flag(name)} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Job:
    """What to run: a model, a task, a shape. ``full``/``lora`` train; ``infer`` is prefill + decode."""

    spec: ModelSpec
    task: str = "lora"
    seq: int = 2048
    batch: int = 1
    new_tokens: int = 128  # infer: tokens generated after the prompt
    device: str = "cuda"
    loss_fraction: float = 1.0  # training: share of tokens that carry a loss (prompt tokens do not)

    def __post_init__(self):
        if isinstance(self.spec, (str, Path)):          # a preset's name or a model directory, as load_spec takes
            object.__setattr__(self, "spec", load_spec(self.spec))
        if not isinstance(self.spec, ModelSpec):
            raise MemfitError(f"a job's spec is a ModelSpec (memfit.load_spec), a preset name or a model directory, "
                              f"got {type(self.spec).__name__}")
        _check_field_types(self)
        if self.task not in TASKS:
            raise MemfitError(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        _positive("seq", self.seq)
        _positive("batch", self.batch)
        if self.task == "infer":
            _positive("new_tokens", self.new_tokens)
        if self.device not in ("cuda", "cpu"):
            raise MemfitError(f"device {self.device!r} is not one of cuda, cpu")
        if not 0 < self.loss_fraction <= 1:
            raise MemfitError(f"{field_flag('loss_fraction')} must be in (0, 1], got {self.loss_fraction}")

    @property
    def positions(self) -> int:
        """The most positions a sequence of the job reaches: its length, and an inference job's new tokens after it."""
        return self.seq + (self.new_tokens if self.task == "infer" else 0)

    @property
    def training(self) -> bool:
        return self.task in TRAINING_TASKS

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def to_dict(self) -> dict:
        """The job as a JSON object; ``spec``, the model's every field, only where its name does not read it back."""
        spec = None if _read_back_by_name(self.spec) else asdict(self.spec)
        return {"model": self.spec.name, "task": self.task, "seq": self.seq, "batch": self.batch,
                "new_tokens": self.new_tokens if self.task == "infer" else None, "device": self.device,
                "loss_fraction": self.loss_fraction, **({"spec": spec} if spec else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "Job":
        """The job :meth:`to_dict` wrote, its model read again from its preset name or its directory (which
        :func:`~memfit.models.spec.load_spec` names by its absolute path), or from the record's ``spec``."""
        data = _record_fields(cls, data, {"model", "task", "seq", "batch", "new_tokens", "device", "loss_fraction"},
                              frozenset({"spec"}))
        if data["new_tokens"] is None:                 # a training job's record
            del data["new_tokens"]
        model, spec = data.pop("model"), data.pop("spec", None)
        return cls(load_spec(model) if spec is None else _spec_from_record(spec), **data)


@dataclass(frozen=True)
class Knobs:
    """Every setting a technique can turn. Defaults are plain PyTorch/transformers behaviour.

    A technique (``techniques.py``) proposes values for some of these; the ledger reads them.
    """

    dtype: str = "bfloat16"  # parameter and activation dtype
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = LORA_TARGETS_ALL
    checkpoint_layers: int = 0  # decoder layers wrapped in activation checkpointing (the first k)
    optimizer: str = "adamw"
    micro_batch: int | None = None  # gradient accumulation: sequences per forward/backward
    offload_layers: int = 0  # of the checkpointed layers, how many keep their input in pinned CPU memory
    fused_ce: bool = False  # loss from hidden states by memfit.kernels.linear_ce: no logits
    fused_swiglu: bool = False  # the gated MLP's silu(gate) * up by memfit.kernels.swiglu: gradients in place
    four_bit: bool = False  # frozen base linears in bitsandbytes NF4 (LoRA only)
    attention: str = "sdpa"  # "sdpa" (torch) or "memfit" (memfit.kernels.attention, two-pass backward)
    partial_load: float = 1.0  # infer: share of FFN neurons loaded in the middle layers (gamma, memfit.infer)
    partial_compute: float = 1.0  # infer: share computed per decoded token (phi <= gamma)
    generator: str = "hf"  # infer: "hf" (transformers' forward, DynamicCache) or "memfit" (memfit generate's loop)
    blr_method: str | None = None  # a block-low-rank model (memfit compress): "blast", "monarch" or "lowrank"
    blr_ratio: float = 0.5  # its share of the decoder's linear parameters
    blr_blocks: int = 16

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))   # fp16 and float16 are one job (and cache key)
        given = self.lora_targets
        targets = None if isinstance(given, (str, bytes)) or not isinstance(given, Iterable) else tuple(given)
        if targets is None or not all(isinstance(t, str) for t in targets):
            raise MemfitError(f"{field_flag('lora_targets')} is a sequence of module names such as ('q_proj', "
                              f"'v_proj'), got {self.lora_targets!r}")
        if isinstance(given, (set, frozenset)):
            targets = tuple(sorted(targets))           # one order, so that equal sets make equal knobs
        object.__setattr__(self, "lora_targets", targets)   # a list is not hashable: no cache key
        _check_field_types(self)
        if self.optimizer not in OPTIMIZERS:
            raise MemfitError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        unknown = set(self.lora_targets) - set(LORA_TARGETS_ALL)
        if unknown:
            raise MemfitError(f"unknown {field_flag('lora_targets')} {sorted(unknown)}; use some of "
                              f"{', '.join(LORA_TARGETS_ALL)}")
        _positive("lora_rank", self.lora_rank)
        if self.checkpoint_layers < 0:
            raise MemfitError(f"{field_flag('checkpoint_layers')} must be >= 0, got {self.checkpoint_layers}")
        if self.micro_batch is not None:
            _positive("micro_batch", self.micro_batch)
        if not 0 < self.partial_compute <= self.partial_load <= 1:
            raise MemfitError(f"need 0 < {field_flag('partial_compute')} <= {field_flag('partial_load')} <= 1, got "
                              f"{self.partial_compute} and {self.partial_load}")
        if self.attention not in ATTENTIONS:
            raise MemfitError(f"attention {self.attention!r} is not one of {', '.join(ATTENTIONS)}")
        if self.generator not in GENERATORS:
            raise MemfitError(f"{field_flag('generator')} {self.generator!r} is not one of {', '.join(GENERATORS)}")
        if not 0 <= self.offload_layers <= self.checkpoint_layers:
            raise MemfitError(f"{field_flag('offload_layers')} must be between 0 and {field_flag('checkpoint_layers')}, "
                              f"got {self.offload_layers} and {self.checkpoint_layers}: only checkpointed layers' "
                              "inputs are offloaded")

    @property
    def patched(self) -> bool:
        """Whether a training job runs through memfit.train.patch (any of its techniques on). Its checkpoints are then
        memfit's own runner (whole-layer recompute; the layer's backward holds the layer output's gradient to its
        end), otherwise transformers' (torch's non-reentrant checkpoint: early-stopped recompute, nothing held; see
        simulate.replay_backward). verify builds the job so, and the ledger replays it so. (``memfit finetune`` runs
        memfit's runner for every plan, so its checkpoint-only plans are replayed with the other runner: a known
        mismatch, not yet aligned.)"""
        return self.fused_ce or self.four_bit or bool(self.offload_layers) or self.fused_swiglu

    def with_(self, **changes) -> "Knobs":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["lora_targets"] = list(self.lora_targets)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Knobs":
        """The knobs :meth:`to_dict` wrote; a record from before ``generator`` existed ran transformers' loop."""
        data = _record_fields(cls, data, {field.name for field in fields(cls)} - {"generator"}, frozenset({"generator"}))
        if not isinstance(data["lora_targets"], list):
            raise MemfitError(f"the knobs record's lora_targets is a list of module names, got {data['lora_targets']!r}")
        return cls(**{**data, "lora_targets": tuple(data["lora_targets"])})   # __post_init__ checks the types
