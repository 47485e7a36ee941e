"""The ledger of an inference job run by memfit's decode loop (``generator="memfit"``, what ``memfit generate`` runs):
its static cache and chunked prefill predicted by the loop's own rules, held against the loop's measured peak."""
import importlib
import json
import re

import pytest
import torch
from conftest import MEASURES_A_CPU_RUN

from memfit.errors import MemfitError
from memfit.infer import generate as loop
from memfit.infer.fused import fuse_layout
from memfit.ledger.job import Job, Knobs
from memfit.ledger.planner import candidates, plan
from memfit.ledger.predict import loop_prefill_chunk, predict
from memfit.ledger.verify import verify
from memfit.models import PRESETS, build_model
from memfit.units import parse_bytes

TINY = PRESETS["tiny"]
# activations outweigh the weights, so that a chunk's peak is most of what is measured
WIDE = TINY.with_(name="wide-mlp", hidden=128, intermediate=1024, num_heads=4, num_kv_heads=2, head_dim=32, vocab=256)
# the attention's tensors outweigh the MLP's: the peak is in a rotation
ATTENTION = TINY.with_(name="attention-heavy", hidden=128, intermediate=64, num_heads=16, num_kv_heads=4, head_dim=32,
                       vocab=256)


def _memfit(dtype: str = "float32") -> Knobs:
    return Knobs(dtype=dtype, generator="memfit")


@MEASURES_A_CPU_RUN
@pytest.mark.parametrize("spec,seq,batch,budget,dtype,peak", [
    (TINY, 64, 2, None, "float32", "1 of 1, 64"),                      # one chunk
    (WIDE, 768, 1, None, "float32", "1 of 1, 768"),                    # activations the bulk of the peak
    (WIDE, 768, 1, 1_500_000, "float32", "1 of 11, 75"),               # a shorter last chunk
    (WIDE, 300, 2, 1_000_000, "float32", "1 of 12, 25"),
    (WIDE, 3000, 1, 1_500_000, "float32", "1 of 40, 75"),              # 40 equal chunks, the last over 3000 keys
    (ATTENTION, 1024, 1, None, "float32", "1 of 1, 1024"),
    (ATTENTION.with_(name="attention-heavy-mha", num_kv_heads=16), 1024, 1, None, "float32", "1 of 1, 1024"),
    (ATTENTION, 4000, 1, 1_000_000, "float32", "32 of 33, 122"),       # a later chunk's attention is the peak
    (ATTENTION, 3000, 1, 1_000_000, "bfloat16", "12 of 13, 244"),
], ids=["tiny", "wide-one-chunk", "wide-chunks", "wide-batch-2-chunks", "wide-40-chunks", "attention", "attention-mha",
        "attention-later-chunk", "attention-later-chunk-bf16"])
def test_verify_of_the_memfit_loop_on_cpu_within_half_a_percent(spec, seq, batch, budget, dtype, peak, monkeypatch):
    """The loop's own lifetimes (``ModelGraph.loop_prefill_chunk``) in the fused layout verify runs it in: a replay of
    transformers' layers had read high here (their held layer inputs), and far high where the prompt chunks. On the
    CPU a later chunk's attention builds its (queries, keys) causal mask and torch's flash-attention scratch: an
    attention-heavy model's prefill peaks in the last full chunk's attention (the loop builds the mask at its dtype's
    size, where torch's own lower-right bias cost several times that: ``probes/cpu_causal_attention_memory.py``)."""
    if budget is not None:
        monkeypatch.setattr(loop, "PREFILL_ACTIVATION_BYTES", budget)
    job = Job(spec, task="infer", seq=seq, batch=batch, new_tokens=8, device="cpu")
    knobs = _memfit(dtype=dtype)
    assert not loop_prefill_chunk(job, knobs)[2]
    result = verify(job, knobs)
    assert abs(result.error) < 0.005, f"{100 * result.error:+.2f}%"
    assert result.ledger.peak_where.endswith(f"(prefill chunk {peak} queries)")


