"""One study invocation per ``out_dir``: its lock, the folders it makes, and SIGTERM turned into a clean stop."""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import threading
from contextlib import contextmanager, suppress
from pathlib import Path

from studies.runner import processes
from studies.runner.runs_csv import StudyError
from vit.training.run_lock import printable

LOCK_NAME = "study.lock"  # in out_dir, held by the invocation running the study (lock_out_dir)


class Stopped(BaseException):
    """SIGTERM reached the study. A BaseException, like KeyboardInterrupt, so that no ``except
    Exception`` on the way (a failed run, Lightning's handlers) takes it for an error and goes on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def lock_out_dir(out_dir: Path):
    """Hold ``<out_dir>/study.lock`` while the study runs; a second invocation on the same folder is refused.

    Two at once would each take the other's runs under way for killed ones, move their folders
    aside and start them again. ``fcntl.flock``: the kernel releases the lock when its process
    ends, ``kill -9`` included, so a lock file left behind never blocks; the PID in it (emptied on
    a clean end) tells that the last invocation was killed. Yields ``record_job(pid, run key)``,
    which writes a local job into the lock as it starts: the jobs of a killed invocation run on,
    and while one does, the next invocation is refused too (``processes.live_jobs``).
    """
    path = out_dir / LOCK_NAME
    shown, shown_path = printable(out_dir), printable(path)  # as messages show them
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _unusable("out_dir", out_dir, err) from None
    try:
        _flock(fd, shown, shown_path)
        _take_over(fd, shown, shown_path)

        def record_job(pid: int, key: str) -> None:
            os.pwrite(fd, processes.job_line(pid, key).encode(), os.fstat(fd).st_size)

        try:
            yield record_job
        finally:
            os.ftruncate(fd, 0)  # an empty lock file: this invocation ended, it was not killed
    finally:
        os.close(fd)  # releases the lock


def _flock(fd: int, shown: str, shown_path: str) -> None:
    """Lock the open lock file ``fd`` without waiting, or raise ``StudyError`` naming the invocation that holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").partition("\n")[0].strip() or "unknown"
        pid = printable(pid)
        raise StudyError(
            f"{shown} is in use by another study invocation (PID {pid}, lock {shown_path}): wait "
            f"for it to finish, or stop it (kill {pid}) and rerun; two at once would redo each "
            "other's runs"
        ) from None
    except OSError as err:
        raise StudyError(
            f"{shown_path} cannot be locked ({err.strerror}): put out_dir on a filesystem with locks"
        ) from None


def _take_over(fd: int, shown: str, shown_path: str) -> None:
    """Refuse while jobs of a killed invocation run on, say so when taking over from one, write this PID."""
    text = os.pread(fd, 1 << 20, 0).decode(errors="replace")
    previous = printable(text.partition("\n")[0].strip())
    if orphans := processes.live_jobs(text):  # a local job's run ignores SIGTERM (submitit): kill -9 stops it
        runs = ", ".join(f"{key} (PIDs {' '.join(map(str, tree))})" for key, tree in orphans)
        pids = " ".join(str(pid) for _, tree in orphans for pid in tree)
        raise StudyError(
            f"{shown}: the study invocation that held {shown_path} (PID {previous or 'unknown'}) was "
            f"killed, but runs it started still run: {runs}. Their results can no longer be "
            f"recorded: stop them (kill -9 {pids}) or wait for them to end, then rerun; started "
            "now, they would run twice in the same folders"
        )
    if previous:
        print(
            f"taking over {shown_path}: the invocation that held it (PID {previous}) ended without releasing it "
            "(killed?); its unfinished runs are redone",
            file=sys.stderr,
            flush=True,
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _unusable(key: str, path: Path, err: OSError) -> StudyError:
    """The error of a folder from the config that cannot be created or written: one line naming the value."""
    reason = (
        "it exists and is not a folder"
        if os.path.exists(path) and not os.path.isdir(path)
        else f"creating {printable(err.filename)} failed ({err.strerror})"
    )
    return StudyError(
        f"{key}={str(path)!r} cannot be used: {reason}; expected a folder that this user can create and write in"
    )


def make_dirs(key: str, path: Path) -> None:
    """Create the config's folder ``key`` and its parents, or raise ``StudyError``, having removed what it created."""
    missing = [p for p in (path, *path.parents) if not os.path.exists(p)]  # the deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        for created in missing:  # rmdir leaves a folder that is not empty (not made here)
            with suppress(OSError):
                created.rmdir()
        raise _unusable(key, path, err) from None


@contextmanager
def stop_on_sigterm():
    """Turn SIGTERM into ``Stopped`` while the study runs (in the main thread; elsewhere nothing changes).

    Python's default would end the process at once, leaving submitit's local jobs running on:
    as an exception, ``fan_out`` cancels them first. Within a run of the debug executor,
    Lightning calls this handler after its own.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_stopped(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
