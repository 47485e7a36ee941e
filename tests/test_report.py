"""README's performance section is generated from benchmarks/results, never typed."""
import json
import shutil

from conftest import ROOT, load_benchmark


def load_report():
    return load_benchmark("report")


def test_readme_performance_section_matches_the_results_files():
    report = load_report()
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(report.START):readme.index(report.END) + len(report.END)]
    assert section == report.render(), "run `python benchmarks/report.py` after adding results"


def test_blr_e2e_bound_at_the_floor_adds_each_methods_layer_floor_to_the_free_step():
    """dense / (free + model floor - free floor): prefill 10 / (4 + 3 - 1) = 1.667, decode 2 / (1 + 0.5 - 0.25) = 1.6."""
    def row(model, prefill, decode, floors, **extra):
        return {"model": model, "mode": "compiled", "prefill_ms": prefill, "decode_ms": decode,
                "prefill_floor_ms": floors[0], "decode_floor_ms": floors[1], **extra}

    rows = [row("dense", 10.0, 2.0, (5.0, 1.0)), row("monarch", 8.0, 1.9, (3.0, 0.5), prefill_speedup=1.25),
            row("free", 4.0, 1.0, (1.0, 0.25), prefill_speedup=2.5, decode_speedup=2.0)]
    text = load_report()._blr_e2e_bound({"rows": rows})
    assert "2.50x in prefill and 2.00x in decode" in text
    assert "monarch 1.667x and 1.600x dense" in text


def test_blr_e2e_bound_uses_the_gpu_only_times_where_the_run_has_them():
    """With queued (GPU-only) times the bound is dense / free from them: a free step the host holds back (decode 1.0
    as called, 0.5 on the GPU) bounds the speedup at 2 / (0.5 + 0.5 - 0.25) = 2.667, not 1.6; the table shows them."""
    def row(model, decode, decode_gpu, floor, **extra):
        return {"model": model, "mode": "compiled", "prefill_ms": 10.0, "decode_ms": decode, "prefill_floor_ms": 1.0,
                "decode_floor_ms": floor, "prefill_gpu_ms": 10.0, "decode_gpu_ms": decode_gpu, "prefill_host_ms": 0.9,
                "decode_host_ms": 0.8, "decode_tokens_per_s": 1e3 / decode, "graph_breaks": 0, **extra}

    rows = [row("dense", 2.0, 2.0, 1.0), row("monarch", 1.9, 1.9, 0.5),
            row("free", 1.0, 0.5, 0.25, prefill_speedup=1.0, decode_speedup=2.0, prefill_gpu_speedup=1.0,
                decode_gpu_speedup=4.0)]
    report = load_report()
    text = report._blr_e2e_bound({"rows": rows})
    assert "1.00x in prefill and 4.00x in decode (dense / free, same run, GPU only)" in text
    assert "monarch 1.000x and 2.667x dense" in text
    section = report.blr_e2e_section({**E2E_RUN, "rows": rows})
    assert "| free | compiled | 10.00 (1.00) | 1.000 (0.250) | 1000 | 10.00 (0.90) / 0.500 (0.800) | 0 |" in section
    no_prefill = [{k: v for k, v in r.items() if not k.startswith("prefill_gpu")} for r in rows]
    assert "| 1000 | - / 0.500 (0.800) | 0 |" in report.blr_e2e_section({**E2E_RUN, "rows": no_prefill})
    assert "(dense / free, same run)" in report._blr_e2e_bound({"rows": no_prefill})
    assert "as `free` measured it (GPU only) and" in text
    failed = [{**r, "prefill_gpu_error": "queued_ms: blocks the host"} if r["model"] == "monarch" else r
              for r in no_prefill]
    assert "No GPU-only time for monarch compiled prefill: queued_ms: blocks the host." in \
        report.blr_e2e_section({**E2E_RUN, "rows": failed})
    without = [{k: v for k, v in r.items() if "gpu" not in k and "host" not in k} for r in rows]
    assert "GPU only" not in report.blr_e2e_section({**E2E_RUN, "rows": without})


def test_pick_note_names_each_miss_and_says_so_when_there_is_none():
    report = load_report()
    miss = {"structure": "monarch", "shape": "llama-7b down", "n": 16, "ratio": 1.086, "fastest": "monarch_bmm_perm_bmm"}
    assert report._pick_note({}) == ""
    assert "no case" in report._pick_note({"pick_check": []})
    assert "monarch llama-7b down N=16 (1.086x monarch_bmm_perm_bmm)" in report._pick_note({"pick_check": [miss]})


def test_a_stopped_run_is_marked_in_its_section_header():
    """A results file written as the run went (``"complete": false``) says so in README; a finished one, or one
    from a benchmark that does not record it, does not."""
    report = load_report()
    run = {"gpu": "H200", "torch": "2.11", "triton": "3.6", "commit": "abc", "date": "2026-12-01T00:00"}
    assert "stopped run" in report._header({**run, "complete": False}, "python x.py")
    assert "stopped run" not in report._header({**run, "complete": True}, "python x.py")
    assert "stopped run" not in report._header(run, "python x.py")


E2E_RUN = {"gpu": "H200", "torch": "2.11", "triton": "3.6", "commit": "abc", "date": "2026-12-01T00:00",
           "model": "llama-3.2-1b", "attention": "memfit", "rows": [], "targets": []}


