"""The decode loop and sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``): memfit attends over the
whole cache, so a window shorter than what a query may see is refused; within the window the two are the same."""
import pytest
import torch
from conftest import seeded
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from memfit.errors import MemfitError
from memfit.infer.generate import Generator, sliding_window
from memfit.models import build_model

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _mistral(window):
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window)).eval()


def _qwen2(**window):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, sliding_window=4, **window)).eval()


def test_a_window_shorter_than_a_query_may_see_is_refused():
    """Window 8: a generator of max_len 10 would let its last query see 9 keys, where the model sees 8 (it decoded
    greedy tokens unlike Hugging Face's before it was refused)."""
    with pytest.raises(MemfitError, match=r"sliding window of the last 8 tokens.*= 10 .*<= 9"):
        Generator(_mistral(8), 10, graphs=False)


def test_a_window_covering_every_query_decodes_as_hugging_face():
    """max_len = window + 1: the query of the last decode step sees exactly the window, so the loop's full attention
    is the model's; greedy tokens equal Hugging Face's."""
    model = _mistral(8)
    ids = torch.randint(0, 256, (1, 5), generator=seeded(1))
    expected = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, 5:]
    got = Generator(model, 9, graphs=False, fused=False).generate(ids, 4).tokens[0]
    assert torch.equal(got, expected.cpu())                            # generate returns its tokens on the CPU


@pytest.mark.parametrize("window, expected", [(dict(use_sliding_window=False), None),            # HF drops the window
                                              (dict(use_sliding_window=True, max_window_layers=2), None),  # no layer has it
                                              (dict(use_sliding_window=True, max_window_layers=1), 4)])
def test_qwen2_window_only_where_its_layers_use_it(window, expected):
    model = _qwen2(**window)
    assert sliding_window(model) == expected
    if expected is None:
        Generator(model, 16, graphs=False)
    else:
        with pytest.raises(MemfitError, match="sliding window of the last 4 tokens"):
            Generator(model, 16, graphs=False)


@pytest.mark.parametrize("config,window", [
    (MistralConfig(**SHAPE, sliding_window=8), 8),
    (Qwen2Config(**SHAPE, sliding_window=4, use_sliding_window=True, max_window_layers=1), 4),
    (Qwen2Config(**SHAPE, sliding_window=4, use_sliding_window=False), None),
])
def test_a_spec_keeps_its_configs_window(config, window):
    """A model memfit builds from a spec read off config.json (plan, verify, presets) attends as the source does:
    the spec dropped the window, and a Mistral was rebuilt with its config class's default of 4096."""
    from memfit.models.spec import ModelSpec

    spec = ModelSpec.from_hf_config(config.to_dict())
    assert sliding_window(build_model(spec.with_(dtype="float32"))) == window

