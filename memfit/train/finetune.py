"""The fine-tuning loop: deterministic batches, AdamW on float32 master weights, exact resume.

A run is reproducible step by step: batch ``s`` is a pure function of (seed, step), so
the data position is just the step count. A checkpoint holds the trainable parameters,
the optimizer state, every RNG (python, torch CPU, CUDA) and the loss history; it is
written into a fresh directory and published by atomically replacing a ``latest``
pointer, so a crash mid-write never leaves a half checkpoint behind. Resuming restores
all of it, and the loss sequence continues exactly as an uninterrupted run's would.

A resume is refused, naming the checkpoint's value and this run's, where the run asks for
something that changes what the saved state means or which batch comes next: another
batch size or seed, other LoRA settings (rank, alpha, rsLoRA, target modules,
modules_to_save, which ``--train-norm`` sets), another dtype for the frozen model, a
4-bit base where it was dense or the reverse, another base model (a digest of a sample of
its frozen weights), or other tokenized data (another file, or a
``--max-len`` or tokenizer that changes the examples; one that does not changes nothing
and is let through). What governs only the
steps still to come may change: the step count, the save interval, and the learning rate
and gradient clipping, which the resumed steps take from this run (said once where they
differ from the checkpoint's).

progress.json carries ``"version"``: 2 records those settings; a file without the key
(version 1, before they were recorded) still loads, its settings assumed to be this
run's (said once), as does a version 2 file written before the 4-bit base was recorded,
or the base model's digest, in that setting; a later version is refused.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import re
import resource
import shutil
import sys
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from memfit.data.jsonl import Example, collate
from memfit.errors import MemfitError, is_count
from memfit.files import atomic_dir, follow_umask, serializing, set_aside_of
from memfit.log import warn_once

CHECKPOINTS = "checkpoints"
LATEST = "latest"
UNIFORM_STEPS = 3            # losses in a row at ln(vocab) that say the model predicts uniformly
UNIFORM_TOLERANCE = 1e-5     # of ln(vocab): a uniform model's loss is ln(vocab) to float32 rounding
BASE_SAMPLE = 16             # values from each end of a frozen weight that base_digest reads
PROGRESS_VERSION = 2   # 1 (no "version" key): the LoRA settings, dtype and data of the run were not recorded

# The LoRA settings a checkpoint records: its name for one, peft's LoraConfig field, and what in the CLI sets it
# (None: nothing does). Each changes what the saved adapter weights mean.
LORA_SETTINGS = (("lora_r", "r", "another --lora-r"), ("lora_alpha", "lora_alpha", "another --lora-alpha"),
                 ("lora_rslora", "use_rslora", None), ("lora_targets", "target_modules", None),
                 ("modules_to_save", "modules_to_save", "--train-norm or --no-train-norm"))
SETTING_HINTS = {key: hint for key, _, hint in LORA_SETTINGS} | {
    "dtype": "another --dtype", "four_bit": "--four-bit, --no-four-bit or another --gpu-memory",
    "base": "another model, the same one changed, or a preset built on another device"}
RUN_SETTINGS = frozenset(SETTING_HINTS) | {"data"}     # run_settings' entries


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60
    batch_size: int = 8
    lr: float = 2e-4
    seed: int = 0
    save_every: int = 20
    max_grad_norm: float = 1.0

    def __post_init__(self):
        for key in ("steps", "batch_size", "save_every"):
            if getattr(self, key) < 1:
                raise MemfitError(f"{key} (--{key.replace('_', '-')}) must be at least 1, got {getattr(self, key)}")
        if not 0 < self.lr < math.inf:                 # NaN fails both comparisons
            raise MemfitError(f"learning rate lr (--lr) must be positive and finite, got {self.lr}")


@dataclass(frozen=True)
class StepReport:
    step: int
    loss: float
    tokens: int
    seconds: float
    peak_bytes: int


def batch_at(examples: list[Example], batch_size: int, seed: int, step: int) -> list[Example]:
    """The examples of ``step``: consecutive slices of a per-epoch permutation seeded by (seed, epoch)."""
    n = len(examples)
    return [examples[_epoch_order(n, seed, position // n)[position % n]]
            for position in range(step * batch_size, (step + 1) * batch_size)]


@functools.lru_cache(maxsize=2)      # a batch spans the epoch it ends in and, unless it is larger, the one before
def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """Epoch ``epoch``'s permutation of ``n`` examples, made once: made again for every example of every batch, it
    cost each step host time in proportion to n x batch size."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch), device="cpu").tolist()


