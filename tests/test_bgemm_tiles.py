"""benchmarks/bgemm_tiles.py, the sweep behind bgemm's tile configs: every tile and the autotuned call
run through the regrouping store the Monarch stages use and are checked against torch, so a tile that
computes the wrong thing enters the results as an error, not as a time. Tiny shapes, the interpreter,
no timing (the GPU timer is replaced by a counter)."""
import sys

import pytest
import torch
from conftest import ON_THE_INTERPRETER, load_benchmark


@pytest.fixture(scope="module")
def bgemm_tiles():
    return load_benchmark("bgemm_tiles")


@pytest.fixture
def untimed(bgemm_tiles, monkeypatch):
    calls = []
    monkeypatch.setattr(bgemm_tiles, "gpu_ms", lambda fn: calls.append(fn()) or 1.0)
    return calls


TILE = (16, 32, 32, 4, 1)   # the interpreter's bgemm tile


@ON_THE_INTERPRETER
@pytest.mark.parametrize("stage,token_major,n", [(1, True, 20), (1, False, 1), (2, False, 7)])
def test_every_candidate_is_checked_and_timed(bgemm_tiles, untimed, stage, token_major, n):
    rows = bgemm_tiles.sweep_case(torch, "tiny", 16 * 64, 16 * 24, 16 * 2, n, stage, [TILE], token_major,
                                  bandwidth=1e11, device="cpu")
    assert [r["candidate"] for r in rows] == ["16x32x32 w4 s1", "16x32x32 w4 s1 even_k", "bgemm (autotuned)",
                                              "cublas bmm (natural order)"]
    assert not [r for r in rows if "error" in r] and len(untimed) == len(rows)
    assert all(r["stage"] == stage and r["x_bandwidth_floor"] > 0 for r in rows)
    (summary,) = bgemm_tiles.summary(rows)
    assert (summary["shape"], summary["n"], summary["stage"]) == ("tiny", n, stage)


@ON_THE_INTERPRETER
def test_a_tile_that_stores_the_wrong_layout_is_an_error_row(bgemm_tiles, untimed, monkeypatch):
    """The check reads the output back through the layout the kernel should have written."""
    right = bgemm_tiles.Gemm.stored
    monkeypatch.setattr(bgemm_tiles.Gemm, "stored", lambda self, torch, c: right(self, torch, c).flip(1))
    rows = bgemm_tiles.sweep_case(torch, "tiny", 16 * 40, 16 * 24, 16 * 3, 20, 1, [TILE], True, bandwidth=1e11,
                                  device="cpu")
    assert all("wrong result" in r["error"] for r in rows if r["candidate"] != "cublas bmm (natural order)")


@ON_THE_INTERPRETER
def test_tiles_that_do_not_fit_are_skipped(bgemm_tiles, untimed):
    """A tile wider than the columns need, or past shared memory, is not run (as bgemm's own prune)."""
    rows = bgemm_tiles.sweep_case(torch, "tiny", 16 * 64, 16 * 24, 16 * 2, 1, 2, [TILE, (16, 256, 32, 4, 1),
                                                                                  (16, 64, 2048, 4, 8)],
                                  False, bandwidth=1e11, device="cpu")
    assert {r["candidate"].split()[0] for r in rows} == {"16x32x32", "bgemm", "cublas"}


@ON_THE_INTERPRETER
def test_gather_mode_times_the_runs_and_the_aligned_windows(bgemm_tiles, untimed):
    """--gather: stage 2 reading Monarch's P^T from stage 1's natural output; per-block rank t = 3 starts
    runs misaligned in 16-B aligned rows, so every tile is also run over aligned windows; each is checked."""
    rows = bgemm_tiles.sweep_case(torch, "tiny", 16 * 64, 16 * 24, 16 * 3, 7, 2, [TILE], False, bandwidth=1e11,
                                  device="cpu", gather=True)
    assert [r["candidate"] for r in rows] == ["16x32x32 w4 s1", "16x32x32 w4 s1 windows", "bgemm (autotuned)",
                                              "cublas bmm (P^T copy untimed)"]
    assert not [r for r in rows if "error" in r] and len(untimed) == len(rows)
    assert all(r["layout"] == "P^T gathered, block-major output" for r in rows)
    (summary,) = bgemm_tiles.summary(rows)
    assert summary["cublas_ms"] == rows[-1]["ms"]


@ON_THE_INTERPRETER
def test_gather_mode_checks_what_the_loads_gathered(bgemm_tiles, untimed, monkeypatch):
    """A reference gathering the wrong runs (here: reversed) makes every bgemm row an error."""
    right = bgemm_tiles.Gemm.views
    monkeypatch.setattr(bgemm_tiles.Gemm, "views", lambda self, torch, a, b: (right(self, torch, a, b)[0].flip(2),
                                                                               right(self, torch, a, b)[1]))
    rows = bgemm_tiles.sweep_case(torch, "tiny", 16 * 64, 16 * 24, 16 * 3, 7, 2, [TILE], False, bandwidth=1e11,
                                  device="cpu", gather=True)
    assert all("wrong result" in r["error"] for r in rows if not r["candidate"].startswith("cublas"))


@ON_THE_INTERPRETER
def test_batch_groups_are_timed_and_checked_beside_each_tile(bgemm_tiles, untimed):
    """--groups: each tile also runs with G input blocks per program, in the K form bgemm would pick, through
    the same check (16 blocks in groups of 3: the last group partial)."""
    rows = bgemm_tiles.sweep_case(torch, "tiny", 16 * 64, 16 * 24, 16 * 2, 20, 1, [TILE], True, bandwidth=1e11,
                                  device="cpu", groups=(1, 3))
    assert [r["candidate"] for r in rows][:3] == ["16x32x32 w4 s1", "16x32x32 w4 s1 even_k", "16x32x32 w4 s1 even_k g3"]
    assert not [r for r in rows if "error" in r]


@pytest.mark.parametrize("argv,message", [(["--tiles", "0"], "--tiles takes a positive"),
                                          (["--groups", "0"], "--groups takes positive"),
                                          (["--gather", "--groups", "4"], "not with --gather"),
                                          (["--runs-z", "--decode"], "--runs-z chooses"),
                                          (["--mid", "--decode"], "give one"),
                                          (["--mid", "--groups", "2"], "not with --gather or --mid"),
                                          (["--tokens", "128", "128"], "each once")])
def test_bad_sweep_options_are_usage_errors(bgemm_tiles, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["bgemm_tiles.py", *argv])
    with pytest.raises(SystemExit):
        bgemm_tiles.parse()
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("mode,tiles", [([], "CONFIGS"), (["--decode"], "DECODE_CONFIGS"), (["--mid"], "MID_CONFIGS"),
                                        (["--gather"], "CONFIGS")])
def test_tiles_past_the_modes_list_are_a_usage_error(bgemm_tiles, monkeypatch, capsys, mode, tiles):
    from memfit.kernels.batched_gemm import BGEMM_SHORT_RUNS

    offered = len(getattr(bgemm_tiles, tiles)) + (len(BGEMM_SHORT_RUNS) if mode == ["--gather"] else 0)
    monkeypatch.setattr(sys, "argv", ["bgemm_tiles.py", *mode, "--tiles", str(offered)])
    assert bgemm_tiles.parse().tiles == offered
    monkeypatch.setattr(sys, "argv", ["bgemm_tiles.py", *mode, "--tiles", str(offered + 1)])
    with pytest.raises(SystemExit):
        bgemm_tiles.parse()
    assert f"--tiles {offered + 1}: this mode offers {offered} tiles" in capsys.readouterr().err
