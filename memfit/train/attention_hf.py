"""memfit attention as a Hugging Face attention implementation (``attn_implementation="memfit"``).

``register()`` adds ``"memfit"`` to transformers' ``AttentionInterface``, and to
``AttentionMaskInterface`` a mask builder (:func:`memfit_attention_mask`) that hands the kernel
either no mask or a 2-D padding mask, never an N x N one, and a call with a KV cache (keys other
than the queries' own) SDPA's full mask. After that,
``build_model(spec, attn_implementation="memfit")`` or
``model.set_attn_implementation("memfit")`` runs every attention layer through
``memfit.kernels.attention.attention``:

* no mask: dense causal attention on (B, H, N, D);
* a padding mask: the valid tokens are packed (no padding computed) and run with
  ``cu_seqlens``, then scattered back (padded rows get zeros). Under ``torch.compile``, where
  packing's data-dependent shape would split the graph at every layer, the tokens stay in place
  and each row runs as its leading padding, its valid tokens and its trailing padding
  (:func:`_padded_in_place`: left or right padding; a mask with a hole is a device-side error).
  The mask builder still reads the mask to drop an all-true one: a few breaks per forward;
* packed batches (``cu_seq_lens_q`` from a flattening collator, or ``position_ids`` that
  restart): run packed as they are. Under ``torch.compile`` the ``position_ids`` are not
  inspected (reading them back to the host would split the graph, and its CUDA graphs, at
  every layer), said once: a packed batch must then carry ``cu_seq_lens_q``.

A layer with a sliding window shorter than its keys (Mistral, some Qwen2 layers) is refused: neither
kernel has the window (found in a review on 2026-12-02: such a layer had attended over every key).

A decode step (one query token against a KV cache, no gradient) runs memfit's kernel for it
(:func:`memfit.kernels.decode.cache_attention`: K and V read once per group of query heads, the
key mask as it is), where it takes the call (``cache_attention_problem``: e.g. a head dim that
is a power of two, at least 16). Other queries
shorter than their keys (a chunk against a cache) and a gradient through a cache go to
transformers' SDPA implementation, said once in the log; so does attention dropout, a padded or packed batch
with an explicit N x N mask (:func:`_with_dropout`). With a cache the mask is SDPA's: a
static cache's keys include its unfilled positions. Until this builder the FlashAttention one
gave them none, so decoding attended over those positions too (a tiny Llama's decode logits 0.1
off; the end-to-end benchmark's memfit-attention runs decoded that way).
"""
from __future__ import annotations

import torch

from memfit.kernels.attention import attention
from memfit.kernels.decode import cache_attention, cache_attention_problem
from memfit.kernels.dispatch import constant_when_compiled
from memfit.log import warn_once

NAME = "memfit"


