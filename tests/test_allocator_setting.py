"""memfit finetune and verify, and memfit.verify(), run torch's CUDA allocator with expandable segments, the setting
the ledger's allocator overhead assumes (benchmarks/plan_fits.py), and keep a user's own setting (either of torch's two
variables), said once where it leaves them off, as they say where CUDA started before them without them."""
import os

import pytest
import torch

from memfit.cli import main
from memfit.local import ALLOCATOR_VARIABLES, EXPANDABLE_SEGMENTS, use_expandable_segments


@pytest.fixture(autouse=True)
def cuda_not_started(monkeypatch):
    """As in a fresh process (a GPU test run has started CUDA long before)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


@pytest.fixture
def unset(monkeypatch):
    """Both variables unset for the test and put back as they were after (setenv first, so the undo restores it)."""
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def said(monkeypatch):
    from memfit import log

    messages = []
    monkeypatch.setattr(log, "warn_once", lambda key, message: messages.append(message))
    return messages


@pytest.mark.parametrize("empty", [False, True])
def test_unset_or_empty_it_becomes_expandable_segments(unset, said, monkeypatch, empty):
    if empty:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    use_expandable_segments()
    assert [os.environ[name] for name in ALLOCATOR_VARIABLES] == [EXPANDABLE_SEGMENTS] * 2 and said == []


@pytest.mark.parametrize("name", ALLOCATOR_VARIABLES)
@pytest.mark.parametrize("setting, warned", [("expandable_segments:True,max_split_size_mb:128", False),
                                             ("expandable_segments: True", False),
                                             ("max_split_size_mb:128", True), ("expandable_segments:False", True)])
def test_a_users_setting_is_kept_and_said_where_it_leaves_them_off(unset, monkeypatch, said, name, setting, warned):
    monkeypatch.setenv(name, setting)
    use_expandable_segments()
    assert {key: os.environ.get(key) for key in ALLOCATOR_VARIABLES} == {
        key: setting if key == name else None for key in ALLOCATOR_VARIABLES}
    assert said == ([f"{name}={setting} is kept; the ledger's allocator overhead assumes {EXPANDABLE_SEGMENTS}, so "
                     "a plan's headroom may not hold"] if warned else [])


def test_cuda_started_before_it_is_said(unset, monkeypatch, said):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    use_expandable_segments()
    assert said == ["CUDA has already started, so its allocator keeps its segments; the ledger's allocator overhead "
                    f"assumes {EXPANDABLE_SEGMENTS}"]


def test_cuda_started_with_them_set_says_nothing(unset, monkeypatch, said):
    """A library caller that set them before its CUDA started has them: nothing to say."""
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", EXPANDABLE_SEGMENTS)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    use_expandable_segments()
    assert said == []


@pytest.mark.parametrize("entry", ["verify", "measure"])
@pytest.mark.parametrize("device, sets", [("cuda", True), ("cpu", False)])
def test_verify_and_measure_set_it_for_a_library_callers_cuda_job_first(monkeypatch, entry, device, sets):
    """memfit.verify() and measure() run a CUDA job as the verify command does (before, only the commands set it),
    before check_runnable, whose bitsandbytes import starts CUDA (a review)."""
    from memfit import Job, Knobs, load_spec
    from memfit.ledger import verify

    calls = []

    class Checked(Exception):
        pass

    def check_runnable(job, knobs):
        calls.append("check")
        raise Checked

    monkeypatch.setattr(verify, "use_expandable_segments", lambda: calls.append("set"))
    monkeypatch.setattr(verify, "check_runnable", check_runnable)
    with pytest.raises(Checked):
        getattr(verify, entry)(Job(load_spec("tiny"), seq=16, device=device), Knobs())
    assert calls == (["set", "check"] if sets else ["check"])


@pytest.mark.parametrize("argv", [["verify", "--pick", "2"], ["finetune", "--device", "mps"]])
def test_the_commands_that_run_a_planned_job_set_it_first(unset, argv):
    assert main(argv) == 2                  # a usage error ends them before any work, after the setting
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE_SEGMENTS
