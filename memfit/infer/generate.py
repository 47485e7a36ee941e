"""A decode loop with a static KV cache and one CUDA graph per decode step.

Hugging Face ``generate`` at batch 1 is launch-bound: hundreds of small kernels per token,
each launched from Python. Here the model's own layers (embedding, norms, q/k/v/o
projections, the MLP -- dense, ``PartialMLP``, bitsandbytes 4-bit or block-low-rank alike:
what is not a plain ``nn.Linear`` is called as it is) run in a fixed-shape step: the KV
cache is preallocated to the longest sequence, the step writes at a slot held in a device
tensor, and attention reads the whole cache under a mask. On CUDA the step (forward,
sampling, advancing the position) is captured once as a ``torch.cuda.CUDAGraph`` and
replayed per token.

Kernels per layer and step are what a batch-1 decode pays for beyond its weight bytes, so
with ``fused`` (the default) a layer whose weights are in memfit's fused layout
(``memfit.infer.fused``; ``load_model`` builds it) runs one q/k/v matmul, one gate/up
matmul over the active neurons and a compiled silu-multiply, instead of five matmuls and
two elementwise kernels; the attention mask is built additive once per step (not
converted per layer). Results then equal the Hugging Face modules' up to rounding
(different matmul shapes may sum in another order); ``fused=False`` with ``fast=False`` is
bit-exact with them (plain ``nn.Linear`` projections and the head are computed from their
weights, which skips any forward hooks on them).

With ``fast`` (the default on CUDA where Triton runs and the decode attention kernel takes the
heads; otherwise the previous loop, said once) a decode step (one token per sequence) also runs
memfit's decode kernels (``memfit.kernels.decode``, ``memfit.kernels.gemv``): one Triton
kernel per layer for rope of q and k, the K/V cache write and attention over the cache up
to the current slot (instead of three compiled kernels, a mask and SDPA), greedy argmax in
two Triton stages, and for each decode matmul shape (every plain ``nn.Linear`` the loop
computes, the head too) the faster of cuBLAS and a Triton GEMV, timed over all layers of
that shape before the graph is captured
(``matmul_paths``, ``attention_variant`` record the choices). These sum in another order
than cuBLAS/SDPA, so results equal the other path up to rounding; ``fast=False`` is the
previous loop.

Prompts: prefill runs eagerly over the whole (left-padded) batch and, for partial
models, selects the decode neurons (``memfit.infer.selection``). A long prompt (and ``score``'s teacher-forced rest)
runs in chunks of queries, each attending over the cache up to its own end. Prompts with no padding attend with no
mask: SDPA's lower-right causal attention (on CUDA flash attention, the G query heads a KV head reading its keys in
place, or memory-efficient attention where there are no groups; on the CPU a later chunk under a (T x keys) mask in
the model dtype, ``_causal_attention``), in chunks whose activations stay under ``PREFILL_ACTIVATION_BYTES``. A
left-padded batch attends under an additive mask of B x G x T x keys elements (G query heads a KV head), in chunks
whose mask stays under ``PREFILL_MASK_BYTES`` (the activations shrink with it); so does an unpadded one where SDPA
has no mask-free causal kernel for the model's dtype and heads (said once). A prompt that fits in one chunk runs as
one. Chunks equal the whole prompt's forward, and the two attentions each other, up to rounding (matmuls over fewer
rows may sum in another order). The graph is captured with the decode neuron counts before the first prompt;
selection permutes weights in place, so the captured pointers stay valid for every later prompt.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from memfit.errors import MemfitError, is_count
from memfit.infer.fused import act_mul, fused_gate_up, fused_qkv, plain_linear
from memfit.infer.selection import (
    begin_prompt,
    end_prompt,
    partial_mlps,
    set_decode_shape,
)
from memfit.kernels import gemv
from memfit.kernels.decode import (
    argmax,
    decode_attention,
    pick_attention,
    shape_problem,
)
from memfit.kernels.dispatch import use_triton
from memfit.log import logger, warn_once
from memfit.models.spec import SUPPORTED_TYPES

# The most bytes a prefill chunk's attention mask may take, with the two tensors it is built from (a bool mask and
# its additive form, before the G-fold copy): B x chunk x keys x (1 + (1 + G) x dtype bytes). A whole prompt's grows
# as T^2 and passes its KV cache (2 x layers x B x T x kv_dim x dtype bytes) from T = 2 x layers x kv_dim x dtype
# bytes / (1 + (1 + G) x dtype bytes) on: 2979 tokens for Llama-3.2-1B in bf16 (16 layers, kv_dim 512, G = 4).
PREFILL_MASK_BYTES = 64 * 2**20
# The most bytes a mask-free prefill chunk's activations may take (``Generator.token_bytes`` a query row): with no
# mask, they are what grows with a chunk (flash attention keeps no scores; on the CPU a later chunk's (T x keys)
# mask in the model dtype comes on top, built and freed by each layer's attention). ``score``'s logits of every token, a
# vocabulary's values a row, come on top: the caller gets them all.
PREFILL_ACTIVATION_BYTES = 256 * 2**20
# A masked chunk attends over the cache up to its end rounded up to this many slots (the later ones are masked):
# torch's memory-efficient attention on CUDA copies a mask whose rows are not a multiple of 8 elements into a padded
# one, and warns (pytorch/pytorch#114173). A mask-free chunk attends over exactly the slots up to its end.
KEY_ALIGN = 8


def _key_aligned(slots: int) -> int:
    """``slots`` rounded up to a multiple of KEY_ALIGN."""
    return -(-slots // KEY_ALIGN) * KEY_ALIGN


def cache_slots(max_len: int) -> int:
    """The slots a Generator's KV cache holds for ``max_len`` positions: rounded up to KEY_ALIGN (the spare ones never
    valid), so that every mask over it, a decode step's too, has rows SDPA's memory-efficient kernel takes as they
    are."""
    return _key_aligned(max_len)


def query_row_bytes(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, itemsize: int) -> int:
    """A query row's activations in a prefill chunk, all of a layer's counted as alive at once: the residual and its
    norm, q/k/v, the attention's output and its projection, then gate and up, silu(gate) and the product. An upper
    bound (what sizes a mask-free chunk); the ledger replays the chunk's ops for its prediction."""
    return itemsize * (4 * hidden + 2 * (heads + kv_heads) * head_dim + 4 * intermediate)


