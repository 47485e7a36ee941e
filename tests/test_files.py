"""Files memfit writes get the mode a plain open() gives a new file under the user's umask, not tempfile's or
safetensors' 0600."""
import errno
import os
import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture
def umask():
    """The umask 027 for the test (0600 and 0644 both differ from the 0640 it gives a new file)."""
    old = os.umask(0o027)
    yield "0o640"
    os.umask(old)


def _modes(root: Path) -> dict[str, str]:
    """Every file under ``root`` (or ``root`` itself) -> its permission bits, in octal."""
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    return {str(p.relative_to(root.parent)): oct(p.stat().st_mode & 0o777) for p in files}


def _tokenizer(tmp_path):
    from memfit.data.tokenizer import ByteTokenizer

    return ByteTokenizer().save_pretrained(tmp_path)


def _rankings(tmp_path):
    from memfit.infer.calibrate import Rankings

    return Rankings({"general": torch.rand(2, 16)}, {"general": 5}).save(tmp_path / "r.safetensors")


def _results(tmp_path):
    from memfit.measure.results import write_results

    return write_results("modes", [], [], out_dir=tmp_path)


def _autotune_cache(tmp_path):
    from memfit.kernels import autotune

    autotune._save_cache({"key": "value"})
    return autotune._cache_path()


def _model_dir(tmp_path):
    from memfit.models import PRESETS, save_model_dir

    return save_model_dir(PRESETS["tiny"], tmp_path / "tiny", dtype="float32")


def _compressed(tmp_path):
    import memfit

    memfit.compress("tiny", tmp_path / "lowrank", method="lowrank", ratio=0.5, progress=False, device="cpu")
    return tmp_path / "lowrank"


def _checkpoint(tmp_path):
    from memfit.train.finetune import TrainConfig, save_checkpoint

    model = torch.nn.Linear(4, 4)
    save_checkpoint(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), 1, [1.0], TrainConfig())
    return tmp_path / "checkpoints"


def _adapter(tmp_path):
    from safetensors.torch import save_file

    from memfit.commands.finetune import _save_adapter

    class Model:                                       # writes what peft's save_pretrained writes, the same ways
        def save_pretrained(self, directory):
            directory.mkdir(exist_ok=True)             # peft: os.makedirs(..., exist_ok=True)
            save_file({"w": torch.zeros(2)}, str(directory / "adapter_model.safetensors"))
            (directory / "adapter_config.json").write_text("{}")

    return _save_adapter(Model(), tmp_path)


@pytest.mark.parametrize("write", [_tokenizer, _rankings, _results, _autotune_cache, _model_dir, _compressed,
                                   _checkpoint, _adapter])
def test_written_files_follow_the_umask(write, tmp_path, monkeypatch, umask):
    monkeypatch.setenv("MEMFIT_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    modes = _modes(Path(write(tmp_path)))
    assert modes and modes == dict.fromkeys(modes, umask)


def test_atomic_path_leaves_the_old_file_and_no_temporary_when_the_write_fails(tmp_path, umask):
    from memfit.files import atomic_path

    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"] and target.read_text() == "old"


def test_atomic_path_keeps_the_mode_of_the_file_it_replaces(tmp_path, umask):
    """A file its owner made private (or opened up) keeps that mode when memfit writes it again."""
    from memfit.files import atomic_path

    target = tmp_path / "cache.json"
    target.write_text("old")
    target.chmod(0o600)
    with atomic_path(target) as tmp:
        tmp.write_text("new")
    assert oct(target.stat().st_mode & 0o777) == "0o600" and target.read_text() == "new"


def test_atomic_dir_replaces_the_old_directory_only_once_the_new_one_is_written(tmp_path, umask):
    """A failed fill leaves the old directory as it was and no temporary; a finished one replaces it, leaving
    nothing beside it, in a directory whose mode follows the umask."""
    from memfit.files import atomic_dir

    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(out, tmp_path / ".model.tmp") as tmp:
        (tmp / "new.txt").write_text("half")
        raise RuntimeError("crash")
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and [p.name for p in out.iterdir()] == ["old.txt"]
    with atomic_dir(out, tmp_path / ".model.tmp") as tmp:
        assert not (tmp_path / "model" / "new.txt").exists()
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and [p.name for p in out.iterdir()] == ["new.txt"]
    assert oct(out.stat().st_mode & 0o777) == "0o750"


def test_atomic_dir_puts_the_old_directory_back_when_the_new_one_cannot_take_its_place(tmp_path, monkeypatch):
    """The old directory is renamed aside before the new one goes in: a failed rename puts it back (removing it
    first, as train_small_model's save had done, would lose it)."""
    from memfit.files import atomic_dir

    out, rename = tmp_path / "model", Path.rename
    out.mkdir()
    (out / "old.txt").write_text("old")

    def failing(self, target):
        if self.name == ".model.tmp":
            raise OSError("rename failed")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="rename failed"), atomic_dir(out, tmp_path / ".model.tmp") as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (out / "old.txt").read_text() == "old"