def peak_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA allocated bytes on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise MemfitError("the model has no trainable parameters (is LoRA on?)")
    return params


def float32_master_weights(model: torch.nn.Module) -> None:
    """Make every trainable float16/bfloat16 parameter float32, as mixed-precision training keeps its master weights.

    AdamW keeps its state in the parameter's dtype: in float16 a gradient's square underflows to 0 and eps=1e-8
    rounds to 0, so the first step wrote inf/NaN into the weights at any learning rate; in bfloat16 an update under
    1/256 of a weight is lost. peft makes LoRA's adapters float32 itself; this takes what it leaves in the model's
    dtype (the modules_to_save copy of model.norm that --train-norm trains). A module holding such a parameter then
    computes in float32 and returns its output in the parameter's former dtype, which the layers after it take (an
    RMSNorm with a float32 weight had returned float32, which a float16 output head refuses).
    """
    for module in model.modules():
        half = [p for p in module.parameters(recurse=False)
                if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)]
        if not half:
            continue
        dtype = half[0].dtype
        for param in half:
            param.data = param.data.float()       # the same Parameter: its name, and peft's hold on it, stay
            param._memfit_dtype = dtype           # the dtype it was given, which a resume compares (run_settings)
        module.register_forward_pre_hook(
            lambda _, args, kwargs: (tuple(_to(a, torch.float32) for a in args),
                                     {key: _to(value, torch.float32) for key, value in kwargs.items()}),
            with_kwargs=True)
        module.register_forward_hook(lambda _, args, output, dtype=dtype: _to(output, dtype))


def _to(value, dtype: torch.dtype):
    """``value`` in ``dtype`` if it is a floating-point tensor, else as it is."""
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def run_settings(model: torch.nn.Module, examples: list[Example], data_name: str | None = None) -> dict:
    """What the state a checkpoint holds means beyond its tensors' names and shapes, read from the model and the data
    themselves, so a library caller is held to them as the CLI is: the active peft adapter's LoRA settings (None for
    a model without one), the dtype of the frozen model, whether its base is 4-bit (an adapter trained against NF4
    weights learned their rounding too), and a digest of the tokenized examples, which another data file, --max-len
    or tokenizer changes (``data_name``, the caller's words for the data, only labels it in messages)."""
    configs = getattr(model, "peft_config", None)
    settings = lora_settings(configs[model.active_adapter] if configs else None)
    frozen = [p.dtype for p in model.parameters() if p.is_floating_point() and not p.requires_grad]
    given = [getattr(p, "_memfit_dtype", p.dtype) for p in model.parameters()]     # before any master weights
    settings["dtype"] = str((frozen or given)[0]).removeprefix("torch.")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    settings["four_bit"] = bool(getattr(base, "is_loaded_in_4bit", False))   # set by memfit's patch and transformers'
    settings["data"] = data_settings(examples, data_name)
    settings["base"] = base_digest(model)           # last: a changed dtype or 4-bit base is named first
    return settings


