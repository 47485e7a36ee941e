"""A stopped benchmark's results file can be resumed only by the same code on the same GPU."""
import json

import pytest

from memfit.errors import MemfitError
from memfit.measure import results


def write(path, **fields):
    here = results.environment()
    path.write_text(json.dumps({"commit": here["commit"], "gpu": here["gpu"], "complete": False, "rows": [],
                                "seconds": 3.0, **fields}))
    return path


def test_a_partial_file_of_this_commit_and_gpu_resumes(tmp_path):
    rows = [{"shape": "s", "n": 1}]
    data = results.partial_results(write(tmp_path / "b.json", rows=rows))
    assert data["rows"] == rows and data["seconds"] == 3.0


@pytest.mark.parametrize("fields,match", [({"complete": True}, "complete run"), ({"commit": "0000000"}, "commit"),
                                          ({"gpu": "another GPU"}, "gpu")])
def test_a_complete_file_or_another_commit_or_gpu_is_refused(tmp_path, fields, match):
    with pytest.raises(MemfitError, match=match):
        results.partial_results(write(tmp_path / "b.json", **fields))


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(MemfitError, match="does not exist"):
        results.partial_results(tmp_path / "none.json")


def test_results_path_is_where_write_results_writes(tmp_path):
    assert results.write_results("bench", [], [], tmp_path) == results.results_path("bench", tmp_path)
