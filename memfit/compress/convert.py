"""Replace a Hugging Face Llama-family model's nn.Linear layers by structured ones.

``compress_model`` is the library entry point: plan ranks (``memfit.compress.plan``),
optionally gather calibration covariances, project every chosen weight -- all layers of
one kind together, batched on the compute device -- and swap in LowRankLinear /
MonarchLinear / BlastLinear modules. It returns the model and a per-layer report with the
relative weight error and, when calibration data was given, the relative output error.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from memfit.compress import projection as proj
from memfit.compress.plan import KINDS, KindPlan, plan_kinds, structure_class
from memfit.compress.resume import KeptLayers, source_digest, tensor_digest
from memfit.errors import MemfitError
from memfit.log import warn_once

# Projections that read the same input: their calibration covariance is gathered once.
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
# Work-space budget for one batched projection (bytes); chunks of layers stay under it.
WORKSPACE_BYTES = 4 << 30


@dataclass
class CompressionResult:
    model: nn.Module
    method: str
    blocks: int
    plan: dict[str, KindPlan]
    layers: dict[str, dict] = field(default_factory=dict)   # module name -> structure config
    # per layer, the relative errors of the layer as saved (its dtype's rounding included): of the weight, and of the
    # output on the calibration tokens (where given: those the activation-aware projection was fitted to)
    report: list[dict] = field(default_factory=list)
    ratio: float | None = None                               # the ratio asked for (None: explicit ranks)
    skip: tuple[str, ...] | None = None                      # the kinds asked to stay dense (None: the default)

    def summary(self) -> dict:
        """What the saved model records of its compression: ``ratio`` and ``skip`` as asked (a plan made with them
        has these ranks), ``linear_ratio`` as reached."""
        dense = sum(p.dense_params for p in self.plan.values())
        new = sum(p.params for p in self.plan.values())
        return {"method": self.method, "blocks": self.blocks, "linear_ratio": new / dense,
                "ratio": self.ratio, "skip": None if self.skip is None else list(self.skip),
                "ranks": {k: p.rank for k, p in self.plan.items()}}


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Module name -> nn.Linear for every projection of every decoder layer. A model that already holds
    block-low-rank layers is refused: its remaining dense projections (the k/v a GQA model keeps) had been compressed
    in turn, at the ratio asked of them alone."""
    from memfit.layers.structured import StructuredLinear

    if found := next(((n, m) for n, m in model.named_modules() if isinstance(m, StructuredLinear)), None):
        raise MemfitError(f"this model is already compressed ({found[0]} is a {type(found[1]).__name__}); compress "
                          "its dense source instead")
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in KINDS and ".layers." in f".{name}"}
    if not found:
        raise MemfitError("found no q/k/v/o/gate/up/down nn.Linear layers: is this a Llama-family model "
                          "that is not already compressed?")
    return found


def model_shapes(linears: dict[str, nn.Linear]) -> dict[str, tuple[int, int]]:
    shapes = {}
    for name, m in linears.items():
        kind = name.rsplit(".", 1)[-1]
        if shapes.setdefault(kind, (m.in_features, m.out_features)) != (m.in_features, m.out_features):
            raise MemfitError(f"{name} is {m.in_features}->{m.out_features} but other {kind} layers differ; "
                              "memfit plans one shape per projection kind")
    return {k: shapes[k] for k in KINDS if k in shapes}


