"""The one-line messages of a training run that name files: checkpoints only when they are on disk, names with
escape sequences shown escaped, and a run folder that another process trains in refused as such."""

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from robust_helpers import cli, error_line, main_in_process, tiny_config

from vit.training import run_dir as run_dir_module
from vit.training.callbacks import Preempted, saved_checkpoints
from vit.training.run_dir import RunDirectoryError, check_run_dir
from vit.training.run_lock import LOCK_NAME, RunLock, printable


class PoisonWeights(L.Callback):
    """Test aid: before training step `step`, fill the model's first weight with NaN (so the loss is NaN)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


# ----------------------------------------------------------------------------- names shown escaped


def test_printable_escapes_what_would_move_the_cursor_or_break_the_line():
    name = "runs/a\x1b[2J\x1b[1Ab\nc\td\u202ee\x7f caf\u00e9 \udcff.ckpt"
    assert printable(name) == "runs/a\\x1b[2J\\x1b[1Ab\\nc\\td\\u202ee\\x7f caf\u00e9 \\xff.ckpt"
    assert printable(Path("plain/run_0")) == "plain/run_0"


def test_a_checkpoint_path_with_an_escape_sequence_is_shown_escaped(tmp_path):
    err = Preempted(15, 13, str(tmp_path / "x\x1b[2J" / "last.ckpt"))
    assert str(err) == (
        f"stopped by SIGTERM after training step 13: {tmp_path}/x\\x1b[2J/last.ckpt holds step 13. "
        "Resume with the same command and --ckpt_path last (or --ckpt_path <that file>)"
    )


# ----------------------------------------------------------------------------- checkpoints named only if on disk


def test_only_checkpoints_on_disk_are_named_each_once(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "last.ckpt").write_bytes(b"a checkpoint")
    written = ModelCheckpoint(dirpath=folder, save_last=True)
    written.last_model_path = str(folder / "last.ckpt")
    written.best_model_path = str(folder / "epoch=0-step=6.ckpt")  # named before its write, which was stopped
    same_file = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=0, save_last=True)
    same_file.last_model_path = str(tmp_path / "." / "checkpoints" / "last.ckpt")
    trainer = SimpleNamespace(
        checkpoint_callbacks=[written, same_file], log_dir=str(tmp_path / "other"), default_root_dir=str(tmp_path)
    )
    assert saved_checkpoints(trainer) == [str(folder / "last.ckpt")]
    (folder / "last.ckpt").unlink()
    assert saved_checkpoints(trainer) == []


@pytest.mark.slow  # trains (to step 3)
def test_a_nan_loss_before_the_first_checkpoint_names_no_checkpoint(tmp_path, monkeypatch, capsys):
    # The step checkpoint (every 3 steps, last.ckpt) names its file, then finds the NaN as it saves: nothing is written.
    config = tiny_config(tmp_path, max_epochs=1)
    code, stderr = cli(
        [
            "fit",
            "--config",
            str(config),
            "--test_after_fit",
            "false",
            "--trainer.callbacks+=test_run_messages.PoisonWeights",
            "--trainer.callbacks.step=1",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 1
    assert error_line(stderr) == (
        "error: train/loss is nan at training step 1 (epoch 0, batch 1); training stopped at step 3, and nothing from "
        "this step on was checkpointed. No checkpoint had been written yet. Lower the learning rate (model.lr=0.002), "
        "add warmup, or look for broken inputs."
    )
    folder = tmp_path / "runs" / "tiny" / "version_0"
    assert not list(folder.rglob("*.ckpt"))
    assert not (folder / LOCK_NAME).exists()  # an error ends the run: its lock goes with it


# ----------------------------------------------------------------------------- one process per run folder


def _holder_line(folder: Path, lock: RunLock, config: str) -> str:
    started = json.loads(lock.path.read_text())["started_utc"]
    return (
        f"{printable(folder)} is being trained by another process (PID {os.getpid()} on {socket.gethostname()}, "
        f"which wrote {config} at {started}): wait for it to end or stop it, then continue the run with "
        "--ckpt_path last"
    )


def test_a_folder_whose_lock_is_held_is_refused_naming_the_holder_and_a_released_one_is_gone(tmp_path):
    folder = tmp_path / "run\x1b[2J"
    lock, holder = RunLock.take(folder)
    assert holder is None
    lock.describe("config_resume1.yaml")
    # A second take waits out a checker's instant, then gives up: the lock is held for the whole run.
    assert RunLock.take(folder) == (
        None,
        f"PID {os.getpid()} on {socket.gethostname()}, which wrote "
        f"config_resume1.yaml at {json.loads(lock.path.read_text())['started_utc']}",
    )
    with pytest.raises(RunDirectoryError) as err:
        check_run_dir(folder, stage="fit", ckpt_path=str(folder / "checkpoints" / "last.ckpt"))
    assert str(err.value) == _holder_line(folder, lock, "config_resume1.yaml")
    assert "\x1b" not in str(err.value)
    lock.release()
    assert list(folder.iterdir()) == []
    check_run_dir(folder, stage="fit")  # free again


def test_a_lock_file_left_by_a_killed_run_does_not_block(tmp_path):
    # kill -9 leaves the file, but the kernel released its flock with the process.
    (tmp_path / LOCK_NAME).write_text(
        json.dumps(
            {"pid": 999999999, "host": "gone", "config": "config.yaml", "started_utc": "2026-01-01T00:00:00+00:00"}
        )
    )
    check_run_dir(tmp_path, stage="fit")
    lock, holder = RunLock.take(tmp_path)
    assert holder is None and json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow  # trains one epoch, then starts three resumes that do not train
def test_a_second_resume_of_a_run_in_progress_is_refused_as_such(tmp_path, monkeypatch, capsys):
    config = tiny_config(tmp_path, max_epochs=1)
    main_in_process(["fit", "--config", str(config), "--test_after_fit", "false"], monkeypatch)
    folder = tmp_path / "runs" / "tiny" / "version_0"
    assert not (folder / LOCK_NAME).exists()  # a run that ended removed its lock
    resume = ["fit", "--config", str(config), "--ckpt_path", "last", "--test_after_fit", "false"]

    other, _ = RunLock.take(folder)  # what a first `--ckpt_path last` holds while it trains
    other.describe("config_resume1.yaml")
    before = {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")}
    code, stderr = cli(resume, monkeypatch, capsys)
    assert (code, error_line(stderr)) == (2, f"error: {_holder_line(folder, other, 'config_resume1.yaml')}")
    assert {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*")} == before  # before Lightning

    # Both past the check at once: the second to take the lock, as the run starts, is refused the same way.
    monkeypatch.setattr(run_dir_module, "run_lock_holder", lambda folder: None)
    code, stderr = cli(resume, monkeypatch, capsys)
    assert (code, error_line(stderr)) == (2, f"error: {_holder_line(folder, other, 'config_resume1.yaml')}")
    assert not (folder / "config_resume1.yaml").exists() and not (folder / "run_info_resume1.json").exists()
    monkeypatch.undo()

    # The holder killed (-9): its file stays, its flock is gone, and the next resume takes the run over.
    os.close(other.fd)
    main_in_process(resume, monkeypatch)
    assert (folder / "config_resume1.yaml").is_file() and not (folder / LOCK_NAME).exists()
