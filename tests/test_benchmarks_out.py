"""Every benchmark that writes results refuses, while it parses its arguments, a results directory that cannot
hold them (measure.results.check_out_dir): a mistyped --out fails in a second, not after minutes of GPU time."""
import sys

import pytest
from conftest import ROOT, load_benchmark

RESULTS_OPTION = {"attention": "--out", "bgemm_tiles": "--out", "blr_accuracy": "--out", "blr_e2e": "--out",
                  "blr_layers": "--out", "chain_tiles": "--out", "decode_profile": "--out", "finetune_ledger": "--out",
                  "finetune_memory": "--out", "ledger_accuracy": "--out", "linear_ce": "--out", "partial_ffn": "--out",
                  "pick_cost": "--out", "train_small_model": "--results"}


@pytest.mark.parametrize("name,option", RESULTS_OPTION.items())
def test_a_results_dir_under_a_file_is_a_usage_error_before_any_work(name, option, monkeypatch, capsys, tmp_path):
    benchmark = load_benchmark(name)
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", option, str(tmp_path / "file" / "sub")])
    with pytest.raises(SystemExit) as raised:
        getattr(benchmark, "parse", benchmark.main)()          # main parses sys.argv where there is no parse()
    assert raised.value.code == 2
    assert f"{option} {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} is a file" in capsys.readouterr().err


def test_every_benchmark_with_an_out_option_is_checked_above():
    scripts = (ROOT / "benchmarks").glob("*.py")
    assert {p.stem for p in scripts if 'add_argument("--out"' in p.read_text()} <= set(RESULTS_OPTION)


def test_the_small_models_directory_is_checked_before_it_trains(monkeypatch, capsys, tmp_path):
    """train_small_model's --out (the model, not the results) under a file, or already there without --force: a
    usage error before the model is built, where these had failed at the save, after the training."""
    benchmark = load_benchmark("train_small_model")
    monkeypatch.setattr(benchmark, "build_model", lambda *a, **k: pytest.fail("refused before building the model"))
    (tmp_path / "file").write_text("")
    (tmp_path / "model").mkdir()
    for out, message in [(tmp_path / "file" / "sub", "is a file"), (tmp_path / "model", "exists; pass --force")]:
        with pytest.raises(SystemExit) as raised:
            benchmark.main(["--out", str(out)])
        assert raised.value.code == 2 and message in capsys.readouterr().err


def test_an_empty_or_dangling_results_dir_is_refused(tmp_path):
    """'' had meant the default directory (the committed results); a symbolic link to nothing on the way had passed
    the check and failed at the results' mkdir, after the work."""
    from memfit.measure.results import out_dir_problem

    assert "names no directory" in out_dir_problem("")
    assert "names no directory" in out_dir_problem("  ", "--results")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert f"{tmp_path / 'link'} is a symbolic link to nothing" in out_dir_problem(tmp_path / "link" / "sub")
    assert out_dir_problem(None) is None and out_dir_problem(tmp_path / "new") is None
