"""`vit.commands.Progress`, the progress line of the long commands: whole lines in a log file (no carriage return),
redrawn in place on a terminal, the rate and time left computed from this invocation's items and clock."""

from __future__ import annotations

import io

import pytest

import vit.commands
from vit.commands import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    """A monotonic clock that the test moves: `clock[0]` seconds."""
    now = [100.0]
    monkeypatch.setattr(vit.commands.time, "monotonic", lambda: now[0])
    return now


def test_in_a_log_file_every_report_is_a_whole_line_with_the_rate_and_the_time_left(clock):
    log = io.StringIO()
    progress = Progress("explaining 6 images", 4, "methods", every=0, stream=log)
    for method in ("rollout", "chefer", "gradcam", "flow"):
        clock[0] += 2.0  # 2 s a method: 0.5 methods/s
        progress.update(note=method)
    progress.close()
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()
    assert log.getvalue().split("\n") == [
        "explaining 6 images: 1/4 methods (rollout), 0.5 methods/s, about 6 s left",
        "explaining 6 images: 2/4 methods (chefer), 0.5 methods/s, about 4 s left",
        "explaining 6 images: 3/4 methods (gradcam), 0.5 methods/s, about 2 s left",
        "explaining 6 images: 4/4 methods (flow), 0.5 methods/s",
        "",
    ]


def test_in_a_log_file_a_line_at_most_every_interval_and_always_the_last(clock):
    log = io.StringIO()
    progress = Progress("folder", 30, "images", every=10, stream=log)
    for _ in range(30):
        clock[0] += 1.0
        progress.update()
    # the first (t=1), the first 10 s after it (t=11, t=21), and the last (t=30)
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == [
        "folder: 1/30 images",
        "folder: 11/30 images",
        "folder: 21/30 images",
        "folder: 30/30 images",
    ]
    assert log.getvalue().endswith("folder: 30/30 images, 1 images/s\n")


def test_a_resumed_count_starts_where_it_was_and_times_only_this_invocation(clock):
    log = io.StringIO()
    progress = Progress("study runs", 10, "runs", done=6, every=0, stream=log)
    clock[0] += 4.0
    progress.update()  # 1 run in 4 s here: 3 runs left take 12 s, whatever the 6 before took
    assert log.getvalue() == "study runs: 7/10 runs, 0.25 runs/s, about 12 s left\n"


def test_on_a_terminal_the_line_is_redrawn_in_place_and_messages_print_above_it(clock):
    screen, other = Terminal(), io.StringIO()
    progress = Progress("study runs", 2, "runs", every=10, stream=screen)
    clock[0] += 1.0
    progress.update()
    progress.write("run a: test/acc 0.5")
    progress.write("run b: on stdout", file=other)
    clock[0] += 1.0
    progress.update()
    progress.close()  # the last line already ended: nothing more
    line1, line2 = "study runs: 1/2 runs, 1 runs/s, about 1 s left", "study runs: 2/2 runs, 1 runs/s"
    assert screen.getvalue() == (
        f"\r{line1}\x1b[K"  # drawn, no newline
        "\rrun a: test/acc 0.5\x1b[K\n"  # over it, a line of its own
        f"\r{line1}\x1b[K"  # drawn again
        "\r\x1b[K"  # erased while the other stream prints
        f"\r{line1}\x1b[K"
        f"\r{line2}\x1b[K\n"  # the last one ends its line
    )
    assert other.getvalue() == "run b: on stdout\n"


def test_closing_a_line_left_in_place_ends_it(clock):
    screen = Terminal()
    progress = Progress("x", 3, "items", stream=screen)
    clock[0] += 1.0
    progress.update()
    progress.close()
    assert screen.getvalue().endswith("\x1b[K\n")


def test_a_fast_rate_is_written_without_an_exponent(monkeypatch):
    clock = iter([0.0, 0.001])
    monkeypatch.setattr("vit.commands.time.monotonic", lambda: next(clock))
    log = io.StringIO()
    Progress("folder", 12345, "images", stream=log).update(12345)
    assert log.getvalue() == "folder: 12345/12345 images, 12345000 images/s\n"
