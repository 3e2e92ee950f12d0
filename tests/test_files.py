"""nmt/files.py: the model folder checked writable (and left as found), one training run's
lock on it, text replaced whole or not at all, and a failed start's empty folder taken back."""

import os
from pathlib import Path

import pytest

from nmt.files import (LOCK_NAME, FolderError, FolderLock, check_writable, removed_if_left_empty,
                       write_text_atomic)


def test_a_new_nested_model_folder_is_made_and_left_empty(tmp_path):
    check_writable(tmp_path / "runs" / "w")
    assert list((tmp_path / "runs" / "w").iterdir()) == []  # the probe taken back


def test_a_folder_in_use_is_refused_naming_its_holder_and_free_again_once_released(tmp_path):
    """The lock file says who holds it (the whole of it: a dead run's longer line replaced);
    a second lock, even in the same process, is refused; held() sees it; release frees it,
    removes the file, and the lock can be taken again."""
    (tmp_path / LOCK_NAME).write_text("x" * 1000)  # a killed run's, its lock dropped
    first = FolderLock(tmp_path)
    assert not first.held()
    first.acquire()
    said = (tmp_path / LOCK_NAME).read_text()
    assert said.startswith(f"pid {os.getpid()} on ") and "xxx" not in said
    assert FolderLock(tmp_path).held()
    with pytest.raises(FolderError, match=f"is in use by another training run \\(pid "
                                          f"{os.getpid()} on .*let it finish or stop it"):
        FolderLock(tmp_path).acquire()
    FolderLock(tmp_path).release()  # a lock never taken releases nothing (train.py's failures)
    assert (tmp_path / LOCK_NAME).exists() and FolderLock(tmp_path).held()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists() and not FolderLock(tmp_path).held()
    first.acquire()  # again, as a resume in the same process does
    assert FolderLock(tmp_path).held()
    first.release()
    first.release()  # twice is once
    assert not FolderLock(tmp_path).held()


def test_a_lock_file_removed_between_open_and_lock_is_opened_again(tmp_path, monkeypatch):
    """The holder releasing (removing the file) while the next run opens it: a lock on the
    removed file would be no lock; the next run locks the new file."""
    import fcntl
    real, calls = fcntl.flock, []

    def flock(f, op):
        if op & fcntl.LOCK_EX and not calls:  # the holder's release, just before our lock
            calls.append(op)
            (tmp_path / LOCK_NAME).unlink()
        return real(f, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    lock = FolderLock(tmp_path).acquire()
    monkeypatch.undo()
    try:
        assert calls and (tmp_path / LOCK_NAME).exists() and FolderLock(tmp_path).held()
    finally:
        lock.release()


def test_a_write_cut_short_leaves_the_file_as_it_was_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "history.json"
    path.write_text("before")
    real = Path.write_text

    def half_then_full_disk(self, text, *args, **kwargs):
        real(self, text[:3], *args, **kwargs)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Path, "write_text", half_then_full_disk)
    with pytest.raises(FolderError, match="could not write .*history.json: No space left"):
        write_text_atomic(path, "after, longer")
    monkeypatch.undo()
    assert path.read_text() == "before" and sorted(p.name for p in tmp_path.iterdir()) == \
        ["history.json"]
    write_text_atomic(path, "after")
    assert path.read_text() == "after" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("stop", [ValueError, KeyboardInterrupt])
def test_a_failed_start_takes_back_only_the_empty_folder_it_made(tmp_path, stop):
    """A start that fails (or is interrupted) removes the folder it created while empty; a
    folder that was there, or that holds a file, stays; the failure goes on up."""
    for name, existed, written in [("new", False, False), ("old", True, False),
                                   ("kept", False, True)]:
        folder = tmp_path / name
        if existed:
            folder.mkdir()
        with pytest.raises(stop):
            with removed_if_left_empty(folder):
                folder.mkdir(exist_ok=True)
                if written:
                    (folder / "tokenizer_en.json").write_text("{}")
                raise stop()
        assert folder.exists() == (existed or written), name
    assert (tmp_path / "kept" / "tokenizer_en.json").exists()
