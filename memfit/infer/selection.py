"""Partial computation: per-prompt choice of the FFN neurons that decode computes.

The rule (SelectInfer / PartInfer): during prefill, which runs over every *loaded*
neuron, each prompt token keeps its top ``TOKEN_KEEP`` (20%) activations among the
loaded neurons, counting only positive ones; each neuron's count is how many tokens
kept it. Decode then computes the ``base`` neurons (the top-delta neurons of the task
ranking, always kept) plus the most frequently kept others, ``compute`` neurons in all.
Ties go to the neuron ranked higher by calibration.

Decode must not gather. ``PartialMLP`` therefore *permutes its own weights in place*
so that the chosen neurons come first: gate and up live interleaved per neuron in one
(k, 2, hidden) buffer (``memfit.infer.fused``), so the first ``m`` neurons' gate and up
rows are one contiguous block ``[:m]`` (one matmul at decode), and down's columns
``[:, :m]`` are one contiguous run of ``m`` values in every output row (a
leading-dimension view: no copy, no index). The permutation costs one pass over
the layer's FFN weights per prompt (a temporary the size of one weight matrix) and is
undone at the next prompt (``restore``), so prefill always sees the loaded order and a
prompt's result never depends on the previous prompt.

Batch > 1: the weights are shared by the batch, so the batch shares one selection: the
counts are summed over every non-padding token of every sequence (the union of the
per-sequence counts), then the rule above is applied once.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError
from memfit.infer.fused import gate_up_buffer

TOKEN_KEEP = 0.2


def count_top_activations(h: torch.Tensor, keep: float = TOKEN_KEEP,
                          token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """How many tokens keep each neuron: per token, its top ``ceil(keep * k)`` activations that are > 0.

    ``h``: (..., k) activations at the down-projection input; ``token_mask``: bool of
    ``h.shape[:-1]`` (False for padding). Returns int64 counts of shape (k,).
    """
    k = h.shape[-1]
    top = max(1, math.ceil(keep * k))
    flat = h.reshape(-1, k)
    values, index = flat.topk(top, dim=-1)
    kept = values > 0
    if token_mask is not None:
        kept &= token_mask.reshape(-1, 1).to(device=kept.device, dtype=torch.bool)
    counts = torch.zeros(k, dtype=torch.int64, device=h.device)
    return counts.scatter_add_(0, index.reshape(-1), kept.reshape(-1).to(torch.int64))


def choose_neurons(counts: torch.Tensor, base: torch.Tensor, m: int, priority: torch.Tensor | None = None) -> torch.Tensor:
    """Positions (ascending) of the ``m`` neurons decode computes: every ``base`` one, then the most counted.

    ``priority``: lower is better, breaks ties in count (calibration rank); position breaks the rest.
    """
    k = counts.numel()
    if not 0 < m <= k:
        raise MemfitError(f"cannot compute {m} neurons out of {k} loaded: the count must be in 1..{k}")
    n_base = int(base.sum())
    if n_base > m:
        raise MemfitError(f"{n_base} base neurons do not fit in the {m} computed ones: lower delta or raise phi")
    order = torch.arange(k, device=counts.device)
    if priority is not None:
        order = torch.sort(priority, stable=True).indices
    key = counts.to(torch.float64).clone()
    key[base] = math.inf
    order = order[torch.sort(-key[order], stable=True).indices]
    return order[:m].sort().values


class PartialMLP(nn.Module):
    """A gated FFN holding only its loaded neurons, computing all of them or the selected first ``m``.

    ``forward`` has the arithmetic of Hugging Face's ``LlamaMLP`` (``down(act(gate(x)) * up(x))``,
    gate and up as separate matmuls): with every neuron loaded and computed, the output
    is bit-for-bit the dense one. The decode loop's fused path instead runs one matmul over
    ``gate_up_weight[:active]`` and calls ``observe`` (equal up to rounding).
    Parameters: ``gate_up_weight`` (k, 2, hidden; ``gate_weight``/``up_weight`` are its
    halves), ``down_weight`` (hidden, k).
    Buffers: ``neuron_ids`` (original index of each loaded neuron, in current order),
    ``base`` (always computed), ``priority`` (calibration rank, lower is better).
    """

    def __init__(self, hidden: int, neuron_ids: torch.Tensor, base: torch.Tensor, priority: torch.Tensor,
                 compute: int, act_fn, dtype=None, device=None):
        super().__init__()
        k = int(neuron_ids.numel())
        if not 0 < compute <= k:
            raise MemfitError(f"a layer with {k} loaded neurons cannot compute {compute}")
        factory = {"dtype": dtype, "device": device}
        self.gate_up_weight = nn.Parameter(gate_up_buffer(k, hidden, **factory), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(hidden, k, **factory), requires_grad=False)
        buffer_device = device if str(device) != "meta" else "cpu"
        # copies: selection permutes these in place
        self.register_buffer("neuron_ids", neuron_ids.to(buffer_device, torch.int64, copy=True), persistent=False)
        self.register_buffer("base", base.to(buffer_device, torch.bool, copy=True), persistent=False)
        self.register_buffer("priority", priority.to(buffer_device, torch.int64, copy=True), persistent=False)
        self.act_fn = act_fn
        self.loaded = k
        self.compute = compute
        self.active = k          # neurons the forward uses: all at prefill, ``compute`` after selection
        self.counts: torch.Tensor | None = None
        self.token_mask: torch.Tensor | None = None
        self.observed = 0        # prompt tokens counted so far: a prefill in chunks observes the prompt a slice at a time

    def extra_repr(self) -> str:
        return f"loaded={self.loaded}, compute={self.compute}, base={int(self.base.sum())}, active={self.active}"

    @property
    def gate_weight(self) -> torch.Tensor:
        return self.gate_up_weight[:, 0]

    @property
    def up_weight(self) -> torch.Tensor:
        return self.gate_up_weight[:, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.active
        h = self.act_fn(F.linear(x, self.gate_weight[:a])) * F.linear(x, self.up_weight[:a])
        self.observe(h)
        return F.linear(h, self.down_weight[:, :a])

    def observe(self, h: torch.Tensor) -> None:
        """During a prompt's prefill, count the top activations of ``h`` (B, T, k), the down-projection input: the
        prompt's next T tokens (a prefill in chunks calls this once per chunk, in order)."""
        if self.counts is None:
            return
        mask = None
        if self.token_mask is not None:
            tokens = h.shape[-2]
            mask = self.token_mask[:, self.observed:self.observed + tokens]
            self.observed += tokens
        self.counts += count_top_activations(h, token_mask=mask)

    # ---- per-prompt selection ----------------------------------------------------------
    @property
    def selects(self) -> bool:
        """Whether decode computes fewer neurons than are loaded (else selection is a no-op)."""
        return self.compute < self.loaded

    @torch.no_grad()
    def _permute(self, perm: torch.Tensor) -> None:
        """Reorder the loaded neurons in place: new position i holds old position ``perm[i]``."""
        perm = perm.to(self.gate_up_weight.device)
        for half in (self.gate_weight, self.up_weight):   # one half at a time: a temporary of one matrix, not two
            half.copy_(half.index_select(0, perm))
        self.down_weight.copy_(self.down_weight.index_select(1, perm))
        perm = perm.to(self.neuron_ids.device)
        self.neuron_ids.copy_(self.neuron_ids[perm])
        self.base.copy_(self.base[perm])
        self.priority.copy_(self.priority[perm])

    def restore(self) -> None:
        """Back to the loaded order (ascending neuron id), computing every loaded neuron."""
        if self.selects and bool((self.neuron_ids[1:] < self.neuron_ids[:-1]).any()):
            self._permute(torch.argsort(self.neuron_ids))
        self.active = self.loaded

    def begin_prompt(self, token_mask: torch.Tensor | None = None) -> None:
        self.restore()
        if self.selects:
            self.counts = torch.zeros(self.loaded, dtype=torch.int64, device=self.gate_up_weight.device)
            self.token_mask, self.observed = token_mask, 0

    def end_prompt(self) -> torch.Tensor | None:
        """Apply the rule to this prompt's counts; returns the selected original neuron ids (or None)."""
        if not self.selects:
            return None
        if self.counts is None:
            raise MemfitError("end_prompt without begin_prompt: run the prompt's prefill between the two")
        chosen = choose_neurons(self.counts, self.base.to(self.counts.device), self.compute,
                                self.priority.to(self.counts.device))
        self.counts, self.token_mask = None, None
        rest = torch.ones(self.loaded, dtype=torch.bool, device=chosen.device)
        rest[chosen] = False
        self._permute(torch.cat([chosen, rest.nonzero().flatten()]))
        self.active = self.compute
        return self.neuron_ids[: self.compute].clone()


def partial_mlps(model: nn.Module) -> list[PartialMLP]:
    return [module for module in model.modules() if isinstance(module, PartialMLP)]


def begin_prompt(model: nn.Module, token_mask: torch.Tensor | None = None) -> None:
    """Before a prompt's prefill: restore every partial layer and start counting (``token_mask``: (B, T), False = padding)."""
    for mlp in partial_mlps(model):
        mlp.begin_prompt(token_mask)


def end_prompt(model: nn.Module) -> list[torch.Tensor | None]:
    """After the prefill: select each partial layer's decode neurons; returns them per partial layer."""
    return [mlp.end_prompt() for mlp in partial_mlps(model)]


def set_decode_shape(model: nn.Module) -> None:
    """Make every partial layer compute its decode count, without selecting (used to capture a CUDA graph)."""
    for mlp in partial_mlps(model):
        mlp.active = mlp.compute
