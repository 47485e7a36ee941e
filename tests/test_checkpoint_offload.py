"""Checkpointed (and offloaded) decoder layers give the same loss and gradients as plain ones."""
import pytest
import torch
from conftest import seeded

from memfit.errors import MemfitError
from memfit.models import PRESETS, build_model
from memfit.train.checkpoint import CheckpointPolicy
from memfit.train.patch import patch, patch_state


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_model():
    """The tiny preset in float32 on the tests' device (CUDA under MEMFIT_TEST_DEVICE=cuda, where the ids are made)."""
    return build_model(PRESETS["tiny"], dtype="float32", device=torch.get_default_device())


def _step(lora: bool, forwards: int = 1, **techniques):
    """Loss, trainable gradients and per-layer forward-call counts of one step on the tiny model (``forwards``
    micro-batches, their losses summed before one backward)."""
    model = _tiny_model()
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model = patch(model, fused_ce=False, lora={"r": 4, "init_lora_weights": False} if lora else None, **techniques)
    model.train()
    generator = seeded(1)
    loss = 0
    for _ in range(forwards):
        ids = torch.randint(0, 259, (2, 23), generator=generator)
        labels = ids.clone()
        labels[:, :7] = -100
        loss = loss + model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, calls, model


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("techniques", [
    {"checkpoint": "layer"},
    {"checkpoint": "layer", "offload_layers": "all"},
    {"checkpoint": "layer", "offload_layers": [0], "offload_to": "disk"},
])
def test_checkpointed_step_matches_plain(lora, techniques):
    loss0, grads0, calls0, _ = _step(lora)
    loss1, grads1, calls1, _ = _step(lora, **techniques)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    assert grads1.keys() == grads0.keys() and len(grads0) > 0
    for name in grads0:
        assert grads0[name].abs().sum() > 0, name  # the comparison must be able to fail
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-7, msg=name)
    assert calls0 == [1, 1] and calls1 == [2, 2]  # the checkpointed layers really recompute


@pytest.mark.parametrize("offload_to", ["cpu", "disk"])
def test_two_forwards_before_one_backward(offload_to):
    """Two micro-batches summed before one backward, their layer inputs offloaded: each forward keeps its own (the
    disk store, and on CUDA the pinned one, had one file or buffer per layer, which the second forward overwrote:
    the first's gradients came out wrong)."""
    loss0, grads0, _, _ = _step(False, forwards=2)
    loss1, grads1, calls, _ = _step(False, forwards=2, checkpoint="layer", offload_layers="all", offload_to=offload_to)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-7, msg=name)
    assert calls == [4, 4]


def test_a_backward_that_cannot_reach_the_layers_is_refused():
    """torch.autograd.grad, backward(inputs=...) and a double backward (create_graph=True) through checkpointed
    layers are refused: the recompute's own backward wrote the layers' .grad, which autograd.grad neither asked for
    nor returned, and create_graph failed on a KeyError."""
    model = patch(_tiny_model(), fused_ce=False, checkpoint="layer")
    model.train()
    ids = torch.randint(0, 259, (2, 9), generator=seeded(2))
    embedding, weight = model.model.embed_tokens.weight, model.model.layers[0].self_attn.q_proj.weight
    for differentiate in (lambda loss: torch.autograd.grad(loss, embedding),
                          lambda loss: loss.backward(inputs=[embedding]),
                          lambda loss: loss.backward(create_graph=True)):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with pytest.raises(MemfitError, match="loss.backward\\(\\) only"):
            differentiate(loss)
        assert weight.grad is None


def test_a_parameters_gradient_hooks_run_once():
    """A hook on a checkpointed layer's weight sees its gradient once (passing the weights to the checkpoint as
    inputs, to reach them, had run each hook a second time, with None)."""
    model = patch(_tiny_model(), fused_ce=False, checkpoint="layer")
    model.train()
    weight = model.model.layers[0].mlp.up_proj.weight
    seen, accumulated = [], []
    weight.register_hook(lambda grad: seen.append(grad) or grad.clamp(-1, 1))
    weight.register_post_accumulate_grad_hook(lambda param: accumulated.append(param.grad))
    ids = torch.randint(0, 259, (2, 9), generator=seeded(3))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert len(seen) == 1 and seen[0] is not None and len(accumulated) == 1


