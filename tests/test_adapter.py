"""A LoRA adapter merged into a loaded model (memfit.infer.adapter) against peft's own merge, and `memfit generate
--adapter`: the fine-tuned model's text, and the adapters and options it refuses."""
import dataclasses
import json

import pytest
import torch

from memfit.cli import main
from memfit.errors import MemfitError
from memfit.infer.adapter import merge_adapter
from memfit.infer.partial_load import load_model
from memfit.models import PRESETS, save_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_model_dir(PRESETS["tiny"], tmp_path_factory.mktemp("tiny"), dtype="float32")


def _adapter(base_dir, out, rslora=False, dtype=torch.float32, **lora):
    """A peft adapter of ``base_dir`` whose every LoRA B and the trained norm are random, so the merge shows."""
    from transformers import AutoModelForCausalLM

    from memfit.train.patch import lora_config, patch

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    config = lora_config({"r": 4, "lora_alpha": 12, "use_rslora": rslora, "modules_to_save": ["model.norm"], **lora})
    model = patch(model, lora=config, fused_ce=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=generator, device="cpu") * 0.5)
    model.save_pretrained(out)
    return out


def _peft_merged(base_dir, adapter, dtype=torch.float32):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    return PeftModel.from_pretrained(base, adapter).merge_and_unload()


@pytest.mark.parametrize("rslora", [False, True])
def test_the_merge_is_peft_s_into_memfit_s_fused_layout(tiny_dir, tmp_path, rslora):
    adapter = _adapter(tiny_dir, tmp_path / "adapter", rslora)
    reference = dict(_peft_merged(tiny_dir, adapter).named_parameters())
    model = load_model(tiny_dir, None, dtype=torch.float32)         # q/k/v and gate/up views of shared buffers
    before = {name: param.clone() for name, param in model.named_parameters()}
    merge_adapter(model, adapter)
    merged = dict(model.named_parameters())
    assert set(merged) <= set(reference)
    changed = [name for name in merged if not torch.equal(merged[name], before[name])]
    assert any("q_proj" in name for name in changed) and any("up_proj" in name for name in changed)
    assert "model.norm.weight" in changed
    for name, param in merged.items():                   # the reference is on the default device, CUDA in GPU runs
        torch.testing.assert_close(param, reference[name].cpu(), rtol=1e-6, atol=1e-6, msg=name)


def test_a_16_bit_model_merges_within_a_rounding_of_peft(tiny_dir, tmp_path):
    adapter = _adapter(tiny_dir, tmp_path / "adapter", dtype=torch.bfloat16)
    reference = dict(_peft_merged(tiny_dir, adapter, torch.bfloat16).named_parameters())
    model = load_model(tiny_dir, None, dtype=torch.bfloat16)
    merge_adapter(model, adapter)
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16
        torch.testing.assert_close(param, reference[name].cpu(), rtol=2 ** -7, atol=2 ** -7, msg=name)   # a bf16 ulp


def test_generate_with_an_adapter_writes_the_merged_models_text(tiny_dir, tmp_path, capsys):
    """What a run of memfit finetune saves is read back by generate: its text is that of peft's merged model saved
    whole and generated from, and not the base model's. On the test device: CUDA in the GPU runs, where the merge
    writes CUDA weights and the decode loop replays a CUDA graph."""
    adapter = _adapter(tiny_dir, tmp_path / "adapter")
    _peft_merged(tiny_dir, adapter).save_pretrained(tmp_path / "merged")
    common = ["--prompt", "hello", "--max-new", "12", "--device", torch.get_default_device().type]

    def text(*argv):
        assert main(["generate", *argv, *common]) == 0
        return capsys.readouterr().out

    with_adapter = text(str(tiny_dir), "--adapter", str(adapter))
    assert with_adapter == text(str(tmp_path / "merged"))
    assert with_adapter != text(str(tiny_dir))


