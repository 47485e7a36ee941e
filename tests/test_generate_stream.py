"""``memfit generate`` with one prompt streams its continuation: with a byte-level tokenizer a multi-byte character
arrives a byte per token, and what is printed must still be the decoded text (it had been U+FFFD for each one)."""
import pytest
import torch

import memfit.infer.generate as generate
from memfit.cli import main
from memfit.infer.generate import GenerationResult
from memfit.models import PRESETS, save_model_dir

TEXT = "café€ 10🙂!"            # 2-, 3- and 4-byte characters, two of them back to back


def _hf_byte_fallback(directory):
    """A Hugging Face tokenizer of byte tokens only (<0x00>..<0xFF> as ids 0..255), decoded by byte fallback, which
    turns a whole run of byte tokens that is not valid UTF-8 (an unfinished character at its end) into U+FFFD."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<unk>": 256, "</s>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(directory)


class _Bytes:
    """Stands in for the decode loop: streams TEXT's UTF-8 bytes as the generated token ids (byte b is id b for
    both tokenizers)."""

    def __init__(self, *args, **kwargs):
        pass

    def generate(self, ids, max_new, attention_mask=None, on_tokens=None, eos=None):
        tokens = list(TEXT.encode())
        for token in tokens:
            on_tokens(torch.tensor([token]))
        return GenerationResult(torch.tensor([tokens]), 0.0, 1.0, len(tokens) - 1, False)


@pytest.mark.parametrize("tokenizer", ["memfit-bytes", "hf-byte-fallback"])
def test_streamed_text_is_the_decoded_text(tokenizer, tmp_path, monkeypatch, capsys):
    directory = save_model_dir(PRESETS["tiny"], tmp_path / "model")        # no tokenizer files: memfit's bytes
    if tokenizer == "hf-byte-fallback":
        _hf_byte_fallback(directory)
    monkeypatch.setattr(generate, "Generator", _Bytes)
    assert main(["generate", str(directory), "--prompt", "hi", "--max-new", str(len(TEXT.encode())),
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == TEXT + "\n"


def test_generation_stops_at_every_end_id_the_generation_config_lists(tmp_path, monkeypatch, capsys):
    """An instruct model lists its end of turn in generation_config.json beside the tokenizer's end of text
    (Llama-3's <|eot_id|>), and Hugging Face's generate stops at any of them; memfit had gone on past them. The
    command passes every one to the loop, which stops at the first it generates, and cuts a batch's rows there."""
    import json

    from memfit.infer.text import load_codec

    directory = save_model_dir(PRESETS["tiny"], tmp_path / "model")
    _hf_byte_fallback(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, ord("!")]}))
    assert load_codec(directory, 512).stops == {257, ord("!")}
    passed = []

    class Stopping(_Bytes):
        def generate(self, ids, max_new, attention_mask=None, on_tokens=None, eos=None):
            passed.append(eos)
            tokens = [[*b"ok!", *b"no"]] * ids.shape[0]
            return GenerationResult(torch.tensor(tokens), 0.0, 1.0, 4, False)

    monkeypatch.setattr(generate, "Generator", Stopping)
    assert main(["generate", str(directory), "--prompt", "a", "--prompt", "b", "--max-new", "5", "--device",
                 "cpu"]) == 0
    assert passed == [None] and capsys.readouterr().out.split("\n")[1] == "ok"
    assert main(["generate", str(directory), "--prompt", "a", "--max-new", "5", "--device", "cpu"]) == 0
    assert passed[-1] == {257, ord("!")}


def test_the_loop_stops_at_any_of_the_ids_it_is_given():
    from memfit.models import build_model

    model = build_model(PRESETS["tiny"], dtype="float32", device="cpu")
    loop = generate.Generator(model, 16, graphs=False, compile=False)
    prompt = torch.tensor([[1, 2, 3]])
    first = int(loop.generate(prompt, 4).tokens[0, 0])
    assert loop.generate(prompt, 4, eos={first, 7}).steps == 0
    assert loop.generate(prompt, 4, eos=[7]).steps == 3


def test_a_seed_makes_sampled_text_repeat(tmp_path, capsys):
    """Sampling from the command line could not be repeated: there was no --seed."""
    directory = save_model_dir(PRESETS["tiny"], tmp_path / "model")

    def sampled(*extra):
        assert main(["generate", str(directory), "--prompt", "hi", "--max-new", "12", "--device", "cpu",
                     "--no-graphs", *extra]) == 0
        return capsys.readouterr().out

    assert sampled("--temperature", "1", "--seed", "3") == sampled("--temperature", "1", "--seed", "3")
    assert sampled("--temperature", "1", "--seed", "3") != sampled("--temperature", "1", "--seed", "4")
    assert main(["generate", str(directory), "--prompt", "hi", "--seed", "3", "--device", "cpu"]) == 2
    assert "--seed seeds the sampling of --temperature > 0" in capsys.readouterr().err


@pytest.mark.parametrize("tokens, said", [([257, *b"no"], "first token is end-of-text: an empty continuation"),
                                          ([*b"ok", 257], "end-of-text token after 2 tokens"),
                                          ([*b"okay"], "stopped at --max-new 4")])
def test_the_command_says_why_a_continuation_ended(tokens, said, tmp_path, monkeypatch, capsys):
    """A model whose greedy first token is end-of-text (a short fine-tune's adapter) had printed an empty line and
    nothing else."""
    directory = save_model_dir(PRESETS["tiny"], tmp_path / "model")
    _hf_byte_fallback(directory)

    class Ending(_Bytes):
        def generate(self, ids, max_new, attention_mask=None, on_tokens=None, eos=None):
            shown = tokens[:next((i + 1 for i, token in enumerate(tokens) if token in (eos or ())), len(tokens))]
            if on_tokens:
                for token in shown:
                    on_tokens(torch.tensor([token]))
            rows = [tokens] * ids.shape[0] if on_tokens is None else [shown]
            return GenerationResult(torch.tensor(rows), 0.0, 1.0, len(rows[0]) - 1, False)

    monkeypatch.setattr(generate, "Generator", Ending)
    assert main(["generate", str(directory), "--prompt", "a", "--max-new", "4", "--device", "cpu"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert said in err and ("(--temperature samples others)" in err) == (tokens[0] == 257)
    assert main(["generate", str(directory), "--prompt", "a", "--max-new", "4", "--device", "cpu", "--temperature",
                 "1"]) == 0
    assert "--temperature samples others" not in capsys.readouterr().err             # sampling already
    assert main(["generate", str(directory), "--prompt", "a", "--prompt", "b", "--max-new", "4", "--device", "cpu"]) == 0
    first = capsys.readouterr().out.split("\n")[0]
    assert first.startswith("--- prompt 1: 'a' (") and said in first
