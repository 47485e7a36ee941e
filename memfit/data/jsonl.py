"""Fine-tuning data from JSONL: one example per line, loss only on the response tokens.

Each non-blank line is a JSON object of one of two forms:

* ``{"prompt": "...", "response": "..."}``
* ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``

They are rendered with one plain template (whatever the tokenizer):
prompt/response as ``prompt + "\\n"`` (no loss) then ``response`` + EOS (loss);
chat messages as ``"<|role|>\\n"`` (no loss) then ``content``, with the assistant's
content + EOS carrying the loss and every other part none. The text up to each EOS is
tokenized as one (:func:`_piece_tokens`). Labels of tokens without a loss are ``-100``.
Any malformed line stops the load with a message naming it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.errors import MemfitError, is_count
from memfit.files import input_file, read_input_text
from memfit.log import warn_once

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")
DEFAULT_DATA = Path(__file__).with_name("finetune_default.jsonl")


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def loss_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


PROMPT_TEMPLATE_FILE = "memfit_prompt_template.json"     # in an adapter memfit finetune saved: how it read prompts


def prompt_text(prompt: str) -> str:
    """A prompt/response example's prompt as it is trained on (tokenized with no special tokens, no loss): what
    ``memfit generate --adapter`` gives an adapter memfit finetune saved for a ``--prompt``, so that it reads what the
    adapter learnt from."""
    return prompt + "\n"


def record_prompt_template(adapter_dir: Path) -> None:
    """Mark ``adapter_dir`` as trained on :func:`prompt_text`'s template with no special tokens, which generate reads
    (:func:`has_prompt_template`); a peft adapter from elsewhere has no mark and gets its prompts as given."""
    (Path(adapter_dir) / PROMPT_TEMPLATE_FILE).write_text(json.dumps(
        {"prompt": prompt_text("{prompt}"), "special_tokens": False}) + "\n")


def has_prompt_template(adapter_dir: str | Path) -> bool:
    """Whether memfit finetune saved ``adapter_dir`` (:func:`record_prompt_template`)."""
    return (Path(adapter_dir) / PROMPT_TEMPLATE_FILE).is_file()


def _segments(record, where: str) -> list[tuple[str, bool]]:
    """(text, carries loss) pieces of one record; the EOS is added after every loss piece."""
    if not isinstance(record, dict):
        raise MemfitError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record and ("prompt" in record or "response" in record):   # messages had been taken, unsaid
        raise MemfitError(f"{where}: the record has both 'messages' and 'prompt'/'response'; give one form a line")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise MemfitError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        pieces = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise MemfitError(f"{where}: messages[{i}] must be an object with a string 'content'")
            role = message.get("role")
            if role not in ROLES:
                raise MemfitError(f"{where}: messages[{i}] has role {role!r}; use one of {', '.join(ROLES)}")
            pieces += [(f"<|{role}|>\n", False), (message["content"], role == "assistant")]
        if not any(loss for _, loss in pieces):
            raise MemfitError(f"{where}: the conversation has no assistant message, so nothing to learn")
        return pieces
    if "prompt" in record or "response" in record:
        for key in ("prompt", "response"):
            if not isinstance(record.get(key), str):
                raise MemfitError(f"{where}: {key!r} must be a string, got {record.get(key)!r}")
        if not record["response"]:
            raise MemfitError(f"{where}: 'response' is empty, so nothing to learn")
        return [(prompt_text(record["prompt"]), False), (record["response"], True)]
    raise MemfitError(f"{where}: expected keys 'prompt' and 'response', or 'messages'; got {sorted(record)}")


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of data or template ``text``: no special token added, and none made from text that spells one.
    Hugging Face tokenizers turn ``</s>`` or ``<|endoftext|>`` written in a text into that special token unless told
    ``split_special_tokens``: a response quoting one had trained an end of sequence mid-answer."""
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _utf8_text(pieces: list[tuple[str, bool]], where: str) -> list[tuple[str, bool]]:
    """``pieces``, where each text is one UTF-8 can hold: a JSON escape of half a surrogate pair (``"\\ud800"``) reads
    as a string no tokenizer can encode, which had ended in a UnicodeEncodeError's traceback."""
    for text, _ in pieces:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise MemfitError(f"{where}: the text holds half a surrogate pair ({text[err.start]!r} at character "
                              f"{err.start}), which is not text; write the character itself or its full pair") from None
    return pieces


