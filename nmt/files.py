"""The run folder on disk: one training run writes into it at a time (`FolderLock`), it must be
writable before any work starts (`check_writable`), a failed start leaves no empty one behind
(`removed_if_left_empty`), and a text file in it is replaced whole or not at all
(`write_text_atomic`; checkpoint.py writes its tensors the same way)."""

import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from config import UserError


class FolderError(UserError):
    """A model folder that cannot be written, or is in use by another run."""


def check_writable(folder):
    """Creates `folder` and refuses, before any training, one that cannot be written."""
    folder = Path(folder)
    if folder.is_file():
        raise FolderError(f"--model_folder {folder} is a file: give a folder (a new one, or a "
                          f"run's to resume)")
    probe = folder / ".write-test"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise FolderError(f"--model_folder {folder} is not writable: {e.strerror}") from None


# ---- one writer per folder ----------------------------------------------------------------------

LOCK_NAME = ".train.lock"


class FolderLock:
    """The one training run that writes into a model folder: an exclusive advisory lock
    (flock) on `.train.lock` in it, taken by rank 0 for the life of the run. The kernel drops
    the lock when its process ends, however it ends (SIGKILL included), so a dead run's lock is
    free again; the file says who holds it, for the refusal. translate.py and export.py only
    read, and take no lock. Where flock does not exist (Windows), there is no lock."""

    def __init__(self, folder):
        self.path = Path(folder) / LOCK_NAME
        self.file = None

    def held(self) -> bool:
        """Whether a run holds the lock now (a probe: nothing is taken, nothing written)."""
        try:
            import fcntl
            probe = open(self.path, encoding="utf-8")
        except (ImportError, OSError):  # no flock, or no lock file: no run
            return False
        with probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
        return False

    def acquire(self):
        try:
            import fcntl
        except ImportError:
            return self
        while self.file is None:
            f = open(self.path, "a+", encoding="utf-8")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                raise FolderError(f"{self.path.parent} is in use by another training run "
                                      f"({holder}); let it finish or stop it, or train into "
                                      f"another --model_folder") from None
            try:  # the holder may have released (removed) the file between our open and lock
                if os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino:
                    self.file = f
                    break
            except FileNotFoundError:
                pass
            f.close()
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
                        f"{time.strftime('%Y-%m-%d %H:%M')}: {' '.join(sys.argv)}")
        self.file.flush()
        return self

    def release(self):
        if self.file is not None:
            self.path.unlink(missing_ok=True)  # still held: a process waiting opens a new file
            self.file.close()  # and this drops the lock
            self.file = None


def write_text_atomic(path: Path, text: str):
    """A temporary file beside `path`, then renamed over it: never a half-written file. A
    full disk is one line, and `path` keeps what it held."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FolderError(f"could not write {path}: {e.strerror or e}; the files already "
                              f"saved are untouched") from None


def remove_files(paths):
    """Takes back the files a failed start wrote (--init_from's copied tokenizers): a start
    that fails leaves no file behind (docs/resuming.md)."""
    for path in paths:
        Path(path).unlink(missing_ok=True)


@contextmanager
def removed_if_left_empty(folder):
    """A failed start (a bad path, a refused checkpoint) leaves no empty folder behind: the
    model folder is removed again if this run created it and wrote nothing in it."""
    new = not Path(folder).exists()
    try:
        yield
    except BaseException:
        if new:
            try:
                Path(folder).rmdir()  # only an empty folder
            except OSError:
                pass
        raise
