"""Partial loading: build a Llama-family model keeping only the chosen FFN neurons of its middle layers.

For each layer in the partial range (all but the first ``full_first`` and last
``full_last``), the loaded neurons are the top ``base`` (delta) fraction of the task
ranking (the general one without a task), then the general ranking's best others up to
``load`` (gamma); the layer's MLP becomes a ``PartialMLP`` holding just their gate/up
rows and down columns, and computing ``compute`` (phi) of them at decode.

Discarded neurons never reach the target device: the model skeleton is built on the
``meta`` device, every tensor is read from the safetensors files with ``safe_open``
and copied straight into its final place, and FFN tensors of partial layers are read
through ``get_slice`` in row chunks of at most ``CHUNK_BYTES`` on the CPU, from which
only the kept rows (gate/up) or columns (down) are copied to the device. With ``compute_all_layers``
the fully loaded layers also become ``PartialMLP`` s (every neuron loaded, phi computed).

With ``fuse`` (the default) every layer's q/k/v weights are views of one buffer and its
gate/up weights views of one per-neuron interleaved buffer (``memfit.infer.fused``), read
straight into place, so the decode loop runs one matmul for each pair/triple at no extra
memory.

Fractions are of the model's full ``intermediate`` size; neuron counts are rounded to a
multiple of ``align`` (8: 16-byte rows in fp16 keep the matmuls on their fast paths).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from memfit.errors import MemfitError, is_count
from memfit.infer.calibrate import RANKINGS_FILE, Rankings, weights_fingerprint
from memfit.infer.fused import share_gate_up, share_qkv
from memfit.infer.selection import PartialMLP
from memfit.local import unreadable_weights
from memfit.log import warn_once
from memfit.models.spec import dtype_of, load_spec

CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class PartialConfig:
    """Options of partial loading (gamma = ``load``) and partial computation (phi = ``compute``)."""

    load: float = 1.0
    compute: float | None = None   # phi; default = load (decode computes every loaded neuron)
    base: float | None = None      # delta; default min(0.3, phi)
    full_first: int = 2
    full_last: int = 2
    task: str | None = None
    align: int = 8
    compute_all_layers: bool = False   # also decode the fully loaded first/last layers with phi

    @property
    def phi(self) -> float:
        return self.load if self.compute is None else self.compute

    @property
    def delta(self) -> float:
        return min(0.3, self.phi) if self.base is None else self.base

    def check(self, num_layers: int) -> None:
        for name, value in (("load (gamma)", self.load), ("compute (phi)", self.phi)):
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise MemfitError(f"{name} must be a fraction in (0, 1], got {value!r}")
        if self.phi > self.load:
            raise MemfitError(f"compute (phi={self.phi}) cannot exceed load (gamma={self.load}): "
                              "decode computes a subset of the loaded neurons")
        if not 0 <= self.delta <= self.phi:
            raise MemfitError(f"base (delta={self.delta}) must be in [0, compute={self.phi}]: base neurons are always computed")
        for name in ("full_first", "full_last"):
            value = getattr(self, name)
            if not is_count(value, 0):
                raise MemfitError(f"{name} must be a non-negative integer, got {value!r}")
        if self.full_first + self.full_last > num_layers:   # the defaults (2 and 2) too: say what keeps them whole
            raise MemfitError(f"partial loading keeps the first {self.full_first} and last {self.full_last} layers "
                              f"whole (full_first, full_last: --full-first, --full-last), {self.full_first + self.full_last}"
                              f" layers, and the model has {num_layers}: ask for fewer whole layers (e.g. "
                              f"--full-first {num_layers // 2} --full-last {num_layers - num_layers // 2 - 1})")
        if not isinstance(self.align, int) or self.align < 1:
            raise MemfitError(f"align must be a positive integer, got {self.align!r}")

    def partial_layers(self, num_layers: int) -> range:
        return range(self.full_first, num_layers - self.full_last)

    def neurons(self, fraction: float, intermediate: int) -> int:
        """Neuron count of ``fraction`` of ``intermediate``, rounded to ``align`` (at least one block)."""
        if fraction >= 1:
            return intermediate
        align = self.align if self.align <= intermediate else 1
        return min(intermediate, max(align, round(fraction * intermediate / align) * align))

    def loads_everything(self, intermediate: int) -> bool:
        """Whether every one of ``intermediate`` neurons is loaded and computed (load and compute may round up to
        it): then no layer is partial, and which neurons a ranking would choose does not matter. False for a load or
        compute that is not a finite number, so that :meth:`check` (which callers may run after this) says so."""
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (self.load, self.phi)):
            return False
        n_load = self.neurons(self.load, intermediate)
        return n_load == intermediate and self.neurons(self.phi, intermediate) >= n_load

    def counts(self, intermediate: int) -> tuple[int, int, int]:
        """(base, compute, load) neuron counts of one partial layer."""
        load = self.neurons(self.load, intermediate)
        compute = min(load, self.neurons(self.phi, intermediate))
        base = 0 if self.delta == 0 else min(compute, self.neurons(self.delta, intermediate))
        return base, compute, load


def choose_loaded(general: torch.Tensor, task: torch.Tensor, n_base: int, n_load: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids ascending, base mask, priority) of one layer: the task ranking's top ``n_base``, then the general ranking to ``n_load``.

    ``priority`` is each loaded neuron's place in that combined order (lower = more important).
    """
    base_ids = task[:n_base]
    taken = torch.zeros(general.numel(), dtype=torch.bool, device=general.device)
    taken[base_ids] = True
    others = general[~taken[general]][: n_load - n_base]
    order = torch.cat([base_ids, others])
    ids, position = torch.sort(order)
    return ids, position < n_base, position


WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors")


def check_weight_files(model_dir: Path) -> None:
    """Raise unless ``model_dir`` holds safetensors weights (a single file or a sharded index)."""
    if not any((Path(model_dir) / name).is_file() for name in WEIGHT_FILES):
        raise MemfitError(f"{model_dir}: no model.safetensors or model.safetensors.index.json "
                          "(memfit loads safetensors only)")


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a model directory (single file or sharded with an index); a one-line
    MemfitError where there are none, or the index or a file's header cannot be read."""
    check_weight_files(model_dir)
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    try:
        if not index.is_file():
            with safe_open(str(single), framework="pt") as handle:
                return {name: single for name in handle.keys()}
        files = {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    except Exception as err:  # noqa: BLE001 - json's, safetensors' and a missing key's errors share no base
        raise unreadable_weights(model_dir, err) from None
    for shard in sorted(set(files.values())):          # each shard's header: a missing or truncated one, named
        try:
            with safe_open(str(shard), framework="pt"):
                pass
        except Exception as err:  # noqa: BLE001 - as above
            raise unreadable_weights(shard, err) from None
    return files


class _CpuSlice:
    """A safetensors slice whose reads land on the CPU: safetensors builds them on torch's default device, which
    under ``torch.set_default_device("cuda")`` put every row chunk on the GPU, beside CPU neuron ids."""

    def __init__(self, part):
        self.part = part

    def get_shape(self):
        return self.part.get_shape()

    def __getitem__(self, index):
        with torch.device("cpu"):
            return self.part[index]


class _Reader:
    """Opens each safetensors file once and reads whole tensors or selected rows/columns of them."""

    def __init__(self, files: dict[str, Path]):
        from safetensors import safe_open

        self.files = files
        self.handles = {path: safe_open(str(path), framework="pt") for path in set(files.values())}  # headers checked

    def _slice(self, name: str):
        if name not in self.files:
            raise MemfitError(f"the model files have no tensor {name!r}")
        return _CpuSlice(self.handles[self.files[name]].get_slice(name))

    def full(self, name: str, out: torch.Tensor) -> None:
        part = self._slice(name)[:]
        if tuple(part.shape) != tuple(out.shape):
            raise MemfitError(f"{name}: the file holds shape {tuple(part.shape)}, the config implies {tuple(out.shape)}")
        out.copy_(part)

    def selected(self, name: str, ids: torch.Tensor, dim: int, out: torch.Tensor) -> None:
        """Copy rows (``dim=0``) or columns (``dim=1``) ``ids`` (ascending) of a 2-D tensor into ``out``.

        Reads row chunks of at most CHUNK_BYTES on the CPU; only the kept part is copied to ``out``'s device.
        """
        part, ids = self._slice(name), ids.to("cpu")  # the chunks are read on the CPU
        rows, cols = part.get_shape()
        row_bytes = cols * out.element_size() * 2
        step = max(1, CHUNK_BYTES // row_bytes)
        written = 0
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            if dim == 0:
                keep = ids[(ids >= start) & (ids < stop)] - start
                if keep.numel():
                    out[written: written + keep.numel()].copy_(part[start:stop].index_select(0, keep))
                    written += keep.numel()
            else:
                out[start:stop].copy_(part[start:stop].index_select(1, ids))
        if dim == 0 and written != out.shape[0]:
            raise MemfitError(f"{name}: wrote {written} of {out.shape[0]} selected rows (neuron ids out of range?)")


def _load_full(reader: _Reader, model: nn.Module, name: str, shape, dtype, device) -> None:
    """Read tensor ``name`` whole into a fresh device tensor and make it the model's parameter."""
    value = torch.empty(shape, dtype=dtype, device=device)
    reader.full(name, value)
    owner_name, _, attr = name.rpartition(".")
    model.get_submodule(owner_name)._parameters[attr] = nn.Parameter(value, requires_grad=False)


def partial_rankings(model_dir: str | Path, partial: PartialConfig, spec,
                     rankings: Rankings | str | Path | None = None) -> Rankings | None:
    """The neuron rankings ``partial`` needs, read (``rankings``, else ``model_dir/rankings.safetensors``) and checked
    against the model and the task it names; None where every neuron is loaded and computed. Cheap: a caller checks
    them before anything else it would read."""
    if partial.loads_everything(spec.intermediate):
        return None
    if not isinstance(rankings, Rankings):
        rankings = Rankings.load(rankings or Path(model_dir) / RANKINGS_FILE)
    rankings.check(spec.num_layers, spec.intermediate)
    rankings.rank(partial.task)                      # an unknown task is refused here
    if rankings.model is not None and (model := dir_fingerprint(Path(model_dir), spec.num_layers)) != rankings.model:
        warn_once(f"rankings:model:{model_dir}", f"the rankings were calibrated on a model with other weights than "
                                                 f"{model_dir} (fingerprint {rankings.model}, this model's {model}): "
                                                 "their neuron choice may not fit it; `memfit calibrate` this model")
    return rankings


def dir_fingerprint(model_dir: Path, num_layers: int) -> str | None:
    """:func:`weights_fingerprint` of a model directory's weights, reading two rows' first values only; None where it
    names its down projections otherwise (nothing to compare)."""
    files = weight_files(model_dir)
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, num_layers - 1)]
    if not all(name in files for name in names):
        return None
    reader = _Reader({name: files[name] for name in names})
    return weights_fingerprint(*(reader._slice(name)[:1] for name in names))


