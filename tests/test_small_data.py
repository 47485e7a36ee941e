"""memfit.data: the byte tokenizer, the offline corpus and the LM train/eval loop."""
import math

import pytest
import torch

from memfit.data import ByteTokenizer, build_corpus, corpus_documents, token_splits
from memfit.data.lm import perplexity, random_windows, train_lm
from memfit.errors import MemfitError


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓ 🐍"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < tok.vocab_size == len(tok)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text + "<eos>"
    with pytest.raises(MemfitError, match="outside"):
        tok.decode([300])


def test_tokenizer_hf_style_call(tmp_path):
    tok = ByteTokenizer()
    batch = tok(["ab", "abc"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[97, 98, tok.pad_token_id], [97, 98, 99]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert tok.batch_decode(batch["input_ids"]) == ["ab", "abc"]
    tok.save_pretrained(tmp_path)
    assert ByteTokenizer.saved_in(tmp_path) and isinstance(ByteTokenizer.from_pretrained(tmp_path), ByteTokenizer)


def test_corpus_is_offline_english_and_split():
    docs = corpus_documents()
    assert len(docs) > 1000 and len(set(docs)) == len(docs)
    train, val = build_corpus()
    assert len(train) > 500_000 and 0.02 < len(val) / len(train) < 0.1
    assert "the" in val and "def" in train or "class" in train
    train_ids, val_ids = token_splits()
    assert train_ids.dtype == torch.long and int(train_ids.max()) < ByteTokenizer.vocab_size


def test_corpus_ignores_methods_other_packages_attach(monkeypatch):
    """transformers attaches warning_once &c. to logging.Logger when imported; such methods are
    not the standard library's text, and the corpus (so the train/validation split) must not
    depend on what else the process has imported."""
    import logging

    before = corpus_documents()

    def attached_elsewhere(self):
        """A method some package attached to a standard-library class at run time, long enough to count."""

    monkeypatch.setattr(logging.Logger, "attached_elsewhere", attached_elsewhere, raising=False)
    assert corpus_documents() == before


def test_random_windows_reach_the_streams_last_token():
    """The start's bound had left out the last window: the stream's last token was never a target, and a stream of
    exactly one window was torch's error; a shorter one is memfit's."""
    stream = torch.arange(10)
    windows = random_windows(stream, 200, 4, torch.Generator().manual_seed(0))
    assert int(windows.max()) == 9 and int(windows.min()) == 0
    assert random_windows(torch.arange(5), 2, 4).tolist() == [[0, 1, 2, 3, 4]] * 2
    with pytest.raises(MemfitError, match="4 tokens, fewer than one window of seq_len \\+ 1 = 5"):
        random_windows(torch.arange(4), 1, 4)


def test_lm_loop_lowers_perplexity():
    from memfit.models import ModelSpec, build_model

    torch.manual_seed(0)
    spec = ModelSpec("t", "llama", 1, 32, 64, 2, 1, 16, ByteTokenizer.vocab_size, dtype="float32")
    model = build_model(spec, dtype="float32", device=torch.get_default_device())   # where the stream is
    stream = torch.tensor(ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 40))
    assert random_windows(stream, 3, 16).shape == (3, 17)
    before = perplexity(model, stream, 32)
    stats = train_lm(model, stream, steps=30, batch=4, seq_len=32, lr=1e-2, warmup=3)
    assert stats["steps"] == 30 and perplexity(model, stream, 32) < 0.5 * before


@pytest.mark.parametrize("best_at", ["start", "middle", "end", "after_nan"])
def test_lm_loop_keeps_the_best_validated_parameters(best_at):
    """Early stopping: the model ends with the parameters it had at its best validation score
    (a NaN first score used to stay the best: nothing compares less than NaN)."""
    from memfit.models import ModelSpec, build_model

    torch.manual_seed(0)
    spec = ModelSpec("t", "llama", 1, 32, 64, 2, 1, 16, ByteTokenizer.vocab_size, dtype="float32")
    model = build_model(spec, dtype="float32", device=torch.get_default_device())   # where the stream is
    stream = torch.tensor(ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 40))
    scores = {"start": [1, 2, 3, 4, 5], "middle": [5, 4, 1, 2, 3], "end": [5, 4, 3, 2, 1],
              "after_nan": [math.nan, 5, 1, 2, 3]}[best_at]
    snapshots = []

    def validate():
        snapshots.append([p.detach().clone() for p in model.parameters()])
        return scores[len(snapshots) - 1]

    stats = train_lm(model, stream, steps=20, batch=4, seq_len=32, lr=1e-2, warmup=2, validate=validate,
                     validate_every=5)
    assert [step for step, _ in stats["validations"]] == [0, 5, 10, 15, 20]
    best = scores.index(min(s for s in scores if not math.isnan(s)))
    assert stats["best_step"] == 5 * best
    for got, want in zip(model.parameters(), snapshots[best]):
        assert torch.equal(got, want)
    assert not torch.equal(snapshots[0][0], snapshots[-1][0])      # training did move the weights


def test_lm_loop_validation_is_timed_apart_and_checked():
    """Scoring time is reported apart and left out of tokens_per_s; a stream too short for one
    window and a non-positive validate_every are clear errors (an empty dev set used to score a
    perfect 1.0 every time, so early stopping silently kept the untrained step-0 weights)."""
    import time

    from memfit.models import ModelSpec, build_model

    torch.manual_seed(0)
    spec = ModelSpec("t", "llama", 1, 32, 64, 2, 1, 16, ByteTokenizer.vocab_size, dtype="float32")
    model = build_model(spec, dtype="float32", device=torch.get_default_device())   # where the stream is
    stream = torch.tensor(ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 40))
    with pytest.raises(MemfitError, match="fewer than one window"):
        perplexity(model, stream[:32], 32)
    with pytest.raises(MemfitError, match="validate_every=0"):
        train_lm(model, stream, steps=2, batch=2, seq_len=16, validate=lambda: 1.0, validate_every=0)
    with pytest.raises(MemfitError, match="steps=0; give a positive number"):   # a ZeroDivisionError
        train_lm(model, stream, steps=0, batch=2, seq_len=16)
    assert train_lm(model, stream, steps=2, batch=2, seq_len=16, validate_every=0)["validate_seconds"] == 0.0

    def slow_score():
        time.sleep(0.05)
        return 1.0

    stats = train_lm(model, stream, steps=4, batch=2, seq_len=16, validate=slow_score, validate_every=2)
    assert [step for step, _ in stats["validations"]] == [0, 2, 4]
    assert stats["validate_seconds"] >= 0.1                          # steps 2 and 4; step 0 is before the clock
    assert stats["tokens_per_s"] == pytest.approx(stats["tokens"] / (stats["seconds"] - stats["validate_seconds"]))
