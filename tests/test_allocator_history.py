"""memfit.measure.allocator_history on a synthetic allocator trace: the replay finds the largest live total, counts
only blocks the recorded span allocated, and groups the blocks live then by site and size, largest first."""
from memfit.measure.allocator_history import live_at_end, live_at_peak, sites_at_peak


def _frame(line, name="f"):
    return {"filename": "/x/memfit/train/mlp.py", "line": line, "name": name}


def _trace(*events):
    return {"device_traces": [[{"action": a, "addr": addr, "size": size, "frames": frames}
                               for a, addr, size, frames in events]]}


def test_the_peak_is_the_largest_live_total_and_frees_of_older_blocks_are_ignored():
    snapshot = _trace(("alloc", 1, 100, [_frame(1)]), ("alloc", 2, 300, [_frame(2)]),
                      ("free_completed", 1, 100, []), ("free_completed", 99, 5000, []),   # allocated before recording
                      ("alloc", 3, 150, [_frame(3)]))
    peak, live = live_at_peak(snapshot)
    assert peak == 450 and sorted(b["addr"] for b in live) == [2, 3]


def test_sites_are_grouped_by_place_and_size_largest_first():
    snapshot = _trace(("alloc", 1, 2**20, [_frame(7, "up")]), ("alloc", 2, 2**20, [_frame(7, "up")]),
                      ("alloc", 3, 3 * 2**20, [_frame(9, "gate")]), ("alloc", 4, 2**19, [_frame(7, "up")]))
    peak, sites = sites_at_peak(snapshot, top=2)
    assert peak == 5.5 * 2**20
    assert [(s["site"], s["block_mib"], s["count"], s["mib"]) for s in sites] == [
        ("mlp.py:9 gate", 3.0, 1, 3.0), ("mlp.py:7 up", 1.0, 2, 2.0)]


def test_what_is_live_at_the_end_of_the_recorded_span():
    snapshot = _trace(("alloc", 1, 100, [_frame(1)]), ("alloc", 2, 300, [_frame(2)]), ("free_completed", 1, 100, []),
                      ("free_completed", 99, 5000, []), ("alloc", 3, 150, [_frame(3)]), ("free_completed", 3, 150, []))
    assert [b["addr"] for b in live_at_end(snapshot)] == [2]
