"""Calibration: rank each layer's FFN neurons by mean |h_i| at the down-projection input.

``h = act(gate(x)) * up(x)`` is what ``down_proj`` reads; a neuron whose |h| is small over
real text contributes little and is the first to drop. A forward pre-hook on every
``mlp.down_proj`` sums |h| per neuron over the non-padding tokens, for all prompts (the
*general* ranking) and per task label (the *task* rankings).

``rankings.safetensors`` (next to the model by default) holds, per ranking NAME
(``general`` or ``task.<label>``): ``NAME.score`` (layers x intermediate, float32 mean |h|)
and ``NAME.rank`` (neuron ids by decreasing score, int32); metadata records the token
counts and the shape, so a file for a model of another shape is refused, and a fingerprint
of the calibrated model's weights (:func:`weights_fingerprint`), so that one calibrated on
other weights of the same shape is said.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from memfit.data.jsonl import text_lines
from memfit.errors import MemfitError
from memfit.files import atomic_path, input_file, serializing

RANKINGS_FILE = "rankings.safetensors"
FORMAT = "memfit-rankings-v1"
FINGERPRINT_ELEMENTS = 256


def weights_fingerprint(first_down: torch.Tensor, last_down: torch.Tensor) -> str:
    """A digest of the first and last layers' ``down_proj`` weights, their first row's first FINGERPRINT_ELEMENTS
    values rounded to bfloat16: the same for a model read from its files in bfloat16 or float32 (a bfloat16 file read
    in float32, a float32 one in bfloat16), other for other weights there (another model, a fine-tune of its down
    projections). Not for one read in float16, which rounds twice: ``memfit calibrate`` digests the files."""
    digest = hashlib.sha256()
    for weight in (first_down, last_down):
        row = weight.detach()[0, :FINGERPRINT_ELEMENTS].to("cpu", torch.bfloat16).contiguous()
        digest.update(row.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class Rankings:
    """Per-layer neuron scores; ``rank(task)`` gives neuron ids, most important first."""

    scores: dict[str, torch.Tensor]           # "general" / "task.<label>" -> (layers, intermediate) float32
    tokens: dict[str, int] = field(default_factory=dict)
    model: str | None = None                  # weights_fingerprint of the calibrated model; None in older files

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.scores["general"].shape)

    @property
    def tasks(self) -> list[str]:
        return sorted(name[len("task."):] for name in self.scores if name.startswith("task."))

    def rank(self, task: str | None = None) -> torch.Tensor:
        """(layers, intermediate) int64 neuron ids by decreasing score (stable: ties keep index order)."""
        name = "general" if task is None else f"task.{task}"
        if name not in self.scores:
            raise MemfitError(f"no ranking for task {task!r}; this file has: {', '.join(self.tasks) or 'only the general ranking'}")
        return torch.sort(self.scores[name], dim=-1, descending=True, stable=True).indices

    def check(self, num_layers: int, intermediate: int, where: str = "rankings") -> None:
        if self.shape != (num_layers, intermediate):
            raise MemfitError(f"{where}: rankings are for {self.shape[0]} layers x {self.shape[1]} neurons, "
                              f"but the model has {num_layers} x {intermediate}; run `memfit calibrate` on this model")

    def save(self, path: str | Path) -> Path:
        """Write atomically (temp file + rename), replacing only a rankings file: a library caller's mistyped path
        had replaced whatever was there, a model's own weights included (the command refused it already)."""
        from safetensors.torch import save_file

        path = Path(path)
        if path.exists() and not is_rankings_file(path):
            raise MemfitError(f"{path} exists and is not a rankings file; Rankings.save replaces only an earlier one")
        tensors = {}
        for name, score in self.scores.items():
            tensors[f"{name}.score"] = score.float().contiguous()
            tensors[f"{name}.rank"] = torch.sort(score, dim=-1, descending=True, stable=True).indices.to(torch.int32).contiguous()
        meta = {"format": FORMAT, "tokens": json.dumps(self.tokens), **({"model": self.model} if self.model else {})}
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            with serializing(path):
                save_file(tensors, str(tmp), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Rankings":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise MemfitError(f"no rankings at {path}: run `memfit calibrate MODEL --data prompts.jsonl` first")
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
                scores = {key[: -len(".score")]: handle.get_tensor(key) for key in handle.keys() if key.endswith(".score")}
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise MemfitError(f"{path}: not a readable safetensors file ({err})") from None
        if not _written_by_save(meta) or "general" not in scores:
            raise MemfitError(f"{path}: not a memfit rankings file (format {meta.get('format')!r}, expected {FORMAT})")
        return cls(scores=scores, tokens=json.loads(meta.get("tokens", "{}")), model=meta.get("model"))


def _written_by_save(metadata: dict) -> bool:
    """Whether a safetensors file's metadata is what :meth:`Rankings.save` writes: its format."""
    return metadata.get("format") == FORMAT


def is_rankings_file(path: str | Path) -> bool:
    """Whether ``path`` is a file :meth:`Rankings.save` wrote (its metadata's format; no tensor is read): the only
    file ``memfit calibrate --force`` replaces, so that a mistyped --out never overwrites a model's own weights."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return _written_by_save(handle.metadata() or {})
    except Exception:  # noqa: BLE001 - safetensors raises its own error types for what is not its file
        return False


def read_prompts(path: str | Path) -> list[dict]:
    """Lines of ``{"text": ..., "task": optional label}`` (``prompt`` is accepted for ``text``)."""
    path = input_file(path, "calibration data", "expected a .jsonl file, one JSON object a line")
    prompts = []
    for number, line in enumerate(text_lines(path, "calibration data"), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise MemfitError(f"{path}:{number}: not JSON ({err.msg})") from None
        text = item.get("text", item.get("prompt")) if isinstance(item, dict) else None
        if not isinstance(text, str) or not text:
            raise MemfitError(f"{path}:{number}: each line needs a non-empty \"text\" string, got {line[:80]!r}")
        task = item.get("task")
        if task is not None and (not isinstance(task, str) or not task.replace("-", "").replace("_", "").isalnum()):
            raise MemfitError(f"{path}:{number}: \"task\" must be a name of letters, digits, - or _, got {task!r}")
        prompts.append({"text": text, "task": task})
    if not prompts:
        raise MemfitError(f"{path}: no prompts found")
    return prompts


class _Recorder:
    """Forward pre-hooks summing |input| of every layer's ``mlp.down_proj`` over the unmasked tokens."""

    def __init__(self, model):
        layers = model.model.layers
        self.modules = [layer.mlp.down_proj for layer in layers if hasattr(layer.mlp, "down_proj")]
        if len(self.modules) != len(layers):
            raise MemfitError("calibration needs the dense model (every layer's mlp.down_proj): load it without --load/--compute")
        inter = self.modules[0].in_features
        device = self.modules[0].weight.device
        self.sum = torch.zeros(len(layers), inter, dtype=torch.float64, device=device)
        self.mask: torch.Tensor | None = None
        self.handles = [module.register_forward_pre_hook(self._hook(i)) for i, module in enumerate(self.modules)]

    def _hook(self, index):
        def hook(module, inputs):
            h = inputs[0].abs().to(torch.float64)
            if self.mask is not None:
                h = h * self.mask.to(h.device, h.dtype).unsqueeze(-1)
            self.sum[index] += h.reshape(-1, h.shape[-1]).sum(0).to(self.sum.device)
        return hook

    def close(self):
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def calibrate(model, batches: Iterable[tuple[torch.Tensor, torch.Tensor, str | None]], progress=None,
              fingerprint: str | None = None) -> Rankings:
    """Rank neurons over ``batches`` of (input_ids, attention_mask, task label or None).

    ``progress``: optional callable(tokens_in_batch) called after each batch. ``fingerprint``: the rankings' record of
    the model (:func:`weights_fingerprint`), by default the model's own down projections'; a caller that loaded it
    from a directory passes the directory's (``memfit.infer.partial_load.dir_fingerprint``), which a model read in
    float16 would not give.
    """
    recorder = _Recorder(model)
    sums: dict[str, torch.Tensor] = {}
    tokens: dict[str, int] = {}
    device = recorder.sum.device
    try:
        for input_ids, mask, task in batches:
            recorder.sum.zero_()
            recorder.mask = mask.to(device)
            model(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False)
            n = int(mask.sum())
            for name in ["general"] + ([f"task.{task}"] if task else []):
                sums[name] = sums.get(name, 0) + recorder.sum.cpu()
                tokens[name] = tokens.get(name, 0) + n
            if progress:
                progress(n)
    finally:
        recorder.close()
    if not tokens.get("general"):
        raise MemfitError("calibration saw no tokens: give at least one non-empty prompt")
    scores = {name: (total / tokens[name]).float() for name, total in sums.items()}
    return Rankings(scores=scores, tokens=tokens,
                    model=fingerprint or weights_fingerprint(recorder.modules[0].weight, recorder.modules[-1].weight))


def prompt_batches(prompts: list[dict], encode, max_tokens: int = 512, batch_size: int = 8):
    """Group prompts by task into right-padded (input_ids, attention_mask, task) batches, truncating to ``max_tokens``."""
    by_task: dict[str | None, list[list[int]]] = {}
    for item in prompts:
        ids = encode(item["text"])[:max_tokens]
        if ids:
            by_task.setdefault(item["task"], []).append(ids)
    for task, seqs in by_task.items():
        for start in range(0, len(seqs), batch_size):
            group = seqs[start:start + batch_size]
            width = max(len(s) for s in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, seq in enumerate(group):
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            yield ids, mask, task