def base_digest(model: torch.nn.Module) -> str:
    """A digest of the frozen weights: each one's name, shape and first and last BASE_SAMPLE values (and of a 4-bit
    weight's block scales, which its packed codes do not change with). A resume onto another model of the same shapes
    had trained on, its losses mixed with the first model's; a sample, not every value, so that it costs nothing at
    8B. A preset's random init differs by device (CPU and CUDA generators), so it differs too."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        digest.update(f"{name}{tuple(param.shape)}".encode())
        state = getattr(param, "quant_state", None)          # bitsandbytes' Params4bit
        for values in (param, getattr(state, "absmax", None)):
            if values is not None:
                flat = values.detach().reshape(-1)
                sample = torch.cat([flat[:BASE_SAMPLE], flat[-BASE_SAMPLE:]]).to("cpu", torch.float64)
                digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def lora_settings(lora) -> dict:
    """:func:`run_settings`' entries for a peft LoraConfig (None: a model without an adapter). Needs no model, so a
    caller can check a resume's adapter before loading one."""
    return {key: None if lora is None else _plain(getattr(lora, field)) for key, field, _ in LORA_SETTINGS}


def data_settings(examples: list[Example], data_name: str | None = None) -> dict:
    """:func:`run_settings`' entry for the data: a digest of the tokenized examples and their counts (``data_name``
    labels them in messages). Needs no model, so a caller can check a resume's data before loading one."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(array("q", (len(example.input_ids), *example.input_ids, *example.labels)).tobytes())
    return {"name": data_name, "examples": len(examples), "tokens": sum(len(example.input_ids) for example in examples),
            "sha256": digest.hexdigest()[:16]}


def _plain(value):
    """A LoraConfig field as JSON keeps it and compares it: a set or list of module names sorted."""
    return sorted(value) if isinstance(value, (set, list, tuple)) else value


def _data_words(data: dict) -> str:
    name = f"{data['name']}: " if data.get("name") else ""
    return f"{name}{data['examples']} examples, {data['tokens']} tokens, sha256 {data['sha256']}"


# ---- checkpoints ----------------------------------------------------------------------
def _rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, model, optimizer, step: int, losses: list[float], config: TrainConfig,
                    settings: dict | None = None) -> Path:
    """Write checkpoint ``step`` and point ``latest`` at it; older checkpoints are removed after. ``settings`` are
    :func:`run_settings`' (None: unrecorded, and a resume assumes them)."""
    from safetensors.torch import save_file

    root = Path(out_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    final = root / name
    shutil.rmtree(root / f".{name}.tmp", ignore_errors=True)       # left by a run killed while it saved
    with atomic_dir(final, root / f".{name}.tmp") as tmp:
        with serializing(final / "trainable.safetensors"):
            save_file({k: p.detach().cpu().contiguous() for k, p in trainable_parameters(model).items()},
                      str(tmp / "trainable.safetensors"))
        follow_umask(tmp / "trainable.safetensors")   # safetensors writes it 0600
        with serializing(final / "state.pt"):
            torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state()}, tmp / "state.pt")
        (tmp / "progress.json").write_text(json.dumps({"version": PROGRESS_VERSION, "step": step, "losses": losses,
                                                       "config": asdict(config), "settings": settings}))
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / LATEST)
    steps = {root / match[1] for path in root.iterdir() if (match := STEP_NAME.fullmatch(path.name))}
    for old in [path for path in steps if path.name != name and path.is_dir()] + \
            [copy for path in steps for copy in set_aside_of(path)] + \
            [root / f".{path.name}.tmp" for path in steps if path.name != name]:   # a save killed before its rename
        shutil.rmtree(old, ignore_errors=True)
    return final