def test_adapters_that_cannot_merge_are_refused(tiny_dir, tmp_path, capsys):

    def fails(argv, message):
        assert main(["generate", str(tiny_dir), "--prompt", "hi", "--device", "cpu", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err

    fails(["--adapter", str(tmp_path)], "not a LoRA adapter directory")
    fails(["--adapter", ""], "not a LoRA adapter directory")              # blank: not taken as left out
    adapter = _adapter(tiny_dir, tmp_path / "adapter")
    fails(["--adapter", str(adapter), "--load", "0.5", "--full-first", "0", "--full-last", "0"],
          "--adapter with partial FFN layers")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    fails(["--adapter", str(adapter)], "only plain LoRA adapters merge here, this one has DoRA")
    other = save_model_dir(dataclasses.replace(PRESETS["tiny"], hidden=2 * PRESETS["tiny"].hidden), tmp_path / "wider",
                           dtype="float32")
    with pytest.raises(MemfitError, match=r"it holds model.layers.0.*as \(.*\), this model's is \("):
        merge_adapter(load_model(other, None, dtype=torch.float32), _adapter(tiny_dir, tmp_path / "fresh"))
    head = _adapter(tiny_dir, tmp_path / "head", target_modules=["q_proj", "lm_head"])
    fails(["--adapter", str(head)], "this one has lm_head trained (this merge takes the decoder layers")


def test_a_refused_adapter_changes_no_weight(tiny_dir, tmp_path):
    """Every tensor is checked before the first is merged: a library caller's model is not left half-merged."""
    from safetensors.torch import load_file, save_file

    adapter = _adapter(tiny_dir, tmp_path / "adapter")
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({**tensors, "base_model.model.model.not_here.weight": torch.ones(3)}, adapter / "adapter_model.safetensors")
    model = load_model(tiny_dir, None, dtype=torch.float32)
    before = {name: param.clone() for name, param in model.named_parameters()}
    with pytest.raises(MemfitError, match="it holds model.not_here.weight as \\(3,\\), this model's is absent"):
        merge_adapter(model, adapter)
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())


def test_what_finetune_saves_generates(tiny_dir, tmp_path, capsys, monkeypatch):
    """The round trip a user makes: memfit finetune on a local model, then generate with its OUT/adapter."""
    out = tmp_path / "run"
    monkeypatch.chdir(tiny_dir.parent)                  # the model named as a user types it, relative
    assert main(["finetune", tiny_dir.name, "--out", str(out), "--steps", "2", "--batch-size", "2", "--max-len", "32",
                 "--device", "cpu", "--train-norm"]) == 0
    assert main(["generate", str(tiny_dir), "--adapter", str(out / "adapter"), "--prompt", "hi", "--max-new", "4",
                 "--device", "cpu", "--no-graphs"]) == 0
    config = (out / "adapter" / "adapter_config.json").read_text()   # peft finds the base from anywhere (not as typed)
    assert json.loads(config)["base_model_name_or_path"] == str(tiny_dir.resolve())
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Loading weights" not in err      # transformers' bar, beside memfit's own
    base, tuned = (load_model(tiny_dir, None, dtype=torch.float32) for _ in range(2))
    merge_adapter(tuned, out / "adapter")                # the saved adapter moves the weights it trained
    moved = {name for (name, a), b in zip(base.named_parameters(), tuned.parameters()) if not torch.equal(a, b)}
    assert "model.norm.weight" in moved and any("q_proj" in name for name in moved)


@pytest.mark.parametrize("marked, raw", [(True, False), (True, True), (False, False)])
def test_generate_encodes_a_finetune_adapters_prompt_as_it_was_trained(tiny_dir, tmp_path, monkeypatch, marked, raw):
    """finetune trains on PROMPT + newline with no special tokens; generate had given its adapter the prompt as the
    tokenizer encodes it by default (a BOS where it adds one) and no newline (a usage audit). --raw-prompt keeps that,
    and an adapter finetune did not save (no mark: record_prompt_template) gets its prompt as given (a review)."""
    from memfit.data.jsonl import load_jsonl, record_prompt_template
    from memfit.data.tokenizer import ByteTokenizer
    from memfit.infer import generate

    class Stop(Exception):
        pass

    given = []

    def capture(self, ids, *args, **kwargs):
        given.append(ids[0].tolist())
        raise Stop

    monkeypatch.setattr(generate.Generator, "generate", capture)
    adapter = _adapter(tiny_dir, tmp_path / "adapter")
    if marked:
        record_prompt_template(adapter)
    with pytest.raises(Stop):
        main(["generate", str(tiny_dir), "--adapter", str(adapter), "--prompt", "hi there", "--max-new", "2",
              "--device", "cpu", "--no-graphs", *(["--raw-prompt"] if raw else [])])
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "hi there", "response": "yo"}) + "\n")
    example = load_jsonl(data, ByteTokenizer(), 64)[0]
    trained_prompt = [t for t, label in zip(example.input_ids, example.labels) if label == -100]
    assert trained_prompt[-1] == ord("\n")
    assert given == [trained_prompt if marked and not raw else ByteTokenizer().encode("hi there")]


def test_a_tokenizer_that_adds_a_bos_encodes_prompts_as_finetune_did_without_it(tmp_path):
    """The BOS half of the prompt template: encode_plain (finetune's examples, an adapter's prompts) adds none where
    the tokenizer's default encode adds one."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    from memfit.infer.text import load_codec

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<unk>": 256, "</s>": 257, "<s>": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 258)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                            bos_token="<s>").save_pretrained(tmp_path)
    codec = load_codec(tmp_path, 259)
    assert codec.encode("hi") == [258, *b"hi"] and codec.encode_plain("hi") == list(b"hi")


def test_text_that_spells_a_special_token_is_trained_and_prompted_as_text(tmp_path):
    """A response quoting ``</s>`` had trained the EOS token mid-answer (a Hugging Face tokenizer turns the text of a
    special token into it unless told not to), and a prompt quoting it had ended there for an adapter. Both read it
    as text now; the EOS after the response stays."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from memfit.data.jsonl import load_jsonl
    from memfit.infer.text import load_codec

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"<unk>": 256, "</s>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "end tag?", "response": "use </s>"}) + "\n")
    example = load_jsonl(data, AutoTokenizer.from_pretrained(tmp_path), 64)[0]
    trained = [t for t, label in zip(example.input_ids, example.labels) if label != -100]
    assert trained == [*b"use </s>", 257]
    assert load_codec(tmp_path, 258).encode_plain("say </s>") == list(b"say </s>")


def test_raw_prompt_without_an_adapter_is_refused(tiny_dir, capsys):
    assert main(["generate", str(tiny_dir), "--prompt", "hi", "--device", "cpu", "--raw-prompt"]) == 2
    assert "--raw-prompt goes with --adapter" in capsys.readouterr().err
