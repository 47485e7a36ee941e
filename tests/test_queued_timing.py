"""memfit.measure.timing.queued_ms: a step's GPU time with its calls queued behind a sleep kernel, apart from the
host's time to issue it. The sleep-and-retry logic runs here against a stand-in for torch.cuda; the GPU tests run
on a CUDA machine, alone (``benchmarks/gpu_runs.sh gpu_tests_timing``)."""
import time

import pytest
import torch

from memfit.errors import MemfitError
from memfit.measure import timing

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="times a CUDA stream")


class FakeCuda:
    """torch.cuda's events, sleep and synchronize for queued_ms: the event recorded right after a sleep reports the
    sleep still running or not as ``held`` says (any other event has completed); a span that ends with a sleep (the
    clock's calibration) lasts 40 ms, any other ``elapsed`` ms."""

    def __init__(self, held: list[bool], elapsed: float = 40.0):
        self.held, self.elapsed, self.sleeps, self.slept = iter(held), elapsed, [], False
        outer = self

        class Event:
            def __init__(self, enable_timing=False):
                self.after_sleep = False

            def record(self):
                self.after_sleep, outer.slept = outer.slept, False

            def synchronize(self):
                pass

            def query(self):
                return not next(outer.held) if self.after_sleep else True

            def elapsed_time(self, end):
                return 40.0 if end.after_sleep else outer.elapsed

        self.Event = Event

    def _sleep(self, cycles):
        self.sleeps.append(cycles)
        self.slept = True

    def synchronize(self):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(held, elapsed=40.0):
        fake = FakeCuda(held, elapsed)
        for name in ("Event", "_sleep", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
        return fake
    return install


def test_each_round_queues_the_calls_behind_a_sleep_sized_from_the_host(fake_cuda, monkeypatch):
    """The sleep lasts QUEUED_SLEEP_MARGIN times the host's estimated issue time of a round's calls, at the measured
    cycles per ms (10^7 cycles took 40 ms here: 2.5e5 per ms); the GPU time is the events' span over the calls."""
    fake = fake_cuda([True] * 3)
    clock = iter(range(0, 10**6, 3))                          # each perf_counter reading 3 ms after the last
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock) * 1e-3)
    calls = []
    result = timing.queued_ms(lambda: calls.append(1), max_calls=4, target_ms=1000, rounds=3)
    assert result.gpu_ms == pytest.approx(40.0 / 4) and result.host_ms == pytest.approx(3 / 4)
    estimate_ms = 3 / 4                                       # the untimed round's 4 calls in 3 ms
    assert fake.sleeps[2:] == [int(timing.QUEUED_SLEEP_MARGIN * estimate_ms * 4 * 2.5e5)] * 3
    assert len(calls) == 1 + 4 + 3 * 4


def test_a_round_has_as_many_calls_as_fill_the_target_time(fake_cuda):
    """The untimed round's 4 calls spanned 40 ms: 10 ms a call, so a 25 ms target takes 3 calls a round (rounded
    up)."""
    fake_cuda([True] * 3)
    calls = []
    timing.queued_ms(lambda: calls.append(1), max_calls=4, target_ms=25, rounds=3)
    assert len(calls) == 1 + 4 + 3 * 3


def test_a_function_without_gpu_work_gets_the_most_calls(fake_cuda):
    fake_cuda([True] * 3, elapsed=0.0)
    calls = []
    timing.queued_ms(lambda: calls.append(1), max_calls=4, target_ms=25, rounds=3)
    assert len(calls) == 1 + 4 + 3 * 4


def test_a_round_whose_sleep_ended_first_is_run_again_with_half_the_calls_and_twice_the_sleep_per_call(fake_cuda):
    fake = fake_cuda([False, True, True])
    calls = []
    timing.queued_ms(lambda: calls.append(1), max_calls=4, target_ms=1000, rounds=2)
    first, retried, second_round = fake.sleeps[2:]
    assert retried == pytest.approx(first, abs=2) and second_round == pytest.approx(first, abs=2)
    assert len(calls) == 1 + 4 + 4 + 2 + 4                  # the retry issued 2 calls, the next round 4 again


def test_a_function_that_blocks_the_host_is_refused(fake_cuda):
    fake_cuda([False] * 3)
    with pytest.raises(MemfitError, match=r"3 times \(from 4 calls down to 1\): the timed function blocks the host"):
        timing.queued_ms(lambda: None, max_calls=4, target_ms=1000, rounds=1, attempts=3)


@needs_cuda
def test_on_the_gpu_a_step_the_host_holds_back_is_timed_by_its_kernels():
    """A call that spends 2 ms on the host before one small kernel: the caller's time (bench_ms) is the host's,
    the queued GPU time a small fraction of it, and the host's issue time at least the 2 ms."""
    x = torch.zeros(1024, device="cuda")

    def host_heavy():
        time.sleep(0.002)
        x.add_(1)

    queued = timing.queued_ms(host_heavy)
    assert queued.host_ms >= 2.0 and queued.gpu_ms < 0.2
    assert timing.bench_ms(host_heavy) > 1.5


@needs_cuda
def test_on_the_gpu_a_step_bound_by_its_kernels_reads_as_graph_replays_do():
    """Within 15% of graph replays timed before and after it: at d7b7323 (an H200) the queued calls of a 4096^3
    matmul took 0.171 ms against 0.195 in graph replays timed after them (results/logs/gpu_tests_timing_d7b7323.log),
    perhaps a faster clock on a GPU the sleep had left idle (not measured)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    before = timing.graph_ms(lambda: a @ a)
    queued = timing.queued_ms(lambda: a @ a)
    after = timing.graph_ms(lambda: a @ a)
    assert 0.85 * min(before, after) < queued.gpu_ms < 1.15 * max(before, after)


@needs_cuda
def test_on_the_gpu_a_synchronising_step_is_refused():
    x = torch.zeros(1, device="cuda")
    with pytest.raises(MemfitError, match="blocks the host"):
        timing.queued_ms(lambda: x.add_(1).item())