def test_disk_stores_sharing_a_directory_keep_their_own_files(tmp_path):
    """Two stores given one directory (two models offloading there) name their files apart: both had counted from 0
    and overwritten each other's inputs, and so a model's gradients)."""
    from memfit.train.checkpoint import DiskStore

    stores = [DiskStore(str(tmp_path)), DiskStore(str(tmp_path))]
    inputs = [torch.full((3,), float(k)) for k in range(2)]
    slots = [store.put(0, tensor) for store, tensor in zip(stores, inputs)]
    for store, slot, tensor in zip(stores, slots, inputs):
        assert torch.equal(store.take(slot), tensor)
        store.close()


def test_policy_can_change_between_steps_and_eval_runs_plain():
    _, _, _, model = _step(True, checkpoint="layer")
    state = patch_state(model)
    state.policy = CheckpointPolicy(("cpu", "none"))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, PRESETS["tiny"].vocab)


def test_policy_errors_name_the_bad_value():
    with pytest.raises(MemfitError, match="needs checkpoint='layer'"):
        CheckpointPolicy.build(4, checkpoint="none", offload_layers="all")
    with pytest.raises(MemfitError, match="layer 7"):
        CheckpointPolicy.build(4, offload_layers=[7])
    with pytest.raises(MemfitError, match="'ssd'"):
        CheckpointPolicy(("gpu", "ssd"))
    assert CheckpointPolicy.build(4, offload_layers=2).places == ("cpu", "cpu", "gpu", "gpu")


@pytest.mark.parametrize("bad, match", [
    ({"lora": {"r": 4, "target_modules": ["qproj"]}}, r"LoRA target_modules qproj match no module of this "
                                                      "model; its linear layers are named down_proj, gate_proj"),
    ({"lora": {"r": 0}}, r"LoRA rank r \(--lora-r\) must be a positive integer"),
    ({"attention": "flash"}, "attention='flash' is not one of sdpa, memfit"),
    ({"ce_path": "fast"}, "kernel path 'fast' for linear_ce is not one of"),
    ({"offload_layers": [9]}, "layer 9"),
])
def test_a_refused_patch_leaves_the_model_as_it_was(bad, match):
    """Each refusal comes before any change: a LoRA target peft found nowhere had left the model patched (attention,
    checkpointing and the loss installed), so the corrected call was told the model was already patched."""
    model = _tiny_model()
    with pytest.raises(MemfitError, match=match):
        patch(model, checkpoint="layer", **{"attention": "memfit", **bad})    # memfit's: a change that would show
    assert model.config._attn_implementation == "sdpa" and type(model).forward is model.forward.__func__
    patch(model, checkpoint="layer", lora={"r": 4, "target_modules": ["q_proj"]}, attention="memfit")


@pytest.mark.parametrize("knobs,match", [({"offload_layers": 2.5}, "offload_layers=2.5: use"),
                                         ({"offload_layers": [0, 1.0]}, "offload_layers=\\[0, 1.0\\]: use"),
                                         ({"offload_layers": ["0"]}, "a list of indices"),
                                         ({"prefetch": 1.5}, "prefetch must be a whole number"),
                                         ({"prefetch": "2"}, "got '2'"), ({"prefetch": 0}, "at least 1"),
                                         ({"offload_layers": [True]}, "a list of indices"),
                                         ({"offload_layers": {0: 1}}, "a list of indices"),
                                         ({"offload_layers": b"ab"}, "a list of indices")])
def test_offload_knobs_of_the_wrong_type_are_memfit_errors(knobs, match):
    """A float, a string or an object that is no list of layer indices is refused with the usage, not a TypeError."""
    with pytest.raises(MemfitError, match=match):
        CheckpointPolicy.build(4, **knobs)


