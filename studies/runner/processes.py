"""The processes of a study's local jobs: written down when they start, found again after a ``kill -9``.

submitit's local jobs are processes of their own (a controller and the run it starts), so a study
invocation killed with ``kill -9`` leaves them running: they go on writing their run folders, and
their results are never recorded. The invocation holding ``<out_dir>/study.lock`` writes one line
per job into it as the job starts (``job_line``); the next invocation reads them back
(``live_jobs``) and refuses to start the same runs beside them. A line holds the PID and the
process start time (field 22 of ``/proc/<PID>/stat``, in clock ticks since boot): a PID that a new
process took after the job ended has another start time, so it does not count. A job that must
stop is killed with every process below it (``kill_process_tree``). Linux (``/proc``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (field 22 of ``/proc/<pid>/stat``); None if it has ended or is a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold ") "
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]  # fields[0] is field 3, the state


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (parents read from ``/proc/*/stat``)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def job_line(pid: int, key: str) -> str:
    """The lock file's line for the job of run ``key`` whose (controller) process is ``pid``; "" if it has ended."""
    start = start_time(pid)
    return "" if start is None else f"job {pid} {start} {key}\n"


def live_jobs(text: str) -> list[tuple[str, list[int]]]:
    """``[(run key, PIDs of its process tree)]`` of the jobs in a lock file's ``text`` (``job_line``) that still run."""
    alive = []
    for line in text.splitlines():
        fields = line.split(maxsplit=3)
        if len(fields) == 4 and fields[0] == "job" and fields[1].isdigit():
            pid = int(fields[1])
            if start_time(pid) == fields[2]:
                alive.append((fields[3], process_tree(pid)))
    return alive


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and every process below it (``process_tree``)."""
    for member in process_tree(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