def _packed(query, key, value, cu, max_len, causal, scale, backward):
    """(1, H, T, D) tensors with sequence offsets -> (1, T, H, D) output."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = attention(q, k, v, causal=causal, scale=scale, cu_seqlens=cu.to(torch.int32),
                    max_seqlen=int(max_len) if max_len is not None else None, backward=backward)
    return out.unsqueeze(0)


def _unpadded(query, key, value, mask, causal, scale, backward):
    """Run only the tokens where ``mask`` (B, N) is true, packed; padded positions get zeros."""
    b, h, n, d = query.shape
    valid = mask.bool().reshape(-1)
    idx = valid.nonzero().squeeze(1)
    lens = mask.bool().sum(1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    q, k, v = (t.transpose(1, 2).reshape(b * n, t.shape[1], d)[idx] for t in (query, key, value))
    out = attention(q, k, v, causal=causal, scale=scale, cu_seqlens=cu, max_seqlen=int(lens.max()),
                    backward=backward)
    full = out.new_zeros(b * n, h, d).index_copy(0, idx, out)
    return full.view(b, n, h, d)


def _padded_in_place(query, key, value, mask, causal, scale, backward):
    """:func:`_unpadded` for torch.compile: packing has a data-dependent shape (and its longest sequence is read
    back to the host), which split the graph at every layer. Here every token stays where it is: each of the B
    rows runs as three sequences, its leading padding, its valid tokens and its trailing padding (3B + 1 fixed
    offsets), so the valid tokens attend only to each other, and the padded positions are zeroed after. Padding
    is computed (as an unpadded kernel would compute it). Each row's valid tokens must be contiguous (left or right
    padding, as tokenizers pad); a mask with a hole stops the run by an assert on the device (on CUDA a device-side
    assert, which leaves the process's CUDA context unusable). Eager runs take any mask (:func:`_unpadded`)."""
    b, h, n, d = query.shape
    valid = mask.bool()
    position = torch.arange(n, device=valid.device)
    end = torch.where(valid, position + 1, 0).amax(1)                 # one past each row's last valid token
    first = torch.minimum(torch.where(valid, position, n).amin(1), end)
    torch._assert_async((valid.sum(1) == end - first).all(),
                        "memfit attention under torch.compile takes a padding mask whose valid tokens are contiguous "
                        "in each row (left or right padding)")
    row = torch.arange(b, device=valid.device) * n
    cu = torch.nn.functional.pad(torch.stack([row + first, row + end, row + n], 1).reshape(-1), (1, 0))
    q, k, v = (t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (query, key, value))
    out = attention(q, k, v, causal=causal, scale=scale, cu_seqlens=cu.to(torch.int32), max_seqlen=n,
                    backward=backward)
    return torch.where(valid[:, :, None, None], out.view(b, n, h, d), 0)


def memfit_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention-function signature; returns ``(output (B, N, H, D), None)``."""
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        from memfit.errors import MemfitError

        raise MemfitError(f"memfit attention has no sliding window: this layer attends over the last {window} keys "
                          f"and has {key.shape[2]}; load the model with attn_implementation='sdpa'")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    backward = getattr(module, "memfit_attention_backward", "two_pass")
    training_dropout = dropout and module.training
    if (query.shape[2] == 1 < key.shape[2] and not training_dropout and not torch.is_grad_enabled()
            and cache_attention_problem(query, key, value, attention_mask) is None):
        return cache_attention(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
    if query.shape[2] != key.shape[2] or (attention_mask is not None and attention_mask.dim() != 2):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        warn_once("attention_hf:fallback", "memfit attention: a query chunk against a KV cache, a decode step its "
                  "cache kernel cannot take (e.g. a head dim not a power of two), a gradient through a cache, "
                  "or a non-padding mask; these calls use transformers' SDPA attention")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    cu, max_len = _packed_offsets(query, kwargs) if attention_mask is None else (None, None)
    if training_dropout:
        return _with_dropout(module, query, key, value, attention_mask, cu, causal, dropout, scaling, kwargs), None
    if attention_mask is not None:
        unpad = _padded_in_place if torch.compiler.is_compiling() else _unpadded
        return unpad(query, key, value, attention_mask, causal, scaling, backward), None
    if cu is not None:
        return _packed(query, key, value, cu, max_len, causal, scaling, backward), None
    out = attention(query, key, value, causal=causal and query.shape[2] > 1, scale=scaling, backward=backward)
    return out.transpose(1, 2).contiguous(), None


def _packed_offsets(query, kwargs) -> tuple:
    """(cu_seqlens, longest sequence) of a packed batch: ``cu_seq_lens_q`` from the collator, or offsets made from
    ``position_ids`` that restart; (None, None) for one sequence per row."""
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    position_ids = kwargs.get("position_ids")
    if cu is None and position_ids is not None and query.shape[0] == 1 and position_ids.shape[-1] > 1 \
            and _restart(position_ids):
        from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

        (cu, _), (max_len, _) = prepare_fa_kwargs_from_position_ids(position_ids)
    return cu, max_len


def _with_dropout(module, query, key, value, attention_mask, cu, causal, dropout, scaling, kwargs):
    """Attention with dropout, which memfit's kernels do not have, by transformers' SDPA attention. One sequence per
    row, no padding: SDPA as it is (causal by its flag). Padding or packed sequences: SDPA takes neither a 2-D
    padding mask nor packed offsets, so they become a (B, 1, N, N) mask, N^2 booleans per row (said once). Until
    this function both went to SDPA as they were: a padded batch of more than one row raised (the (B, N) mask does
    not broadcast against the scores), one padded row was attended without its causal mask (SDPA turns is_causal
    off when given a mask), and packed sequences were attended as one. Padded query rows attend to every key (no
    row is empty, so none is NaN) and are zeroed after, as the kernels' padded rows are."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    warn_once("attention_hf:dropout", "memfit attention: attention dropout runs by transformers' SDPA attention "
              "(memfit's kernels have no dropout), with an explicit N x N mask where the batch is padded or packed")
    if attention_mask is None and cu is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=causal, **kwargs)[0]
    n = query.shape[2]
    position = torch.arange(n, device=query.device)
    allowed = position[None, :] <= position[:, None] if causal else torch.ones(n, n, dtype=torch.bool,
                                                                              device=query.device)
    if cu is not None:
        sequence = torch.bucketize(position, cu[1:].to(query.device), right=True)
        allowed = allowed & (sequence[:, None] == sequence[None, :])
    allowed = allowed[None, None]
    valid = None if attention_mask is None else attention_mask.bool()
    if valid is not None:
        allowed = allowed & valid[:, None, None, :] | ~valid[:, None, :, None]
    out, _ = sdpa_attention_forward(module, query, key, value, allowed, dropout=dropout, scaling=scaling, **kwargs)
    return out if valid is None else torch.where(valid[:, :, None, None], out, 0)