@torch.no_grad()
def load_model(model_dir: str | Path, partial: PartialConfig | None = None, *, dtype=None, device="cpu",
               rankings: Rankings | str | Path | None = None, progress=None, fuse: bool = True) -> nn.Module:
    """A ``*ForCausalLM`` from a local safetensors directory; partial FFN layers when ``partial`` is given.

    ``partial=None`` loads the dense model through the same path (a baseline with the
    same allocation behaviour). ``dtype``: None or "auto" for the one the weights were saved in; ``device``: auto,
    cpu, cuda or cuda:N (:func:`memfit.local.resolve_device`). ``rankings``: a Rankings, a path, or None for
    ``model_dir/rankings.safetensors`` (needed when load or compute < 1).
    ``progress``: optional callable(done, total) after each tensor read.
    ``fuse``: lay q/k/v and gate/up out in shared buffers (see the module docstring); False keeps
    Hugging Face's separate tensors (needed to ``save_pretrained`` the model: its saver refuses the
    strided gate/up views).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from memfit.local import check_model_dir, resolve_device

    model_dir = check_model_dir(model_dir)      # a preset's name had been read as a hub id, a network error
    spec = load_spec(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if getattr(config, "mlp_bias", False):
        raise MemfitError(f"{model_dir}: FFN biases (mlp_bias=true) are not supported by partial loading")
    torch_dtype = dtype_of(spec.dtype if dtype in (None, "auto") else dtype)
    device = resolve_device(device)
    files = weight_files(model_dir)

    plan: dict[int, tuple] = {}
    if partial is not None:
        partial.check(spec.num_layers)
        n_base, n_compute, n_load = partial.counts(spec.intermediate)
        if (ranked := partial_rankings(model_dir, partial, spec, rankings)) is not None:
            general, task = ranked.rank(), ranked.rank(partial.task)
        else:  # everything loaded and computed: the order is irrelevant
            general = task = torch.arange(spec.intermediate).expand(spec.num_layers, -1)
        in_range = partial.partial_layers(spec.num_layers)
        for layer in range(spec.num_layers):
            if layer in in_range:
                plan[layer] = (*choose_loaded(general[layer], task[layer], n_base, n_load), n_compute)
            elif partial.compute_all_layers and n_compute < spec.intermediate:
                plan[layer] = (*choose_loaded(general[layer], task[layer], n_base, spec.intermediate), n_compute)

    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    layers = model.model.layers
    for index, (ids, base, priority, n_compute) in plan.items():
        act_fn = layers[index].mlp.act_fn
        layers[index].mlp = PartialMLP(spec.hidden, ids, base, priority, n_compute, act_fn, dtype=torch_dtype, device=device)

    reader = _Reader(files)
    jobs = []
    for index, (ids, *_rest) in plan.items():
        mlp, prefix = layers[index].mlp, f"model.layers.{index}.mlp."
        jobs += [(reader.selected, prefix + "gate_proj.weight", ids, 0, mlp.gate_weight),
                 (reader.selected, prefix + "up_proj.weight", ids, 0, mlp.up_weight),
                 (reader.selected, prefix + "down_proj.weight", ids, 1, mlp.down_weight)]
    if fuse:
        for index, layer in enumerate(layers):
            prefix = f"model.layers.{index}."
            views = [(f"self_attn.{name}", view) for name, view in share_qkv(layer.self_attn, torch_dtype, device)]
            if index not in plan and all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj")):
                views += [(f"mlp.{name}", view) for name, view in share_gate_up(layer.mlp, torch_dtype, device)]
            jobs += [(reader.full, prefix + name, view) for name, view in views]
    for name, param in model.named_parameters():
        if param.is_meta and not (tied and name == "lm_head.weight"):
            jobs.append((_load_full, reader, model, name, param.shape, torch_dtype, device))
    for done, (fn, *args) in enumerate(jobs, 1):
        fn(*args)
        if progress:
            progress(done, len(jobs))
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise MemfitError(f"{model_dir}: tensors not found in the files: {', '.join(leftover[:5])}")
    return model.eval()


def ffn_params(model: nn.Module) -> int:
    """FFN parameters resident in ``model`` (dense and partial layers)."""
    total = 0
    for layer in model.model.layers:
        total += sum(p.numel() for p in layer.mlp.parameters())
    return total


def expected_ffn_params(spec, partial: PartialConfig) -> int:
    """FFN parameters that ``load_model(partial=...)`` keeps: 3 * hidden * neurons per layer."""
    _, _, n_load = partial.counts(spec.intermediate)
    n_partial = len(partial.partial_layers(spec.num_layers))
    return 3 * spec.hidden * (n_partial * n_load + (spec.num_layers - n_partial) * spec.intermediate)


def describe(partial: PartialConfig, spec) -> str:
    n_base, n_compute, n_load = partial.counts(spec.intermediate)
    layers = partial.partial_layers(spec.num_layers)
    where = "every layer" if partial.compute_all_layers else "those layers"
    return (f"layers {layers.start}..{layers.stop - 1} of {spec.num_layers}: load {n_load}/{spec.intermediate} neurons "
            f"(base {n_base}); decode computes {n_compute} in {where}" if len(layers) else "no partial layers")

