"""A run folder locked while a process trains in it (`RunLock`, the file `run.lock`): a second `fit` of the same
run is refused naming the first (`run_lock_holder`, `in_use_message`); and how a path or name from a user is
printed (`printable`)."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn

try:
    import fcntl
except ImportError:  # not on POSIX: no lock, the exclusive create of the config still keeps two runs apart
    fcntl = None

LOCK_NAME = "run.lock"  # in a run folder while a process trains in it


def printable(text: object) -> str:
    """`text` as a message may show it: every character that is not printable (escape sequences, newlines, bidi
    overrides) as its escape, so a file name can neither clear the screen nor hide or fake a line of a one-line
    error; a byte that is not UTF-8 (PEP 383) as `\\xff`, as `vit.data.files.text_name` writes it."""
    return "".join(_shown(c) for c in str(text))


def _shown(c: str) -> str:
    if c.isprintable():
        return c
    if "\udc80" <= c <= "\udcff":  # the byte os.fsdecode could not decode
        return f"\\x{ord(c) - 0xDC00:02x}"
    return c.encode("unicode_escape").decode("ascii")


class RunLock:
    """`run.lock` in a run folder, held with `fcntl.flock` by the process training in it.

    A lock, not the config files: `config_resume1.yaml` shows that a resume started, not that it still runs. The
    kernel releases a flock when its process ends, `kill -9` included, so a file left by a killed run never blocks
    (the next run takes it over); a run that ends, well or with an error, removes it. The file holds the holder's
    PID, host, start and config file, for the refusal of a second process. Where the filesystem has no locks (or
    not POSIX), runs go unlocked, as before: the exclusive create of the config still keeps two new runs apart."""

    WAIT_S = 1.0  # a check (`holder`) holds the lock for an instant: a run taking it retries this long

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, run_dir: Path) -> tuple[RunLock | None, str | None]:
        """`(lock, None)` once held, `(None, holder)` if a live process holds it, `(None, None)` without locks."""
        if fcntl is None:
            return None, None
        path = run_dir / LOCK_NAME
        deadline = time.monotonic() + cls.WAIT_S
        while True:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:  # the config write that follows says what is wrong with the folder
                return None, None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    return None, _details(path)
                time.sleep(0.05)
                continue
            except OSError as err:
                os.close(fd)
                rank_zero_warn(
                    f"{printable(path)} cannot be locked ({err.strerror}): this run is not protected "
                    "from a second process resuming it at the same time"
                )
                return None, None
            try:  # its holder may have removed the file between our open and our lock: then take the new one
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                lock = cls(path, fd)
                lock.describe("")
                return lock, None
            os.close(fd)

    def describe(self, config_name: str) -> None:
        """Write who holds the lock, for the refusal of a second process."""
        text = (
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "config": config_name,
                    "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                }
            )
            + "\n"
        )
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)

    def release(self) -> None:
        """Remove the file, then unlock (removed first: whoever opens it now takes a new one)."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)


def run_lock_holder(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s `run.lock` ("PID 412 on node3, which wrote ..."), or None if no live process does."""
    path = run_dir / LOCK_NAME
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _details(path)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def _details(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        pid, host, config, started = info["pid"], info["host"], info["config"], info["started_utc"]
    except (OSError, ValueError, KeyError, TypeError):  # written an instant later, or not by this code
        return f"its {LOCK_NAME} says no more"
    wrote = f", which wrote {printable(config)} at {printable(started)}" if config else f", since {printable(started)}"
    return f"PID {printable(pid)} on {printable(host)}{wrote}"


def in_use_message(run_dir: Path, holder: str) -> str:
    """The refusal of a run folder that a live process trains in."""
    return (
        f"{printable(run_dir)} is being trained by another process ({holder}): wait for it to end or stop it, "
        "then continue the run with --ckpt_path last"
    )
