"""The decode loop's compiled elementwise helpers (``Generator(compile=True)``): which steps run them, and that
they trace where the caller has set torch's default device."""
import torch
from conftest import default_device, load_on_test_device, seeded

from memfit.infer import generate
from memfit.models import PRESETS, build_model, save_model_dir


def test_compiled_helpers_run_decode_steps_only(monkeypatch):
    """The compiled helpers (dynamic=False, fullgraph=True) compile once per shape: a prefill or a scored run, whose
    length changes with every prompt, had run them too, and past dynamo's recompile limit (8 by default) a call
    failed outright. Stand-ins record the shapes the compiled set is called with: one token a row only."""
    shapes = []

    def recording(fn):
        return lambda x, *rest: shapes.append(tuple(x.shape)) or fn(x, *rest)

    monkeypatch.setattr(generate, "_compiled", lambda: {name: recording(fn) for name, fn in generate._EAGER.items()})
    model = build_model(PRESETS["tiny"], dtype="float32", device=torch.get_default_device())
    runner = generate.Generator(model, 16, batch=1, graphs=False, compile=True, fast=False)
    for length in (3, 5, 7):
        ids = torch.randint(1, PRESETS["tiny"].vocab, (1, length), generator=seeded(length))
        runner.generate(ids, 4)
        runner.score(torch.randint(1, PRESETS["tiny"].vocab, (1, length + 4), generator=seeded(length)), length)
    assert shapes and all(shape[1] == 1 for shape in shapes), sorted(set(shapes))   # (B, T, ...)


def test_the_compiled_helpers_trace_under_a_default_device(monkeypatch, tmp_path):
    """``torch.set_default_device`` puts a function mode on the stack, under which dynamo could not trace
    ``Tensor.unflatten`` (a ``super()`` call): act_mul used it, so in such a process the compile failed and every
    decode step ran the eager helpers (seen on the H200 under ``MEMFIT_TEST_DEVICE=cuda``). Traced here with
    dynamo's eager backend, the same graphs without inductor's compile."""
    monkeypatch.setattr(generate, "_compiled", lambda: {
        name: torch.compile(fn, backend="eager", dynamic=False, fullgraph=True) for name, fn in generate._EAGER.items()})
    model = load_on_test_device(save_model_dir(PRESETS["tiny"], tmp_path))   # gate/up in the fused layout: act_mul
    with default_device(torch.get_default_device()):
        runner = generate.Generator(model, 16, batch=1, graphs=False, compile=True, fast=False)
        runner.generate(torch.randint(1, PRESETS["tiny"].vocab, (1, 5), generator=seeded(5)), 3)
    assert runner.fused_layers == PRESETS["tiny"].num_layers and runner.ops is not generate._EAGER