def _piece_tokens(pieces: list[tuple[str, bool]], tokenizer) -> list[list[int]]:
    """Each piece's token ids, the text up to each EOS encoded as one: a SentencePiece tokenizer (Llama-2's,
    Mistral's) starts every text it encodes with a word boundary, so pieces encoded apart had put a spurious space
    token before every response and role marker. A piece's tokens are what its text adds to the encoding of the text
    before it; where that encoding is no prefix of the longer one (a token across the boundary), the piece starts a
    new encoding, as every piece did before."""
    tokens, text, before = [], "", []
    for piece, loss in pieces:
        ids = encode_text(tokenizer, text + piece)
        if ids[:len(before)] != before:
            text, before = "", []
            ids = encode_text(tokenizer, piece)
        tokens.append(ids[len(before):] + ([tokenizer.eos_token_id] if loss else []))
        text, before = ("", []) if loss else (text + piece, ids)
    return tokens


def _tokenize(pieces: list[tuple[str, bool]], tokenizer, max_len: int) -> tuple[Example | None, bool]:
    """Token ids and labels of one record's pieces, truncated to ``max_len`` (None if no loss token survives), and
    whether truncation cut any."""
    ids, labels = [], []
    for (_, loss), tokens in zip(pieces, _piece_tokens(pieces, tokenizer)):
        ids += tokens
        labels += tokens if loss else [IGNORE_INDEX] * len(tokens)
    cut = len(ids) > max_len
    ids, labels = ids[:max_len], labels[:max_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):  # label 0 is never predicted
        return None, cut
    return Example(tuple(ids), tuple(labels)), cut


def check_source(path: str | Path, max_len: int) -> Path:
    """``path`` as a readable JSONL file and ``max_len`` as a usable length (callers check before any work)."""
    if not is_count(max_len, 2):
        raise MemfitError(f"max_len (--max-len) must be an integer >= 2 (a prompt token and a response token), got "
                          f"{max_len!r}")
    return input_file(path, "data file", "pass a JSONL file")


def text_lines(path: Path, role: str = "data file") -> list[str]:
    """The lines of a UTF-8 text file, a byte-order mark first allowed (Windows Notepad writes one); a one-line
    MemfitError where the file is not UTF-8 (a PowerShell ``>`` redirect writes UTF-16) or cannot be read (naming its
    ``role``)."""
    try:                                                # split at newlines only: a JSON string may hold U+2028
        return read_input_text(path, role, encoding="utf-8-sig").removesuffix("\n").split("\n")
    except UnicodeDecodeError as err:
        raise MemfitError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None


def read_records(path: str | Path, max_len: int) -> list[list[tuple[str, bool]]]:
    """Every example of a JSONL file as its (text, carries loss) pieces, checked line by line: a MemfitError names the
    first bad line. No tokenizer is needed, so a caller checks the data before it loads a model."""
    path = check_source(path, max_len)
    records = []
    for number, line in enumerate(text_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise MemfitError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        except RecursionError:                          # json's own error for it: a traceback
            raise MemfitError(f"{where}: the JSON is nested too deeply to read") from None
        records.append(_utf8_text(_segments(record, where), where))
    if not records:
        raise MemfitError(f"{path}: no usable examples (the file is empty)")
    return records


def tokenize_records(path: str | Path, records: list[list[tuple[str, bool]]], tokenizer, max_len: int) -> list[Example]:
    """The examples of :func:`read_records`' ``records`` (read from ``path``), tokenized; those whose every response
    token truncation at ``max_len`` cut are dropped, said once, and so are those it cut short (their end and the EOS
    that teaches the model to stop are not trained: that had gone unsaid)."""
    tokenized = [_tokenize(pieces, tokenizer, max_len) for pieces in records]
    examples = [example for example, _ in tokenized if example is not None]
    if cut := sum(example is not None and was_cut for example, was_cut in tokenized):
        warn_once(f"jsonl:cut:{path}", f"{path}: {cut} example(s) were cut at {max_len} tokens, so their end and "
                  "its EOS are not trained; a longer --max-len keeps them whole")
    if dropped := len(records) - len(examples):
        warn_once(f"jsonl:dropped:{path}", f"{path}: {dropped} example(s) lost all response tokens to "
                  f"truncation at {max_len} tokens and were skipped")
    if not examples:
        raise MemfitError(f"{path}: no usable examples (every response was truncated away at {max_len} tokens)")
    return examples


def load_jsonl(path: str | Path, tokenizer, max_len: int) -> list[Example]:
    """All examples of a JSONL file, tokenized. Raises MemfitError naming the first bad line."""
    return tokenize_records(path, read_records(path, max_len), tokenizer, max_len)


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (padding labelled -100)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
