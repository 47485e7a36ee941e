"""Pieces the block-low-rank kernels (lowrank, monarch, blast) share.

* ``pick_variant``: each op has several complete kernel pipelines (e.g. Triton GEMMs vs
  a Triton stage plus a cuBLAS stage); which is fastest depends on the shape. The first
  call for a shape times each candidate on the GPU (CUDA-graph replays, as the layers
  run in decode, calling in turn copies of its arguments that together exceed the L2, as a model
  reads its weights from HBM: :func:`rotation`), times those
  within 25% of the fastest again in three interleaved rounds, and remembers the winner in a JSON
  file (``$MEMFIT_AUTOTUNE_CACHE``, default ``~/.cache/memfit/autotune.json``), keyed by
  GPU, Triton version, a digest of the candidates' source files, op and shape, so a
  second run does not retune and an edited kernel is timed afresh. Off the GPU (the
  interpreter) the op's default is taken; inside a CUDA graph capture the cached winner
  is used, or, for a shape never timed before, the default (said once).
  The Triton kernels' own tile configs are tuned by ``triton.autotune`` with
  ``cache_results=True`` (Triton's on-disk cache), keyed on the same shapes, and timed from
  graph replays too, each call after an L2 flush (:func:`autotune_bench`).
* ``n_bucket``: the token count rounded up to a power of two, at least 16 (one 16-token tile), the
  tile autotune key for N; ``pick_bucket``: the same without the floor, the variant pick's key, since
  which pipeline wins can change between 1 and 16 tokens where the tiles do not.
* Shapes are runtime ints in the kernels, so one compile (two where a loop drops its K mask
  when K allows) serves every layer shape
  (keeps a cold autotune short); a stride equal to 1 is specialised by Triton to the
  constant 1, so unit-stride loads and stores vectorise.
* ``bgemm``: one strided batched GEMM kernel whose store can regroup columns, which is
  how the Monarch permutation and output layouts are folded into stores. Hopper-sized
  tiles for many tokens, 16-token tiles with wide K steps for decode, a grouped program
  order (a group of token tiles sweeps the column tiles together, so A and B tiles are
  re-read from L2, not HBM) and 64-bit offsets.
* ``bmm_into``: the cuBLAS alternative for a stage that is a plain strided batched GEMM
  writing a strided view of the output (ldc = the row stride), so no copy is made.
* Chained stages (the ``*_pdl`` pipelines, small N): a pipeline's second kernel is
  launched with programmatic dependent launch (Hopper+): the first calls
  ``gdc_launch_dependents`` as it starts, so the second is scheduled while the first runs;
  a GEMM stage asks L2 for its own weight slice (``prefetch_l2``: no registers held), the
  mixing stage loads its S tile, and only then does it wait (``gdc_wait``) for the
  previous kernel's output. At decode, where each kernel is a
  launch plus one dependent read of its weights, the second stage's launch and weight read
  overlap the first stage instead of following it. Off the GPU (the interpreter) the
  kernels run without it, so the tests cover the same arithmetic.
  Tried and taken out (817fdcf): every stage of a chain, the first too, launched dependent on whatever kernel came
  before it (its weight slice prefetched, then the wait) and letting the next kernel start after its wait (the last
  stage too, so that the next layer's first stage, or a compiled kernel built with inductor's ``enable_pdl``, could
  start early). In the end-to-end decode with memfit's attention
  (``earlier/blr_e2e_memfit_attention_chain_ends_817fdcf.json``) Monarch's step took 1.220 ms, against 1.215 before
  it (44a54ef) and 1.221 after it was taken out (0cdc726); BLAST's 1.400 against 1.304 and 1.306, with two of its four
  picks different (``z_mixgemm_pdl`` at q/o, ``bgemm_mix_bgemm_pdl`` at down, where both other runs took
  ``bgemm_mix_gemv_pdl``: the picks time back-to-back calls, which the change let overlap); the dense model's 1.410
  against 1.412 and 1.409; the free model's, which runs no BLR kernel, 0.787 against 0.599 and 0.601 (not traced).
  With inductor's PDL on too (the setting it was built for;
  ``earlier/blr_e2e_memfit_attention_inductor_pdl_chain_ends_817fdcf.json`` against 0cdc726's
  ``blr_e2e_memfit_attention_inductor_pdl.json``) Monarch's decode took 1.163 ms against 1.239 (6% faster, the fastest
  Monarch decode of any run; down's pick differed, ``two_stage_pdl`` against ``gemv_gemv_pdl``), BLAST's 1.346
  against 1.339, dense 1.298 and free 0.766-0.768 in both. Taken out: in the default setting no gain for Monarch and
  BLAST slower with two picks changed (not traced which), and where it helps, inductor's PDL speeds the dense model
  more (Monarch 1.116x dense there, against 1.154x in the default setting). A candidate again if memfit compiles
  with inductor's PDL.
* ``recompute_backward``: the custom ops' backward. It recomputes the op's reference
  forward in PyTorch ops and differentiates it, so the forward saves only x and the
  weights (no intermediates; not x either where no weight needs a gradient); the price is one
  extra forward in the backward.
"""
import functools
import hashlib
import inspect
import json
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.files import atomic_path
from memfit.kernels.dispatch import (
    constant_when_compiled,
    dot_precision,
    interpreting,
    outside_the_dispatcher,
    use_triton,
)
from memfit.log import warn_once
from memfit.measure.timing import graph_ms, turn_orders

_CACHE: dict | None = None
_UNTIMED: set[str] = set()      # pick keys where no candidate could be timed (this process only)
_VARIANT_MEMO: dict[tuple, str] = {}    # (op, shape_key, device) -> the pipeline auto_variant settled on (this process)
PICK_REP_MS = 10                 # ms of graph replays per kernel variant or tile config (short: a cold run of
                                 # many shapes stays fast)
PICK_FINALIST_SLACK = 1.25       # variants within this factor of the fastest first timing are timed again,
PICK_FINAL_ROUNDS = 3            # in this many interleaved rounds (:func:`_final_times`), of PICK_REP_MS in all
ROTATE_BYTES = 150 * 2**20       # the copies a timing calls in turn hold at least this (3x an H100's 50 MB L2),
ROTATE_MAX_COPIES = 64           # at most this many copies
PICK_TIMINGS: dict[str, dict] = {}  # "op shape_key" -> every pick made in this process: the ms each candidate read
                                    # (first; the finalists' medians) and the pick, or a cache hit (benchmarks set
                                    # them beside their own times)


def pick_bucket(n: int) -> int:
    """The variant pick's key for N: rounded up to a power of two, 1 and 16 apart. With n_bucket's floor of 16,
    a table timing N = 1 first reused that pick at N = 16. At Llama-7B down the Monarch pick read 6-10% slower than
    ``bmm_perm_bmm`` at N = 16 in three runs (43f911d, 04677cb, 9f70ccb), and about as fast as ``bmm``, which leads
    at N = 1 by 1.4-2.9%. Keyed apart (6a18df8), the pick there takes ``bmm`` at N = 1 and ``bmm_perm_bmm`` at
    N = 16, which the table read at 20.03 us against that pipeline's own row's 19.89."""
    return _next_pow2(n)


