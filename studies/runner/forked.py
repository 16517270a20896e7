"""The ``forked`` executor: each run in a process of its own, forked from a copy of the study's process made before
its lock, instead of a fresh interpreter per run (submitit's ``local``), which imports torch and Lightning again.

On 2 cores a fresh interpreter spends 4-5 s importing torch, Lightning and the library before a tiny run's second of
training, and two importing at once take longer still (``benchmarks/study_overhead.py``). The server (``serving``) is
forked once, before the study takes its lock and computes anything: it holds no lock file, no thread pool and no
open run, so every run forks from the same clean state and shares nothing with the run before (W&B, seeds, threads).

A job is what ``study.fan_out`` drives: ``submit`` returns a ``ForkedJob`` with ``done``, ``result`` and ``cancel``,
its PID as ``job_id`` (what the lock records, ``processes``: after a ``kill -9`` of the study a run goes on, as
submitit's local jobs do, and the next invocation refuses to start beside it) and its logs as ``paths``. Linux.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from studies.runner import processes


@dataclass(frozen=True)
class Paths:
    """A job's files: its stdout and stderr (the run's own output, as submitit's logs) and its result, as JSON (plain
    data: a file in the log folder is never unpickled)."""

    stdout: Path
    stderr: Path
    result: Path


def _child(job, paths: Paths) -> None:
    """In the run's process: its output into its logs, then ``job()``; the row, or the traceback, as JSON."""
    for fd, path in ((1, paths.stdout), (2, paths.stderr)):
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, fd)
        os.close(log)
    # Python's streams too, which may not be those descriptors (a stream replaced by a caller, pytest's capture)
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
    try:
        outcome = ("row", job())
    except BaseException:  # noqa: BLE001 - whatever ended the run is its failure, reported by the study
        traceback.print_exc()
        outcome = ("error", traceback.format_exc())
    tmp = paths.result.with_name(paths.result.name + ".tmp")
    tmp.write_text(json.dumps(outcome))
    os.replace(tmp, paths.result)  # whole or absent: a killed run leaves no half result


def _serve(conn, study_end) -> None:
    """The server's loop: fork a process for each ``(job, paths)`` received and send its PID back, until the study's
    end of the pipe closes. Ctrl-C is the study's to handle: it kills the runs (``ForkedJob.cancel``)."""
    study_end.close()  # the copy forked with this process: else the pipe would never end
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fork = multiprocessing.get_context("fork")
    while True:
        try:
            job, paths = conn.recv()
        except EOFError:  # the study ended (or was killed): the runs under way go on, as the lock records
            return
        run = fork.Process(target=_child, args=(job, paths), name=job.run.key)
        run.start()
        conn.send(run.pid)
        multiprocessing.active_children()  # reaps the runs that ended


@contextmanager
def serving():
    """The server, forked from this process now (call it before the study locks its folder or computes); it ends
    with the block."""
    here, there = multiprocessing.Pipe()
    server = multiprocessing.get_context("fork").Process(target=_serve, args=(there, here), name="study-runs")
    server.start()
    there.close()
    try:
        yield here
    finally:
        here.close()  # the server sees the end of its pipe and returns
        server.join()


class JobFailed(RuntimeError):
    """A forked run failed: its message is the run's traceback, whose last line is the error (``failure_line``)."""


class ForkedJob:
    """One run's process: ``done`` (and killed past its time limit), ``result`` (its row), ``cancel``."""

    def __init__(self, pid: int, paths: Paths, timeout_s: float) -> None:
        self.pid, self.paths, self.timeout_s = pid, paths, timeout_s
        self.job_id, self.started = str(pid), processes.start_time(pid)  # None: it has ended already
        self.deadline, self.timed_out = time.monotonic() + timeout_s, False

    def running(self) -> bool:
        return self.started is not None and processes.start_time(self.pid) == self.started

    def done(self) -> bool:
        if self.running() and time.monotonic() > self.deadline:
            self.timed_out = True
            self.cancel()
        return self.paths.result.exists() or not self.running()

    def result(self) -> dict:
        while not self.done():
            time.sleep(0.05)
        if self.timed_out:
            raise JobFailed(f"the run passed its time limit of {self.timeout_s / 60:g} min and was killed")
        try:
            kind, value = json.loads(self.paths.result.read_text())
        except FileNotFoundError:
            raise JobFailed(
                f"the run's process ended before its result was written (see {self.paths.stderr})"
            ) from None
        if kind == "error":
            raise JobFailed(value)
        return value

    def cancel(self, check: bool = False) -> None:
        """Kill the run with every process below it (its data loader's workers)."""
        if self.running():
            processes.kill_process_tree(self.pid)


class ForkedExecutor:
    """Submit study jobs to the server (``serving``) as processes of their own; their logs and results in ``folder``."""

    cluster = "forked"
    poll_s = 0.05  # `done` is a stat and a read of /proc here (submitit's reads files): a run's end is seen at once

    def __init__(self, folder: Path, *, timeout_min: int, server) -> None:
        self.folder, self.timeout_s, self.server = Path(folder), 60.0 * timeout_min, server
        self.folder.mkdir(parents=True, exist_ok=True)

    def submit(self, job) -> ForkedJob:
        stem = f"{job.run.key}.{time.time_ns()}"  # unique: a rerun keeps the logs of the attempt before
        paths = Paths(*(self.folder / f"{stem}.{suffix}" for suffix in ("out", "err", "result.json")))
        self.server.send((job, paths))
        return ForkedJob(self.server.recv(), paths, self.timeout_s)