CHECKPOINT_NAME = r"step-\d{7,}"            # a checkpoint's own directory
# A checkpoint's directory, a name beginning like its set-aside copy (files.set_aside_of says which are) or its
# temporary directory: a save removes the earlier ones, those copies and temporaries (a run killed mid-save had left
# its .step-N.tmp for good), and nothing else in the checkpoints directory (the globs before had taken any name after
# "step-").
STEP_NAME = re.compile(rf"(?:\.)?({CHECKPOINT_NAME})(?:\.old-.*|\.tmp)?")


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, or where it names none (a run killed between its first checkpoint and the
    pointer's write, or the pointer removed) the newest checkpoint directory: each is made whole before it gets its
    name (atomic_dir), so one that exists is complete. None where there is no checkpoint directory (until this
    fallback a run that found no pointer started afresh and removed the checkpoints at its first save)."""
    root = Path(out_dir) / CHECKPOINTS
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else ""
    if re.fullmatch(CHECKPOINT_NAME, named) and (root / named).is_dir():     # an empty pointer named root itself
        return root / named
    steps = [path for path in root.glob("step-*") if re.fullmatch(CHECKPOINT_NAME, path.name) and path.is_dir()]
    return max(steps, key=lambda path: int(path.name.removeprefix("step-")), default=None)


def checkpoint_to_resume(out_dir: Path) -> Path:
    """The latest checkpoint in ``out_dir``, the one a resume continues; a MemfitError where there is none."""
    if (checkpoint := latest_checkpoint(out_dir)) is None:
        raise MemfitError(f"--resume: {out_dir} holds no checkpoint to resume from")
    return checkpoint


def checkpoint_lr(path: Path) -> float | None:
    """The learning rate checkpoint ``path`` was trained at; None where its progress.json cannot say
    (:func:`load_checkpoint` reports a checkpoint it cannot read)."""
    try:
        return float(_progress(path)["config"]["lr"])
    except (KeyError, TypeError, ValueError):
        return None


def checkpoint_step(path: Path) -> int:
    """The step checkpoint ``path`` was saved at; 0 where its progress.json cannot say (:func:`load_checkpoint`
    reports a checkpoint it cannot read)."""
    step = _progress(path).get("step")
    return step if is_count(step, least=0) else 0


def checkpoint_setting(path: Path, key: str):
    """The :func:`run_settings` entry ``key`` checkpoint ``path`` recorded; None where it recorded none or its
    progress.json cannot say."""
    settings = _progress(path).get("settings")
    return settings.get(key) if isinstance(settings, dict) else None


def _progress(path: Path) -> dict:
    """Checkpoint ``path``'s progress record; {} where it cannot be read (:func:`load_checkpoint` reports that)."""
    try:
        record = json.loads((path / "progress.json").read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _recorded_data(data: dict) -> dict:
    """A checkpoint's recorded data entry with the fields a comparison and its message read (a KeyError, or a
    TypeError where it is not a mapping, if one is missing)."""
    return {"name": data.get("name"), **{key: data[key] for key in ("sha256", "examples", "tokens")}}


def check_resumable(path: Path, config: TrainConfig, settings: dict | None) -> dict:
    """The checks of a resume from ``path`` that need no tensors: its progress.json is readable, of a version this
    memfit reads and whole, and it was trained with ``config``'s batch size and seed and with ``settings``, any of
    :func:`run_settings`' entries (the data, the LoRA settings, the dtype, the 4-bit base: those left out, or all where
    None, are not compared; a checkpoint that did not record them, progress version 1, or some of them, as version 2
    did not record the 4-bit base, is assumed to match in those, said once). Returns
    the progress record; a MemfitError names what differs. :func:`load_checkpoint` makes them with the model's own
    settings before it reads the tensor files; the CLI with the settings it asks for before it loads the model. A key
    that is none of run_settings' is a ValueError (compared, it would read as a setting the checkpoint lacks)."""
    if unknown := set(settings or ()) - RUN_SETTINGS:
        raise ValueError(f"check_resumable: {', '.join(sorted(unknown))} are not run_settings' entries "
                         f"({', '.join(sorted(RUN_SETTINGS))})")
    try:
        progress = json.loads((path / "progress.json").read_text())
        if (version := progress.get("version", 1)) > PROGRESS_VERSION:    # before its other files, whose form may differ
            raise MemfitError(f"cannot resume {path}: its progress.json is version {version}, written by a newer "
                              f"memfit (this one reads up to {PROGRESS_VERSION})")
        trained = {"batch_size": progress["config"]["batch_size"], "seed": progress["config"]["seed"]}
        if missing := [key for key in ("step", "losses") if key not in progress]:
            raise KeyError(missing[0])                              # a record without them is not one
        recorded = progress.get("settings")
        was_data = None if recorded is None else _recorded_data(recorded["data"])
    except MemfitError:
        raise
    except Exception as err:  # noqa: BLE001 - json's and the record's own errors share no base
        raise MemfitError(f"cannot resume {path}: the checkpoint cannot be read ({type(err).__name__}: {err})") from None
    for key, was in trained.items():
        if was != getattr(config, key):
            raise MemfitError(f"cannot resume {path}: it was trained with {key}={was}, "
                              f"this run asks for {getattr(config, key)}")
    if recorded is None and settings:
        warn_once("finetune:resume-unrecorded", f"--resume: {path} does not record the LoRA settings, dtype and data "
                                                "it was trained with (an earlier memfit wrote it); assuming they are "
                                                "this run's")
    if recorded is None or not settings:
        return progress
    if (data := settings.get("data")) is not None and \
            (was_data["sha256"], was_data["examples"]) != (data["sha256"], data["examples"]):
        raise MemfitError(f"cannot resume {path}: it was trained on other data ({_data_words(was_data)}) than this "
                          f"run's ({_data_words(data)}); another --data, --max-len or tokenizer?")
    if unrecorded := [key for key in settings if key != "data" and key not in recorded]:
        warn_once("finetune:resume-unrecorded-some", f"--resume: {path} does not record {', '.join(unrecorded)} (an "
                                                     "earlier memfit wrote it); assuming this run's")
    for key, now in settings.items():
        if key != "data" and key in recorded and (was := recorded[key]) != now:
            hint = f" ({SETTING_HINTS[key]}?)" if SETTING_HINTS.get(key) else ""
            raise MemfitError(f"cannot resume {path}: it was trained with {key}={was}, this run asks for {now}{hint}")
    return progress


def load_checkpoint(path: Path, model, optimizer, config: TrainConfig, settings: dict) -> tuple[int, list[float]]:
    """Restore parameters, optimizer and RNG from ``path``; return (step, losses). A checkpoint that cannot be read
    (a truncated file), was trained with another batch size, seed or :func:`run_settings` than ``settings``, or whose
    parameters have other names or shapes is a MemfitError saying so; the optimizer takes ``config``'s learning rate,
    said once where it is not the checkpoint's (as is another max_grad_norm)."""
    from safetensors.torch import load_file

    progress = check_resumable(path, config, settings)
    saved, step, losses = progress["config"], progress["step"], progress["losses"]
    try:
        tensors = load_file(str(path / "trainable.safetensors"))
        state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")   # the optimizer moves it
        optimizer_state, rng = state["optimizer"], state["rng"]
    except Exception as err:  # noqa: BLE001 - safetensors' and torch.load's errors share no base
        raise MemfitError(f"cannot resume {path}: the checkpoint cannot be read ({type(err).__name__}: {err})") from None
    params = trainable_parameters(model)
    if set(tensors) != set(params):
        raise MemfitError(f"cannot resume {path}: its trainable parameters do not match this model's "
                          "(different model or LoRA settings?)")
    if reshaped := next((name for name, value in tensors.items() if value.shape != params[name].shape), None):
        raise MemfitError(f"cannot resume {path}: it holds {reshaped} as {tuple(tensors[reshaped].shape)}, this run "
                          f"makes it {tuple(params[reshaped].shape)} (another --lora-r, or another model?)")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    optimizer.load_state_dict(optimizer_state)     # its param_groups hold the checkpoint's lr: this run's replaces it
    for group in optimizer.param_groups:
        group["lr"] = config.lr
    if changed := [f"{key} {saved[key]:g} -> {getattr(config, key):g}" for key in ("lr", "max_grad_norm")
                   if saved.get(key, getattr(config, key)) != getattr(config, key)]:
        warn_once("finetune:resume-changed", f"--resume: the steps after step {step} train with "
                                             f"{', '.join(changed)} (the checkpoint's -> this run's)")
    _set_rng_state(rng)
    return step, losses


# ---- the loop -------------------------------------------------------------------------
def refuse_overwriting_a_run(out_dir: Path, resume: bool) -> None:
    """A new run (not ``resume``) into a directory that holds one is refused: its first checkpoint would remove the
    earlier run's. The command checks it before the model loads; :func:`train` checks it for a library caller, whose
    earlier checkpoints it had removed unsaid."""
    if not resume and latest_checkpoint(out_dir) is not None:
        raise MemfitError(f"{out_dir} already holds a run; pass --resume (resume=True) to continue it, or choose "
                          "another --out (out_dir)")


def train(model, examples: list[Example], pad_id: int, config: TrainConfig, out_dir: Path, *, resume: bool = False,
          on_step: Callable[[StepReport], None] | None = None, data_name: str | None = None) -> list[float]:
    """Train ``model`` for ``config.steps`` total steps; return the loss of every step (resumed ones included).
    Its trainable parameters become float32 first (:func:`float32_master_weights`); ``data_name`` names the data in
    a refused resume's message."""
    refuse_overwriting_a_run(out_dir, resume)
    device = next(p.device for p in model.parameters())
    settings = run_settings(model, examples, data_name)     # before the master weights: the dtype asked for
    float32_master_weights(model)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params.values(), lr=config.lr, weight_decay=0.0)
    step, losses = 0, []
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    if resume:
        step, losses = load_checkpoint(checkpoint_to_resume(out_dir), model, optimizer, config, settings)
    if step >= config.steps:
        if resume:
            warn_once("finetune:resume-done", f"--resume: the checkpoint is at step {step}, --steps asks for "
                                              f"{config.steps}: nothing to train")
        return losses
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    while step < config.steps:
        start = time.perf_counter()
        picked = batch_at(examples, config.batch_size, config.seed, step)
        batch = {k: v.to(device) for k, v in collate(picked, pad_id).items()}
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params.values(), config.max_grad_norm))
        losses.append(float(loss.detach()))
        if not (math.isfinite(losses[-1]) and math.isfinite(norm)):   # before the step makes the weights NaN
            raise MemfitError(f"at step {step + 1} the loss is {losses[-1]} and the gradient norm {norm}: "
                              + _non_finite_cause(step, config, settings["dtype"]))
        if uniform := _predicts_uniformly(losses, model.config.vocab_size):
            warn_once("finetune:uniform", f"since step {step + 2 - UNIFORM_STEPS} the loss has been {uniform}: the "
                                          "model gives every token the same probability whatever the input, so it has "
                                          f"stopped learning; training diverged: lower --lr ({config.lr:g})")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if on_step is not None:
            on_step(StepReport(step, losses[-1], int(batch["attention_mask"].sum()), time.perf_counter() - start,
                               peak_bytes(device)))
        if step % config.save_every == 0 or step == config.steps:
            save_checkpoint(out_dir, model, optimizer, step, losses, config, settings)
    return losses


