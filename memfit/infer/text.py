"""Text <-> token ids for the verbs that read or write text (generate, calibrate, compress, finetune).

In order: the model directory's own Hugging Face tokenizer, memfit's byte-level
tokenizer (``memfit.data.tokenizer``, used by the models our scripts train), else raw
UTF-8 bytes as ids 0..255. Bytes for a model directory are said once per directory, since a
model not trained on them reads noise (a directory whose tokenizer memfit does not find, e.g.
vocab.json and merges.txt alone, was tokenized as bytes unsaid).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memfit.data.jsonl import encode_text
from memfit.errors import MemfitError
from memfit.local import load_hf_tokenizer
from memfit.log import warn_once

_HF_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class TextCodec:
    encode: Callable[[str], list[int]]            # as the tokenizer encodes a text by default (a BOS where it adds one)
    decode: Callable[[list[int]], str]
    stops: frozenset[int]                         # the ids that end a continuation (none for raw bytes)
    kind: str
    encode_plain: Callable[[str], list[int]]      # as memfit finetune encodes its examples (encode_text)


def _memfit_bytes():
    try:
        from memfit.data.tokenizer import ByteTokenizer
    except ImportError:
        return None
    tok = ByteTokenizer()

    def decode(ids):
        kept = [int(i) for i in ids if 0 <= int(i) < tok.vocab_size]
        if len(kept) < len(ids):
            warn_once("text:out-of-vocab", f"dropping generated ids outside the byte tokenizer's {tok.vocab_size} "
                                           "(the model's vocabulary is larger: a random-init model?)")
        return tok.decode(kept)

    return TextCodec(tok.encode, decode, frozenset({tok.eos_id}), "memfit-bytes", lambda text: encode_text(tok, text))


def generation_stops(model_dir: str | Path) -> frozenset[int]:
    """The ids ``generation_config.json`` ends generation at (its ``eos_token_id``: an id or a list), none where it
    has none. Instruct models list more than the tokenizer's EOS there (Llama-3's ``<|eot_id|>``, Qwen2.5's
    ``<|im_end|>``), and Hugging Face's generate stops at any of them: memfit had gone on past them."""
    try:
        value = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):      # no file, not JSON, not an object
        return frozenset()
    ids = value if isinstance(value, list) else [value]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def load_codec(model_dir: str | Path | None, vocab: int) -> TextCodec:
    """The tokenizer for ``model_dir`` (see module doc)."""
    if model_dir is not None and any((Path(model_dir) / name).is_file() for name in _HF_FILES):
        tok = load_hf_tokenizer(model_dir)
        stops = frozenset({tok.eos_token_id} - {None}) | generation_stops(model_dir)
        return TextCodec(lambda text: tok.encode(text), lambda ids: tok.decode(ids, skip_special_tokens=True),
                         stops, "hf", lambda text: encode_text(tok, text))
    codec = _memfit_bytes()
    if codec is None:
        warn_once("text:raw-bytes", "no tokenizer in the model directory and no memfit.data.tokenizer: "
                                    "using raw UTF-8 bytes as token ids 0..255")
        raw = lambda text: list(text.encode("utf-8"))  # noqa: E731 - no special tokens either way
        codec = TextCodec(raw, lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace"),
                          frozenset(), "raw-bytes", raw)
    if vocab < 256:
        raise MemfitError(f"a byte-level tokenizer needs a vocabulary of at least 256 ids; this model has {vocab}")
    if model_dir is not None:
        warn_once(f"text:bytes:{model_dir}", f"text tokenized as bytes ({codec.kind}): {model_dir} has none of "
                  f"{', '.join(_HF_FILES)}; right only for a model trained on byte ids (memfit's own)")
    return codec
