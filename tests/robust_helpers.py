"""Helpers for the tests of robust runs: tiny configs derived from the shipped ones, and subprocess runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = REPO / "configs" / "two_circles" / "vit.yaml"
RESUMABLE_OVERLAY = REPO / "configs" / "two_circles" / "vit_resumable.yaml"
STEPS_PER_EPOCH = 8  # num_train 256 / batch_size 32


def tiny_config(tmp_path: Path, *, max_epochs: int = 3, every_n_train_steps: int = 3, **data) -> Path:
    """The shipped resumable two-circles config (base + overlay), shrunk to seconds on a CPU; returns its path."""
    config = overlay(yaml.safe_load(BASE_CONFIG.read_text()), yaml.safe_load(RESUMABLE_OVERLAY.read_text()))
    trainer = config["trainer"]
    trainer.update(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer["logger"]["init_args"].update(save_dir=str(tmp_path / "runs"), name="tiny")
    step_checkpoint = trainer["callbacks"][1]["init_args"]
    assert "every_n_train_steps" in step_checkpoint  # the shipped config keeps its fault-tolerance checkpoint
    step_checkpoint["every_n_train_steps"] = every_n_train_steps
    # Stochastic depth draws random numbers every step (depth 2: the first block's rate is 0, the second's 0.2).
    config["model"]["backbone"]["init_args"].update(
        patch_size=8, embed_dim=32, depth=2, num_heads=2, drop_path_rate=0.2
    )
    config["data"]["init_args"].update(num_train=256, num_val=64, num_test=64, batch_size=32, **data)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def overlay(base: dict, top: dict) -> dict:
    """A second `--config` on top of a first, as jsonargparse applies it: mappings merge, lists and values replace."""
    merged = dict(base)
    for key, value in top.items():
        both_mappings = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = overlay(base[key], value) if both_mappings else value
    return merged


def run_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "runs" / "tiny").glob("version_*"))


def train_command(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *args]


def subprocess_env() -> dict[str, str]:
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(*args), cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )


class PauseAtStep(L.Callback):
    """Test aid: after training step `step`, write `marker` and wait, so a test can signal the process there.

    The wait ends when a stop signal has been noted (SIGTERM by Lightning, SIGINT by `StopOnSignal`),
    so the step ends as it would have; a SIGKILL ends it anyway.
    """

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            Path(self.marker).write_text(str(trainer.global_step))
            stoppers = [cb for cb in trainer.callbacks if hasattr(cb, "received")]
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not any(cb.received(trainer) for cb in stoppers):
                time.sleep(0.05)


class RecordMetrics(L.Callback):
    """Test aid: append val/* and train/loss* at each validation end to a JSON-lines file.

    `{rank}` in the path is the process rank.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "train/loss"))}
        with open(self.path.format(rank=trainer.global_rank), "a") as f:
            f.write(json.dumps({"epoch": trainer.current_epoch, "step": trainer.global_step, **metrics}) + "\n")


def read_metrics(path: Path) -> dict[int, dict]:
    """The last record of each epoch (a resumed run may have repeated one)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["epoch"]: r for r in records}


def main_in_process(args: list[str], monkeypatch) -> None:
    """`train.py ARGS` in this process (no import cost), with a clean sys.argv as the CLI expects."""
    from vit.training.cli import main

    monkeypatch.setattr(sys, "argv", ["train.py"])
    main(args)


_SHARED: dict[Path, Path] = {}


def shared_run(root: Path, monkeypatch) -> Path:
    """One uninterrupted tiny run per test session (3 epochs, checkpoint every 3 steps); returns its folder.

    Its `metrics.jsonl` has the validation metrics of each epoch, `runs/tiny/version_0` the run.
    """
    if root not in _SHARED:
        root.mkdir(parents=True, exist_ok=True)
        config = tiny_config(root)
        main_in_process(
            [
                "fit",
                "--config",
                str(config),
                "--test_after_fit",
                "false",
                "--trainer.callbacks+=robust_helpers.RecordMetrics",
                f"--trainer.callbacks.path={root / 'metrics.jsonl'}",
            ],
            monkeypatch,
        )
        _SHARED[root] = root
    return _SHARED[root]


def cli(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """`train.py ARGS` in this process, expected to exit: its exit code and its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main_in_process(args, monkeypatch)
    return exit_info.value.code, capsys.readouterr().err


def error_line(stderr: str) -> str:
    """The one `error: ...` line of a refused command (and no traceback)."""
    assert "Traceback" not in stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return line


def save_with_folder(checkpoint: dict, path: Path) -> Path:
    """`torch.save(checkpoint, path)` and its model folder beside it, as a run writes both (its training record made
    again from the values given): what every inference door opens."""
    import torch

    import vit.artifact as artifact
    from vit.training.record import training_record

    checkpoint = {**checkpoint, "training_record": training_record(checkpoint)}
    torch.save(checkpoint, path)
    made = artifact.from_checkpoint(checkpoint)
    artifact.write(artifact.folder_of(path), *made)
    return path
