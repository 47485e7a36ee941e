"""A small English text corpus that every Python installation carries: its documentation.

Documents are the ``pydoc`` help topics (``pydoc_data.topics``: the language reference
sections, ~0.5 MB) and the docstrings of a fixed list of pure standard-library modules
(their classes and functions). Nothing is downloaded, so the same script trains and
evaluates on every machine; the text differs slightly between Python versions, so
results carry the version. Modules with import side effects (GUI, ``this``,
``antigravity``) are not on the list.
"""
from __future__ import annotations

import importlib
import inspect
import sys
import warnings

import torch

MODULES = (
    "abc argparse array ast asyncio base64 bisect builtins calendar cmd codecs collections "
    "collections.abc concurrent.futures configparser contextlib copy csv dataclasses datetime "
    "decimal difflib dis doctest email email.message enum filecmp fnmatch fractions ftplib "
    "functools getopt gettext glob gzip hashlib heapq hmac html html.parser http.client "
    "http.server imaplib inspect io ipaddress itertools json json.decoder logging "
    "logging.handlers lzma mailbox math mimetypes multiprocessing numbers operator optparse os "
    "os.path pathlib pickle pickletools pkgutil platform plistlib poplib pprint profile pstats "
    "queue quopri random re reprlib sched secrets selectors shelve shlex shutil signal smtplib "
    "socket socketserver sqlite3 ssl statistics string stringprep struct subprocess symtable "
    "sys sysconfig tabnanny tarfile tempfile textwrap threading time timeit token tokenize "
    "trace traceback tracemalloc types typing unittest unittest.mock urllib.parse "
    "urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree "
    "xml.sax zipfile zipimport zlib"
).split()


def _from_stdlib(obj) -> bool:
    """Whether ``obj`` comes from the standard library: a method another package attached at run
    time (transformers adds ``warning_once`` &c. to ``logging.Logger``) is not the module's text,
    and the corpus must not depend on what else the process has imported."""
    origin = getattr(obj, "__module__", None)
    return origin is None or origin.split(".")[0] in sys.stdlib_module_names


def _docstrings(module) -> list[str]:
    docs = [inspect.getdoc(module) or ""]
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name, None)
        if getattr(obj, "__module__", None) != module.__name__ or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                if not attr.startswith("_") and inspect.isroutine(member) and _from_stdlib(member):
                    docs.append(inspect.getdoc(member) or "")
    return [d for d in docs if len(d) >= 40]


def corpus_documents() -> list[str]:
    """The corpus as a list of documents, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [topics[key] for key in sorted(topics)]
    for name in MODULES:
        with warnings.catch_warnings():  # deprecated aliases (typing.io ...) warn when touched
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except ImportError:  # e.g. a Python built without sqlite3/ssl
                continue
            docs.extend(_docstrings(module))
    seen, unique = set(), []
    for doc in docs:  # inherited methods repeat their docstrings
        if doc not in seen:
            seen.add(doc)
            unique.append(doc)
    return unique


def split_documents(val_every: int = 20) -> tuple[list[str], list[str]]:
    """``(train_docs, val_docs)``: every ``val_every``-th document is held out for validation."""
    docs = corpus_documents()
    return [d for k, d in enumerate(docs) if k % val_every], [d for k, d in enumerate(docs) if k % val_every == 0]


def build_corpus(val_every: int = 20) -> tuple[str, str]:
    """``(train_text, val_text)`` with documents separated by blank lines (e.g. calibration text)."""
    train, val = split_documents(val_every)
    return "\n\n".join(train), "\n\n".join(val)


def token_splits(val_every: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation token streams (1-D long tensors) of the byte tokenizer, documents joined by eos. (It had
    taken any tokenizer and failed for every one but the byte tokenizer, which every caller uses.)"""
    from memfit.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    train, val = split_documents(val_every)

    def stream(docs: list[str]) -> torch.Tensor:
        ids = []
        for doc in docs:
            ids.extend(tok.encode(doc))
            ids.append(tok.eos_id)
        return torch.tensor(ids, dtype=torch.long)

    return stream(train), stream(val)


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def dev_test_split(held_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out stream's two halves: ``dev`` to choose when training stops (early stopping),
    ``test`` for the perplexity reported, so no reported number was used to choose a checkpoint."""
    half = held_out.numel() // 2
    return held_out[:half], held_out[half:]