def test_the_ledger_chunks_the_prompt_as_the_loop_does(monkeypatch):
    """The chunk the ledger replays is the first of the loop's own ``prefill_chunks`` (the largest), for prompts of
    one chunk, of several, and of a budget smaller than one query row."""
    model = build_model(WIDE)
    fuse_layout(model)
    for budget, seq, batch in ((1 << 28, 700, 1), (1_500_000, 700, 1), (1_000_000, 301, 3), (1, 40, 1)):
        monkeypatch.setattr(loop, "PREFILL_ACTIVATION_BYTES", budget)
        job = Job(WIDE, task="infer", seq=seq, batch=batch, new_tokens=5, device="cpu")
        ranges = loop.Generator(model, job.positions, batch=batch).prefill_chunks(seq, masked=False)
        assert loop_prefill_chunk(job, _memfit()) == (ranges[0][1], len(ranges), False)


def test_a_long_prompt_peaks_lower_in_the_loop_and_its_cache_is_whole_from_the_start():
    job = Job(PRESETS["llama-3.2-1b"], task="infer", seq=32768, new_tokens=1000)
    hf, ours = predict(job, Knobs()), predict(job, Knobs(generator="memfit"))
    spec = job.spec
    slots = loop.cache_slots(job.positions)
    assert slots == 33768 and ours.peak_phase == "prefill"
    assert ours.peak["kv_cache"] >= 2 * spec.num_layers * spec.kv_dim * slots * 2        # every slot, in prefill
    assert ours.total < hf.total - 1.5 * 2**30                   # one chunk's activations, not the whole prompt's
    assert "prefill chunk 1 of 12" in ours.peak_where


def test_a_masked_prefill_counts_its_mask(monkeypatch):
    """On CUDA in fp32 with grouped KV heads SDPA has no mask-free kernel: the loop prefills under a (B, 1, G x T,
    keys) mask, in chunks the mask's budget sizes, and attends with the memory-efficient kernel (no scores kept,
    where transformers' enable_gqa call takes the math kernel). The mask is the whole difference from the same
    chunks unmasked, and the last full chunk, whose mask is the largest, is named."""
    ledger = importlib.import_module("memfit.ledger.predict")      # the module (the package exports the function)

    job = Job(PRESETS["qwen2.5-0.5b"], task="infer", seq=8192, device="cuda")
    knobs = Knobs(dtype="float32", generator="memfit")
    chunk, chunks, masked = loop_prefill_chunk(job, knobs)
    assert masked and chunks > 1
    groups, keys = job.spec.num_heads // job.spec.num_kv_heads, loop.cache_slots(job.seq)
    assert chunk == loop.PREFILL_MASK_BYTES // loop.mask_bytes_per_query(1, keys, groups, 4)
    with_mask = predict(job, knobs)
    assert with_mask.peak_where.endswith(f"(prefill chunk {job.seq // chunk} of {chunks}, {chunk} queries, masked)")
    assert with_mask.total < predict(job, Knobs(dtype="float32")).total / 2     # transformers' keeps every score
    spec = job.spec
    monkeypatch.setattr(ledger, "_loop_prefill_masked", lambda job, knobs: False)
    monkeypatch.setattr(loop, "PREFILL_ACTIVATION_BYTES", chunk * loop.query_row_bytes(
        spec.hidden, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate, 4))
    assert loop_prefill_chunk(job, knobs) == (chunk, chunks, False)
    assert with_mask.total - predict(job, knobs).total == groups * chunk * keys * 4
    assert not loop_prefill_chunk(job, Knobs(dtype="bfloat16", generator="memfit"))[2]    # flash attention: no mask


def test_the_planner_offers_the_loop_where_transformers_does_not_fit():
    job = Job(PRESETS["llama-3.2-3b"], task="infer", seq=8192, batch=8)
    budget = parse_bytes("16GiB")
    assert predict(job, Knobs()).device_total > budget
    _, plans = plan(job, Knobs(), budget)
    assert plans[0].techniques == ["memfit's decode loop (`memfit generate`)"]
    assert plans[0].knobs.generator == "memfit" and plans[0].ledger.device_total <= budget
    exact = [p for p in plans if "approximate" not in " ".join(p.techniques)]
    assert exact and all(p.knobs.generator == "memfit" for p in exact)     # no exact plan fits without the loop
    training = Job(PRESETS["llama-3.2-1b"], task="lora", seq=512)
    assert all(p.knobs.generator == "hf" for p in plan(training, Knobs(), parse_bytes("80GiB"))[1])


