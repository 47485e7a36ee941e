"""Timed picks: which of an op's kernel pipelines, or of a chain's tile pairs, a shape runs, timed on the GPU and
remembered on disk; and the tile autotuner every memfit Triton kernel tuned by :func:`tuned` uses.

* ``pick_variant``: each op has several complete kernel pipelines (e.g. Triton GEMMs vs
  a Triton stage plus a cuBLAS stage); which is fastest depends on the shape. The first
  call for a shape times each candidate on the GPU (CUDA-graph replays, as the layers
  run in decode, calling in turn copies of its arguments that together exceed the L2, as a model
  reads its weights from HBM: :func:`rotation`), times those
  within 25% of the fastest again in three interleaved rounds, and remembers the winner in a JSON
  file (``$MEMFIT_AUTOTUNE_CACHE``, default ``~/.cache/memfit/autotune.json``), keyed by
  GPU, Triton version, a digest of memfit's kernel sources (:func:`source_digest`), op and shape, so a
  second run does not retune and an edited kernel is timed afresh. Off the GPU (the
  interpreter) the op's default is taken; inside a CUDA graph capture the cached winner
  is used, or, for a shape never timed before, the default (said once).
* The Triton kernels' own tile configs are tuned by ``triton.autotune`` (:func:`tuned`) with
  ``cache_results=True`` (Triton's on-disk cache), keyed on the shapes, and timed from
  graph replays too, each call after an L2 flush (:func:`autotune_bench`).
"""
import functools
import inspect
import json
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from memfit.errors import MemfitError
from memfit.files import atomic_path, digest_files, held_exclusively
from memfit.kernels.dispatch import interpreting
from memfit.log import logger, warn_once
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
CHAIN_TILE_PICKS: dict[str, dict] = {}  # "op shape_key" -> a chain's pair pick in this process: its timings, or the
                                        # pair read from the cache (disk_pick's records; in tile_picks)
CHAIN_TILE_MEMO: dict[tuple, tuple] = {}   # (op, shape_key, device) -> the pair batched_gemm.pick_chain_tiles
                                            # returned: later calls in this process skip the lookup (and a failed
                                            # timing)


def _cache_path() -> Path:
    """``$MEMFIT_AUTOTUNE_CACHE``, where set and not empty (an empty one had ended the first save in a ValueError)."""
    return Path(os.environ.get("MEMFIT_AUTOTUNE_CACHE") or Path.home() / ".cache" / "memfit" / "autotune.json")