@torch.no_grad()
def input_covariances(model: nn.Module, names: list[str], batches, device,
                      on_batch: Callable[[int, int | None], None] | None = None) -> dict[str, torch.Tensor]:
    """``X^T X`` (float32, summed over tokens) of the input of each module in ``names``, on the model's own device.

    ``batches`` yields ``input_ids`` tensors; ``on_batch(number, total)`` is called as each batch's forward starts
    (``total`` None where ``batches`` has no length). Modules sharing an input (q/k/v, gate/up) get the same tensor, gathered
    once. The forward runs through the decoder alone (no logits: batch x tokens x vocabulary values, at Llama-3's
    vocabulary of 128256), with no KV cache, on ``device`` one decoder layer at a time: the embedding, the final norm
    and the rotary tables move there for the whole forward, each decoder layer and its covariances so far just
    before its forward and back just after. So the device holds one layer's weights and covariances (at Llama-3-8B's
    down projection the covariance alone is 14336^2 float32 values a layer), not the model's: a model larger than the GPU is
    calibrated on it. The price: every batch copies every layer's weights to the device (their host copies stay, so
    nothing copies them back) and its covariances there and back, and the covariances live in host memory between
    layers (each layer's, ``in^2`` floats per input it gathers). Where the model is on ``device`` already, nothing
    moves.
    """
    modules = dict(model.named_modules())
    source = {}
    for name in names:
        prefix, kind = name.rsplit(".", 1)
        rep = f"{prefix}.{SHARED_INPUT[kind]}" if kind in SHARED_INPUT and f"{prefix}.{SHARED_INPUT[kind]}" in modules else name
        source[name] = rep
    sums: dict[str, torch.Tensor] = {}

    def hook(rep):
        def fn(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            acc = sums.get(rep)
            sums[rep] = x.T @ x if acc is None else acc.addmm_(x.T, x)
        return fn

    decoder, home, tokens = model.get_decoder(), next(model.parameters()).device, 0
    reps = set(source.values())
    visiting = {layer: [rep for rep in reps if modules[rep] in within] for layer in decoder.layers
                for within in [set(layer.modules())]}
    away: dict[nn.Module, list] = {}                   # each layer on the device: its tensors at home

    def arrive(layer, args):                           # a decoder layer and the covariances of its inputs so far
        away[layer] = _visit(layer, device)
        sums.update({rep: sums[rep].to(device) for rep in visiting[layer] if rep in sums})

    def leave(layer, args, out):
        _come_home(away.pop(layer))
        sums.update({rep: sums[rep].to(home) for rep in visiting[layer] if rep in sums})

    handles = [modules[rep].register_forward_pre_hook(hook(rep)) for rep in reps]
    handles += [layer.register_forward_pre_hook(arrive) for layer in visiting]
    handles += [layer.register_forward_hook(leave) for layer in visiting]
    try:
        total = len(batches)
    except TypeError:                                  # a generator; a DataLoader over an iterable dataset
        total = None
    resident = {}
    try:
        for child in decoder.children():
            if child is not decoder.layers:
                resident[child] = _visit(child, device)
        for number, ids in enumerate(batches, 1):
            if on_batch:
                on_batch(number, total)
            decoder(input_ids=ids.to(device), use_cache=False)
            tokens += ids.numel()
    finally:
        for handle in handles:
            handle.remove()
        for tensors in [*resident.values(), *away.values()]:   # the post-hooks brought the layers home; this, one an
            _come_home(tensors)                                # error stopped
    sums = {rep: cov.to(home) for rep, cov in sums.items()}
    if not sums:
        raise MemfitError("the calibration data produced no tokens")
    if broken := next((rep for rep, cov in sums.items() if not bool(cov.isfinite().all())), None):
        raise MemfitError(f"{broken}: its inputs on the calibration data are not finite (the model overflows there: "
                          "float16 weights?), so no projection or error can use them; compress without calibration "
                          "data, or from Python on the model in bfloat16 or float32; nothing is written")
    if tokens < (width := max(cov.shape[0] for cov in sums.values())):
        warn_once("calibration-short", f"calibration: {tokens} tokens for layers up to {width} inputs wide: their "
                  "input covariance is rank-deficient, and the output errors, measured on the same tokens, read "
                  "low; give more (--calib-samples, --calib-seq)")
    return {name: sums[rep] for name, rep in source.items()}


def _visit(module: nn.Module, device) -> list:
    """Take ``module`` to ``device`` and return what it held at home, for :func:`_come_home`: a forward leaves the
    weights as they were, so they need not be copied back (at Llama-3.2-1B, copying every layer back into fresh host
    memory after each calibration batch had taken most of the calibration's time on an H100). A move that fails part
    way is undone before the error goes on."""
    home = [(m, name, t, t.data, t.grad, None if t.grad is None else t.grad.data) for m in module.modules()
            for name, t in m._parameters.items() if t is not None]     # a move sets a gradient's .data in place
    home += [(m, name, t, None, None, None) for m in module.modules() for name, t in m._buffers.items() if t is not None]
    try:
        module.to(device)
    except BaseException:
        _come_home(home)
        raise
    return home


def _come_home(home: list) -> None:
    """Put back what :func:`_visit` returned (each parameter with its data and gradient, each buffer), dropping the
    device copies."""
    for m, name, t, data, grad, grad_data in home:
        if isinstance(t, nn.Parameter):
            m._parameters[name] = t
            t.data = data
            if grad is not None:
                grad.data = grad_data
            t.grad = grad
        else:
            m._buffers[name] = t


def _chunk_size(method: str, kp: KindPlan, blocks: int, activation_aware: bool = False) -> int:
    """Matrices per batched projection that keep the work space under WORKSPACE_BYTES."""
    fin, fout, r = kp.in_features, kp.out_features, kp.rank
    floats = 4 * fin * fout + fin * fin + 2 * min(fin, fout) ** 2    # the last: truncated_svd's Gram and eigenvectors
    if activation_aware:   # the whitening (projection.whitening_factor): the covariance in float64 and, with one block
        floats += fin * fin + (2 * fin * fin + fin * fout if blocks == 1 else 0)   # (low-rank), its damped copy,
        # factor and W times it: uncounted, a low-rank chunk took up to 1.8x its share (tests/test_compress.py)
    if method == "blast":   # the factors and Gram matrices, and the float64 copy the diagonalising start takes
        floats += 2 * blocks * (fin + fout) * r + 2 * blocks * blocks * r * r + fin * fout
        if activation_aware:   # blast_refine_output_error: A C, (A - A^) C, A^, the damped C, V-bar and C V-bar
            floats += 3 * fin * fout + fin * fin + 2 * blocks * fin * r
    elif method == "monarch":
        floats += 2 * fin * fout
        if activation_aware:   # monarch_refine_output_error: A scaled, A - A^ and the sweep's copy, (A - A^) C, the
            floats += 6 * fin * fout + 4 * fin * fin    # error's two temporaries; the scaled, damped C and its makings
    return max(1, WORKSPACE_BYTES // (8 * floats))


def project(method: str, W: torch.Tensor, rank: int, blocks: int, cov: torch.Tensor | None,
            steps: int) -> tuple[torch.Tensor, ...]:
    """Factors of the batched ``W``."""
    if method == "lowrank":
        return proj.lowrank_project(W, rank, cov)
    if method == "monarch":
        return proj.monarch_project(W, rank, blocks, cov)
    return proj.blast_project(W, rank, blocks, cov, steps=steps)


def empty_layer(method: str, linear: nn.Linear, rank: int, blocks: int, dtype: torch.dtype | None = None) -> nn.Module:
    """A randomly initialised memfit.layers module of ``linear``'s shape and bias, on its device, in ``dtype`` (default:
    its weight's)."""
    kwargs = {} if method == "lowrank" else {"blocks": blocks}
    return structure_class(method)(linear.in_features, linear.out_features, rank, bias=linear.bias is not None,
                                   device=linear.weight.device, dtype=dtype or linear.weight.dtype, **kwargs)


def build_layer(method: str, linear: nn.Linear, rank: int, blocks: int, factors) -> nn.Module:
    """A memfit.layers module holding ``factors`` (one matrix's), with ``linear``'s bias, dtype, device."""
    layer = empty_layer(method, linear, rank, blocks, torch.float32)
    with torch.no_grad():
        if method == "lowrank":
            layer.U.copy_(factors[0])
            layer.V.copy_(factors[1])
        elif method == "monarch":  # W_ij ~ L_ij R_ij^T
            layer.set_factors(*factors)
        else:
            layer.U.copy_(factors[0])
            layer.V.copy_(factors[1])
            layer.S.copy_(factors[2])
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.float())
    return layer.to(linear.weight.dtype)


def structure_config(method: str, layer: nn.Module) -> dict:
    config = {"structure": method, "in_features": layer.in_features, "out_features": layer.out_features,
              "rank": layer.rank, "bias": layer.bias is not None}
    if method != "lowrank":
        config["blocks"] = layer.blocks
    if method == "monarch":
        config["permute_output"] = layer.permute_output
    return config


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _names(group: list[str]) -> str:
    """A group of layers named for a message: the first, and how many more."""
    return group[0] + (f" and {len(group) - 1} more {group[0].rsplit('.', 1)[-1]} layers" if len(group) > 1 else "")


def _refuse_non_finite_factors(method: str, names: list[str], factors) -> None:
    """A MemfitError naming the first layer of ``names`` whose factors are not finite (from finite weights: a defect),
    before any is built into the model: they would be saved, and the model would generate nothing."""
    for k, name in enumerate(names):
        if not all(bool(f[k].isfinite().all()) for f in factors):
            raise MemfitError(f"{name}: its {method} factors are not finite, from a finite weight (a memfit defect: "
                              "please report it with the model); nothing is written")


def compress_model(model: nn.Module, method: str = "blast", ratio: float | None = 0.5, blocks: int = 16,
                   ranks: dict[str, int] | None = None, skip: tuple[str, ...] | None = None,
                   calibration=None, activation_aware: bool = False, steps: int = 300,
                   device: str | torch.device | None = None,
                   progress: Callable[[str, int], None] | None = None,
                   kept: KeptLayers | None = None) -> CompressionResult:
    """Compress ``model``'s decoder linears in place to ``ratio`` of their parameters.

    ``calibration``: an iterable of ``input_ids`` tensors; needed by
    ``activation_aware=True`` (which then minimises each layer's output error), and when
    given also yields each layer's relative output error in the report. ``ranks`` (kind ->
    rank) overrides ``ratio``. ``steps``: BLAST descent steps. ``device``: where the
    projections run (default: CUDA when available); the model, on one device, stays there (each group of weights,
    and for the calibration forward each decoder layer, visits ``device``). ``progress(kind, n_done)`` is called
    as matrices finish; with ``n_done`` 0, ``kind`` is a phrase instead: which calibration batch's forward starts,
    then ``"projection"`` once they are done.
    ``kept``: the layers an interrupted run projected with the same settings are taken from it, and each group
    projected now goes to it (:mod:`memfit.compress.resume`). A MemfitError raised once projections
    have begun (a defect's non-finite factors, a covariance no ridge makes positive definite) leaves the model
    partly compressed: load it again to retry.
    """
    if activation_aware and calibration is None:
        raise MemfitError("activation-aware projection needs calibration data (--calib FILE or --calib-builtin)")
    proj.check_steps(steps)
    if len(placed := {str(p.device) for p in model.parameters()}) > 1:
        raise MemfitError(f"compress_model takes a model on one device (its calibration forward moves its layers to "
                          f"the projection device and back); this one's parameters are on {', '.join(sorted(placed))}")
    linears = decoder_linears(model)
    plan = plan_kinds(model_shapes(linears), method, ratio, blocks, ranks, skip)
    blocks = 1 if method == "lowrank" else blocks
    chosen = [n for n in linears if plan[n.rsplit(".", 1)[-1]].rank is not None]
    if broken := next((n for n in chosen if not bool(linears[n].weight.isfinite().all())), None):
        raise MemfitError(f"{broken}: its weight has non-finite values (inf or NaN), which no projection can fit; "
                          "nothing is written")
    work = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_device = next(model.parameters()).device
    digests: dict[int, str] = {}

    def cov_digest(cov: torch.Tensor) -> str:          # q/k/v and gate/up share one covariance: digested once
        if id(cov) not in digests:
            digests[id(cov)] = tensor_digest(cov)
        return digests[id(cov)]

    def say_batch(number: int, total: int | None) -> None:
        progress(f"calibration forward, batch {number}" + (f" of {total}" if total else ""), 0)

    covs = {}
    if calibration is not None:
        covs = input_covariances(model, chosen, calibration, work, on_batch=say_batch if progress else None)
        if progress:
            progress("projection", 0)
    result = CompressionResult(model, method, blocks, plan, ratio=None if ranks else ratio, skip=skip)
    for kind in KINDS:
        names = [n for n in chosen if n.rsplit(".", 1)[-1] == kind]
        if not names:
            continue
        kp = plan[kind]
        step = _chunk_size(method, kp, blocks, activation_aware)
        for start in range(0, len(names), step):
            group = names[start:start + step]
            W = torch.stack([linears[n].weight.detach().to(work, torch.float32) for n in group])
            cov = torch.stack([covs[n].to(work) for n in group]) if covs else None
            layers = sources = None
            if kept is not None:
                sources = {n: source_digest(linears[n], cov_digest(covs[n]) if activation_aware else None)
                           for n in group}
                layers = kept.layers(sources, lambda n, rank=kp.rank: empty_layer(method, linears[n], rank, blocks))
            if layers is None:
                try:
                    factors = project(method, W, kp.rank, blocks, cov if activation_aware else None, steps)
                except MemfitError as err:
                    raise MemfitError(f"{_names(group)}: {err}") from None
                _refuse_non_finite_factors(method, group, factors)
                layers = [build_layer(method, linears[name], kp.rank, blocks, [f[k].to(model_device) for f in factors])
                          for k, name in enumerate(group)]
                if kept is not None:
                    kept.keep(sources, layers)
            for k, (name, layer) in enumerate(zip(group, layers)):
                replace_module(model, name, layer)
                # the errors of the factors as saved (their dtype's rounding: in a bf16 model they had been the
                # fp32 factors'), multiplied out in float32 as the layer's forward accumulates
                saved = copy.deepcopy(layer).to(work, torch.float32).to_dense().detach()
                weight_err = float(proj.relative_weight_error(W[k], saved))
                out_err = None if cov is None else float(proj.relative_output_error(W[k], saved, cov[k]))
                result.layers[name] = structure_config(method, layer)
                result.report.append({"layer": name, "kind": kind, "rank": kp.rank,
                                      "in_features": kp.in_features, "out_features": kp.out_features,
                                      "weight_error": weight_err, "output_error": out_err,
                                      "activation_aware": activation_aware})
            if progress:
                progress(kind, len(group))
    return result


def structure_model(model: nn.Module, method: str, ratio: float | None = 0.5, blocks: int = 16,
                    ranks: dict[str, int] | None = None, skip: tuple[str, ...] | None = None) -> CompressionResult:
    """Swap in randomly initialised structured layers of the planned ranks, with no projection.

    For speed and memory measurements, which depend on shapes only (a random-init model
    projected would cost minutes and change nothing measured).
    """
    linears = decoder_linears(model)
    plan = plan_kinds(model_shapes(linears), method, ratio, blocks, ranks, skip)
    blocks = 1 if method == "lowrank" else blocks
    result = CompressionResult(model, method, blocks, plan, ratio=None if ranks else ratio, skip=skip)
    for name, linear in linears.items():
        kp = plan[name.rsplit(".", 1)[-1]]
        if kp.rank is None:
            continue
        layer = empty_layer(method, linear, kp.rank, blocks)
        replace_module(model, name, layer)
        result.layers[name] = structure_config(method, layer)
    return result
