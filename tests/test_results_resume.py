"""A stopped benchmark's results file can be resumed only by the same code, GPU, libraries and settings."""
import json

import pytest

from memfit.errors import MemfitError
from memfit.measure import results

HERE = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "abc1234", "date": "today"}


@pytest.fixture(autouse=True)
def this_machine(monkeypatch):
    monkeypatch.setattr(results, "environment", lambda: dict(HERE))


def write(path, **fields):
    path.write_text(json.dumps({**HERE, "complete": False, "rows": [], "seconds": 3.0, "tokens": [1, 16],
                                **fields}))
    return path


def test_a_partial_file_of_this_commit_gpu_and_settings_resumes(tmp_path):
    rows = [{"shape": "s", "n": 1}]
    data = results.partial_results(write(tmp_path / "b.json", rows=rows), tokens=[1, 16])
    assert data["rows"] == rows and data["seconds"] == 3.0


@pytest.mark.parametrize("fields,match", [({"complete": True}, "complete run"), ({"commit": "0000000"}, "commit"),
                                          ({"gpu": "another GPU"}, "gpu"), ({"triton": "3.5.0"}, "triton"),
                                          ({"tokens": [1]}, "tokens"), ({"commit": "abc1234-dirty"}, "uncommitted"),
                                          ({"commit": "unknown"}, "the commit of it is unknown")])
def test_a_complete_file_or_other_code_gpu_libraries_or_settings_are_refused(tmp_path, fields, match):
    with pytest.raises(MemfitError, match=match):
        results.partial_results(write(tmp_path / "b.json", **fields), tokens=[1, 16])


def test_uncommitted_code_here_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "environment", lambda: {**HERE, "commit": "abc1234-dirty"})
    with pytest.raises(MemfitError, match="uncommitted"):
        results.partial_results(write(tmp_path / "b.json"))


@pytest.mark.parametrize("text,match", [(None, "does not exist"), ("{not json", "cannot resume")])
def test_a_missing_or_unreadable_file_is_refused(tmp_path, text, match):
    path = tmp_path / "b.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(MemfitError, match=match):
        results.partial_results(path)


def test_results_path_is_where_write_results_writes(tmp_path):
    assert results.write_results("bench", [], [], tmp_path) == results.results_path("bench", tmp_path)


def test_an_unknown_commit_on_both_sides_is_refused(tmp_path, monkeypatch):
    """With no git checkout and no MEMFIT_COMMIT both the file and the run read "unknown", which had matched: a run of
    any code resumed any other's."""
    monkeypatch.setattr(results, "environment", lambda: {**HERE, "commit": "unknown"})
    with pytest.raises(MemfitError, match="the commit of this run is unknown"):
        results.partial_results(write(tmp_path / "b.json", commit="unknown"), tokens=[1, 16])