def _read_cache(path: Path) -> dict:
    """The picks the file holds; none where it is missing, unreadable or not a JSON object (said once: a list had
    ended the first lookup in an AttributeError)."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cache, dict):
        warn_once(f"autotune-cache-shape:{path}", f"the autotune cache {path} is not a JSON object; tuning again "
                                                  "and writing it anew")
        return {}
    return cache


def _load_cache() -> dict:
    global _CACHE
    if _CACHE is None:
        _CACHE = _read_cache(_cache_path())
    return _CACHE


def _save_cache(cache: dict) -> None:
    """Write ``cache`` with the picks another process saved since this one read the file (this one's win a tie): each
    had written back the file as it first read it, and the last to save dropped the others' picks. The read and the
    write hold the file's lock, so that two saves at the same instant do not each miss the other's picks."""
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with held_exclusively(path):
            cache.update({key: value for key, value in _read_cache(path).items() if key not in cache})
            with atomic_path(path) as tmp:
                tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    except OSError as err:
        warn_once(f"autotune-cache:{path}", f"cannot write the autotune cache {path}: {err}; tuning again next run")


def source_digest(fns: tuple) -> str:
    """Short hash of the files defining ``fns`` and of every module of memfit.kernels (a candidate runs kernels
    defined in others: :mod:`memfit.kernels.batched_gemm`'s GEMM, gemv's block GEMV in BLAST's chain): a changed
    kernel invalidates cached picks. Every call of an op whose pick is cached still builds this key, so the files are
    looked up once per code object."""
    files = sorted({_source_file(fn) for fn in fns} | set(kernel_sources()))
    return _digest_files(tuple(files))


@functools.cache
def kernel_sources() -> tuple[str, ...]:
    """The source files of the memfit.kernels package."""
    return tuple(str(path) for path in sorted(Path(__file__).parent.glob("*.py")))


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
    return digest_files(files)                        # once a process: every cached pick's key builds it


def pick_variant(op: str, shape_key: tuple, candidates: dict, default: str, args: tuple) -> str:
    """Name of the fastest of ``candidates`` (name -> fn(*args)) for this shape, cached on disk (:func:`disk_pick`);
    ``default`` off the GPU, or where the pick cannot be timed."""
    picked = _gpu_pick(op, shape_key, candidates, default, args)
    return default if picked is None else picked


def auto_variant(op: str, shape_key: tuple, offer: Callable[[], tuple[dict, str]], args: tuple) -> str:
    """The pipeline an op's ``variant="auto"`` runs: :func:`pick_variant` over ``offer()`` (its candidates and its
    default), remembered per shape key and args[0]'s device for the rest of the process once it is settled on the
    GPU: timed now, read from the cache, or the default where nothing could be timed (which :func:`disk_pick` does
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
    key = "|".join([torch.cuda.get_device_name(), triton.__version__, source_digest(tuple(candidates.values())), op,
                    *map(str, shape_key)])
    return disk_pick(op, shape_key, key, candidates, args, PICK_TIMINGS, f"running {default!r} untimed")


def disk_pick(op: str, shape_key: tuple, key: str, candidates: dict, args: tuple, records: dict,
               instead: str) -> str | None:
    """The name of the fastest of ``candidates`` under the disk-cache ``key``: the cached one, or else all timed now
    (:func:`_timed_fastest`) and the winner saved. ``records["op shape_key"]`` gets the timings of a pick made here
    ({"pick", "cached": True} for one read from the cache). None where nothing can be timed, each case said once
    with ``instead`` (what runs instead): a first call inside a CUDA graph capture (timing would launch work into
    the graph), or no candidate ran (e.g. each out of memory), which later calls in this process then skip too."""
    cache, record = _load_cache(), f"{op} {shape_key}"
    if cache.get(key) in candidates:
        records.setdefault(record, {"pick": cache[key], "cached": True})
        logger.debug("%s %s: %s, from the pick cache (%s)", op, shape_key, cache[key], _cache_path())
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
    logger.debug("%s %s: %s, the fastest finalist (%s ms; first timings of all %d: %s)", op, shape_key,
                 timings["pick"], _listed(timings["finalists"]), len(candidates), _listed(timings["first"]))
    return timings["pick"]


def _listed(times: dict) -> str:
    """name -> ms, fastest first, as a debug message shows them."""
    return ", ".join(f"{name} {ms:.4g}" for name, ms in sorted(times.items(), key=lambda kv: kv[1]))


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
    :func:`batched_gemm.pick_chain_tiles`, which times over copies of its own; Triton's autotuning) then runs while
    only its own copies are alive. Building a Monarch Llama-1B decode loop peaked 0.39 GB above the model at
    dfd69a8, 0.35 of it the two sets of copies alive together (``benchmarks/results/probes/generator_peak_dfd69a8.json``)."""
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
    size, device = _nbytes(args), cuda_device(args)
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


def cuda_device(args: tuple) -> torch.device | None:
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
    chain took together with the timings of every pair (:func:`batched_gemm.pick_chain_tiles`). The benchmarks record
    it beside the variant picks: the same pipeline has read 11.15 and 13.32 us in two layer tables offered the same tiles
    (Monarch two_stage_pdl, Llama-1B up, N = 128, 1476f91 and f969028), and neither recorded which tiles its
    autotuner took."""
    picks = {kernel.base_fn.__name__: {str(key): str(config) for key, config in kernel.cache.items()}
             for kernel in TUNED_KERNELS if kernel.cache}
    return picks | ({"chained bgemm pairs": dict(CHAIN_TILE_PICKS)} if CHAIN_TILE_PICKS else {})


def forget_picks() -> None:
    """Drop what a later pick in this process would reuse (the disk cache it loaded, the picks it could not time, the
    chains' pairs, the ops' remembered picks), so the next pick reads the cache file MEMFIT_AUTOTUNE_CACHE now names
    (a benchmark's own picks file). The records of picks made (PICK_TIMINGS, CHAIN_TILE_PICKS) stay: call it before
    the first pick."""
    global _CACHE
    _CACHE = None
    _UNTIMED.clear()
    CHAIN_TILE_MEMO.clear()
    _VARIANT_MEMO.clear()