def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` of max(1, n) in plain Python: Triton's is a ConstexprFunction, whose call from the
    host unwraps its arguments as constexprs, and the ops ask it several times at every call (the pick's bucket,
    the tiles' N bucket, the block sizes)."""
    return 1 << (max(1, int(n)) - 1).bit_length()


def n_bucket(n: int) -> int:
    return max(16, pick_bucket(n))


def _cache_path() -> Path:
    return Path(os.environ.get("MEMFIT_AUTOTUNE_CACHE", Path.home() / ".cache" / "memfit" / "autotune.json"))


def _load_cache() -> dict:
    global _CACHE
    if _CACHE is None:
        try:
            _CACHE = json.loads(_cache_path().read_text())
        except (OSError, ValueError):
            _CACHE = {}
    return _CACHE


def _save_cache(cache: dict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    except OSError as err:
        warn_once(f"autotune-cache:{path}", f"cannot write the autotune cache {path}: {err}; tuning again next run")


def _source_digest(fns: tuple) -> str:
    """Short hash of the files defining ``fns`` and this one: a changed kernel invalidates cached picks. Every call
    of an op whose pick is cached still builds this key, so the files are looked up once per code object."""
    files = sorted({_source_file(fn) for fn in fns} | {__file__})
    return _digest_files(tuple(files))


def _source_file(fn) -> str:
    """``inspect.getsourcefile(fn)``, through its code object where it has one (a pick's candidates may be closures
    made at each call, as gemv's are: their code objects are few)."""
    code = getattr(fn, "__code__", None)
    return inspect.getsourcefile(fn) if code is None else _code_source_file(code)


@functools.cache
def _code_source_file(code) -> str:
    return inspect.getsourcefile(code)


@functools.cache
def _digest_files(files: tuple[str, ...]) -> str:
    digest = hashlib.sha1()
    for name in files:
        digest.update(Path(name).read_bytes())
    return digest.hexdigest()[:12]


def contiguous_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the BLR kernels read it, with a unit stride: a strided view is copied (the Triton pipelines read
    one as if it were contiguous, which gave wrong outputs and no error before the ops called this)."""
    return None if bias is None else bias.contiguous()


def bind_shapes(op: str, x: torch.Tensor, bias: torch.Tensor | None, factors: dict[str, tuple[torch.Tensor, str]],
                x_letters: str, bias_letters: str) -> dict[str, int]:
    """The sizes of the letters in the factors' shape patterns (name -> (tensor, e.g. "b m r")), refusing a factor
    with another number of dimensions or a letter two places give different sizes; x's last dimension must be the
    product of ``x_letters``' sizes and ``bias``, if given, a vector of the product of ``bias_letters``'. A BLR op's
    kernels index its factors by these sizes, so a mismatch read out of bounds (or corrupted memory) unchecked. x must
    be floating point: the op computes in x's dtype, so integer x truncated the weights to integers, unsaid."""
    if not x.is_floating_point():
        raise MemfitError(f"{op}: x must be floating point (the op computes in x's dtype), got {x.dtype}")
    sizes, source = {}, {}
    for name, (tensor, pattern) in factors.items():
        letters = pattern.split()
        if tensor.dim() != len(letters):
            raise MemfitError(f"{op}: {name} has shape {tuple(tensor.shape)}; expected ({', '.join(letters)})")
        for letter, size in zip(letters, tensor.shape):
            if sizes.setdefault(letter, size) != size:
                raise MemfitError(f"{op}: {name} has shape {tuple(tensor.shape)}, expected ({', '.join(letters)}) "
                                  f"with {letter} = {sizes[letter]} as in {source[letter]}")
            source.setdefault(letter, name)

    def product(letters: str) -> int:
        total = 1
        for letter in letters.split():       # a loop, not math.prod over a generator: torch.compile breaks its graph there
            total *= sizes[letter]
        return total

    if x.dim() == 0 or x.shape[-1] != product(x_letters):
        raise MemfitError(f"{op}: x has shape {tuple(x.shape)}; its last dimension must be "
                          f"{' * '.join(x_letters.split())} = {product(x_letters)}")
    if bias is not None and tuple(bias.shape) != (product(bias_letters),):
        raise MemfitError(f"{op}: bias has shape {tuple(bias.shape)}; expected ({product(bias_letters)},)")
    return sizes


def skips_dispatcher(*tensors: torch.Tensor | None) -> bool:
    """Whether a BLR op's wrapper may call the op's function directly instead of through its custom op: where
    :func:`memfit.kernels.dispatch.outside_the_dispatcher` allows it and no gradient is recorded (the custom op
    registers the backward). The eager prefill of a compressed model was host-bound on the H200's host at a93ab16."""
    grad = torch.is_grad_enabled()
    return outside_the_dispatcher(*tensors) and not any(grad and t is not None and t.requires_grad for t in tensors)


def runs_triton(op: str, x: torch.Tensor, tensors: tuple, path: str | None, variant: str) -> bool:
    """Whether a BLR op runs its Triton op (:func:`memfit.kernels.dispatch.use_triton`) rather than its reference; no
    tokens run the reference (which returns an empty output). A ``variant=`` names a Triton pipeline: asked where
    the reference runs, it is refused rather than ignored."""
    if x.numel() and use_triton(op, x, *tensors, path=path):
        return True
    if variant != "auto" and x.numel():
        raise MemfitError(f"{op}: variant={variant!r} names a Triton pipeline, and this call runs the PyTorch "
                          f"reference (path={path or 'auto'}, tensors on {x.device.type}); leave variant='auto'")
    return False


def require_offered(op: str, variant: str, offered: Callable[[], dict], where: str) -> None:
    """Refuse a ``variant=`` an op does not offer ``where`` (e.g. "at this token count"), naming the ones it does.
    ``offered`` is called only for a named variant: an op's Python wrapper runs at every call, inside
    torch.compile'd models too, and ``auto`` needs no offer there (the op works it out)."""
    if variant == "auto":
        return
    names = offered()
    if variant not in names:
        raise MemfitError(f"{op}: variant {variant!r} is not available {where}; available: {', '.join(names)}")


def pick_variant(op: str, shape_key: tuple, candidates: dict, default: str, args: tuple) -> str:
    """Name of the fastest of ``candidates`` (name -> fn(*args)) for this shape, cached on disk (:func:`_disk_pick`);
    ``default`` off the GPU, or where the pick cannot be timed."""
    picked = _gpu_pick(op, shape_key, candidates, default, args)
    return default if picked is None else picked


def auto_variant(op: str, shape_key: tuple, offer: Callable[[], tuple[dict, str]], args: tuple) -> str:
    """The pipeline an op's ``variant="auto"`` runs: :func:`pick_variant` over ``offer()`` (its candidates and its
    default), remembered per shape key and args[0]'s device for the rest of the process once it is settled on the
    GPU: timed now, read from the cache, or the default where nothing could be timed (which :func:`_disk_pick` does
    not try again in this process). Not remembered: the default off the GPU, or inside a CUDA graph capture, so that
    a later call outside it times the pick. Every eager call runs this; before the memo, building the offer, the cache
    key and the lookup took 30-170 us of a layer call's host time on the H200's host, against 115-370 us for the
    pipeline's Python and launches (``benchmarks/probes/op_host_cost.py``, a93ab16; at dfd69a8 the remembered pick
    cost at most 33 us over a named variant)."""
    memo = (op, shape_key, args[0].device)
    variant = _VARIANT_MEMO.get(memo)
    if variant is None:
        candidates, default = offer()
        variant = _gpu_pick(op, shape_key, candidates, default, args)
        if variant is None:
            if args[0].device.type != "cuda" or torch.cuda.is_current_stream_capturing():
                return default
            variant = default
        _VARIANT_MEMO[memo] = variant
    return variant


def _gpu_pick(op: str, shape_key: tuple, candidates: dict, default: str, args: tuple) -> str | None:
    """pick_variant's pick on the GPU: the one candidate, or the disk pick; None off the GPU or where nothing could
    be timed."""
    if not all(t.is_cuda for t in _tensors(args)):
        return None
    if len(candidates) == 1:
        return default
    key = "|".join([torch.cuda.get_device_name(), triton.__version__, _source_digest(tuple(candidates.values())), op,
                    *map(str, shape_key)])
    return _disk_pick(op, shape_key, key, candidates, args, PICK_TIMINGS, f"running {default!r} untimed")


def _disk_pick(op: str, shape_key: tuple, key: str, candidates: dict, args: tuple, records: dict,
               instead: str) -> str | None:
    """The name of the fastest of ``candidates`` under the disk-cache ``key``: the cached one, or else all timed now
    (:func:`_timed_fastest`) and the winner saved. ``records["op shape_key"]`` gets the timings of a pick made here
    ({"pick", "cached": True} for one read from the cache). None where nothing can be timed, each case said once
    with ``instead`` (what runs instead): a first call inside a CUDA graph capture (timing would launch work into
    the graph), or no candidate ran (e.g. each out of memory), which later calls in this process then skip too."""
    cache, record = _load_cache(), f"{op} {shape_key}"
    if cache.get(key) in candidates:
        records.setdefault(record, {"pick": cache[key], "cached": True})
        return cache[key]
    if torch.cuda.is_current_stream_capturing():
        warn_once(f"pick-in-capture:{key}", f"{op}: first call for shape {shape_key} is inside a CUDA graph capture, "
                  f"so it is not timed: {instead} (call it once before capturing)")
        return None
    if key in _UNTIMED:
        return None
    timings = _timed_fastest(op, candidates, args)
    if "pick" not in timings:                       # each failure was said (e.g. no memory to time in)
        warn_once(f"pick-none-ran:{key}", f"{op}: nothing could be timed for shape {shape_key}; {instead} in this "
                  "process (timed again in the next)")
        _UNTIMED.add(key)
        return None
    cache[key] = timings["pick"]
    records[record] = timings
    _save_cache(cache)
    return timings["pick"]


def _timed_fastest(op: str, candidates: dict, args: tuple) -> dict:
    """The timings of ``candidates`` (name -> fn(*args)) over :func:`rotation`'s copies of ``args``: every one once
    ("first"), those within PICK_FINALIST_SLACK of the fastest again (:func:`_final_times`, "finalists"), and the
    fastest finalist ("pick"; no pick where none could be timed)."""
    settled = _settled(op, candidates, args)
    copies = rotation(op, args) if settled else []
    first = {name: float("inf") for name in candidates} | _rotated_times(op, settled, copies)
    best = min(first.values())
    if best == float("inf"):
        return {"first": first}
    finalists = {name: candidates[name] for name, ms in first.items() if ms <= best * PICK_FINALIST_SLACK}
    final = _final_times(op, finalists, copies) if len(finalists) > 1 else {name: first[name] for name in finalists}
    return {"first": first, "finalists": final, "pick": min(final, key=final.get)}


def _settled(op: str, candidates: dict, args: tuple) -> dict:
    """``candidates`` less those that fail a first call on ``args`` (said once; they read inf), each called once
    before :func:`rotation` copies the arguments: what a candidate sets up on its first call (a chain's tile pick,
    :func:`pick_chain_tiles`, which times over copies of its own; Triton's autotuning) then runs while only its own
    copies are alive. Building a Monarch Llama-1B decode loop peaked 0.39 GB above the model at dfd69a8, 0.35 of it
    the two sets of copies alive together (``benchmarks/results/probes/generator_peak_dfd69a8.json``)."""
    settled = {}
    for name, fn in candidates.items():
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 (as in _time_candidate: the others still compete)
            _say_failed(op, name, err)
            continue
        settled[name] = fn
    return settled


def _final_times(op: str, finalists: dict, copies: list[tuple]) -> dict:
    """name -> median ms of ``PICK_FINAL_ROUNDS`` rounds that each time every finalist once, forward and reverse by
    turns (:func:`memfit.measure.timing.turn_orders`), each round over 1 / PICK_FINAL_ROUNDS of a first timing's
    replays (the rounds together replay about as long as one more timing of the finalists, and each pays a
    timing's fixed costs: warm-up, the estimate, the capture).

    The first timings are where each candidate's Triton kernels are autotuned (seconds of GPU work at large N), in
    a fixed order; the finalists, timed again with every kernel tuned and no candidate always first, decide.
    """
    rounds: dict[str, list[float]] = {name: [] for name in finalists}
    for order in turn_orders(list(finalists), PICK_FINAL_ROUNDS):
        for name, ms in _rotated_times(op, {name: finalists[name] for name in order}, copies,
                                       rep_ms=PICK_REP_MS / PICK_FINAL_ROUNDS).items():
            rounds[name].append(ms)
    return {name: statistics.median(ms) for name, ms in rounds.items()}


def rotation_copies(bytes_per_call: int, device: torch.device | None = None) -> int:
    """How many copies of a call's inputs and weights to call in turn so that none is read from L2: enough to hold
    ROTATE_BYTES or three times the GPU's L2, whichever is more, at most ROTATE_MAX_COPIES, at least one
    (``blr_layers`` rotates its table's copies by the same rule)."""
    target = max(ROTATE_BYTES, 3 * _l2_bytes(device))
    return max(1, min(ROTATE_MAX_COPIES, math.ceil(target / max(bytes_per_call, 1))))


def rotation(op: str, args: tuple) -> list[tuple]:
    """``args`` and copies of it, :func:`rotation_copies` in all, for a timing to call in turn, so each call reads
    its weights and inputs from HBM, as a model's layers do. Tensors are copied also inside lists and tuples (the
    per-layer weights a gemv pick times together), with their strides (a row-strided view stays one; an expanded,
    stride-0 view is materialised) and with a tensor passed twice copied once; other values are shared.

    Until 1deb9e7 the pick timed (L2 flush + call) minus the flush: at decode sizes a few us left from two
    timings of some 30 us each. In the full layer table at 6a18df8 (``blr_layers.py --summarize``), at N <= 128,
    its finalists read 0.875x to 1.265x the table's time of the same pipeline (10th to 90th percentile 0.931x to
    1.084x), where a row's four rounds in the table spread by a median 1.2-1.6%; at Llama-1B q/o and gate, N = 128,
    it took pipelines the table read 8.6% and 10.3% slower than the fastest. Rotating copies takes no difference
    of two timings, and rotates as the table does (which also counts the output's bytes). Where the copies cannot
    exceed the L2 (arguments of under 1/32 of it) or do not fit in memory, the pick says once that it times partly
    from L2.
    """
    size, device = _nbytes(args), _cuda_device(args)
    count = rotation_copies(size, device) if device is not None else 1
    try:
        copies = [args] + [_clone(args, {}) for _ in range(count - 1)]
    except torch.cuda.OutOfMemoryError:
        warn_once(f"pick-warm-l2:{op}", f"{op}: no memory for {count} copies of its {size >> 20} MiB of arguments; "
                  "kernel variants are timed on one copy, partly from L2")
        return [args]
    if count > 1 and count * size < 2 * _l2_bytes(device):
        warn_once(f"pick-small-rotation:{op}", f"{op}: {count} copies of its {size >> 10} KiB of arguments are less "
                  "than twice the L2; kernel variants are timed partly from L2")
    return copies


def _tensors(value):
    """The tensors in ``value``, also inside lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(value) -> int:
    """Bytes of the tensors in ``value`` (each counted once)."""
    return sum({id(t): t.nbytes for t in _tensors(value)}.values())


def _clone(value, memo: dict):
    """``value`` with its tensors copied, also inside lists and tuples, each with its own strides (an expanded view
    contiguous: torch will not copy into overlapping memory); ``memo`` (id -> copy) makes a tensor passed twice one
    copy."""
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            expanded = any(stride == 0 and size > 1 for stride, size in zip(value.stride(), value.shape))
            memo[id(value)] = value.clone() if expanded else torch.empty_strided(    # an expanded view is materialised
                value.shape, value.stride(), dtype=value.dtype, device=value.device).copy_(value)
        return memo[id(value)]
    if isinstance(value, (list, tuple)):
        items = [_clone(item, memo) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _l2_bytes(device: torch.device | None = None) -> int:
    """The L2 size in bytes of ``device`` (by default the current GPU; 0 without one, or off the GPU)."""
    if not torch.cuda.is_available():
        return 0
    if device is None:
        device = torch.cuda.current_device()
    elif torch.device(device).type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)


def _rotated_times(op: str, candidates: dict, copies: list[tuple], rep_ms: float = PICK_REP_MS) -> dict:
    """name -> median ms of one call of each candidate: graph replays of it called on every copy in turn
    (:func:`rotation`), divided by the copies. A candidate that fails here is skipped, said once."""
    return {name: _time_candidate(op, name, lambda fn=fn: [fn(*args) for args in copies], (), rep_ms) / len(copies)
            for name, fn in candidates.items()}


def l2_flush(size: int, device: torch.device):
    """Returns a call that reads a new ``size``-byte buffer and allocates nothing the size of it. Run before a timed
    call, a read of more than the L2 leaves it holding clean lines of the buffer, so the call finds none of its own
    data there. The reduction is in the buffer's own dtype: a ``sum`` of uint8 first copies the buffer to int64,
    eight times its size and written, not only read (1 GB for an H200's 126 MB flush)."""
    return torch.empty(size, dtype=torch.uint8, device=device).max


def autotune_bench(kernel_call, quantiles=None):
    """``triton.autotune``'s benchmarker for the BLR kernels: a config's median time from CUDA-graph
    replays, each call after an L2 flush (a read of twice the L2, clean lines: the call pays no write-backs for
    it). The flush's own time is included: it is the same for every config, and a ranking needs no more. A tile
    config's call has fixed arguments, so :func:`rotation`'s copies are not open to it. Without memory for the
    flush the configs are timed warm, said once.

    Triton's default times one call at a time between two events, each after zeroing a 256 MB
    buffer; at decode sizes (a few us) its bgemm picks ran up to 1.25x the time of the best tile
    timed by graph replays from HBM (``benchmarks/bgemm_tiles.py --decode``, 113a844).
    """
    if torch.cuda.is_current_stream_capturing():
        raise MemfitError("a BLR kernel is being autotuned inside a CUDA graph capture; run the op once "
                          "before capturing so its tile config is chosen outside")
    size = 2 * (_l2_bytes(torch.device("cuda")) or 64 * 2**20)
    call = kernel_call
    try:
        flush = l2_flush(size, torch.device("cuda"))
        call = lambda: (flush(), kernel_call())  # noqa: E731
    except torch.cuda.OutOfMemoryError:
        warn_once("autotune-warm-l2", f"triton.autotune: no memory for the {size >> 20} MiB L2 flush; tile configs "
                  "are timed with a warm L2")
    ms = _graph_ms(call, ())
    return [ms] * len(quantiles) if quantiles else ms


def _cuda_device(args: tuple) -> torch.device | None:
    """The device of the first CUDA tensor in ``args`` (also inside lists and tuples), if any."""
    return next((t.device for t in _tensors(args) if t.is_cuda), None)


def _graph_ms(fn, args: tuple, rep_ms: float = PICK_REP_MS) -> float:
    """Median ms of ``fn(*args)`` as CUDA-graph replays (so a decode-sized call's time is its GPU
    time, not Python's launch overhead, which would favour the variant with fewer launches), on
    :func:`memfit.measure.timing.graph_ms`'s side stream, which first waits for the work queued on the
    caller's stream, whose buffers the timed calls may reuse."""
    return graph_ms(lambda: fn(*args), rep_ms)


def _time_candidate(op: str, name: str, fn, args: tuple, rep_ms: float = PICK_REP_MS) -> float:
    """:func:`_graph_ms`, where a variant that fails to compile, run or be captured here is skipped,
    with a warning."""
    try:
        return _graph_ms(fn, args, rep_ms)
    except Exception as err:  # noqa: BLE001 (e.g. a config past this GPU's shared memory: the others still compete)
        _say_failed(op, name, err)
        return float("inf")


def _say_failed(op: str, name: str, err: Exception) -> None:
    warn_once(f"variant-failed:{op}:{name}", f"{op}: variant {name} failed here and is not picked: "
              f"{type(err).__name__}: {str(err)[:200]}")


def recompute_backward(reference, n_tensors: int, n_options: int = 0):
    """An autograd ``backward`` for a custom op whose first ``n_tensors`` args are tensors: the reference's gradient,
    recomputed from the saved tensors.

    The forward's ``setup_context`` (:func:`save_for_recompute`) saves those tensors (any
    may be None) and the remaining args in ``ctx.rest``; the reference takes the tensors
    and the first ``n_options`` of the rest (the others, e.g. a kernel variant, are ignored).
    Twice differentiable: where the backward records a graph (``create_graph=True``: a gradient penalty, a
    Hessian-vector product) the recompute runs on the saved tensors as they are, still joined to the forward's
    graph, and keeps its own graph; otherwise on detached copies, keeping nothing. Through 2d431bc it always
    detached, and a second derivative came back wrong (the Triton path) or None (the reference path), unsaid.
    """

    def backward(ctx, grad):
        saved = list(ctx.saved_tensors)
        if ctx.x_like is not None:                     # frozen weights: x was not saved (see save_for_recompute)
            saved[0] = ctx.x_like.expand(ctx.x_shape)
        needs = ctx.needs_input_grad[:n_tensors]
        twice = torch.is_grad_enabled()
        inputs = [t if t is None or (twice and t.requires_grad) else t.detach().requires_grad_(need)
                  for t, need in zip(saved, needs)]
        wanted = [t for t, need in zip(inputs, needs) if t is not None and need]
        grads = iter(())
        if wanted:
            with torch.enable_grad():
                out = reference(*inputs, *ctx.rest[:n_options])
                grads = iter(torch.autograd.grad(out, wanted, grad, create_graph=twice))
        result = [next(grads) if t is not None and need else None for t, need in zip(inputs, needs)]
        return (*result, *([None] * len(ctx.rest)))

    return backward


def recomputing(reference, n_tensors: int, n_options: int = 0):
    """``reference`` as an autograd function with the custom ops' memory behaviour (:func:`save_for_recompute`,
    :func:`recompute_backward`): the path where no Triton kernel runs (CPU). Run as plain autograd, a reference
    kept its intermediates for the backward (z and its copies), which the ledger does not count; run inside a
    custom op, its forward's temporaries were hidden from memfit's first CPU memory tracker, which saw an op as one call.
    Twice differentiable (:func:`recompute_backward`). ``torch.compile`` cannot trace its backward's
    ``autograd.grad`` (it broke the graph in training), so under torch.compile the reference is differentiated as
    it is (:func:`_reference_differentiated_when_compiled`, said once). Where no gradient is wanted (no_grad, or
    no input that requires one) the reference runs as it is: nothing is kept for a backward either way, and
    torch.compile then traces it whole (through the autograd function it broke the graph at every layer, and
    crashed inside dynamo on the low-rank reference)."""
    backward = recompute_backward(reference, n_tensors, n_options)

    class Recomputing(torch.autograd.Function):
        @staticmethod
        def forward(*inputs):
            return reference(*inputs[:n_tensors + n_options])

        @staticmethod
        def setup_context(ctx, inputs, output):
            save_for_recompute(ctx, inputs, output, n_tensors)

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx, grad)

    def run(*inputs):
        wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs[:n_tensors])
        if wanted and not (torch.compiler.is_compiling() and _reference_differentiated_when_compiled()) and not (
                torch._C._are_functorch_transforms_active() and _reference_differentiated_under_transforms()):
            return Recomputing.apply(*inputs)
        return reference(*inputs[:n_tensors + n_options])

    return run


@constant_when_compiled
def _reference_differentiated_when_compiled() -> bool:
    """True, said once: under torch.compile the BLR reference path differentiates the reference as it is, since the
    recomputing autograd function's backward (``autograd.grad``) splits the graph at every layer; what the compiled
    graph keeps for the backward is then torch.compile's choice, not the recompute the ledger counts. torch.compile
    runs this while tracing and keeps the result as a constant, so the warning costs no graph break."""
    warn_once("blr:compiled-reference", "block-low-rank layers on the PyTorch reference path under torch.compile: "
              "the reference is differentiated as it is (torch.compile chooses what to keep for the backward), not "
              "recomputed in the backward as eagerly")
    return True


def _reference_differentiated_under_transforms() -> bool:
    """True, said once: under torch.func transforms (vmap, grad, jvp, hessian) the BLR reference path is
    differentiated as it is, since the recomputing autograd function has no vmap or jvp rule (it raised); what is
    kept for the backward is then autograd's choice, not the recompute the ledger counts."""
    warn_once("blr:transformed-reference", "block-low-rank layers on the PyTorch reference path under torch.func "
              "transforms: the reference is differentiated as it is, not recomputed in the backward")
    return True


def save_for_recompute(ctx, inputs, output, n_tensors: int) -> None:
    """Save the op's tensors for :func:`recompute_backward`, but not x (the first) where no weight needs a gradient
    (a frozen BLR layer under LoRA elsewhere): every BLR reference is linear in x, so the gradient for x does not
    depend on it, and the backward differentiates the reference at x = 0 (one zero element, expanded) instead of
    keeping each layer's input alive from its forward to its backward, as the ledger assumes of a frozen layer."""
    x, weights = inputs[0], inputs[1:n_tensors]
    frozen = not any(ctx.needs_input_grad[1:n_tensors])
    ctx.x_like, ctx.x_shape = (x.new_zeros(()), x.shape) if frozen else (None, None)
    ctx.save_for_backward(None if frozen else x, *weights)
    ctx.rest = tuple(inputs[n_tensors:])


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b at :func:`blr_precision` (the interpreter's bf16 dot is fixed in kernels/interpreter.py)."""
    return tl.dot(a, b, acc, input_precision=PRECISION)


def blr_precision(dtype: torch.dtype) -> str:
    """The BLR kernels' dot precision: tensor cores for 16-bit inputs, fp32 per torch's matmul precision."""
    return dot_precision(dtype, "block-low-rank kernels")


TUNED_KERNELS: list = []   # the autotuner of every kernel :func:`tuned` made, for :func:`tile_picks`


def tuned(configs: list[tuple], names: tuple[str, ...], interpreter_config: tuple, key: list[str], prune=None):
    """``triton.autotune`` over ``configs`` (tuples of ``names`` values, then warps, stages).

    Under the interpreter only ``interpreter_config`` is used (small tiles, no timing).
    """
    def config(values):
        *tiles, warps, stages = values
        return triton.Config(dict(zip(names, tiles)), num_warps=warps, num_stages=stages)

    if interpreting():
        tuner = triton.autotune(configs=[config(interpreter_config)], key=key)
    else:
        pruning = {"early_config_prune": prune} if prune else None
        tuner = triton.autotune(configs=[config(c) for c in configs], key=key, prune_configs_by=pruning,
                                cache_results=True, do_bench=autotune_bench)

    def registered(fn):
        kernel = tuner(fn)
        TUNED_KERNELS.append(kernel)
        return kernel
    return registered


def tile_picks() -> dict[str, dict]:
    """Kernel name -> {autotuning key: the tile config taken} for every kernel :func:`tuned` made that has tuned in
    this process (or read its pick from Triton's disk cache), and under "chained bgemm pairs" the pair of tiles each
    chain took together with the timings of every pair (:func:`pick_chain_tiles`). The benchmarks record it beside
    the variant picks: the same pipeline has read 11.15 and 13.32 us in two layer tables offered the same tiles
    (Monarch two_stage_pdl, Llama-1B up, N = 128, 1476f91 and f969028), and neither recorded which tiles its
    autotuner took."""
    picks = {kernel.base_fn.__name__: {str(key): str(config) for key, config in kernel.cache.items()}
             for kernel in TUNED_KERNELS if kernel.cache}
    return picks | ({"chained bgemm pairs": dict(CHAIN_TILE_PICKS)} if CHAIN_TILE_PICKS else {})


def keep_small_n(configs, n: int, name: str = "BN"):
    """Decode-sized N (<= 16) keeps only BN == 16 tiles; larger N drops them."""
    keep = [c for c in configs if (c.kwargs[name] == 16) == (n <= 16)]
    return keep or configs


SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block (opt-in maximum)


def fits_smem(config, tile_elems: int, elem_bytes: int) -> bool:
    """Whether ``num_stages`` copies of a ``tile_elems``-element operand set fit shared memory."""
    return config.num_stages * tile_elems * elem_bytes <= SMEM_BYTES


def pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, _next_pow2(n))


TOKEN_MAJOR_MIN_N = 128  # from here Monarch and BLAST also offer intermediates stored token-contiguous, (b, r, N),
                         # through Triton stages: below it a row of tokens is too short to fill whole cache lines
                         # (Monarch's all-cuBLAS tbmm_tbmm is offered at every N)


# ---- chained stages: programmatic dependent launch and an L2 prefetch of the weights ----

PDL_MAX_N = 128          # token counts where a stage's launch and first read are a visible share of its time (Monarch's
                         # chain goes further: monarch.TWO_STAGE_PDL_MAX_N); offered up to 256 at ba0a9d7, BLAST's and
                         # low-rank's chains were the fastest of their structure at none of the five shapes timed
                         # there (blr_layers_subset_256_chained.json)
PREFETCH_BLOCK = tl.constexpr(128)  # L2 prefetch requests issued per step (one per thread at 4 warps)


def pdl_offered() -> bool:
    """Whether the ``*_pdl`` pipelines are offered: on GPUs with programmatic dependent launch
    (compute capability 9.0+), and under the interpreter, which runs them without it."""
    if interpreting():
        return True
    # get_device_properties, which dynamo folds to a constant (its constant_fold_functions); get_device_capability is
    # not on that list. A precaution: no graph break was measured there (BLAST's wrapper asked it at every decode call
    # at 1476f91, whose compiled end-to-end run showed no sign of one)
    return torch.cuda.is_available() and torch.cuda.get_device_properties().major >= 9


def pick_candidates(available: dict, never_close_on_h200: tuple[str, ...]) -> dict:
    """The pipelines ``pick_variant`` times: ``available`` (what the op can run, and what the layer table times),
    less ``never_close_on_h200`` on a GPU that offers the chained (``*_pdl``) pipelines (:func:`pdl_offered`),
    at every N (above PDL_MAX_N too, where no chained pipeline runs: the rule rests on the H200's tables alone).
    An op names there the pipelines that in four full layer tables on the H200 from 43f911d to 89a2ab1 and one
    stopped run (9f70ccb) were never the fastest nor within 5% of it at any N (``blr_layers.py --summarize``
    over those files lists them): each cost every cold pick its compiles, tile tuning and timings for nothing.
    The plain-PyTorch pipelines are kept although some never came close either: they are cheap to time and
    guard the pick against a Triton stage that runs badly on a new shape. The names stay available
    (``variant=...``); without PDL they are the decode pipelines and the pick times them."""
    if not pdl_offered():
        return available
    return {name: fn for name, fn in available.items() if name not in never_close_on_h200}


def chain_options(launch_dependents: bool | None = None, wait_for_previous: bool | None = None) -> dict:
    """Kernel keyword arguments for a stage in a chain: the GDC constexprs the kernel has (None:
    it has no such flag) and, for a stage that waits, the launch attribute that lets it start
    before the previous kernel ends (all off under the interpreter, which has no launches to
    overlap and no inline PTX)."""
    on = not interpreting()
    options = {}
    if launch_dependents is not None:
        options["LAUNCH_DEPENDENTS"] = launch_dependents and on
    if wait_for_previous is not None:
        options["WAIT_FOR_PREVIOUS"] = wait_for_previous and on
        options |= {"launch_pdl": True} if wait_for_previous and on else {}
    return options


@triton.jit
def prefetch_l2(base, rows, row_stride, row_len, LINE: tl.constexpr):
    """Ask L2 for ``rows`` rows of ``row_len`` unit-stride elements, ``row_stride`` apart, from
    ``base``: one ``prefetch.global.L2`` per 128-byte line (``LINE`` elements), fire and forget."""
    per_row = tl.cdiv(row_len, LINE) + 1             # + 1: a row not starting on a line boundary spans one more
    total = rows * per_row
    for start in range(0, total, PREFETCH_BLOCK):
        idx = tl.minimum(start + tl.arange(0, PREFETCH_BLOCK), total - 1)
        col = tl.minimum((idx % per_row) * LINE, row_len - 1)
        ptrs = base + (idx // per_row).to(tl.int64) * row_stride + col
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def line_elements(t: torch.Tensor) -> int:
    """Elements of ``t`` per 128-byte cache line."""
    return 128 // t.element_size()



# ---- strided batched GEMM with a regrouping store --------------------------------

def _prune_bgemm(configs, named_args, **kwargs):
    """Tiles for the token count (16-token tiles only at decode, a stage in a chain its own; the mid tiles where
    :func:`mid_tiles_offered`), no wider than the columns or a run of K (a group of a gathered a) needs, and whose
    pipeline stages fit shared memory; batch-grouped tiles only for a plain launch with few K steps at large N (judged
    by the N bucket, the autotuner's key, so one rule holds for every N that shares a pick)."""
    chained = kwargs.get("LAUNCH_DEPENDENTS") or kwargs.get("WAIT_FOR_PREVIOUS")
    other = BGEMM_PLAIN_DECODE if chained else BGEMM_CHAINED_DECODE
    if not mid_tiles_offered(named_args["N_BUCKET"], named_args["C"], named_args["BATCHES"],
                             named_args["a_ptr"].device):
        other = other + BGEMM_MID
    one_run = named_args["AGRP"] == named_args["K"]
    if one_run:                                        # a read in one run: the short-run tiles are not for it
        other = other + BGEMM_SHORT_RUNS
    grouped = (one_run and not named_args["BGRP"] and not chained
               and named_args["N_BUCKET"] >= BATCH_GROUP_MIN_N
               and named_args["K"] <= BATCH_GROUP_MAX_K and named_args["BATCHES"] > 1)
    configs = [c for c in configs if bgemm_tile(c) not in other and (grouped or c.kwargs["BATCH_GROUP"] == 1)]
    configs = keep_small_n(configs, named_args["N"])
    size = named_args["a_ptr"].element_size()
    keep = [c for c in configs if bgemm_tile_fits(c, named_args["C"], named_args["AGRP"], size)]
    return keep or configs[:1]


def mid_tiles_offered(n_bucket: int, cols: int, batches: int, device: torch.device) -> bool:
    """Whether bgemm tunes over BGEMM_MID: for an N bucket above decode up to MID_MAX_N where the smallest large tile
    (64 x 128) gives fewer programs than half the SMs of ``device``."""
    return (16 < n_bucket <= MID_MAX_N
            and triton.cdiv(n_bucket, 64) * triton.cdiv(cols, 128) * batches < sm_count(device) / 2)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def bgemm_tile(config) -> tuple:
    """A bgemm config as its tile tuple (BN, BC, BK, warps, stages), the form the tile lists use."""
    return (config.kwargs["BN"], config.kwargs["BC"], config.kwargs["BK"], config.num_warps, config.num_stages)


def bgemm_tile_fits(config, cols: int, k: int, elem_bytes: int) -> bool:
    """Whether a bgemm tile config is worth running: no wider than the columns or K need, and its
    pipeline stages fit shared memory."""
    bn, bc, bk = (config.kwargs[name] for name in ("BN", "BC", "BK"))
    return (bc <= max(32, pow2_at_least(cols)) and bk <= max(32, pow2_at_least(k))
            and fits_smem(config, bk * (bn + bc), elem_bytes))


def jit_function(kernel):
    """The ``@triton.jit`` function under a kernel's autotune and heuristics wrappers."""
    from triton.runtime import Autotuner, Heuristics

    while isinstance(kernel, (Autotuner, Heuristics)):
        kernel = kernel.fn
    return kernel


# Decode, a launch on its own: six tiles, the best of which is within 0.9% of the best of 16 at every
# Monarch stage of the paper's shapes, N = 1 and 16 (bgemm_tiles_decode.json, 113a844: few warps, deep
# pipelines). A stage in a chain keeps the earlier four: with these six the PDL pipelines ran up to 1.5x
# slower (blr_layers, cba5eee; not profiled: a waiting stage's many small programs may hold SMs that the
# stage before it needs).
BGEMM_PLAIN_DECODE = [(16, 64, 128, 2, 4), (16, 32, 64, 2, 8), (16, 32, 256, 2, 4), (16, 64, 64, 4, 6),
                      (16, 128, 64, 4, 5), (16, 32, 128, 2, 6)]
BGEMM_CHAINED_DECODE = [(16, 32, 256, 4, 3), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3)]
# Offered to every gathered a (``a_runs``): K steps of 16 or 32, for runs where 64-wide steps mask much of
# their columns (Monarch's t = 16, 32, 48 at Llama-1B: 75%, 50%, 25%).
BGEMM_SHORT_RUNS = [(128, 128, 32, 4, 4), (128, 128, 16, 4, 5), (128, 256, 32, 8, 3)]
# 64-token tiles of few columns, offered at the N buckets between decode and MID_MAX_N to a launch that the large
# tiles leave with few programs (:func:`mid_tiles_offered`; the large tiles' pick, 128 x 64, gave Llama-1B q/o's stage
# 2 at N = 128 32 programs on 132 SMs). From `bgemm_tiles.py --mid` (d1edfef, bgemm_tiles_mid.json): at N = 128 one of
# these three was the best of the sweep's 14 mid tiles at 13 of the 14 Monarch stages (at Llama-7B qkvo's stage 1,
# 1.14x that best, and a large tile faster than all); the best of the three took 0.81-1.32x the time of the large
# tiles' pick, below 1.0x at 11 stages (Llama-1B q/o: 3.57 / 3.59 us against 3.97 / 4.43, stages 1 / 2); at N = 512
# a mid tile was faster at two stages (Llama-1B q/o and down, stage 2, 0.95-0.96x), which the large tiles fill with
# 128 programs. In the layer table at N = 128 Monarch's q/o went from 6.42 us (1476f91) to 5.48 (273092a) and 5.43
# (f969028). Offered to every launch up to 256 tokens (273092a), they slowed `tbmm` at Llama-7B gate/up, 25.29 ->
# 28.61 us, whose stage 1 the large tiles already give 384 programs (as 32-token tiles had in 04453a1's trial,
# results/earlier/README.md); kept out there, 25.60.
BGEMM_MID = [(64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (64, 32, 128, 4, 3)]
MID_MAX_N = 256
BGEMM_CONFIGS = [  # BN, BC, BK, warps, stages
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
    *BGEMM_PLAIN_DECODE, *BGEMM_CHAINED_DECODE, *BGEMM_SHORT_RUNS, *BGEMM_MID,
]
# Tiles that run BATCH_GROUP batches per program (BN, BC, BK, BATCH_GROUP, warps, stages), offered to any plain
# launch whose K is a few steps (K <= BATCH_GROUP_MAX_K: Monarch's stage 1 at Llama-1B and -7B; two_stage's
# stage 2 at r <= 256 too until 412d845, whose interleaved reads of w2 they do not take) at large N; the autotuner
# keeps the one-batch tiles where they win. From the sweep
# `bgemm_tiles.py --groups 2 4 8` (f1b698c, bgemm_tiles_groups.json,
# bgemm_tiles_runs_z_groups.json): Llama-1B gate, N = 8192, K = 128, stage 1 84.4 -> 72.0 us token-major, q/o
# 46.2 -> 37.9, up 119.3 -> 107.1; at K = 256 (Llama-7B) they win in the (N, b, r) layout (qkvo, N = 8192: 214.4
# -> 196.5) and lose token-major; no gain at K >= 512; a few groups empty the grid at small N.
BGEMM_GROUPED = [(256, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 256, 64, 4, 8, 4), (64, 128, 64, 4, 4, 4)]
BATCH_GROUP_MIN_N, BATCH_GROUP_MAX_K = 1024, 256
BGEMM_TUNED = [(*tile[:3], 1, *tile[3:]) for tile in BGEMM_CONFIGS] + BGEMM_GROUPED   # BN, BC, BK, BATCH_GROUP, w, s


# Elements an a gathered in aligned windows may be read past its last run: a step's BK less one, plus a
# window's lead (at most 16 B less one element).
A_WINDOW_SLACK = max(bk for _, _, bk, _, _ in BGEMM_CONFIGS) + 16


def a_window(a, sab: int, san: int, sak: int, sag: int, gathered: bool) -> int:
    """For a gathered a whose runs start misaligned (a batch stride, Monarch's t, not a multiple of 16 B)
    while its rows and runs are aligned: the alignment, in elements, of the windows the kernel reads
    instead (vector loads; the columns outside the run are zeroed in registers). 0: read the runs."""
    align = 16 // a.element_size()
    return align if (gathered and sak == 1 and sab % align and not san % align and not sag % align
                     and not a.data_ptr() % 16) else 0


@triton.jit
def _k_step_tiles(a_ptrs, b_ptrs, a_rows, b_cols, rk, k0, k_end, EVEN_K: tl.constexpr):
    """One K step's a (BN, BK) and b (BK, BC) tiles, at K offset k0 of a run (or of all of K) ending at
    k_end; EVEN_K: the run is a whole number of steps, so no K mask to build and apply."""
    if EVEN_K:
        return tl.load(a_ptrs, mask=a_rows, other=0.0), tl.load(b_ptrs, mask=b_cols, other=0.0)
    return (tl.load(a_ptrs, mask=a_rows & (rk[None, :] + k0 < k_end), other=0.0),
            tl.load(b_ptrs, mask=(rk[:, None] + k0 < k_end) & b_cols, other=0.0))


@triton.jit
def _interleaved_b_rows(k0, rk, BGRP: tl.constexpr, sbg, sbk, BK: tl.constexpr):
    """Offsets of b's rows for the K step at k0 where b holds interleaved runs of BGRP rows (runs sbg apart, a run's
    rows sbk apart): one scalar division where the step lies in one run (BK divides BGRP), else one per row. BGRP is
    a constexpr, so the divisions are shifts or multiplies. 412d845 divided by a runtime value for every row of every
    K step; its chained two_stage took 3.4-15.1% longer at decode, and at Llama-1B gate 90c6571 took back most of it
    (README's Monarch status)."""
    if BGRP % BK == 0:
        return (k0 // BGRP) * sbg + (k0 % BGRP + rk) * sbk
    k = k0 + rk
    return (k // BGRP) * sbg + (k % BGRP) * sbk


@tuned(BGEMM_TUNED, ("BN", "BC", "BK", "BATCH_GROUP"), (16, 32, 32, 1, 4, 1),
       key=["N_BUCKET", "K", "C", "GRP", "AGRP", "BGRP", "BATCHES", "LAUNCH_DEPENDENTS", "WAIT_FOR_PREVIOUS"],
       prune=_prune_bgemm)
@triton.heuristics({"EVEN_K": lambda meta: meta["AGRP"] % meta["BK"] == 0,
                    "A_GROUPED": lambda meta: meta["AGRP"] < meta["K"],
                    "B_INTERLEAVED": lambda meta: meta["BGRP"] > 0,    # BGRP: b's interleaved run length, or 0
                                                                        # (one compiled kernel for every K)
                    "A_WINDOW": lambda meta: a_window(meta["a_ptr"], meta["sab"], meta["san"], meta["sak"], meta["sag"],
                                                      meta["AGRP"] < meta["K"])})
@triton.jit
def _bgemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, N, K, C, GRP, AGRP, BATCHES, N_BUCKET,
                  sab, san, sak, sag, sbb, sbk, sbc, sbg, scb, scn, scg, sci, BGRP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
                  WAIT_FOR_PREVIOUS: tl.constexpr, B_ROWS_CONTIGUOUS: tl.constexpr, LINE: tl.constexpr,
                  BN: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                  A_GROUPED: tl.constexpr = False, B_INTERLEAVED: tl.constexpr = False, A_WINDOW: tl.constexpr = 0,
                  GROUP_N: tl.constexpr = 8, BATCH_GROUP: tl.constexpr = 1):
    tl.static_assert(BATCH_GROUP == 1 or not (A_GROUPED or B_INTERLEAVED or A_WINDOW > 0 or WAIT_FOR_PREVIOUS),
                     "batch groups: plain loop only")
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    n_tiles = tl.cdiv(N, BN)
    c_tiles = tl.cdiv(C, BC)
    pid = tl.program_id(0)
    per_group = GROUP_N * c_tiles                      # GROUP_N token tiles sweep all column tiles together
    first = (pid // per_group) * GROUP_N
    rows = tl.minimum(n_tiles - first, GROUP_N)
    pid_n = first + (pid % per_group) % rows
    pid_c = (pid % per_group) // rows
    bt = tl.program_id(1).to(tl.int64) * BATCH_GROUP    # this program's (first) batch
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rc = pid_c * BC + tl.arange(0, BC)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + bt * sab + rn[:, None] * san + rk[None, :] * sak
    b_cols_ptr = b_ptr + bt * sbb + rc[None, :] * sbc
    b_ptrs = b_cols_ptr + rk[:, None] * sbk
    if WAIT_FOR_PREVIOUS:                              # b is this op's weights: fetch them while a is being made
        b_tile = b_ptr + bt * sbb + pid_c * BC * sbc
        cols = tl.minimum(BC, C - pid_c * BC)
        if B_INTERLEAVED:                              # its K rows: one slab of rows sbg apart (bgemm checks)
            prefetch_l2(b_tile, K, sbg, cols, LINE)
        elif B_ROWS_CONTIGUOUS:                        # b[k, c] at k * sbk + c
            prefetch_l2(b_tile, K, sbk, cols, LINE)
        else:                                          # b[k, c] at k + c * sbc
            prefetch_l2(b_tile, cols, sbc, K, LINE)
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BN, BC), dtype=tl.float32)
    a_rows, b_cols = rn[:, None] < N, rc[None, :] < C
    if A_WINDOW > 0:                                   # runs of a that start misaligned: aligned windows
        lead = (bt * sab) % A_WINDOW                    # window column of the run's first element
        san_w = (san // A_WINDOW) * A_WINDOW            # = san (a_window checked): written so Triton sees the
        sag_w = (sag // A_WINDOW) * A_WINDOW            # alignment where it did not specialize the stride
        a_win = a_ptr + ((bt * sab) // A_WINDOW) * A_WINDOW + rn[:, None] * san_w + rk[None, :]
        steps = tl.cdiv(AGRP + A_WINDOW - 1, BK)
        for step in range(0, (K // AGRP) * steps):
            run = (step // steps).to(tl.int64)
            q = (step % steps) * BK + rk - lead        # position in the run of each window column
            in_run = (q >= 0) & (q < AGRP)
            a = tl.load(a_win + run * sag_w + (step % steps) * BK, mask=a_rows, other=0.0)
            a = tl.where(in_run[None, :], a, tl.zeros_like(a))     # neighbours' columns (or slack) out
            b = tl.load(b_cols_ptr + run * sbg + q[:, None] * sbk, mask=in_run[:, None] & b_cols, other=0.0)
            acc = mma(a, b, acc, PRECISION)
    elif A_GROUPED:                                    # K = (K / AGRP) runs of AGRP, a's runs sag apart, b's sbg
        steps = tl.cdiv(AGRP, BK)                      # steps per run; a step never crosses a run
        for step in range(0, (K // AGRP) * steps):
            run = (step // steps).to(tl.int64)
            start = (step % steps) * BK                # of this step in its run
            a, b = _k_step_tiles(a_ptrs + run * sag + start * sak, b_ptrs + run * sbg + start * sbk, a_rows,
                                 b_cols, rk, start, AGRP, EVEN_K)
            acc = mma(a, b, acc, PRECISION)
    elif BATCH_GROUP > 1:                              # BATCH_GROUP batches in one flat loop of K steps: the
        k_steps = tl.cdiv(K, BK)                       # next batch's tiles load while this one's is stored
        for step in range(0, BATCH_GROUP * k_steps):
            g = (step // k_steps).to(tl.int64)
            k0 = (step % k_steps) * BK
            live = bt + g < BATCHES
            a, b = _k_step_tiles(a_ptrs + g * sab + k0 * sak, b_ptrs + g * sbb + k0 * sbk, a_rows & live,
                                 b_cols & live, rk, k0, K, EVEN_K)
            acc = mma(a, b, acc, PRECISION)
            if k0 + BK >= K:
                _store_tile(c_ptr, bias_ptr, acc, bt + g, rn, rc, a_rows & b_cols & live, live, C, GRP, scb, scn, scg,
                            sci, HAS_BIAS)
                acc = tl.zeros((BN, BC), dtype=tl.float32)
    else:
        for k0 in range(0, K, BK):
            if B_INTERLEAVED:
                b_ptrs = b_cols_ptr + _interleaved_b_rows(k0, rk, BGRP, sbg, sbk, BK)[:, None]
            a, b = _k_step_tiles(a_ptrs, b_ptrs, a_rows, b_cols, rk, k0, K, EVEN_K)
            acc = mma(a, b, acc, PRECISION)
            a_ptrs += BK * sak
            if not B_INTERLEAVED:
                b_ptrs += BK * sbk
    if BATCH_GROUP == 1:
        _store_tile(c_ptr, bias_ptr, acc, bt, rn, rc, a_rows & b_cols, True, C, GRP, scb, scn, scg, sci, HAS_BIAS)


@triton.jit
def _store_tile(c_ptr, bias_ptr, acc, bt, rn, rc, mask, live, C, GRP, scb, scn, scg, sci, HAS_BIAS: tl.constexpr):
    """c[bt][rn, rc] = acc (+ bias), column rc stored at its group's offset (the regrouping store); ``live``:
    batch bt exists (a batch group's last may run past the batches: then nothing is read or written)."""
    col = bt * scb + (rc // GRP).to(tl.int64) * scg + (rc % GRP).to(tl.int64) * sci   # token-major: i r N > 2^31
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=(rc < C) & live, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rn[:, None] * scn + col[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def bgemm_grid(n: int, cols: int, batches: int, bn: int, bc: int, batch_group: int) -> tuple[int, int]:
    """bgemm's launch grid: (token tiles x column tiles, batch groups)."""
    return triton.cdiv(n, bn) * triton.cdiv(cols, bc), triton.cdiv(batches, batch_group)


def bgemm(a, b, c, n: int, k: int, cols: int, batches: int, a_strides, b_strides, c_strides,
          grp: int | None = None, bias=None, launch_dependents: bool = False,
          wait_for_previous: bool = False, a_runs: tuple[int, int] | None = None, b_interleaved: int = 1,
          tile: tuple | None = None) -> None:
    """c[bt][n, col] = sum_k a[bt][n, k] b[bt][k, col] (+ bias[feature]) for bt < batches.

    Strides in elements: a (batch, n, k), b (batch, k, col), c (batch, n, group, in-group):
    column ``col`` is stored at ``(col // grp) * group + (col % grp) * in_group`` so a
    store can scatter column groups (the Monarch P^T) with no copy. The bias is read at
    the stored column offset, so it applies when c is the (N, out) output itself.

    ``a_runs = (length, stride)`` gathers a the same way on load: k in runs of ``length``
    (a divisor of k), run g of a row starting ``g * stride`` elements after run 0, which the
    a strides address (so Monarch's stage 2 reads P^T straight from stage 1's natural output).
    Where the runs start misaligned but rows and runs are 16-B aligned (Monarch's t = 93), the
    kernel reads aligned windows around each run, up to A_WINDOW_SLACK elements past the last
    run, which a's storage must hold (checked).

    ``b_interleaved = g`` reads b's rows interleaved: K index ``q + j * (k / g)`` (position q of run j) from row
    ``q * g + j``, rows ``b_strides[1]`` apart (Monarch's w2, stored in (s, j) order so that cuBLAS can read it, read
    by a stage 2 whose K is in (j, s) order). With ``a_runs``, b's runs are a's (the same length).

    Where K is a few steps (K <= BATCH_GROUP_MAX_K) and N's bucket >= BATCH_GROUP_MIN_N, a plain launch (a and b
    read in one run) also tunes over tiles that run several batches per program in one flat loop (``BGEMM_GROUPED``).

    In a chain (:func:`chain_options`): ``launch_dependents`` lets the next kernel start now;
    ``wait_for_previous`` prefetches this program's slice of b (the weights) into L2, then
    waits for the previous kernel (which writes a). b needs a unit stride along k or col.

    ``tile`` (BN, BC, BK, warps, stages), one of :func:`bgemm_tiles_offered`, runs that tile instead of the
    autotuner's pick (a chain's tiles are picked together: :func:`pick_chain_tiles`).
    """
    grp = grp or cols
    run, run_stride = a_runs or (k, 0)
    if wait_for_previous and 1 not in tuple(b_strides)[1:]:
        raise MemfitError(f"bgemm: a chained stage needs b with a unit stride, got strides {tuple(b_strides)}")
    if run < 1 or k % run:
        raise MemfitError(f"bgemm: a's runs of {run} do not divide k = {k}")
    if b_interleaved < 1 or k % b_interleaved:
        raise MemfitError(f"bgemm: b's {b_interleaved} interleaved runs do not divide k = {k}")
    if b_interleaved > 1 and wait_for_previous and b_strides[2] != 1:
        raise MemfitError("bgemm: a chained stage reads interleaved b rows only with a unit column stride")
    if b_interleaved > 1 and a_runs and run != k // b_interleaved:
        raise MemfitError(f"bgemm: b's interleaved runs of {k // b_interleaved} must be a's runs of {run}")
    sbb, sbk, sbc, sbg = bgemm_b_strides(b_strides, run, b_interleaved)
    if a_window(a, *a_strides, run_stride, run < k):             # reads aligned windows around the runs
        last = (batches - 1) * a_strides[0] + (n - 1) * a_strides[1] + (k // run - 1) * run_stride + run
        if (a.storage_offset() + last + A_WINDOW_SLACK) * a.element_size() > a.untyped_storage().nbytes():
            raise MemfitError(f"bgemm: a's runs start misaligned, so a's storage needs {A_WINDOW_SLACK} elements "
                              "of slack past its last run (allocate it larger)")
    grid = lambda meta: bgemm_grid(n, cols, batches, meta["BN"], meta["BC"], meta["BATCH_GROUP"])
    kernel, fixed = _bgemm_kernel, {}
    if tile is not None:                                          # the heuristics still set EVEN_K and the a reads
        if tuple(tile) not in BGEMM_CONFIGS:
            raise MemfitError(f"bgemm: tile {tile} is none of its (BN, BC, BK, warps, stages) tiles (BGEMM_CONFIGS)")
        kernel = _bgemm_kernel.fn
        fixed = dict(zip(("BN", "BC", "BK", "num_warps", "num_stages"), tile), BATCH_GROUP=1)
    kernel[grid](a, b, c, bias if bias is not None else c, n, k, cols, grp, run, batches, n_bucket(n),
                 *a_strides, run_stride, sbb, sbk, sbc, sbg, *c_strides, k // b_interleaved if b_interleaved > 1 else 0,
                 HAS_BIAS=bias is not None,
                 PRECISION=blr_precision(a.dtype), B_ROWS_CONTIGUOUS=wait_for_previous and b_strides[2] == 1,
                 LINE=line_elements(b), **chain_options(launch_dependents, wait_for_previous), **fixed)


def bgemm_b_strides(b_strides, run: int, interleaved: int) -> tuple[int, int, int, int]:
    """The kernel's b strides (batch, row within a run, column, run) for b (batch, k, col) strides, a's runs of
    ``run`` rows and ``interleaved`` interleaved runs of b (1: none; then a run of b is a's, ``run`` rows on)."""
    sbb, row, sbc = b_strides
    return (sbb, row * interleaved, sbc, row) if interleaved > 1 else (sbb, row, sbc, run * row)


def bgemm_tiles_offered(a, n: int, k: int, cols: int, batches: int, launch_dependents: bool = False,
                        wait_for_previous: bool = False) -> list[tuple]:
    """The one-batch tiles (BN, BC, BK, warps, stages) bgemm's autotuner chooses between for this launch (a plain,
    ungathered a of ``a``'s dtype and device; :func:`_prune_bgemm`)."""
    shape = {"N": n, "N_BUCKET": n_bucket(n), "C": cols, "K": k, "AGRP": k, "BGRP": 0, "BATCHES": batches, "a_ptr": a}
    kept = _prune_bgemm(_bgemm_kernel.configs, shape, LAUNCH_DEPENDENTS=launch_dependents,
                        WAIT_FOR_PREVIOUS=wait_for_previous)
    return sorted({bgemm_tile(c) for c in kept if c.kwargs["BATCH_GROUP"] == 1})


CHAIN_TILE_PICKS: dict[str, dict] = {}  # "op shape_key" -> a chain's pair pick in this process: its timings, or the
                                        # pair read from the cache (_disk_pick's records; in tile_picks)
AUTOTUNED_PAIR = (None, None)           # a chain's two launches left to the autotuner, each tuned alone
_CHAIN_TILE_MEMO: dict[tuple, tuple] = {}   # (op, shape_key, device) -> the pair pick_chain_tiles returned: later
                                            # calls in this process skip the lookup (and a failed timing)


def pick_chain_tiles(op: str, shape_key: tuple, stages: tuple[tuple[int, int, int], tuple[int, int, int]],
                     run_with, args: tuple) -> tuple:
    """The tiles of a pipeline's two chained bgemm launches (the first launching its dependents, the last waiting
    for the kernel before it), picked together: every pair of the tiles each launch is offered
    (:func:`bgemm_tiles_offered`), the whole pipeline ``run_with(*args, tiles=pair)`` timed as the variant pick times
    pipelines, by the same :func:`_disk_pick` (rotating copies, CUDA-graph replays, finalists again; cached on disk
    beside the variant picks; every pair's timing recorded in CHAIN_TILE_PICKS, so in ``tile_picks``). ``stages``:
    each launch's (K, columns, batches); args[0] is the (N, in) input. AUTOTUNED_PAIR where the launches are left
    to the autotuner: off the GPU, where nothing is timed; at a first call inside a CUDA graph capture, or
    where no pair could be timed (each said once).

    Why: the autotuner times each launch alone, but in a chain the second runs beside the first. At Llama-1B up,
    N = 128, the pair of its picks read 11.15 us in Monarch's ``two_stage_pdl`` (the op 11.40) where the best of 25
    pairs took 10.88, and one stage-2 tile it can take alone (128 x 128 for 128 x 64) made the chain 13.33 us, the
    time the f969028 layer table read (``benchmarks/chain_tiles.py``, 19084f9). The price is paid once per shape and
    N bucket (the pick is cached on disk): a layer's first calls at N = 1 and 16, three structures at the seven
    shapes, took 142.5 s against 92.3 s before (``benchmarks/pick_cost.py``, af7a5bc and d1edfef)."""
    x, device = args[0], _cuda_device(args)
    if device is None:
        return AUTOTUNED_PAIR
    memo = (op, shape_key, device)
    if memo in _CHAIN_TILE_MEMO:
        return _CHAIN_TILE_MEMO[memo]
    n = x.shape[0]
    (k1, cols1, batches1), (k2, cols2, batches2) = stages
    pairs = {f"{t1} + {t2}": (t1, t2)
             for t1 in bgemm_tiles_offered(x, n, k1, cols1, batches1, launch_dependents=True)
             for t2 in bgemm_tiles_offered(x, n, k2, cols2, batches2, wait_for_previous=True)}
    key = "|".join([torch.cuda.get_device_name(), triton.__version__, _source_digest((run_with,)), op, "chained tiles",
                    *map(str, shape_key)])
    picked = _disk_pick(op, shape_key, key, {label: functools.partial(run_with, tiles=tiles)
                                              for label, tiles in pairs.items()}, args, CHAIN_TILE_PICKS,
                        "each chained launch takes the tile its autotuner picks alone")
    if picked is None and torch.cuda.is_current_stream_capturing():
        return AUTOTUNED_PAIR                       # not remembered: the next call outside a capture times the pairs
    _CHAIN_TILE_MEMO[memo] = AUTOTUNED_PAIR if picked is None else pairs[picked]
    return _CHAIN_TILE_MEMO[memo]


def forget_picks() -> None:
    """Drop what a later pick in this process would reuse (the disk cache it loaded, the picks it could not time, the
    chains' pairs, the ops' remembered picks), so the next pick reads the cache file MEMFIT_AUTOTUNE_CACHE now names
    (a benchmark's own picks file). The records of picks made (PICK_TIMINGS, CHAIN_TILE_PICKS) stay: call it before
    the first pick."""
    global _CACHE
    _CACHE = None
    _UNTIMED.clear()
    _CHAIN_TILE_MEMO.clear()
    _VARIANT_MEMO.clear()


def bmm_into(a, b, out, bias=None) -> None:
    """out = a @ b (+ bias) by cuBLAS, written straight into ``out``.

    ``a`` (batch, n, k), ``b`` (batch, k, col) and ``out`` (batch, n, col) may be strided
    views (e.g. ``y.view(n, b, p).transpose(0, 1)``): cuBLAS takes a row stride as its
    leading dimension and any batch stride, so the block-major output needs no copy.
    ``bias`` broadcasts to ``out``: (batch, 1, col) over rows, (batch, n, 1) over columns.
    """
    if bias is None:
        torch.bmm(a, b, out=out)
    else:
        torch.baddbmm(bias, a, b, out=out)


def per_block_gemm(a, w, bias, cublas: bool, permute_output: bool = False, wait_for_previous: bool = False,
                   gathered_runs: tuple[int, int] = (1, 0), w_interleaved: int = 1, tile: tuple | None = None):
    """y (N, b p): output block i = a[:, i, :] @ w[i] (+ bias), the last stage of Monarch and BLAST.

    ``a`` (N, b, K) and ``w`` (b, K, p) may be strided views. Block-major output (feature
    i p + s) by cuBLAS (:func:`bmm_into`) or by :func:`bgemm`; ``permute_output`` (bgemm
    only: cuBLAS cannot store a column stride) writes the interleaved feature s b + i, and
    ``wait_for_previous`` (bgemm only) chains it after the kernel that wrote ``a``.
    ``gathered_runs = (count, stride)`` (bgemm only): block i's operand is ``count`` runs of K columns
    side by side, run g read ``g * stride`` elements after a[:, i, :] (w then has count * K rows).
    ``w_interleaved = g`` (bgemm only): w[i]'s rows hold g interleaved runs (:func:`bgemm`'s ``b_interleaved``).
    ``tile``: bgemm's tile, where not autotuned (:func:`bgemm`).
    """
    n, b, k = a.shape
    p = w.shape[2]
    runs, run_stride = gathered_runs
    if w.shape[1] != runs * k:
        raise MemfitError(f"per_block_gemm: w has {w.shape[1]} rows for {runs} runs of {k}")
    y = torch.empty(n, b * p, device=a.device, dtype=a.dtype)
    if cublas:
        if runs != 1 or w_interleaved != 1 or tile is not None:
            raise MemfitError("per_block_gemm: cuBLAS takes no bgemm tile and cannot gather runs of a or interleaved "
                              "rows of w; use bgemm (cublas=False)")
        bmm_into(a.transpose(0, 1), w, y.view(n, b, p).transpose(0, 1), None if bias is None else bias.view(b, 1, p))
    else:
        block_stride, col_stride = (1, b) if permute_output else (p, 1)
        bgemm(a, w, y, n, runs * k, p, b, (a.stride(1), a.stride(0), a.stride(2)), w.stride(),
              (block_stride, y.stride(0), 0, col_stride), bias=bias, wait_for_previous=wait_for_previous,
              a_runs=(k, run_stride) if runs > 1 else None, b_interleaved=w_interleaved, tile=tile)
    return y

