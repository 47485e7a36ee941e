"""README's performance section is generated from benchmarks/results, never typed."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_performance_section_matches_the_results_files():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(report.START):readme.index(report.END) + len(report.END)]
    assert section == report.render(), "run `python benchmarks/report.py` after adding results"
