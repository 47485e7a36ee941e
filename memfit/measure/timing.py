"""GPU timing and the two ceilings every roofline is drawn against.

Times come from ``triton.testing.do_bench`` (CUDA events, median) after warm-up, from CUDA-graph replays
(:func:`graph_ms`), or from calls queued behind a sleep kernel (:func:`queued_ms`: the GPU's time where the host's is
longer). The ceilings (matmul rate, copy bandwidth) are measured in the same run as the thing timed.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from memfit.errors import MemfitError


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def best_wall_seconds(fn, repeats: int, device) -> tuple[float, object]:
    """The least of ``repeats`` wall-clock times of ``fn()`` in seconds, each synchronised on a CUDA ``device``, after
    one untimed call; and the last call's result. For calls of a second or more (a solver's whole run), where
    :func:`bench_ms`'s repetitions would take minutes."""
    cuda = torch.device(device).type == "cuda"
    result = fn()
    best = math.inf
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, result


def device_ms(fn, device) -> float:
    """Median milliseconds of ``fn()``: :func:`bench_ms` on a CUDA ``device``; on the CPU (a benchmark's --smoke run,
    which checks the code path, not the speed) the median of three wall-clock runs."""
    if torch.device(device).type == "cuda":
        return bench_ms(fn)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


_TIMING_STREAMS: dict[int, torch.cuda.Stream] = {}
GRAPH_REPLAYS = 10


def graph_ms(fn, rep_ms: float = 20) -> float:
    """Median ms of one ``fn()`` from CUDA-graph replays, ``triton.testing.do_bench_cudagraph``'s method (a warm-up
    call, an estimate from five calls, one graph of as many calls as fill ``rep_ms``, GRAPH_REPLAYS timed replays),
    on one side stream per device that every timing reuses. ``do_bench_cudagraph`` runs on a new stream from
    torch's pool at each call, and torch keeps a cuBLAS workspace for every stream cuBLAS has run on, for the life
    of the process: after the kernel-variant picks of one Llama-1B BLR model, about 1 GiB of them on the H200
    (``benchmarks/ledger_accuracy.py --blr`` at b85a879 read them as memory left allocated between its jobs),
    which the model then ran without."""
    device = torch.cuda.current_device()
    if device not in _TIMING_STREAMS:
        _TIMING_STREAMS[device] = torch.cuda.Stream()
    stream = _TIMING_STREAMS[device]
    stream.wait_stream(torch.cuda.current_stream())
    try:
        return _replayed_ms(fn, rep_ms, stream)
    finally:                                           # the caller's later work waits for the timed calls
        torch.cuda.current_stream().wait_stream(stream)


def _span_ms(run) -> float:
    """GPU ms between events recorded before and after ``run()`` on the current stream (waits for the second)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _calls(fn, n: int) -> None:
    for _ in range(n):
        fn()


def _replayed_ms(fn, rep_ms: float, stream) -> float:
    """:func:`graph_ms`'s timing on ``stream``: warm-up, estimate, capture (on that stream), replays."""
    with torch.cuda.stream(stream):
        fn()
        estimate = _span_ms(lambda: _calls(fn, 5)) / 5
        calls = max(1, int(rep_ms / estimate)) if estimate > 0 else 1000
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            _calls(fn, calls)
        times = [_span_ms(graph.replay) / calls for _ in range(GRAPH_REPLAYS)]
    return float(statistics.median(times))


class QueuedTime(NamedTuple):
    """:func:`queued_ms`'s result: one call's GPU time with the calls back to back, and the host's time to issue one."""

    gpu_ms: float
    host_ms: float


QUEUED_SLEEP_MARGIN = 2.0      # the sleep that holds the stream lasts this many times the host's estimated issue time