def prefill_chunk_queries(batch: int, keys: int, masked: bool, row_bytes: int, groups: int, itemsize: int) -> int:
    """Queries a prefill chunk holds (at least one) over ``keys`` cache slots: ``masked``, as many as keep its mask,
    with the two tensors it is built from, within ``PREFILL_MASK_BYTES``; else as many as keep its activations
    (``row_bytes`` a query row, :func:`query_row_bytes`) within ``PREFILL_ACTIVATION_BYTES``. ``groups``: query heads
    a KV head. Shared by :meth:`Generator.prefill_chunks` and the ledger's model of this loop."""
    if masked:
        return max(1, PREFILL_MASK_BYTES // max(1, mask_bytes_per_query(batch, keys, groups, itemsize)))
    return max(1, PREFILL_ACTIVATION_BYTES // (batch * row_bytes))


def mask_bytes_per_query(batch: int, keys: int, groups: int, itemsize: int) -> int:
    """Bytes a masked chunk's mask takes a query, with the two tensors it is built from (``Generator._mask``: a bool
    mask and its additive form, before the G-fold copy)."""
    return batch * keys * (1 + (1 + groups) * itemsize)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add, then RMSNorm of the sum: (sum, normed)."""
    x = x + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots):
    """Rotate q and k (B, T, heads, D), write k and v into the caches at ``slots``; returns q (B, H, T, D)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k_cache.index_copy_(2, slots, k)
    v_cache.index_copy_(2, slots, v)
    return q


def _attention(q, k_cache, v_cache, mask, scale):
    """SDPA over the cache slots given; the output's memory layout depends on the backend (e.g. (B, rows, heads,
    D))."""
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale)


def _masked_attention(q, k_seen, v_seen, mask, scale):
    """Attention of q (B, H, T, D) over the cache slots given, under the additive ``mask`` (B, 1, G*T, keys): q grouped
    per KV head (B, Hkv, G*T, D; row g*T + t is query head kv*G + g at token t), so the G query heads of a KV head
    share its keys without copies. Returns (B, T, H*D)."""
    B, H, T, D = q.shape
    grouped = q.reshape(B, k_seen.shape[1], H // k_seen.shape[1] * T, D)
    return _merge_heads(_attention(grouped, k_seen, v_seen, mask, scale), T)


def _causal_attention(q, k_seen, v_seen, scale):
    """SDPA of a chunk of queries q (B, H, T, D) at the last T of the ``keys`` cache slots given: each sees every key
    up to its own slot (lower-right causal; rows with no padding only). Returns (B, T, H*D).

    With torch's lower-right bias, which CUDA runs with no mask (flash or memory-efficient attention), as does any
    device but the CPU. There torch materialises that bias: the attention peaked 11.5-13.8 bytes per (query, key) pair
    above its output where T < keys and 10.3-11.3 where T = keys, in fp32 and bf16 at six shapes
    (``benchmarks/probes/cpu_causal_attention_memory.py``, f2c8868). So on the CPU a chunk of T = keys queries (a
    prompt's first) takes SDPA's own causal flag, the same attention with no mask, and a later one an additive
    (T, keys) mask in q's dtype, built here for this call (``cpu_causal_mask_bytes`` a chunk): 2.3-5.3 bytes a pair
    with the kernel's scratch, the outputs bit-identical to the bias's there."""
    heads, T = q.shape[1:3]
    keys, gqa = k_seen.shape[2], heads != k_seen.shape[1]
    if q.device.type != "cpu":
        bias = {"attn_mask": causal_lower_right(T, keys)}
    elif T == keys:
        bias = {"is_causal": True}
    else:
        bias = {"attn_mask": torch.full((T, keys), float("-inf"), dtype=q.dtype, device=q.device).triu_(keys - T + 1)}
    o = F.scaled_dot_product_attention(q, k_seen, v_seen, scale=scale, enable_gqa=gqa, **bias)
    return _merge_heads(o, T)                          # (B, H, T, D): one query row a head


def cpu_causal_mask_bytes(queries: int, keys: int, itemsize: int) -> int:
    """Bytes of the mask ``_causal_attention`` builds on the CPU for a chunk of ``queries`` over ``keys`` cache slots
    (none where they are equal); the ledger counts it."""
    return 0 if queries == keys else queries * keys * itemsize


def mask_free_causal_kernel(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                            head_dim: int) -> bool:
    """Whether SDPA attends lower-right causally with no mask for this model on this device, with its backends as they
    are switched now (``torch.nn.attention.sdpa_kernel``): on CUDA through flash or memory-efficient attention (in
    torch 2.11 the latter takes no grouped KV heads); elsewhere always (on the CPU a later chunk attends under a
    (T x keys) mask in the model dtype, ``_causal_attention``: B (1 + (1 + G) d) / d times smaller than
    ``Generator._mask``'s, d its bytes). On CUDA without either, torch would build that mask and run the math
    kernel, every score materialised and the KV heads copied out to the query heads. The answer does not depend on
    the sequence lengths: a few slots stand in for them."""
    if device.type != "cuda":
        return True
    q = torch.empty(1, heads, 8, head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, kv_heads, 8, head_dim, device=device, dtype=dtype)
    params = SDPAParams(q, kv, kv, None, 0.0, False, heads != kv_heads)
    return bool(can_use_flash_attention(params) or can_use_efficient_attention(params))


def _plain_projections(layer: nn.Module) -> bool:
    """Whether the layer's q/k/v and gate/up are plain ``nn.Linear`` (fusable; 4-bit and block-low-rank are not)."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    return all(map(plain_linear, projections))


def _merge_heads(o: torch.Tensor, T: int) -> torch.Tensor:
    """(B, Hkv, G*T, D) grouped attention output -> (B, T, H*D) in head order kv*G + g, whatever o's strides.

    Splitting a dim (``unflatten``) is a view for any strides; the final ``reshape`` copies only when the
    backend's layout needs it (a ``view`` there fails on the (B, rows, heads, D) layout of the
    memory-efficient and cuDNN kernels).
    """
    B, Hkv, rows, D = o.shape
    return o.unflatten(2, (rows // T, T)).permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * (rows // T) * D)


# The elementwise parts of a step: on CUDA they are compiled (dozens of tiny kernels a layer become a few);
# the matmuls are cuBLAS or the decode GEMV pick's (``_matmul``), or the model's own modules (4-bit, block-low-rank).
_EAGER = {"norm": _norm, "add_norm": _add_norm, "rope_and_cache": _rope_and_cache, "act_mul": act_mul}


_COMPILED: dict = {}
_CAPTURE_STREAMS: dict = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream per device on which every Generator warms up and captures its decode step: torch keeps a
    cuBLAS workspace (32 MiB) for every stream cuBLAS has run on, for the life of the process (as ``measure.timing``
    found for its own timing streams), and a new stream per Generator had left one behind each time cuBLAS ran there:
    in one process of ``benchmarks/ledger_accuracy.py --loop`` on an H100, the batch-4 and BLAST jobs read 2.99% and
    3.56% low with a stream each (8a45034), 2.02% and 1.81% with this one (da462fa). One such workspace is made here
    when the autotuner runs torch's matmul as a candidate in a warm-up (``ledger_snapshot.py --measured-peak``,
    results/logs/ledger_snapshot_loop_512_fba0819.log)."""
    key = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[key]


def _compiled() -> dict:
    """One compiled set per process, so every Generator reuses the compiled kernels."""
    if not _COMPILED:
        _COMPILED.update({name: torch.compile(fn, dynamic=False, fullgraph=True) for name, fn in _EAGER.items()})
    return _COMPILED


def use_decode_kernels(fast: bool | None, embed: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether a decode step runs memfit's decode kernels (``Generator``'s ``fast``).

    True forces them: a clear error where Triton cannot run or the decode attention kernel
    cannot take the heads. None: on CUDA when ``use_triton`` allows (so ``MEMFIT_KERNELS``
    overrides, as for every op) and the kernel takes the heads; a CUDA model that falls back
    to the previous loop says why, once. Off CUDA the default is the previous loop.
    """
    problem = shape_problem(heads, kv_heads, head_dim)
    if fast:
        use_triton("decode kernels", embed, path="triton")     # a clear error where Triton cannot run
        if problem is not None:
            raise MemfitError(f"fast=True: memfit's decode attention kernel cannot run this model: {problem}")
        return True
    if fast is not None or embed.device.type != "cuda":
        return False
    reason = problem if use_triton("decode kernels", embed) else ("MEMFIT_KERNELS=reference, no Triton, or weights "
                                                                  "in a dtype the kernels do not take")
    if reason is not None:
        warn_once("generate:no-decode-kernels", f"decode runs without memfit's decode kernels ({reason}): cuBLAS, "
                                                "compiled rope/cache writes and SDPA")
    return reason is None


def sliding_window(model) -> int | None:
    """The shortest sliding window among the model's attention layers (a query sees only that many keys, itself the
    last), or None where every layer attends over all earlier keys.

    Decided as the Hugging Face modelling code decides it: an attention module that carries ``sliding_window`` (Qwen2:
    set on the layers ``layer_types`` marks "sliding_attention", from ``max_window_layers`` on, and None on the others
    and on every layer when ``use_sliding_window`` is off) uses its own; any other layer the config's
    ``sliding_window`` (Mistral applies it to every layer, whatever ``layer_types`` says; Llama has none).
    """
    default = getattr(model.config, "sliding_window", None)
    windows = [getattr(layer.self_attn, "sliding_window", default) for layer in model.model.layers]
    return min((w for w in windows if w is not None), default=None)


def decode_length_problem(max_len: int, positions: int | None, window: int | None) -> str | None:
    """Why memfit's loop cannot decode ``max_len`` positions (prompt + new tokens) of a model with ``positions``
    position embeddings and a sliding ``window`` (None: none of either), or None where it can: it attends over the
    whole cache. :func:`check_decode_length` asks it of a model, the ledger's ``check_memfit_loop`` of a spec."""
    if positions is not None and max_len > positions:
        return f"prompt + new tokens = {max_len} exceeds the model's {positions} positions"
    if window is not None and max_len - 1 > window:
        return (f"this model attends over a sliding window of the last {window} tokens and memfit's decode loop has "
                f"none: with max_len = prompt + new tokens = {max_len} a token would see up to {max_len - 1}; keep "
                f"prompt + new tokens <= {window + 1}")
    return None