def test_a_save_into_a_directory_leaves_the_files_it_did_not_write(tmp_path, umask):
    """save_model_dir chmods what the save wrote, not a file already there (which may not be ours to chmod)."""
    from memfit.models import PRESETS
    from memfit.models.build import save_model_dir

    mine = tmp_path / "notes.safetensors"
    mine.write_text("kept")
    mine.chmod(0o600)
    save_model_dir(PRESETS["tiny"], tmp_path)
    modes = _modes(tmp_path)
    assert modes.pop(f"{tmp_path.name}/notes.safetensors") == "0o600"
    assert modes and set(modes.values()) == {umask}


@pytest.mark.parametrize("proc", [True, False], ids=["from /proc", "set and put back"])
def test_the_umask_read_is_right_from_many_threads(umask, proc, monkeypatch, tmp_path):
    """Read from /proc or, without it, by setting and restoring the umask: two threads doing the latter at once
    could read each other's stand-in, or leave it set."""
    from concurrent.futures import ThreadPoolExecutor

    from memfit import files
    from memfit.files import new_file_mode

    if not proc:
        monkeypatch.setattr(files, "PROC_STATUS", tmp_path / "missing")
    switching = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                          # threads switch often enough to meet mid-read
    try:
        with ThreadPoolExecutor(4) as pool:
            modes = set(pool.map(lambda _: new_file_mode(), range(20000)))
    finally:
        sys.setswitchinterval(switching)
    assert modes == {int(umask, 8)} and os.umask(0o027) == 0o027


def test_data_from_a_pipe_is_read(tmp_path):
    """``--data <(...)`` names a pipe: a regular-file test had called it "does not exist"."""
    import os
    import threading

    from memfit.data.jsonl import read_records

    fifo = tmp_path / "data.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"prompt": "a", "response": "bc"}\n'), daemon=True)
    writer.start()
    assert read_records(fifo, 64) == [[("a\n", False), ("bc", True)]]   # the prompt's template adds the newline
    writer.join()


@pytest.mark.parametrize("reader", ["data file", "calibration data", "calibration file"])
def test_an_input_that_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch, reader):
    """An unreadable --data, --calib or calibrate --data had given a bare '[Errno 13] Permission denied' (root reads
    any file, so the refusal is made by a stand-in read)."""
    from memfit.compress.calibration import load_calibration
    from memfit.data.jsonl import read_records
    from memfit.errors import MemfitError
    from memfit.infer.calibrate import read_prompts

    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a"}\n')
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")) if self == path else real(self, *a, **k))
    read = {"data file": lambda: read_records(path, 64), "calibration data": lambda: read_prompts(path),
            "calibration file": lambda: load_calibration(str(path), False, None, 256, 2, 8)}[reader]
    with pytest.raises(MemfitError, match=f"{reader} '.*in.jsonl' cannot be read \\(Permission denied\\)"):
        read()


