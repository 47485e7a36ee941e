"""The fine-tuning loop: deterministic batches, AdamW on the trainable parameters, exact resume.

A run is reproducible step by step: batch ``s`` is a pure function of (seed, step), so
the data position is just the step count. A checkpoint holds the trainable parameters,
the optimizer state, every RNG (python, torch CPU, CUDA) and the loss history; it is
written into a fresh directory and published by atomically replacing a ``latest``
pointer, so a crash mid-write never leaves a half checkpoint behind. Resuming restores
all of it, and the loss sequence continues exactly as an uninterrupted run's would.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from memfit.data.jsonl import Example, collate
from memfit.errors import MemfitError
from memfit.files import atomic_dir, follow_umask, set_aside_of
from memfit.log import warn_once

CHECKPOINTS = "checkpoints"
LATEST = "latest"


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
                raise MemfitError(f"{key} must be at least 1, got {getattr(self, key)}")
        if not 0 < self.lr < math.inf:                 # NaN fails both comparisons
            raise MemfitError(f"learning rate must be positive and finite, got {self.lr}")


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
    picked = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, n)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        picked.append(examples[int(order[offset])])
    return picked


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


# ---- checkpoints ----------------------------------------------------------------------
def _rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, model, optimizer, step: int, losses: list[float], config: TrainConfig) -> Path:
    """Write checkpoint ``step`` and point ``latest`` at it; older checkpoints are removed after."""
    from safetensors.torch import save_file

    root = Path(out_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    final = root / name
    shutil.rmtree(root / f".{name}.tmp", ignore_errors=True)       # left by a run killed while it saved
    with atomic_dir(final, root / f".{name}.tmp") as tmp:
        save_file({k: p.detach().cpu().contiguous() for k, p in trainable_parameters(model).items()},
                  str(tmp / "trainable.safetensors"))
        follow_umask(tmp / "trainable.safetensors")   # safetensors writes it 0600
        torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state()}, tmp / "state.pt")
        (tmp / "progress.json").write_text(json.dumps({"step": step, "losses": losses, "config": asdict(config)}))
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / LATEST)
    steps = {root / match[1] for path in root.iterdir() if (match := STEP_NAME.fullmatch(path.name))}
    for old in [path for path in steps if path.name != name and path.is_dir()] + \
            [copy for path in steps for copy in set_aside_of(path)]:   # atomic_dir's, left by a save killed mid-swap
        shutil.rmtree(old, ignore_errors=True)
    return final


# A checkpoint's directory, or a name beginning like its set-aside copy (files.set_aside_of says which are): a save
# removes the earlier ones and those copies, and nothing else in the checkpoints directory (the globs before had taken
# any name after "step-").
STEP_NAME = re.compile(r"(?:\.)?(step-\d{7,})(?:\.old-.*)?")


def latest_checkpoint(out_dir: Path) -> Path | None:
    pointer = Path(out_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(path: Path, model, optimizer, config: TrainConfig) -> tuple[int, list[float]]:
    """Restore parameters, optimizer and RNG from ``path``; return (step, losses). A checkpoint that cannot be read
    (a truncated file) or whose parameters have other shapes (another --lora-r) is a MemfitError saying so."""
    from safetensors.torch import load_file

    try:
        progress = json.loads((path / "progress.json").read_text())
        saved, step, losses = progress["config"], progress["step"], progress["losses"]
        saved_batch, saved_seed = saved["batch_size"], saved["seed"]
        tensors = load_file(str(path / "trainable.safetensors"))
        state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")   # the optimizer moves it
        optimizer_state, rng = state["optimizer"], state["rng"]
    except Exception as err:  # noqa: BLE001 - json's, safetensors' and torch.load's errors share no base
        raise MemfitError(f"cannot resume {path}: the checkpoint cannot be read ({type(err).__name__}: {err})") from None
    for key, was in (("batch_size", saved_batch), ("seed", saved_seed)):
        if was != getattr(config, key):
            raise MemfitError(f"cannot resume {path}: it was trained with {key}={was}, "
                              f"this run asks for {getattr(config, key)}")
    params = trainable_parameters(model)
    if set(tensors) != set(params):
        raise MemfitError(f"cannot resume {path}: its trainable parameters do not match this model's "
                          "(different model or LoRA settings?)")
    if reshaped := next((name for name, value in tensors.items() if value.shape != params[name].shape), None):
        raise MemfitError(f"cannot resume {path}: it holds {reshaped} as {tuple(tensors[reshaped].shape)}, this run "
                          f"makes it {tuple(params[reshaped].shape)} (another --lora-r?)")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    optimizer.load_state_dict(optimizer_state)
    _set_rng_state(rng)
    return step, losses


# ---- the loop -------------------------------------------------------------------------
def train(model, examples: list[Example], pad_id: int, config: TrainConfig, out_dir: Path, *, resume: bool = False,
          on_step: Callable[[StepReport], None] | None = None) -> list[float]:
    """Train ``model`` for ``config.steps`` total steps; return the loss of every step (resumed ones included)."""
    device = next(p.device for p in model.parameters())
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params.values(), lr=config.lr, weight_decay=0.0)
    step, losses = 0, []
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    if resume:
        checkpoint = latest_checkpoint(out_dir)
        if checkpoint is None:
            raise MemfitError(f"--resume: {out_dir} holds no checkpoint to resume from")
        step, losses = load_checkpoint(checkpoint, model, optimizer, config)
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
        batch = {k: v.to(device) for k, v in collate(batch_at(examples, config.batch_size, config.seed, step), pad_id).items()}
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params.values(), config.max_grad_norm))
        losses.append(float(loss.detach()))
        if not (math.isfinite(losses[-1]) and math.isfinite(norm)):   # before the step makes the weights NaN
            raise MemfitError(f"at step {step + 1} the loss is {losses[-1]} and the gradient norm {norm}: training "
                              f"diverged; lower --lr ({config.lr:g}) or check the data")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if on_step is not None:
            on_step(StepReport(step, losses[-1], int(batch["attention_mask"].sum()), time.perf_counter() - start,
                               peak_bytes(device)))
        if step % config.save_every == 0 or step == config.steps:
            save_checkpoint(out_dir, model, optimizer, step, losses, config)
    return losses
