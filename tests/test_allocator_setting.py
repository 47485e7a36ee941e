"""memfit finetune and verify run torch's CUDA allocator with expandable segments, the setting the ledger's allocator
overhead assumes (benchmarks/plan_fits.py), and keep a user's own PYTORCH_CUDA_ALLOC_CONF, said once where it leaves
them off."""
import os

import pytest

from memfit.cli import main
from memfit.local import EXPANDABLE_SEGMENTS, use_expandable_segments

VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"


@pytest.fixture
def unset(monkeypatch):
    """The variable unset for the test and put back as it was after (setenv first, so the undo restores it)."""
    monkeypatch.setenv(VARIABLE, "")
    monkeypatch.delenv(VARIABLE)


@pytest.fixture
def said(monkeypatch):
    from memfit import log

    messages = []
    monkeypatch.setattr(log, "warn_once", lambda key, message: messages.append(message))
    return messages


def test_unset_it_becomes_expandable_segments(unset, said):
    use_expandable_segments()
    assert os.environ[VARIABLE] == EXPANDABLE_SEGMENTS and said == []


@pytest.mark.parametrize("setting, warned", [("expandable_segments:True,max_split_size_mb:128", False),
                                             ("expandable_segments: True", False),
                                             ("max_split_size_mb:128", True), ("expandable_segments:False", True)])
def test_a_users_setting_is_kept_and_said_where_it_leaves_them_off(monkeypatch, said, setting, warned):
    monkeypatch.setenv(VARIABLE, setting)
    use_expandable_segments()
    assert os.environ[VARIABLE] == setting
    assert said == ([f"{VARIABLE}={setting} is kept; the ledger's allocator overhead assumes {EXPANDABLE_SEGMENTS}, so "
                     "a plan's headroom may not hold"] if warned else [])


@pytest.mark.parametrize("argv", [["verify", "--pick", "2"], ["finetune", "--device", "mps"]])
def test_the_commands_that_run_a_planned_job_set_it_first(unset, argv):
    assert main(argv) == 2                  # a usage error ends them before any work, after the setting
    assert os.environ[VARIABLE] == EXPANDABLE_SEGMENTS