def test_a_later_chunk_can_peak_on_the_cpu_but_not_on_cuda(monkeypatch):
    """Off CUDA a later chunk's attention builds its (queries, keys) causal mask: a long prompt of short chunks peaks
    there. On CUDA no chunk builds one, and the first is the largest."""
    monkeypatch.setattr(loop, "PREFILL_ACTIVATION_BYTES", 1_000_000)
    cpu = predict(Job(ATTENTION, task="infer", seq=4000, new_tokens=4, device="cpu"), _memfit())
    assert re.fullmatch(r"\d+\.sdpa \(prefill chunk \d+ of \d+, \d+ queries\)", cpu.peak_where)
    assert "chunk 1 of" not in cpu.peak_where
    cuda = predict(Job(ATTENTION, task="infer", seq=4000, new_tokens=4, device="cuda"), Knobs(generator="memfit"))
    assert "(prefill chunk 1 of" in cuda.peak_where


def test_what_the_loop_does_not_run_is_refused():
    window = TINY.with_(name="tiny-window", model_type="mistral", extra={"sliding_window": 32})
    with pytest.raises(MemfitError, match=r"generator \(--generator\) memfit runs its own attention"):
        predict(Job(TINY, task="infer", seq=16), Knobs(generator="memfit", attention="memfit"))
    with pytest.raises(MemfitError, match=r"memfit, tiny-window: this model attends over a sliding window of the last "
                                          r"32 tokens .* = 34 a token would see up to 33; keep prompt \+ new tokens <= 33"):
        predict(Job(window, task="infer", seq=30, new_tokens=4, device="cpu"), Knobs(generator="memfit"))
    predict(Job(window, task="infer", seq=30, new_tokens=3, device="cpu"), Knobs(generator="memfit"))
    with pytest.raises(MemfitError, match=r"memfit, tiny: prompt \+ new tokens = 4097 exceeds the model's 4096 "
                                          r"positions \(or use generator hf\)"):
        predict(Job(TINY, task="infer", seq=4090, new_tokens=7, device="cpu"), Knobs(generator="memfit"))
    assert plan(Job(TINY, task="infer", seq=4090, new_tokens=7, device="cpu"), Knobs(),
                parse_bytes("1GiB"))[1][0].knobs.generator == "hf"                # nor offered by the planner
    with pytest.raises(MemfitError, match=r"memfit runs models memfit's loader reads, and it loads no 4-bit base"):
        predict(Job(TINY, task="infer", seq=16), Knobs(generator="memfit", four_bit=True))
    # 4-bit and the loop are each offered, never together: that plan had no command to run it
    offered = candidates(Job(PRESETS["llama-3.2-1b"], task="infer", seq=8192), Knobs())
    assert any(k.four_bit for k in offered) and any(k.generator == "memfit" for k in offered)
    assert not any(k.four_bit and k.generator == "memfit" for k in offered)
    with pytest.raises(MemfitError, match=r"generator \(--generator\) does nothing with task lora"):
        predict(Job(TINY, task="lora", seq=16, device="cpu"), Knobs(generator="memfit"))
    with pytest.raises(MemfitError, match=r"generator \(--generator\) 'vllm' is not one of hf, memfit"):
        Knobs(generator="vllm")


def test_a_knobs_record_from_before_the_generator_reads_as_transformers_loop():
    record = Knobs(generator="memfit").to_dict()
    assert Knobs.from_dict(record).generator == "memfit"
    del record["generator"]
    assert Knobs.from_dict(json.loads(json.dumps(record))) == Knobs()


@MEASURES_A_CPU_RUN
def test_memfit_verify_runs_the_loop_it_is_asked_for(capsys, monkeypatch):
    from memfit.cli import main

    built = []
    monkeypatch.setattr(loop.Generator, "__init__", _counting(loop.Generator.__init__, built))
    code = main(["verify", "--model", "tiny", "--task", "infer", "--seq", "32", "--new-tokens", "4", "--device", "cpu",
                 "--generator", "memfit"])
    assert code == 0 and len(built) == 2                              # the warm-up run and the measured one
    assert "by memfit's decode loop" in " ".join(capsys.readouterr().out.split())


