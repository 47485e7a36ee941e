"""ByteTokenizer: UTF-8 bytes as token ids 0..255, plus three special tokens.

Every machine can tokenize every text with it, with no vocabulary file: the small models
our benchmarks train use it, and so does any code that expects a Hugging Face-style
tokenizer (``encode``/``decode``/``__call__``/``batch_decode``, ``pad_token_id`` ...).
"""
from __future__ import annotations

import json
from pathlib import Path

from memfit.errors import MemfitError
from memfit.files import atomic_path

CONFIG_NAME = "memfit_tokenizer.json"


class ByteTokenizer:
    """Bytes 0..255 are themselves; ``pad=256``, ``bos=257``, ``eos=258``; ``vocab_size=259``."""

    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 259
    special_tokens = {"<pad>": 256, "<bos>": 257, "<eos>": 258}

    # Hugging Face attribute names for the same ids.
    pad_token_id, bos_token_id, eos_token_id = pad_id, bos_id, eos_id
    pad_token, bos_token, eos_token = "<pad>", "<bos>", "<eos>"
    padding_side = "right"

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False, add_special_tokens: bool = False,
               split_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens`` adds both bos and eos, as HF does). Text never becomes a
        special token here, so ``split_special_tokens`` (Hugging Face's switch for that) changes nothing."""
        if not isinstance(text, str):
            raise MemfitError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        if add_bos or add_special_tokens:
            ids.insert(0, self.bos_id)
        if add_eos or add_special_tokens:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped (or written by name), bad UTF-8 replaced."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out, names = bytearray(), {v: k for k, v in self.special_tokens.items()}
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i in names:
                if not skip_special_tokens:
                    out.extend(names[i].encode())
            else:
                raise MemfitError(f"token id {i} is outside the byte tokenizer's vocabulary (0..{self.vocab_size - 1})")
        return out.decode("utf-8", errors="replace")

    def batch_decode(self, batch, skip_special_tokens: bool = True) -> list[str]:
        if hasattr(batch, "tolist"):
            batch = batch.tolist()
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def __call__(self, text, add_special_tokens: bool = False, padding: bool | str = False, truncation: bool = False,
                 max_length: int | None = None, return_tensors: str | None = None) -> dict:
        """HF-style call: ``{"input_ids", "attention_mask"}`` for a str or a list of str."""
        single = isinstance(text, str)
        rows = [self.encode(t, add_special_tokens=add_special_tokens) for t in ([text] if single else text)]
        if truncation and max_length:
            rows = [r[:max_length] for r in rows]
        masks = [[1] * len(r) for r in rows]
        if padding or return_tensors:
            width = max_length if padding == "max_length" and max_length else max((len(r) for r in rows), default=0)
            if len({len(r) for r in rows}) > 1 and not padding:
                raise MemfitError("texts of different lengths need padding=True to become one tensor")
            masks = [m + [0] * (width - len(m)) for m in masks]
            rows = [r + [self.pad_id] * (width - len(r)) for r in rows]
        if return_tensors == "pt":
            import torch

            return {"input_ids": torch.tensor(rows, dtype=torch.long), "attention_mask": torch.tensor(masks, dtype=torch.long)}
        if return_tensors is not None:
            raise MemfitError(f"return_tensors={return_tensors!r}: only 'pt' or None")
        return {"input_ids": rows[0] if single else rows, "attention_mask": masks[0] if single else masks}

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write a small marker file so a model directory records its tokenizer.

        Written to a temp file and renamed, so a crash never leaves a truncated marker in the directory.
        """
        path = Path(directory) / CONFIG_NAME
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"tokenizer": "memfit-bytes", "vocab_size": self.vocab_size, **self.special_tokens}))
        return path

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "ByteTokenizer":
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise MemfitError(f"{directory}: no {CONFIG_NAME}; this directory was not saved with a ByteTokenizer")
        return cls()

    @staticmethod
    def saved_in(directory: str | Path) -> bool:
        return (Path(directory) / CONFIG_NAME).is_file()