def queued_ms(fn, max_calls: int = 20, target_ms: float = 20.0, rounds: int = 5, attempts: int = 3) -> QueuedTime:
    """Median GPU ms of one ``fn()`` when the GPU never waits for the host, and the host's median ms to issue one.

    :func:`bench_ms` times each call from an event before it to one after it. Where the host takes longer to issue a
    call's work than the GPU takes to run it (a step compiled with ``mode="reduce-overhead"``: torch's CUDA-graph
    trees check guards and inputs before each replay), the GPU idles between kernels waiting for the host, and that
    time is the host's. Here a sleep kernel holds the stream while the host issues a round of calls, so they run back
    to back once it ends: the events around them give the GPU's time. A round has as many calls as fill about
    ``target_ms`` (at most ``max_calls``; from an untimed round of ``max_calls``), and its sleep lasts
    QUEUED_SLEEP_MARGIN times the host's time to issue them. A round counts only if the sleep was still running when
    the host had issued every call (else the GPU may have waited); a round is tried at most ``attempts`` times in all,
    each retry with half the calls and the same total sleep (twice the margin per call), then this raises: ``fn``
    blocks the host (a synchronisation, a copy to the host), or its launches fill the GPU's queue. The calls run
    without the L2 flush ``bench_ms`` puts between them, so this is not a lower bound on ``bench_ms``'s time (a
    Llama-1B prefill read 4.090 ms here against 3.978 by ``bench_ms``, 73979c2). :func:`graph_ms` cannot time such a
    step: one compiled with ``mode="reduce-overhead"`` replays CUDA graphs of its own, which cannot be captured into
    another. CUDA only."""
    fn()
    torch.cuda.synchronize()
    issue_s = []

    def untimed_round():
        issued = time.perf_counter()
        _calls(fn, max_calls)
        issue_s.append(time.perf_counter() - issued)

    per_call_ms = _span_ms(untimed_round) / max_calls
    host_estimate_ms = 1e3 * issue_s[0] / max_calls
    calls = max_calls if per_call_ms <= 0 else max(1, min(max_calls, math.ceil(target_ms / per_call_ms)))
    cycles_per_ms = _sleep_cycles_per_ms()
    gpu, host = [], []
    for _ in range(rounds):
        round_calls, sleep_per_call_ms = calls, QUEUED_SLEEP_MARGIN * host_estimate_ms
        for _ in range(attempts):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(sleep_per_call_ms * round_calls * cycles_per_ms))
            start.record()
            issued = time.perf_counter()
            _calls(fn, round_calls)
            issue_ms = 1e3 * (time.perf_counter() - issued) / round_calls
            held = not start.query()                   # the sleep still running: every call queued behind it
            end.record()
            end.synchronize()
            if held:
                gpu.append(start.elapsed_time(end) / round_calls)
                host.append(issue_ms)
                break
            round_calls, sleep_per_call_ms = max(1, round_calls // 2), 2 * sleep_per_call_ms
        else:
            raise MemfitError(f"queued_ms: the host was still issuing calls when the sleep ended, {attempts} times "
                              f"(from {calls} calls down to {max(1, calls >> (attempts - 1))}): the timed function "
                              "blocks the host (a synchronisation or a copy to it) or its launches fill the GPU's "
                              "queue, so its calls cannot be queued")
    return QueuedTime(float(statistics.median(gpu)), float(statistics.median(host)))


def _sleep_cycles_per_ms() -> float:
    """Cycles of ``torch.cuda._sleep`` per ms on the current device (its clock, measured: the SM clock varies)."""
    cycles = 10_000_000
    torch.cuda._sleep(cycles)                          # warm
    return cycles / _span_ms(lambda: torch.cuda._sleep(cycles))


@dataclass(frozen=True)
class Ceilings:
    """Measured peak rates: bf16 matmul FLOP/s and device-memory bytes/s (read + write)."""

    matmul_flops: float
    bandwidth: float

    def floor_ms(self, flops: float, bytes_moved: float) -> float:
        """Roofline floor: the larger of compute time and memory time, in ms."""
        return 1e3 * max(flops / self.matmul_flops, bytes_moved / self.bandwidth)


def empty_kernel_ms(launches: int = 64) -> float:
    """GPU time of one kernel that does nothing, replayed back to back in a CUDA graph.

    No kernel timed the way the layer benchmarks time theirs (graph replays) can take less,
    so a target below it (e.g. "within 2x of a 0.5 us weight-read floor") cannot be met by
    any kernel, cuBLAS's included; the benchmarks record it next to their floors.
    """
    flag = torch.zeros(1, device="cuda")
    return graph_ms(lambda: [flag.add_(0) for _ in range(launches)]) / launches


def measure_ceilings(device: str = "cuda") -> Ceilings:
    """Measure bf16 matmul rate (8192^3 on random data) and copy bandwidth (2 GiB copy)."""
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    src = torch.randn(2**28, device=device, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    cp_ms = bench_ms(lambda: dst.copy_(src))
    return Ceilings(matmul_flops=2 * n**3 / (mm_ms * 1e-3), bandwidth=2 * 2**30 / (cp_ms * 1e-3))


def turn_orders(names: list, rounds: int) -> list[list]:
    """The order of each of ``rounds`` rounds that time every one of ``names`` once: forward and reverse by turns,
    so that a steady drift of the GPU's speed over the rounds reaches every name alike (none is always first).
    Used wherever candidates are compared by timing (the BLR variant pick, the layer benchmark)."""
    return [list(names) if turn % 2 == 0 else list(reversed(names)) for turn in range(rounds)]


GPU_STATE_FIELDS = {"clocks.sm": "sm_clock_mhz", "power.draw": "power_w", "temperature.gpu": "temperature_c"}


def gpu_state() -> dict | None:
    """The GPU's SM clock (MHz), power draw (W) and temperature (C) as ``nvidia-smi`` reports them now (its
    sampling period is 1/6 s to 1 s), or None where it cannot say: no GPU, or (said once) nvidia-smi failed.
    Benchmarks record it around their timings: a card that slows under sustained load would show it here, not in
    the times alone. The GPU is named by its UUID (nvidia-smi and CUDA may number GPUs differently)."""
    import subprocess

    from memfit.log import warn_once

    if not torch.cuda.is_available():
        return None
    try:
        uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_STATE_FIELDS)}", "--format=csv,noheader,nounits",
                              f"--id=GPU-{uuid}"], capture_output=True, text=True, timeout=10, check=True).stdout
        values = [float(v) for v in out.strip().splitlines()[0].split(",")]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, RuntimeError, AttributeError) as err:
        warn_once("gpu-state", f"nvidia-smi gave no clock, power and temperature for this GPU ({type(err).__name__}: "
                               f"{str(err)[:200]}); the results record none")
        return None
    return dict(zip(GPU_STATE_FIELDS.values(), values))
