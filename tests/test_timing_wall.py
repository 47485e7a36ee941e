"""memfit.measure.timing.best_wall_seconds: one untimed call, then the least of the timed ones, and the last result."""
import time

from memfit.measure.timing import best_wall_seconds


def test_the_least_of_the_timed_calls_after_an_untimed_one():
    sleeps = iter([0.05, 0.03, 0.001, 0.02])
    calls = []

    def fn():
        calls.append(next(sleeps))
        time.sleep(calls[-1])
        return len(calls)

    seconds, result = best_wall_seconds(fn, repeats=3, device="cpu")
    assert len(calls) == 4 and result == 4
    assert 0.001 <= seconds < 0.02                     # the third call's, not the untimed first
