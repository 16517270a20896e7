"""The study runner's progress in a log file: whole lines, no carriage return, a line for each finished run with its
scores and then how many runs are done, the time left; the resumed runs counted as done."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from study_helpers import fake_row, tiny_config

from studies.runner import grid, runs_csv, study


class Done:
    """A finished job whose result is its run's row (no training: this is about what is printed)."""

    def __init__(self, job) -> None:
        self.job = job

    def done(self) -> bool:
        return True

    def result(self) -> dict:
        return fake_row(self.job.run)


class Executor:
    def submit(self, job):
        return Done(job)


def execute_to_files(tmp_path: Path, runs: list[grid.Run], cfg: dict) -> tuple[str, str]:
    """`study._execute` of `runs` with stdout and stderr redirected to files (not terminals), as `nohup ... > log`."""
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with out.open("w") as stdout, err.open("w") as stderr:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            assert not sys.stderr.isatty()
            study._execute(
                runs,
                "calibration runs",
                cfg=cfg,
                pool=Executor(),
                parallel=2,
                progress=True,
                record_job=lambda pid, key: None,
                revision="",
                budget=[None],
            )
    return out.read_text(), err.read_text()


def test_a_logged_study_prints_whole_lines_a_run_at_a_time(tmp_path):
    cfg = grid.load_config(tiny_config(tmp_path))
    Path(cfg["out_dir"]).mkdir(parents=True)
    runs = grid.calibration_plan(cfg)
    runs_csv.append_row(Path(cfg["out_dir"]) / "runs.csv", fake_row(runs[0]))  # finished by an earlier invocation
    out, err = execute_to_files(tmp_path, runs, cfg)
    assert "\r" not in out + err and out.endswith("\n") and err.endswith("\n")
    assert out.splitlines() == [f"{run.key}: test/acc 0.5000  val/acc 0.5000  (0.1 s)" for run in runs[1:]]
    counts = [line.split(",")[0] for line in err.splitlines()]
    assert counts == [f"calibration runs: {n}/{len(runs)} runs" for n in range(2, len(runs) + 1)]
    assert all(", about " in line and line.endswith(" s left") for line in err.splitlines()[:-1])
    assert "left" not in err.splitlines()[-1]
