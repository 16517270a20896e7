"""The runner's `forked` executor: runs in processes forked from a server made before the lock, which compute the
rows and predictions a run in this process computes, are recorded in the lock as they start, fail in one line
naming the run, and are killed when stopped or past their time limit."""

from __future__ import annotations

import csv
import re
import time
from pathlib import Path

import numpy as np
import pytest
from study_helpers import KEY, REFUSED, cnn_config, tiny, tiny_config, without_audit

from studies.runner import forked, processes, study
from studies.runner.__main__ import main as study_main

TIMES = ("train_time_s", "finished_at")  # what differs between two runs of the same settings


def _relation_config(folder: Path) -> Path:
    """The tiny study's ViT on the relation task, two seeds, a fixed rate, the moved test set: two runs."""
    cfg = without_audit(tiny())
    return tiny_config(
        folder,
        cfg,
        models={"vit-learned": cfg["models"]["vit-learned"]},
        families={"vit": ["vit-learned"]},
        lrs={"vit": 1e-3},
        experiments=[{**cfg["experiments"][0], "models": ["vit-learned"]}],
    )


def _rows(folder: Path) -> dict[str, dict]:
    with open(folder / "results" / "runs.csv", newline="") as f:
        return {row["key"]: {k: v for k, v in row.items() if k not in TIMES} for row in csv.DictReader(f)}


@pytest.mark.slow  # trains
def test_forked_runs_give_the_rows_and_predictions_of_runs_in_this_process(tmp_path, monkeypatch):
    real_job_line, written = processes.job_line, []

    def job_line(pid, key):
        written.append((pid, key, real_job_line(pid, key)))
        return written[-1][2]

    monkeypatch.setattr(processes, "job_line", job_line)
    study.run_study(_relation_config(tmp_path / "forked"), progress=False, executor="forked", parallel=2)
    assert (tmp_path / "forked" / "results" / "study.lock").read_text() == ""  # a clean end
    study.run_study(_relation_config(tmp_path / "debug"), progress=False, executor="debug")
    forked_rows, debug_rows = _rows(tmp_path / "forked"), _rows(tmp_path / "debug")
    assert len(forked_rows) == 2 and forked_rows == debug_rows
    for key in forked_rows:
        ours, theirs = (np.load(tmp_path / f / "results" / "predictions" / f"{key}.npz") for f in ("forked", "debug"))
        assert sorted(ours.files) == sorted(theirs.files) and "shift_pred" in ours.files
        assert all(np.array_equal(ours[name], theirs[name]) for name in ours.files)
    # Each run went into the lock as it started, by its own process (not this one), and wrote its logs.
    assert sorted(key for _, key, _ in written) == sorted(forked_rows)
    assert all(line.startswith(f"job {pid} ") and line.endswith(f" {key}\n") for pid, key, line in written)
    logs = tmp_path / "forked" / "runs" / "submitit"
    for key in forked_rows:
        (out,) = logs.glob(f"{key}.*.out")
        assert out.read_text().startswith("test/acc = 0.5000 on 32 images")  # the run's own output


@pytest.mark.slow  # trains
def test_a_forked_run_whose_model_is_refused_ends_the_study_with_one_line_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(cnn_config(tmp_path, strides=(1, 0))), "--parallel", "1"])  # forked: default
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert re.search(f"FAILED {KEY} \\(model cnn-rf5, seed 0\\): {re.escape(REFUSED)} \\(log: \\S+\\.err\\)\n", err)
    assert err.endswith(f"error: 1 runs failed (rerun the same command to retry them): {KEY}: {REFUSED}\n")
    assert "Traceback" not in err


class Sleep:
    """A job that sleeps (standing in for a run), named as a run is."""

    class run:
        key = "sleeper"

    def __call__(self):
        time.sleep(600)


def _wait(job: forked.ForkedJob, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not job.done():
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.05)


def test_a_stopped_study_kills_its_forked_runs(tmp_path):
    with forked.serving() as server:
        job = forked.ForkedExecutor(tmp_path, timeout_min=10, server=server).submit(Sleep())
        assert job.running() and not job.done()
        study._cancel([job], wait_s=10)  # what fan_out does on SIGTERM or Ctrl-C
        _wait(job)
        assert not job.running()
        with pytest.raises(forked.JobFailed, match=r"^the run's process ended before its result was written \(see "):
            job.result()


def test_a_forked_run_past_its_time_limit_is_killed_and_says_so(tmp_path):
    with forked.serving() as server:
        executor = forked.ForkedExecutor(tmp_path, timeout_min=10, server=server)
        executor.timeout_s = 0.5
        job = executor.submit(Sleep())
        _wait(job)
        assert not job.running()
        with pytest.raises(forked.JobFailed, match=r"^the run passed its time limit of 0.00833333 min and was killed$"):
            job.result()