def _restart(position_ids: torch.Tensor) -> bool:
    """Whether ``position_ids`` restart (a packed batch); not inspected under torch.compile."""
    if torch.compiler.is_compiling():
        return _not_inspected_when_compiled()
    return bool((position_ids[..., 1:] < position_ids[..., :-1]).any())


@constant_when_compiled
def _not_inspected_when_compiled() -> bool:
    """False, said once. torch.compile runs this while tracing and keeps its result as a
    constant, so the warning costs no graph break."""
    warn_once("attention_hf:compiled-position-ids", "memfit attention under torch.compile does not check "
              "position_ids for restarts (that would split the graph at every layer): a packed batch that carries "
              "only position_ids is attended as one sequence; pass cu_seq_lens_q with it")
    return False


def memfit_attention_mask(**kwargs):
    """transformers' mask-builder signature (keywords only). Where the keys are the queries' own (no cache), the
    FlashAttention-style mask: None or the 2-D padding mask, which the kernel takes. It reads the mask to drop an
    all-true one: under torch.compile a few graph breaks per forward, not per layer (passing an all-true mask on
    instead sent it where None had gone: a packed batch's ``cu_seq_lens_q`` and dropout's SDPA fallback). Otherwise
    the keys come from a KV cache, and the call goes to the decode kernel or to SDPA
    (:func:`memfit_attention_forward`), which take SDPA's own mask: a static cache's keys include the positions it
    has not filled yet."""
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    q_length = kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]   # transformers 4.x
    return (flash_attention_mask if q_length == kwargs["kv_length"] else sdpa_mask)(**kwargs)


def register() -> str:
    """Make ``attn_implementation="memfit"`` available to every transformers model; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, memfit_attention_forward)
    AttentionMaskInterface.register(NAME, memfit_attention_mask)
    return NAME


def set_backward_variant(model: torch.nn.Module, variant: str) -> None:
    """Choose the attention backward variant (``memfit.kernels.attention.VARIANTS``) for every layer."""
    from memfit.errors import MemfitError
    from memfit.kernels.attention import VARIANTS

    if variant not in VARIANTS:
        raise MemfitError(f"backward variant {variant!r} is not one of {', '.join(VARIANTS)}")
    for module in model.modules():
        if hasattr(module, "is_causal") and hasattr(module, "num_key_value_groups"):
            module.memfit_attention_backward = variant