def check_decode_length(model, max_len: int) -> None:
    """Refuse a decode of ``max_len`` positions past the model's position embeddings or its sliding window
    (:func:`decode_length_problem`). Reads only the config and the attention modules' attributes, so a model built
    on the meta device answers it before any weight is read."""
    if problem := decode_length_problem(max_len, getattr(model.config, "max_position_embeddings", None),
                                        sliding_window(model)):
        raise MemfitError(problem)


@dataclass
class GenerationResult:
    tokens: torch.Tensor               # (B, new) generated ids
    prefill_s: float
    decode_s: float
    steps: int                         # decode steps timed (new tokens - 1: the first comes from prefill)
    graphs: bool
    peak_bytes: int | None = None      # CUDA max_memory_allocated since the caller last reset the peak stats
    selected: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens per second per sequence (prefill excluded)."""
        return self.steps / self.decode_s if self.decode_s > 0 else float("nan")


class Generator:
    """Static-cache generation for one model, batch size and maximum length.

    ``graphs``: None = use CUDA graphs on CUDA; False = eager steps (CPU, debugging).
    ``temperature``: 0 = greedy; a finite > 0 samples with the Gumbel-max trick (graph-safe).
    ``compile``: None = compile the elementwise helpers (norms, rope, cache writes) with
    ``torch.compile`` on CUDA, for the decode steps (a prefill runs them eagerly); a failed compile falls back to
    eager, said once.
    ``fused``: one matmul for q/k/v and one for gate/up where the weights are in the fused layout
    (equal to the model's modules up to rounding); False = the model's own modules, bit-exact.
    ``fast``: None = memfit's decode kernels on CUDA where they can run (see ``use_decode_kernels``); True
    forces them (on CPU only under the Triton interpreter, for tests); False = cuBLAS, compiled rope/cache
    writes, SDPA.

    Every query attends over all earlier keys in the cache: a model with a sliding window (``sliding_window``) shorter
    than the longest run of keys a query may see, ``max_len - 1`` (the last token is sampled, never attended from),
    is refused rather than decoded with attention it was not trained for. Within the window the two are the same.

    The loop rebuilds each layer from its projections, norms and rope, as Llama, Qwen2 and Mistral compute them
    (``memfit.models.spec.SUPPORTED_TYPES``): another architecture (Qwen3's q/k norms, ...) is refused, not decoded
    into wrong text.
    """

    def __init__(self, model, max_len: int, batch: int = 1, graphs: bool | None = None, temperature: float = 0.0,
                 compile: bool | None = None, fused: bool = True, fast: bool | None = None):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_TYPES:
            raise MemfitError(f"memfit's decode loop implements {', '.join(SUPPORTED_TYPES)} models, not model_type "
                              f"{cfg.model_type!r} (it would decode wrong text): use the model's own generate")
        if not (is_count(max_len, 2) and is_count(batch)):
            raise MemfitError(f"max_len must be an integer >= 2 and batch one >= 1, got max_len={max_len!r}, "
                              f"batch={batch!r}")
        if not math.isfinite(temperature) or temperature < 0:
            raise MemfitError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
        check_decode_length(model, max_len)
        self.model, self.max_len, self.batch, self.temperature = model, max_len, batch, float(temperature)
        embed = model.get_input_embeddings().weight
        self.device, self.dtype = embed.device, embed.dtype
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.token_bytes = query_row_bytes(cfg.hidden_size, self.heads, self.kv_heads, self.head_dim,
                                           cfg.intermediate_size, self.dtype.itemsize)
        layers = model.model.layers
        self.qkv = [fused_qkv(layer.self_attn) if fused else None for layer in layers]
        self.gate_up = [fused_gate_up(layer.mlp) if fused else None for layer in layers]
        self.fused_layers = sum(a is not None and b is not None for a, b in zip(self.qkv, self.gate_up))
        fusable = sum(_plain_projections(layer) for layer, a, b in zip(layers, self.qkv, self.gate_up)
                      if a is None or b is None)
        if fused and fusable:
            warn_once("generate:unfused", f"{fusable} of {len(layers)} layers decode with separate q/k/v and gate/up "
                                          "matmuls: their weights are not in memfit's fused layout (load the model "
                                          "with memfit.infer.load_model)")
        self.cache_len = cache_slots(max_len)
        shape = (batch, self.kv_heads, self.cache_len, self.head_dim)
        factory = {"device": self.device}
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, **factory) for _ in layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, **factory) for _ in layers]
        self.valid = torch.zeros(batch, self.cache_len, dtype=torch.bool, **factory)   # slot holds a real token
        self.key_slots = torch.arange(self.cache_len, **factory)
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.to(self.device, torch.float32)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        # decode-step state, all on the device so one graph replays every step
        self.tok = torch.zeros(batch, 1, dtype=torch.long, **factory)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, **factory)
        self.slot = torch.zeros(1, dtype=torch.long, **factory)
        self.step_index = torch.zeros(1, dtype=torch.long, **factory)
        self.out = torch.zeros(batch, max_len, dtype=torch.long, **factory)
        self.used: int | None = None     # cache slots the prompt and its decode steps fill: on the host, no sync
        self.graph = None
        self.fast = use_decode_kernels(fast, embed, self.heads, self.kv_heads, self.head_dim)
        self.matmul_paths: dict[str, str] = {}                      # decode matmul shape -> "cublas" or a GEMV variant
        self.attention_variant = None
        self.ops = _compiled() if (self.device.type == "cuda" if compile is None else compile) else _EAGER
        use_graphs = self.device.type == "cuda" if graphs is None else graphs
        if use_graphs and self.device.type != "cuda":
            raise MemfitError("CUDA graphs need the model on a CUDA device")
        if self.fast:
            self._plan_kernels()
            logger.debug("generate: decode attention %s; decode matmuls %s", self.attention_variant,
                         ", ".join(f"{shape} by {path}" for shape, path in self.matmul_paths.items()))
        if use_graphs:
            self._capture()
        elif self.ops is not _EAGER:
            self._warm_up()

    # ---- the model, step by step ---------------------------------------------------------
    def _rope(self, positions: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.rope_scale).to(self.dtype)[:, None], (emb.sin() * self.rope_scale).to(self.dtype)[:, None])

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, keys: int,
                 logits: str | None, decode: bool = False, causal: bool = False) -> torch.Tensor | None:
        """Forward ``ids`` (B, T) at rope ``positions`` (B, T), writing K/V at cache ``slots`` (T,) and attending over
        the cache's first ``keys`` slots (every slot a query may see: the last of ``slots`` and earlier). Returns the
        logits of the ``"last"`` token or of ``"all"``, or None (a prefill chunk before the last needs only the
        cache).

        ``causal``: ``slots`` are the last T of the ``keys`` and every row's slots before them hold real tokens, so
        attention needs no mask (``_causal_attention``); else it runs under ``_mask``.

        ``decode``: a decode step (one token a row, the same shapes every step) runs the compiled helpers and, with
        ``fast``, memfit's attention kernel (no mask); anything else (a prefill chunk, even of one token, or a scored
        run) the eager helpers and SDPA (its matmuls take the planned paths of the shapes planned): each new length
        would be another compile, and past dynamo's recompile limit (torch._dynamo.config.recompile_limit, 8 by
        default) a fullgraph call fails outright (FailOnRecompileLimitHit in a test process that had run many
        lengths)."""
        model, (B, T) = self.model, ids.shape
        x = model.get_input_embeddings()(ids)
        rope = self._rope(positions)
        kernels = self.fast and decode
        # key j is visible to the query at slot s when it holds a token and j <= s; every query sees itself.
        # Additive and in the model dtype, built once per step: SDPA would convert a bool mask in every layer.
        mask = None if kernels or causal else self._mask(slots, B, self.heads // self.kv_heads, T, keys)
        ops = self.ops if decode else _EAGER
        layers = model.model.layers
        h = ops["norm"](x, layers[0].input_layernorm.weight, layers[0].input_layernorm.variance_epsilon)
        for i, layer in enumerate(layers):
            post = layer.post_attention_layernorm
            x, h = ops["add_norm"](x, self._attend(i, h, rope, slots, keys, mask, kernels, causal, ops), post.weight,
                                   post.variance_epsilon)
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            x, h = ops["add_norm"](x, self._mlp(i, layer.mlp, h, ops), following.weight, following.variance_epsilon)
        if logits is None:
            return None
        return self._project(model.get_output_embeddings(), h[:, -1:] if logits == "last" else h)

    def _attend(self, i: int, h: torch.Tensor, rope, slots: torch.Tensor, keys: int, mask: torch.Tensor | None,
                kernels: bool, causal: bool, ops: dict) -> torch.Tensor:
        """Layer ``i``'s attention of ``h`` (B, T, hidden) through its o projection, K/V written into the cache. A
        method of its own so that q, k, v and the attention's output are freed when it returns, before the MLP runs
        (held as the loop's locals, they had been alive through it: 2 q_dim + 2 kv_dim elements a query)."""
        (B, T), (H, Hkv, D) = h.shape[:2], (self.heads, self.kv_heads, self.head_dim)
        cos, sin = rope
        attn = self.model.model.layers[i].self_attn
        if self.qkv[i] is not None:
            qkv = self._matmul(h, *self.qkv[i]).view(B, T, H + 2 * Hkv, D)
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
        else:
            q, k, v = (self._project(proj, h).view(B, T, -1, D) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if kernels:
            o = decode_attention(q[:, 0], k[:, 0], v[:, 0], cos[:, 0, 0], sin[:, 0, 0], self.k_cache[i], self.v_cache[i],
                                 self.valid, slots, attn.scaling, self.attention_variant).view(B, 1, H * D)
        else:
            q = ops["rope_and_cache"](q, k, v, cos, sin, self.k_cache[i], self.v_cache[i], slots)
            k_seen, v_seen = self.k_cache[i][:, :, :keys], self.v_cache[i][:, :, :keys]
            o = (_causal_attention(q, k_seen, v_seen, attn.scaling) if causal
                 else _masked_attention(q, k_seen, v_seen, mask, attn.scaling))
        return self._project(attn.o_proj, o)

    def _mask(self, slots: torch.Tensor, B: int, G: int, T: int, keys: int) -> torch.Tensor:
        """SDPA's additive mask (B, 1, G*T, keys) over the cache's first ``keys`` slots: key j is visible to the query
        at slot s when it holds a token and j <= s; every query sees itself. In the model dtype, built once per step
        (SDPA would convert a bool mask in every layer)."""
        key_slots = self.key_slots[:keys]
        visible = key_slots[None, :] <= slots[:, None]
        mask = (self.valid[:, None, :keys] & visible[None]) | (key_slots[None, :] == slots[:, None])[None]
        mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
        return mask[:, None, None].expand(B, 1, G, T, keys).reshape(B, 1, G * T, keys)

    def prefill_chunks(self, stop: int, first: int = 0, masked: bool = True) -> list[tuple[int, int]]:
        """The ranges [start, end) of query slots ``first``..``stop - 1`` (a prompt's prefill: 0..T - 1) that run as
        one forward each, at least one query a chunk: ``masked``, as many as keep the chunk's mask, with the two
        tensors it is built from, within ``PREFILL_MASK_BYTES`` over ``stop`` keys; else as many as keep its
        activations within ``PREFILL_ACTIVATION_BYTES``."""
        size = prefill_chunk_queries(self.batch, self._keys_through(stop), masked, self.token_bytes,
                                     self.heads // self.kv_heads, self.dtype.itemsize)
        return [(start, min(start + size, stop)) for start in range(first, stop, size)]

    def _attends_mask_free(self, stop: int) -> bool:
        """Whether queries up to slot ``stop`` attend with no mask: every row's slots before it hold real tokens (no
        left padding; one host sync) and SDPA has a mask-free causal kernel here now (where it has none, said
        once)."""
        if not bool(self.valid[:, :stop].all()):
            return False
        if mask_free_causal_kernel(self.device, self.dtype, self.heads, self.kv_heads, self.head_dim):
            return True
        warn_once("generate:masked-prefill", f"prompts without padding prefill under an attention mask, in smaller "
                                             f"chunks: SDPA has no mask-free causal kernel for {self.dtype} with "
                                             f"{self.heads} query and {self.kv_heads} KV heads of {self.head_dim} on "
                                             f"{self.device} (or its flash and memory-efficient kernels are off)")
        return False

    def _keys_through(self, end: int) -> int:
        """The cache slots a masked chunk of queries ending at slot ``end`` attends over: ``end``, rounded up to
        KEY_ALIGN (the cache's length is a multiple of it)."""
        return min(self.cache_len, _key_aligned(end))

    def _forward_in_chunks(self, ids: torch.Tensor, positions: torch.Tensor, first: int, logits: str) -> torch.Tensor:
        """Forward ``ids`` (B, n) at ``positions`` (B, n) into cache slots ``first``..``first + n - 1``, a chunk of
        queries at a time (:meth:`prefill_chunks`), each attending over the cache up to its end: the last token's
        logits (``"last"``) or every token's (``"all"``)."""
        stop = first + ids.shape[1]
        causal = self._attends_mask_free(stop)
        chunks = self.prefill_chunks(stop, first, masked=not causal)
        if len(chunks) > 1:
            logger.debug("generate: %d tokens forward in %d chunks of queries (%s)", stop - first, len(chunks),
                         f"no mask, their activations within {PREFILL_ACTIVATION_BYTES} bytes" if causal
                         else f"their masks within {PREFILL_MASK_BYTES} bytes")
        outputs = []
        for start, end in chunks:
            rows = slice(start - first, end - first)
            wanted = logits if logits == "all" or end == stop else None
            out = self._forward(ids[:, rows], positions[:, rows], self.key_slots[start:end],
                                end if causal else self._keys_through(end), wanted, causal=causal)
            if out is not None:
                outputs.append(out)
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]

    def _matmul(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) by the path planned for this decode shape (cuBLAS for any other; a prefill's head over the
        last tokens has the decode step's shape, and takes its path)."""
        if not self.matmul_paths:
            return F.linear(x, w, bias)
        path = self.matmul_paths.get(gemv.shape_key(x.numel() // x.shape[-1], w, bias), gemv.CUBLAS)
        return gemv.linear(x, w, bias, path)

    def _project(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A projection module: a plain ``nn.Linear`` through ``_matmul``, anything else (4-bit, block-low-rank)
        called."""
        return self._matmul(x, proj.weight, proj.bias) if plain_linear(proj) else proj(x)

    def _decode_matmuls(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of every matmul a decode step runs through ``_matmul``, with partial layers at their decode
        count: fused q/k/v or each plain-linear projection of an unfused layer (a compressed model's dense k/v), o,
        fused gate/up and down, and the head."""
        products = []
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            if self.qkv[i] is not None:
                products.append(self.qkv[i])
                projections = [attn.o_proj]
            else:
                projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            products += [(p.weight, p.bias) for p in projections if plain_linear(p)]
            if self.gate_up[i] is not None:
                gate_up, down = self.gate_up[i]
                a = getattr(layer.mlp, "compute", gate_up.shape[0])
                products += [(gate_up[:a].flatten(0, 1), None), (down[:, :a], None)]
        head = self.model.get_output_embeddings()
        if plain_linear(head):
            products.append((head.weight, head.bias))
        return products

    @torch.no_grad()
    def _plan_kernels(self) -> None:
        """Time the decode attention variants and, per decode matmul shape, cuBLAS against the GEMV variants
        (each over all layers of that shape; cached on disk by ``pick_variant``); off CUDA the defaults."""
        self.attention_variant = pick_attention(list(zip(self.k_cache, self.v_cache)), self.heads,
                                                self.model.model.layers[0].self_attn.scaling)
        for key, weights in self.matmul_groups().items():
            x = torch.randn(self.batch, weights[0][0].shape[1], dtype=self.dtype, device=self.device)
            self.matmul_paths[key] = gemv.pick_path(x, weights)

    def matmul_groups(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]]:
        """The decode matmuls grouped by ``gemv.shape_key`` (what one path choice covers)."""
        groups: dict[str, list] = {}
        for w, b in self._decode_matmuls():
            groups.setdefault(gemv.shape_key(self.batch, w, b), []).append((w, b))
        return groups

    def _mlp(self, i: int, mlp, h: torch.Tensor, ops: dict) -> torch.Tensor:
        """The layer's FFN: one gate/up matmul over the active neurons, silu-multiply, down (or the module itself)."""
        if self.gate_up[i] is None:
            return mlp(h)
        gate_up, down = self.gate_up[i]
        a = getattr(mlp, "active", gate_up.shape[0])      # PartialMLP: every loaded neuron at prefill, the selected at decode
        g = ops["act_mul"](self._matmul(h, gate_up[:a].flatten(0, 1)))
        if hasattr(mlp, "observe"):
            mlp.observe(g)
        return self._matmul(g, down[:, :a])

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy at temperature 0, else the Gumbel-max trick: argmax(logits / T + noise). Below T = 1 the same
        argmax is taken of those scores times T, logits + T noise, which no float32 overflows (logits / 1e-39 had
        been inf, token 0): a temperature too small to move the scores samples the greedy token, its limit."""
        pick = argmax if self.fast else (lambda scores: scores.argmax(-1))
        if self.temperature == 0:
            return pick(logits)
        noise = -torch.log(-torch.log(torch.rand_like(logits, dtype=torch.float32).clamp_(1e-20, 1)))
        if self.temperature < 1:
            return pick(logits.float() + self.temperature * noise)
        return pick(logits.float() / self.temperature + noise)

    def _step(self) -> None:
        """One decode token: forward ``tok`` at ``slot``, sample the next, advance (all on device)."""
        self.valid.index_fill_(1, self.slot, True)
        logits = self._forward(self.tok, self.pos, self.slot, self.cache_len, "last", decode=True)[:, -1]
        nxt = self._sample(logits)[:, None]
        self.tok.copy_(nxt)
        self.out.index_copy_(1, self.step_index, nxt)
        self.pos += 1
        self.slot += 1
        self.step_index += 1

    @torch.no_grad()
    def _warm_up(self) -> None:
        """Two steps (compiling the helpers); a compile failure switches to the eager helpers."""
        try:
            for _ in range(2):
                self._step()
        except Exception as err:  # torch.compile raises many error types (backend, lowering, missing compiler)
            if self.ops is _EAGER:
                raise
            warn_once("generate:no-compile", f"torch.compile of the decode helpers failed ({type(err).__name__}: "
                                             f"{str(err).splitlines()[0] if str(err) else ''}); running them eagerly")
            self.ops = _EAGER
            for _ in range(2):
                self._step()

    @torch.no_grad()
    def _capture(self) -> None:
        set_decode_shape(self.model)
        try:
            stream = _capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._warm_up()         # lazy inits, compiles and cuBLAS workspaces happen outside capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                self._step()
            self.graph = graph
        except RuntimeError as err:     # e.g. a kernel that synchronises; eager still works
            warn_once("generate:no-graph", f"CUDA graph capture failed ({str(err).splitlines()[0]}); decoding eagerly")
            self.graph = None
            torch.cuda.synchronize(self.device)
        for mlp in partial_mlps(self.model):
            mlp.restore()

    # ---- public ----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Reset the cache, run the prompts (B, T; left-padded), select decode neurons; returns the first new tokens."""
        self._check_prompts(input_ids, attention_mask)
        return self._prefill(input_ids, attention_mask)[1]

    def _check_prompts(self, input_ids, attention_mask) -> None:
        """Prompts as the loop reads them: (batch, T >= 1) token ids within the vocabulary, a mask of their shape. A
        1-D, empty or out-of-vocabulary prompt had ended in an IndexError deep in the loop or the embedding. Checked
        once per public call (one host sync, before any timing starts)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
                or input_ids.is_complex() or input_ids.dtype == torch.bool or input_ids.shape[1] < 1:
            raise MemfitError("input_ids must be an integer tensor of shape (batch, prompt length >= 1), got "
                              + (f"{input_ids.dtype} of shape {tuple(input_ids.shape)}"
                                 if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__))
        if input_ids.shape[0] != self.batch:
            raise MemfitError(f"this generator was built for batch {self.batch}, got {input_ids.shape[0]} prompts")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        low, high = torch.stack(torch.aminmax(input_ids)).tolist()
        if low < 0 or high >= vocab:
            raise MemfitError(f"input_ids hold ids from {low} to {high}; the model's vocabulary is 0 to {vocab - 1}")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise MemfitError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                              f"{tuple(input_ids.shape)}")

    def _prefill(self, input_ids, attention_mask):
        B, T = input_ids.shape
        if T >= self.max_len:
            raise MemfitError(f"the prompt ({T} tokens) leaves no room in max_len={self.max_len}")
        input_ids = input_ids.to(self.device)
        mask = torch.ones(B, T, dtype=torch.bool, device=self.device) if attention_mask is None else attention_mask.to(self.device).bool()
        if not bool(mask[:, -1].all()):
            raise MemfitError("pad prompts on the left: the last position of every prompt must be a real token")
        self.valid.zero_()
        self.valid[:, :T] = mask
        positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)
        begin_prompt(self.model, mask)
        logits = self._forward_in_chunks(input_ids, positions, 0, "last")[:, -1]
        self.selected = end_prompt(self.model)
        first = self._sample(logits)[:, None]
        self.tok.copy_(first)
        self.pos.copy_(positions[:, -1:] + 1)
        self.slot.fill_(T)
        self.used = T
        self.step_index.fill_(1)
        self.out.zero_()
        self.out[:, :1] = first
        return logits, first

    @torch.no_grad()
    def decode(self, steps: int) -> None:
        """Run ``steps`` more decode steps after a prefill, each filling the next cache slot. Refused, before any
        step runs, where they would pass ``max_len`` (a step there had indexed out of range: on CUDA a device-side
        assert inside the replayed graph, which ends the process's CUDA context)."""
        if self.used is None:
            raise MemfitError("decode continues a prompt: call prefill(input_ids) first")
        if not is_count(steps, 0) or self.used + steps > self.max_len:
            raise MemfitError(f"decode({steps!r}) takes an integer from 0 to {self.max_len - self.used}, the cache "
                              f"slots left of max_len={self.max_len}: build the Generator with a larger max_len")
        self.used += steps
        for _ in range(steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new: int, attention_mask: torch.Tensor | None = None,
                 on_tokens=None, eos: int | Iterable[int] | None = None) -> GenerationResult:
        """Generate ``max_new`` tokens after the prompts. ``on_tokens(ids (B,))`` streams each new token
        (one host sync per token); with ``eos``, an id or several (an instruct model's end of turn beside its end of
        text), batch 1 stops at the first of them it generates."""
        self._check_prompts(input_ids, attention_mask)
        T = input_ids.shape[1]
        if max_new < 1 or T + max_new > self.max_len:
            raise MemfitError(f"max_new={max_new} must be >= 1 and fit in max_len={self.max_len} after a {T}-token prompt")
        self._sync()
        t0 = time.perf_counter()
        first = self._prefill(input_ids, attention_mask)[1]
        self._sync()
        t1 = time.perf_counter()
        steps = max_new - 1
        stops = {eos} if isinstance(eos, int) else set(eos or ())
        if on_tokens is None and not stops:
            self.decode(steps)
        else:
            token = first[:, 0]
            if on_tokens:
                on_tokens(token.cpu())
            done = 0
            while done < steps and not (stops and self.batch == 1 and int(token[0]) in stops):
                self.decode(1)
                done += 1
                token = self.tok[:, 0]
                if on_tokens:
                    on_tokens(token.cpu())
            steps = done
        self._sync()
        t2 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        tokens = self.out[:, : steps + 1].to("cpu", copy=True)    # a copy: the next prompt reuses ``out``
        return GenerationResult(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps,
                                graphs=self.graph is not None, peak_bytes=peak, selected=self.selected)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Teacher-forced logits (B, T - prompt_len, V) predicting tokens prompt_len..T-1.

        The prompt (first ``prompt_len`` tokens) runs as a prefill and selects neurons; the rest runs as a prefill
        does (in chunks of queries) with the selected neurons: what token-by-token decode would compute, up to
        rounding (a decode step's matmuls and attention may run memfit's kernels, these cuBLAS and SDPA).
        """
        self._check_prompts(input_ids, None)
        B, T = input_ids.shape
        if not 0 < prompt_len < T <= self.max_len:
            raise MemfitError(f"score needs 0 < prompt_len ({prompt_len}) < length ({T}) <= max_len ({self.max_len})")
        first, _ = self._prefill(input_ids[:, :prompt_len], None)
        if T - 1 == prompt_len:
            return first[:, None]
        slots = self.key_slots[prompt_len:T - 1]
        self.valid[:, prompt_len:T - 1] = True
        positions = slots[None].expand(B, -1)
        rest = self._forward_in_chunks(input_ids[:, prompt_len:T - 1].to(self.device), positions, prompt_len, "all")
        return torch.cat([first[:, None], rest], dim=1)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every parameter except the embedding table (one row is
    read), partial FFN layers counted at their decode neuron count, plus bitsandbytes quant-state absmax."""
    embed = model.get_input_embeddings().weight
    total = 0
    tied = model.get_output_embeddings().weight is embed
    seen = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or (p is embed and not tied):
                continue
            seen.add(id(p))
            nbytes = p.numel() * p.element_size()
            if name.endswith("_weight") and hasattr(module, "compute"):   # PartialMLP
                nbytes = nbytes * module.compute // module.loaded
            total += nbytes
            state = getattr(p, "quant_state", None)
            if state is not None and getattr(state, "absmax", None) is not None:
                total += state.absmax.numel() * state.absmax.element_size()
    return total