def _disk_full(*args, **kwargs):
    """A full disk as safetensors reports it, after part of the file memfit named (its temporary) is written."""
    import safetensors

    Path(args[1]).write_bytes(b"half")
    raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _stream_writer_failed(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 61824 vs 61716")


@pytest.mark.parametrize("write, failing, name", [
    (_rankings, "safetensors", "r.safetensors"), (_compressed, "save_model", "model.safetensors"),
    (_compressed, "save_file", "group-model.layers.0.self_attn.q_proj.safetensors"),
    (_checkpoint, "safetensors", "trainable.safetensors"), (_checkpoint, "torch", "state.pt"),
    (_adapter, "safetensors", "adapter"),
])
def test_a_full_disk_is_an_oserror_naming_the_file_and_leaves_nothing_behind(write, failing, name, tmp_path,
                                                                             monkeypatch):
    """safetensors and torch.save raise their own types for a full disk, which the command line showed as a
    traceback; an OSError is its one line. The temporary the write went to is removed. (A compress keeps what it
    projected beside its output, by design: its save_model is the output's, its save_file a kept group's.)"""
    import safetensors.torch

    from memfit.compress.resume import progress_dir

    if failing == "torch":
        monkeypatch.setattr(torch, "save", _stream_writer_failed)
    for function in ("save_file", "save_model"):      # imported where they are called
        if failing in ("safetensors", function):
            monkeypatch.setattr(safetensors.torch, function, _disk_full)
    before = set(tmp_path.rglob("*"))
    with pytest.raises(OSError, match=rf"{name}: the write failed, the disk is full \(") as raised:
        write(tmp_path)
    assert raised.value.errno == errno.ENOSPC
    kept = progress_dir(tmp_path / "lowrank")
    assert not [p for p in set(tmp_path.rglob("*")) - before if p.name != "checkpoints" and kept not in (p, *p.parents)]
    assert not [p for p in kept.rglob("*") if p.name.startswith(".")]   # no temporary among the kept layers


def test_a_write_that_fails_for_another_reason_is_not_called_a_full_disk(tmp_path):
    import safetensors

    from memfit.files import serializing

    with pytest.raises(OSError, match=r"x.safetensors: the write failed \(.*Permission denied.*\)$") as raised:
        with serializing(tmp_path / "x.safetensors"):
            raise safetensors.SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")
    assert raised.value.errno is None
    with pytest.raises(safetensors.SafetensorError, match="shared tensors"):     # not a write failure: as it is
        with serializing(tmp_path / "x.safetensors"):
            raise safetensors.SafetensorError("Some tensors share memory, this will lead to duplicate memory on disk "
                                              "(shared tensors)")


def test_the_autotune_cache_keeps_another_processs_picks_and_survives_a_file_that_is_no_object(tmp_path, monkeypatch):
    """Each process wrote back the file as it first read it (the last to save dropped the others' picks); a file
    holding a JSON list ended the first lookup in an AttributeError, and an empty MEMFIT_AUTOTUNE_CACHE the first
    save in a ValueError."""
    import json

    from memfit.kernels import autotune

    said = []
    monkeypatch.setattr(autotune, "warn_once", lambda key, message: said.append(message))
    monkeypatch.setattr(autotune, "_CACHE", None)            # this process's copy, put back after the test
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("MEMFIT_AUTOTUNE_CACHE", str(path))
    path.write_text("[1, 2]")
    assert autotune._load_cache() == {} and said == [f"the autotune cache {path} is not a JSON object; tuning again "
                                                     "and writing it anew"]
    autotune._load_cache()["mine"] = "a"
    path.write_text(json.dumps({"theirs": "b", "mine": "old"}))       # another process saved since
    autotune._save_cache(autotune._load_cache())
    assert json.loads(path.read_text()) == {"mine": "a", "theirs": "b"}
    monkeypatch.setenv("MEMFIT_AUTOTUNE_CACHE", "")
    assert autotune._cache_path() == Path.home() / ".cache" / "memfit" / "autotune.json"


def test_autotune_cache_saves_wait_for_one_another(tmp_path, monkeypatch):
    """Two saves at the same instant had each read the file before the other wrote it, and the later write dropped
    the earlier one's picks. A save now holds the file's lock from its read to its write: one that starts while
    another holds it waits, and then keeps the other's picks."""
    import json
    import threading

    from memfit.files import held_exclusively
    from memfit.kernels import autotune

    path = tmp_path / "autotune.json"
    monkeypatch.setenv("MEMFIT_AUTOTUNE_CACHE", str(path))
    with held_exclusively(path):                 # another process, between its read and its write
        saving = threading.Thread(target=autotune._save_cache, args=({"mine": "a"},))
        saving.start()
        saving.join(0.5)
        assert saving.is_alive(), "the save did not wait for the lock"
        path.write_text(json.dumps({"theirs": "b"}))
    saving.join(10)
    assert json.loads(path.read_text()) == {"mine": "a", "theirs": "b"}