def _predicts_uniformly(losses: list[float], vocab_size: int) -> str | None:
    """Where the last UNIFORM_STEPS losses all equal ln(vocab_size) (to UNIFORM_TOLERANCE), the loss of predicting
    every token with the same probability, the words for it, else None. A learning rate far too high (--lr 1e6) drives
    the model there in a step or two and it stays, finite, so the non-finite check never fires; a random-init model
    starts near ln V, but its loss moves from batch to batch by more than the tolerance; a uniform model's is the
    same on every batch."""
    uniform = math.log(vocab_size)
    recent = losses[-UNIFORM_STEPS:]
    if len(recent) == UNIFORM_STEPS and all(abs(loss - uniform) <= UNIFORM_TOLERANCE * uniform for loss in recent):
        return f"{recent[-1]:.4f}, ln {vocab_size}"
    return None


def _non_finite_cause(step: int, config: TrainConfig, dtype: str) -> str:
    """What a non-finite loss or gradient at ``step`` (0-based) points to: before any update (step 0 is never resumed)
    the weights are as built, so not the learning rate."""
    if step:
        return f"training diverged; lower --lr ({config.lr:g}) or check the data"
    overflow = " (float16 overflows past 65504: bfloat16 or float32 do not)" if dtype == "float16" else ""
    return f"no update has been made yet, so the learning rate is not the cause; check the model and the data{overflow}"
