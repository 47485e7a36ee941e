"""memfit.measure.allocator_history on a synthetic allocator trace: the replay finds the largest live total, counts
only blocks the recorded span allocated, and groups the blocks live then by site and size, largest first."""
import pytest

from memfit.measure.allocator_history import first_alloc_in, live_at_end, live_at_peak, sites_at_peak


def _frame(line, name="f"):
    return {"filename": "/x/memfit/train/mlp.py", "line": line, "name": name}


def _trace(*events):
    """A trace of ``events``, each free as the allocator records one of a block no other stream used: requested, then
    completed at once."""
    actions = [(a, addr, size, frames) for a, addr, size, frames in events for a in
               (("free_requested", "free") if a == "free" else (a,))]
    return {"device_traces": [[{"action": a, "addr": addr, "size": size, "frames": frames}
                               for a, addr, size, frames in actions]]}


def test_the_peak_is_the_largest_live_total_and_frees_of_older_blocks_are_ignored():
    snapshot = _trace(("alloc", 1, 100, [_frame(1)]), ("alloc", 2, 300, [_frame(2)]),
                      ("free", 1, 100, []), ("free", 99, 5000, []),   # allocated before recording
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
    snapshot = _trace(("alloc", 1, 100, [_frame(1)]), ("alloc", 2, 300, [_frame(2)]), ("free", 1, 100, []),
                      ("free", 99, 5000, []), ("alloc", 3, 150, [_frame(3)]), ("free", 3, 150, []))
    assert [b["addr"] for b in live_at_end(snapshot)] == [2]


def test_a_block_stops_counting_when_its_free_is_requested():
    """A block used on another stream (record_stream) is freed in two steps: requested, when the allocator takes it off
    allocated_bytes, and completed once that stream is done. The replay had counted it until completed: above the
    allocator's own peak."""
    snapshot = {"device_traces": [[
        {"action": "alloc", "addr": 1, "size": 100, "frames": []},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 2, "size": 80, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []}]]}
    peak, live = live_at_peak(snapshot)
    assert peak == 100 and [b["addr"] for b in live] == [1]
    assert [b["addr"] for b in live_at_end(snapshot)] == [2]


def test_a_peak_read_from_a_marked_event_on_keeps_what_earlier_events_left_live():
    """A measured step's peak, read from the marker its start allocates, counts the warm-up's leftovers (a library
    workspace, say) and not the warm-up's own larger peak."""
    snapshot = _trace(("alloc", 1, 32, [_frame(1, "warm_up")]), ("alloc", 2, 1000, [_frame(2, "warm_up")]),
                      ("free", 2, 1000, []), ("alloc", 3, 1, [_frame(3, "step_begins")]), ("free", 3, 1, []),
                      ("alloc", 4, 200, [_frame(4, "step")]), ("free", 4, 200, []), ("alloc", 5, 100, [_frame(5)]))
    since = first_alloc_in(snapshot, "step_begins")
    assert since == 4 and live_at_peak(snapshot)[0] == 1032
    peak, live = live_at_peak(snapshot, since)
    assert peak == 232 and sorted(b["addr"] for b in live) == [1, 4]
    with pytest.raises(ValueError, match="no allocation by nowhere"):
        first_alloc_in(snapshot, "nowhere")
