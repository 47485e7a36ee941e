"""Every benchmark that writes results refuses, while it parses its arguments, a results directory that cannot
hold them (measure.results.check_out_dir): a mistyped --out fails in a second, not after minutes of GPU time; and
other bad options likewise, before any work."""
import sys
from pathlib import Path

import pytest
from conftest import ROOT, load_benchmark

RESULTS_OPTION = {"attention": "--out", "bgemm_tiles": "--out", "blr_accuracy": "--out", "blr_counters": "--out",
                  "blr_e2e": "--out", "blr_generate": "--out", "blr_layers": "--out", "chain_tiles": "--out",
                  "decode_profile": "--out",
                  "finetune_ledger": "--out", "finetune_memory": "--out", "finetune_steps": "--out",
                  "ledger_accuracy": "--out", "ledger_repredict": "--out", "linear_ce": "--out", "partial_ffn": "--out",
                  "pick_cost": "--out", "plan_fits": "--out", "sdpa_math_memory": "--out", "swiglu": "--out",
                  "train_small_model": "--results"}


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
    """train_small_model's --out (the model, not the results) under a file, already there without --force, a
    directory no earlier run wrote, '.', '' or a symbolic link: a usage error before the model is built (these had
    failed at the save, after the training, or replaced the directory: --out . --smoke emptied the working one)."""
    benchmark = load_benchmark("train_small_model")
    monkeypatch.setattr(benchmark, "build_model", lambda *a, **k: pytest.fail("refused before building the model"))
    (tmp_path / "file").write_text("")
    (tmp_path / "model").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("not a model")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    (tmp_path / "model" / "train_info.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "data")
    for argv, message in [(["--out", str(tmp_path / "file" / "sub")], "is a file"),
                          (["--out", str(tmp_path / "model")], "exists; pass --force"),
                          (["--out", str(tmp_path / "data"), "--force"], "no earlier run wrote it"),
                          (["--out", ".", "--smoke"], "name the model directory itself"),
                          (["--out", "", "--force"], "name the model directory itself"),
                          (["--out", str(tmp_path / "link"), "--force"], "symbolic link")]:
        with pytest.raises(SystemExit) as raised:              # --out . had replaced the working directory
            benchmark.main(argv)
        assert raised.value.code == 2 and message in capsys.readouterr().err
    assert (tmp_path / "data" / "keep.txt").exists()


def test_an_empty_or_dangling_results_dir_is_refused(tmp_path):
    """'' had meant the default directory (the committed results); a symbolic link to nothing on the way had passed
    the check and failed at the results' mkdir, after the work."""
    from memfit.measure.results import out_dir_problem

    assert "names no directory" in out_dir_problem("")
    assert "names no directory" in out_dir_problem("  ", "--results")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert f"{tmp_path / 'link'} is a symbolic link to nothing" in out_dir_problem(tmp_path / "link" / "sub")
    assert out_dir_problem(None) is None and out_dir_problem(tmp_path / "new") is None
    assert "too long" in out_dir_problem(tmp_path / ("x" * 300))
    if Path("/proc/self").is_dir():                       # writing is probed: os.access lets root through on /proc
        assert "cannot write in /proc" in out_dir_problem("/proc/memfit-results")


@pytest.mark.parametrize("argv,message", [(["--ratio", "2"], "--ratio is a fraction of the linear parameters, in (0, 1)"),
                                          (["--ratio", "0"], "in (0, 1); got 0.0"),
                                          (["--blocks", "0"], "--blocks must be a positive integer; got 0"),
                                          (["--smoke", "--recovery-steps", "-1"], "--recovery-steps must be a positive"),
                                          (["--seq", "0"], "--seq must be a positive integer"),
                                          (["--recovery-lr", "nan"], "--recovery-lr must be a positive number")])
def test_blr_accuracy_refuses_bad_settings_before_it_trains(argv, message, monkeypatch, capsys):
    """--ratio 2 had trained and scored the model, then failed with a traceback in the compression."""
    benchmark = load_benchmark("blr_accuracy")
    monkeypatch.setattr(benchmark, "load_or_train", lambda *a: pytest.fail("refused before the model is loaded"))
    with pytest.raises(SystemExit) as raised:
        benchmark.main(argv)
    assert raised.value.code == 2 and message in capsys.readouterr().err


def test_blr_accuracy_smoke_keeps_the_options_given():
    """--smoke's tiny settings fill only the options the user left out (it had overwritten --blocks and the rest)."""
    benchmark = load_benchmark("blr_accuracy")
    smoke = benchmark.parse(["--smoke", "--blocks", "2", "--model", str(ROOT / "benchmarks/results/small_llama")])
    assert (smoke.blocks, smoke.seq, smoke.model) == (2, 64, ROOT / "benchmarks/results/small_llama")
    assert vars(benchmark.parse(["--smoke"])).items() >= {**benchmark.SMOKE_SETTINGS, "model": None}.items()
    assert benchmark.parse(["--blocks", "8"]).blocks == 8 and benchmark.parse([]).seq == 512


def test_attention_counters_help_needs_no_gpu(monkeypatch, capsys):
    """--help had started CUDA work first (a traceback on a machine without a GPU); without one, a one-line error."""
    benchmark = load_benchmark("attention_counters")
    with pytest.raises(SystemExit) as raised:
        benchmark.main(["--help"])
    assert raised.value.code == 0 and "Nsight Compute" in capsys.readouterr().out
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: False)
    assert benchmark.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
