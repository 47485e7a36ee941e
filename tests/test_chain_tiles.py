"""benchmarks/chain_tiles.py, Monarch's chained two_stage_pdl with each pair of stage tiles: every pair and the
op as it runs are checked against torch before they are timed, so a pair that computes the wrong thing is an
error row, not a time. Tiny shapes, the interpreter (no launch to chain), no timing (the GPU timer is a counter)."""
import pytest
import torch
from conftest import ON_THE_INTERPRETER, load_benchmark

TILE, OTHER = (16, 32, 64, 2, 8), (16, 64, 64, 4, 6)   # two of bgemm's tiles (BGEMM_CONFIGS), small for the interpreter


@pytest.fixture(scope="module")
def chain_tiles():
    return load_benchmark("chain_tiles")


@pytest.fixture
def untimed(chain_tiles, monkeypatch):
    calls = []
    monkeypatch.setattr(chain_tiles, "gpu_ms", lambda fn: calls.append(fn()) or 1.0)
    return calls


@ON_THE_INTERPRETER
def test_every_pair_and_the_op_are_checked_then_timed(chain_tiles, untimed, monkeypatch):
    """Each pair runs its own two tiles (checked, then timed: two calls), then the op runs its pick."""
    from memfit.kernels import batched_gemm

    launched, heuristics = [], batched_gemm._bgemm_kernel.fn
    run = heuristics.run
    monkeypatch.setattr(heuristics, "run", lambda *args, **kwargs: launched.append(
        tuple(kwargs[name] for name in ("BN", "BC", "BK", "num_warps", "num_stages"))) or run(*args, **kwargs))
    rows = chain_tiles.sweep_pairs(torch, "tiny", 16 * 8, 16 * 6, 16 * 2, 20, [TILE], [TILE, OTHER], device="cpu")
    assert launched[:8] == [TILE, TILE] * 2 + [TILE, OTHER] * 2
    assert [r["candidate"] for r in rows] == ["16x32x64 w2 s8 + 16x32x64 w2 s8", "16x32x64 w2 s8 + 16x64x64 w4 s6",
                                              chain_tiles.OP]
    assert not [r for r in rows if "error" in r] and len(untimed) == len(rows)
    (summary,) = chain_tiles.summary(rows)
    assert summary["pairs"] == 2 and summary["op_over_best"] == 1.0


@ON_THE_INTERPRETER
def test_a_pair_whose_output_is_wrong_is_an_error_row(chain_tiles, untimed, monkeypatch):
    """The check compares y with the reference Monarch layer: stage 1 reading other weights fails it."""
    right = chain_tiles.chained
    monkeypatch.setattr(chain_tiles, "chained", lambda x, w1, w2, tiles: right(x, w1.flip(1), w2, tiles))
    rows = chain_tiles.sweep_pairs(torch, "tiny", 16 * 8, 16 * 6, 16 * 2, 20, [TILE], [TILE], device="cpu")
    assert "wrong result" in rows[0]["error"] and "error" not in rows[1]
    assert chain_tiles.summary(rows) == []


@pytest.mark.parametrize("argv,message", [(["--tokens", "128", "128"], "each once"), (["--tokens", "512"], "up to 256"),
                                          (["--tokens", "0"], "positive"), (["--shapes", "nope"], "unknown shape")])
def test_bad_options_are_usage_errors(chain_tiles, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["chain_tiles.py", *argv])
    with pytest.raises(SystemExit):
        chain_tiles.parse()
    assert message in capsys.readouterr().err


def test_an_out_that_cannot_hold_results_is_a_usage_error_before_any_case(chain_tiles, monkeypatch, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    for out, message in [(tmp_path / "file", "is a file, not a directory"),
                         (tmp_path / "file" / "sub", "file is a file")]:
        monkeypatch.setattr("sys.argv", ["chain_tiles.py", "--out", str(out)])
        with pytest.raises(SystemExit):
            chain_tiles.parse()
        assert message in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["chain_tiles.py", "--out", str(tmp_path / "new" / "dir")])
    assert chain_tiles.parse().out == str(tmp_path / "new" / "dir")