def test_blr_e2e_section_names_the_compiler_setting_it_ran_with():
    """A run with --inductor-pdl says so in its title and its command; a run without (or from before the option
    existed) does not."""
    report = load_report()
    run = E2E_RUN
    with_pdl = report.blr_e2e_section({**run, "inductor_pdl": True})
    assert "compiled with inductor's PDL" in with_pdl and "--attention memfit --inductor-pdl`" in with_pdl
    for plain in ({**run, "inductor_pdl": False}, run):
        text = report.blr_e2e_section(plain)
        assert "PDL" not in text and "--attention memfit`" in text


def test_blr_e2e_section_rebuilds_methods_and_the_gemv_option():
    """The command names --methods from the rows where they are not the default pair, and --decode-gemv, which the
    title names too."""
    report = load_report()
    row = {"mode": "compiled", "prefill_ms": 2.0, "prefill_floor_ms": 1.0, "decode_ms": 1.0, "decode_floor_ms": 0.5,
           "decode_tokens_per_s": 1000.0, "graph_breaks": 0}
    rows = [{**row, "model": name} for name in ("dense", "monarch", "free")]
    run = {**E2E_RUN, "rows": rows}
    assert "--attention memfit --methods monarch`" in report.blr_e2e_section(run)
    both = report.blr_e2e_section({**run, "rows": rows + [{**row, "model": "blast"}], "decode_gemv": True})
    assert "--attention memfit --decode-gemv`" in both and "memfit's decode GEMV pick" in both


def results_copy(report, tmp_path, monkeypatch):
    """README and the results files it is rendered from, copied under ``tmp_path``, which the report then reads as
    the repository; returns the copied results folder."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name in report.results_read():
        shutil.copy(report.RESULTS / f"{name}.json", results)
    shutil.copy(ROOT / "README.md", tmp_path)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", results)
    return results


def test_check_fails_on_a_stored_met_its_numbers_contradict(tmp_path, monkeypatch, capsys):
    """A file claiming a target it missed renders as met; README regenerated from it matches, and --check still fails
    naming the file and the target."""
    report = load_report()
    path = results_copy(report, tmp_path, monkeypatch) / "linear_ce.json"
    data = json.loads(path.read_text())
    wrong = data["targets"][0]
    wrong["met"] = not wrong["met"]
    path.write_text(json.dumps(data))
    assert report.main([]) == 0
    capsys.readouterr()
    assert report.main(["--check"]) == 1
    problems = capsys.readouterr().err.splitlines()
    assert len(problems) == 1 and problems[0].startswith(f"benchmarks/results/linear_ce.json: target {wrong['name']!r}")


def test_check_fails_naming_each_missing_results_file_rendering_says_it_leaves_out(tmp_path, monkeypatch, capsys):
    """A section's own file and one a section adds a paragraph from, deleted: rendering leaves them out and says so;
    --check, even on README rendered without them, fails naming both."""
    report = load_report()
    results = results_copy(report, tmp_path, monkeypatch)
    gone = ["blr_generate", report.PLAN_FITS_DEFAULT]
    for name in gone:
        (results / f"{name}.json").unlink()
    assert report.main([]) == 0
    err = capsys.readouterr().err
    assert all(f"benchmarks/results/{name}.json is missing" in err for name in gone)
    assert report.main(["--check"]) == 1
    assert capsys.readouterr().err.splitlines() == [f"benchmarks/results/{name}.json: missing" for name in gone]


def test_readme_is_replaced_by_a_rename_not_rewritten_in_place(tmp_path, monkeypatch):
    """An interrupted write must not leave README truncated: the new text goes to a temp file renamed over it (a new
    inode), which leaves nothing behind."""
    report = load_report()
    results_copy(report, tmp_path, monkeypatch)
    before = (tmp_path / "README.md").stat().st_ino
    assert report.main([]) == 0
    assert (tmp_path / "README.md").stat().st_ino != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "benchmarks"]


def test_blr_headings_take_blocks_prefill_length_and_targets_met_from_the_file():
    """b, the prefill length and "targets not met" come from the results file, not the text."""
    report = load_report()
    run = {"gpu": "H200", "torch": "2.11", "triton": "3.6", "commit": "abc", "date": "2026-12-01T00:00", "rows": []}
    met = [{"name": "t", "measured": 1.0, "target": 2.0, "unit": "ms", "better": "lower", "met": True}]
    missed = [{**met[0], "measured": 3.0, "met": False}]
    layers = report.blr_layers_section({**run, "blocks": 8, "targets": met})
    assert layers.startswith("### Block-low-rank layer kernels, bf16, b = 8\n")
    unmet = report.blr_layers_section({**run, "blocks": 8, "targets": missed})
    assert "b = 8 (work in progress: targets not met)\n" in unmet
    row = {"model": "dense", "mode": "compiled", "prefill_ms": 2.0, "prefill_floor_ms": 1.0, "decode_ms": 1.0,
           "decode_floor_ms": 0.5, "decode_tokens_per_s": 1000.0, "graph_breaks": 0, "prefill_tokens": 512}
    e2e = report.blr_e2e_section({**E2E_RUN, "rows": [row], "targets": met})
    assert "| prefill 512 tokens ms (floor) |" in e2e and "not met" not in e2e
    assert "memfit's attention (targets not met)\n" in report.blr_e2e_section({**E2E_RUN, "rows": [row], "targets": missed})
    unrecorded = {k: v for k, v in row.items() if k != "prefill_tokens"}
    assert "| model | mode | prefill ms (floor) |" in report.blr_e2e_section({**E2E_RUN, "rows": [unrecorded]})
