"""memfit.models.build_model: a random-init preset, its weights drawn once, as the model initialises them."""
from dataclasses import replace

import pytest
import torch

from memfit.models import PRESETS, build_model


@pytest.mark.parametrize("tied", [False, True])
def test_build_model_draws_each_weight_once_as_the_model_initialises_it(monkeypatch, tied):
    """Each linear and embedding is drawn by one ``normal_`` at the config's initializer range (a tied head's weight is
    the embedding's, drawn by each module, as the model's init does), the norms are ones, torch's own init (kaiming
    ``uniform_``) never runs, a tied head stays the embedding, and a seed gives the same model."""
    spec = replace(PRESETS["tiny"], tied_embeddings=tied)
    draws = {"normal_": 0, "uniform_": 0}
    for name in draws:
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, _name=name, _original=original, **kwargs):
            draws[_name] += 1
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    model = build_model(spec, dtype="float32")
    matrices = {name: p for name, p in model.named_parameters() if p.dim() == 2}
    drawn = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]   # a tied head's too
    assert draws == {"normal_": len(drawn), "uniform_": 0}
    std = model.config.initializer_range
    spread = {name: float(p.detach().std()) for name, p in matrices.items()}
    assert all(abs(s / std - 1) < 0.1 for s in spread.values()), spread
    assert all(bool((p == 1).all()) for p in model.parameters() if p.dim() == 1)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    again = build_model(spec, dtype="float32")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    other = build_model(spec, dtype="float32", seed=1)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