def test_numpy_integers_and_arrays_are_layer_counts_and_lists():
    np = pytest.importorskip("numpy")
    assert CheckpointPolicy.build(4, offload_layers=np.array([0, 2])).places == ("cpu", "gpu", "cpu", "gpu")
    assert CheckpointPolicy.build(4, offload_layers=np.array([], dtype=int)).places == ("gpu",) * 4
    assert CheckpointPolicy.build(4, offload_layers=np.int64(1), prefetch=np.int64(2)).places[:2] == ("cpu", "gpu")


@pytest.mark.parametrize("checkpointed,offloaded", [(-1, 0), (1, 3), (5, 0), (2, -1)])
def test_first_layers_refuses_counts_that_do_not_fit(checkpointed, offloaded):
    with pytest.raises(MemfitError, match="need 0 <= offloaded <= checkpointed <= 4 layers"):
        CheckpointPolicy.first_layers(4, checkpointed, offloaded)


def test_recomputed_layer_output_is_freed_before_the_layers_backward():
    """The recompute's output (batch x tokens x hidden) is not held while the layer's own backward runs,
    where a checkpointed step peaks: its storage is gone by the time the layer's first op differentiates."""
    import weakref

    from memfit.train.checkpoint import install

    outputs, alive_in_backward = [], []

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, hidden):
            out = self.linear(hidden) + hidden
            outputs.append(weakref.ref(out))
            if out.grad_fn is not None:                      # the recompute: look as the layer's first op differentiates
                out.grad_fn.register_prehook(lambda grads: alive_in_backward.append(outputs[-1]() is not None))
            return out

    layers = [Layer()]
    install(layers, CheckpointPolicy(("gpu",)))
    hidden = torch.randn(3, 8, requires_grad=True)
    layers[0](hidden).sum().backward()
    assert len(outputs) == 2 and alive_in_backward == [False]  # forward, recompute; freed before its backward began
    assert hidden.grad is not None and layers[0].linear.weight.grad is not None


def test_a_layer_input_that_needs_no_gradient_gets_none():
    """Under LoRA the first layer's input (the frozen embeddings' output) needs no gradient: the recompute runs
    with grad on but that input not requiring one (no tokens x hidden gradient is made), and the adapters'
    gradients still come; a layer where nothing trains recomputes but skips the backward."""
    from memfit.train.checkpoint import install

    calls = []

    class Layer(torch.nn.Linear):
        def forward(self, hidden):
            calls.append((torch.is_grad_enabled(), hidden.requires_grad))
            return super().forward(hidden)

    layers = [Layer(8, 8), Layer(8, 8)]
    layers[1].requires_grad_(False)
    install(layers, CheckpointPolicy(("gpu", "gpu")))
    frozen_input = torch.randn(3, 8)
    layers[0](frozen_input).sum().backward()
    assert calls == [(False, False), (True, False)]          # forward without grad, recompute with it
    assert layers[0].weight.grad is not None and frozen_input.grad is None
    layers[1](frozen_input).sum().backward()                 # the anchor still calls its backward: nothing to do
    assert layers[1].weight.grad is None


def test_disk_offload_leaves_no_directory_behind():
    """The disk store's own directory goes with it, closed or dropped (a patched model dropped never closes it),
    after its pending writes; a forked child's exit does not remove its parent's."""
    import gc
    import os

    from memfit.train.checkpoint import DiskStore

    for close in (True, False):
        store = DiskStore(None)
        store.take(store.put(0, torch.ones(3)))
        store.put(1, torch.ones(1000))                                     # a write possibly still pending
        directory = store.directory
        if close:
            store.close()
        else:
            del store
            gc.collect()
        assert not os.path.exists(directory)
    store = DiskStore(None)
    child = os.fork()
    if child == 0:                                   # as a forked child's normal exit would: run the finalizer
        store._remove()
        os._exit(0)
    os.waitpid(child, 0)
    assert os.path.isdir(store.directory)
    store.close()
    assert not os.path.exists(store.directory)


def test_disk_store_takes_an_empty_directory_name_as_its_own_and_refuses_a_file(tmp_path):
    import os

    from memfit.train.checkpoint import DiskStore

    store = DiskStore("")
    assert store.owned and os.path.isdir(store.directory)
    store.close()
    assert not os.path.exists(store.directory)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MemfitError, match="exists and is not a directory"):
        DiskStore(str(tmp_path / "afile"))