@MEASURES_A_CPU_RUN
@pytest.mark.parametrize("batch,heads,kv_heads,queries,keys,head_dim,dtype,packs", [
    (1, 16, 4, 244, 2928, 32, "bfloat16", True),     # a later chunk: packed where the CPU has AMX
    (1, 16, 4, 244, 244, 32, "bfloat16", True),      # a first chunk, causal
    (2, 8, 2, 128, 1100, 64, "bfloat16", True),
    (1, 8, 8, 256, 1024, 64, "bfloat16", True),      # as many KV heads as query heads
    (1, 8, 2, 100, 777, 33, "bfloat16", True),       # an odd head dim and key tail: padded where packed
    (1, 4, 4, 40, 300, 64, "bfloat16", False),       # too few queries to pack
    (1, 8, 2, 128, 900, 64, "float16", None),        # packed where the CPU's AMX takes float16
    (2, 8, 8, 100, 700, 64, "float32", False),
])
def test_the_cpu_flash_scratch_is_what_torchs_attention_allocates(batch, heads, kv_heads, queries, keys, head_dim,
                                                                   dtype, packs):
    """The ledger's rule for torch's CPU flash attention (``predict._cpu_flash_scratch``), against the call itself on
    this CPU: everything it allocates is that scratch, its output and its float32 log-sum-exp. On a CPU with AMX,
    torch packs bfloat16 K and V for it, which the rule had left out: the loop's ledger read 18% low there."""
    from memfit.ledger.predict import _cpu_attention_packs, _cpu_flash_query_split, _cpu_flash_scratch
    from memfit.measure.memory import CpuAllocationTracker

    torch_dtype = getattr(torch, dtype)
    q = torch.randn(batch, heads, queries, head_dim, dtype=torch_dtype, device="cpu")
    k, v = (torch.randn(batch, kv_heads, keys, head_dim, dtype=torch_dtype, device="cpu") for _ in range(2))
    causal = queries == keys
    mask = None if causal else torch.zeros(queries, keys, dtype=torch_dtype, device="cpu")
    with CpuAllocationTracker() as tracker:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                         enable_gqa=kv_heads < heads)
    outputs = batch * heads * queries * (head_dim * q.element_size() + 4)
    assert tracker.peak == outputs + _cpu_flash_scratch(batch, heads, kv_heads, queries, keys, head_dim, dtype, causal)
    if packs is not None and torch.get_num_threads() <= 2:    # the cases' work per thread is sized for this CI
        split = min(_cpu_flash_query_split(queries), queries)
        packed = _cpu_attention_packs(batch, heads, kv_heads, queries, keys, head_dim, dtype, causal, split,
                                      torch.get_num_threads())
        assert packed == (packs and torch.cpu._is_amx_tile_supported())


def _counting(init, calls: list):
    def counted(self, *args, **kwargs):
        calls.append(args)
        return init(self, *args, **kwargs)
    return counted


def test_a_cached_prediction_follows_the_loops_chunk_budget(monkeypatch):
    job = Job(WIDE, task="infer", seq=700, new_tokens=5, device="cpu")
    assert "chunk 1 of 1," in predict(job, _memfit()).peak_where
    monkeypatch.setattr(loop, "PREFILL_ACTIVATION_BYTES", 1_500_000)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)    # the attention's scratch is per thread: with 16 (a
    assert "chunk 1 of 10," in predict(job, _memfit()).peak_where    # GPU host's CPU) a later chunk peaks
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert "chunk 9 of 10," in predict(job, _memfit()).peak_where


def test_fuse_layout_keeps_the_values_and_makes_the_loaders_layout():
    from memfit.infer.fused import fused_gate_up, fused_qkv

    spec = PRESETS["qwen2.5-0.5b"].with_(name="qwen-small", num_layers=2, hidden=64, intermediate=96, num_heads=4,
                                         num_kv_heads=2, head_dim=16, vocab=128)       # q/k/v with biases
    model = build_model(spec, dtype="float32")
    ids = torch.randint(0, spec.vocab, (2, 9), device="cpu")
    before = model(ids).logits
    fuse_layout(model)
    assert all(fused_qkv(layer.self_attn) is not None and fused_qkv(layer.self_attn)[1] is not None
               and fused_gate_up(layer.mlp) is not None for layer in model.model.layers)
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="asks SDPA's CUDA kernels")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
def test_the_ledgers_mask_rule_is_sdpas_on_this_gpu(dtype, heads, kv_heads):
    from memfit.ledger.predict import _loop_prefill_masked
    from memfit.models.spec import dtype_of

    spec = TINY.with_(name="heads", hidden=8 * 64, num_heads=heads, num_kv_heads=kv_heads, head_dim=64)
    job = Job(spec, task="infer", seq=64, device="cuda")
    free = loop.mask_free_causal_kernel(torch.device("cuda"), dtype_of(dtype), heads, kv_heads, 64)
    assert _loop_prefill_masked(job, Knobs(dtype=dtype, generator="memfit")) == (not free)
