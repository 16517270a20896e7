"""The run directory: never reused by accident, and it records what is needed to rerun it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

PACKAGES = ("readable-vit", "torch", "torchvision", "lightning", "torchmetrics", "timm", "jsonargparse", "numpy")


class RunDirectoryError(ValueError):
    """The run directory already holds another run."""


class RunConfig(SaveConfigCallback):
    """LightningCLI's `SaveConfigCallback` that also writes `run_info.json`, and never reuses a run's folder.
    A run folder that already holds a run is refused; `fit` resuming inside its own folder adds `config_resume1.yaml` /
    `run_info_resume1.json` (then 2, ...). Loggers without a run folder (W&B) get the whole config, and the files go
    beside the run's checkpoints. `command`: the CLI's arguments (`sys.argv`)."""

    def __init__(self, *args, command: list[str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.command, self._run_dir, self._suffix = command, None, ""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.already_saved or not self.save_to_log_dir:
            return
        folder_per_run = not trainer.loggers or isinstance(trainer.loggers[0], (TensorBoardLogger, CSVLogger))
        # Collectives: every rank calls them; rank 0 decides and claims, every rank gets its answer. Without a run
        # folder, save_dir/name/version: the folder holding the run's `checkpoints/`.
        logger = trainer.loggers[0] if trainer.loggers else None
        run_dir = Path(trainer.log_dir if folder_per_run else trainer.strategy.broadcast(os.path.join(
            logger.save_dir or trainer.default_root_dir, str(logger.name), version_dir(logger.version))))
        taken, refusal = False, None
        if trainer.is_global_zero:
            taken = holds_a_run(run_dir, self.config_filename)
            if folder_per_run:
                try:
                    check_run_dir(run_dir, stage=stage, ckpt_path=self.config.get("ckpt_path"),
                                  config_filename=self.config_filename)
                except RunDirectoryError as err:
                    refusal = str(err)
            elif taken and not self.overwrite:
                refusal = (f"{run_dir / self.config_filename} already exists; "
                           "not overwriting the config of an earlier run")
            if refusal is None:
                if taken and folder_per_run:
                    self._suffix = _free_suffix(run_dir)
                refusal = self._claim(run_dir)
        refusal, self._suffix = trainer.strategy.broadcast((refusal, self._suffix))
        if refusal is not None:
            raise RunDirectoryError(refusal)
        if trainer.is_global_zero:
            self._run_dir = run_dir
            self.save_config(trainer, pl_module, stage)
        self.already_saved = trainer.strategy.broadcast(True)

    def _claim(self, run_dir: Path) -> str | None:
        """Write the config with an exclusive create, so two runs never take one folder; the refusal, or None."""
        stem, ext = os.path.splitext(self.config_filename)
        path = run_dir / f"{stem}{self._suffix}{ext}"
        run_dir.mkdir(parents=True, exist_ok=True)
        text = self.parser.dump(self.config, skip_none=False)
        try:
            with open(path, "w" if self.overwrite else "x") as f:
                f.write(text)
        except FileExistsError:
            return (f"{path} was written by another run while this one started; nothing was written. "
                    "Start this run again: it takes the next free folder")
        return None

    def save_config(self, trainer, pl_module, stage: str) -> None:
        """Write `run_info.json`, and give loggers without a run folder the whole config (rank 0 only)."""
        config = self.config.clone().as_dict()
        config.pop("config", None)  # the paths of the YAML files given, not settings
        for logger in trainer.loggers:
            if not isinstance(logger, (TensorBoardLogger, CSVLogger)):
                logger.log_hyperparams(config)
        info = run_info(trainer, stage=stage, seed=self.config.get("seed_everything"),
                        ckpt_path=self.config.get("ckpt_path"), command=self.command)
        (self._run_dir / f"run_info{self._suffix}.json").write_text(json.dumps(info, indent=2) + "\n")


def version_dir(version) -> str:
    """The folder name of a logger's `version`: `version_3` for 3, a string as it is."""
    return version if isinstance(version, str) else f"version_{version}"


def holds_a_run(log_dir: Path, config_filename: str = "config.yaml") -> bool:
    """Whether `log_dir` has a saved config or checkpoints, i.e. a run was there."""
    return (log_dir / config_filename).is_file() or any((log_dir / "checkpoints").glob("*.ckpt"))


def check_run_dir(log_dir: Path, *, stage: str, ckpt_path=None, config_filename: str = "config.yaml") -> None:
    """Raise `RunDirectoryError` if `log_dir` holds a run, unless this is `fit` resuming from a checkpoint in it."""
    resuming = stage == "fit" and ckpt_path is not None and log_dir.resolve() in Path(ckpt_path).resolve().parents
    if holds_a_run(log_dir, config_filename) and not resuming:
        raise RunDirectoryError(f"the run directory {log_dir} already holds a run ({config_filename} or checkpoints); "
                                "nothing was written. Leave trainer.logger.init_args.version unset (each run gets the "
                                "next free version_N), choose another name/version, or continue that run with "
                                "--ckpt_path last.")


def _free_suffix(log_dir: Path) -> str:
    k = 1
    while (log_dir / f"config_resume{k}.yaml").exists() or (log_dir / f"run_info_resume{k}.json").exists():
        k += 1
    return f"_resume{k}"


def run_info(trainer, *, stage: str | None = None, seed: Any = None, ckpt_path: Any = None,
             command: list[str] | None = None) -> dict[str, Any]:
    """What a rerun needs beyond `config.yaml`: seed, versions, commit, command line and hardware."""
    info: dict[str, Any] = {
        "command": ["python", *(sys.argv if command is None else command)],
        "subcommand": stage,
        "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # seed_everything exports the seed it used; `seed_everything: true` draws one, recorded here.
        "seed": int(os.environ["PL_GLOBAL_SEED"]) if "PL_GLOBAL_SEED" in os.environ else seed,
        "resumed_from": None if ckpt_path is None else str(ckpt_path),
        "git": git_state(Path(__file__).resolve().parent),
        "python": platform.python_version(),
        # torch's own version string carries its build (e.g. "+cu132", "+cpu"); the metadata one does not.
        "packages": {name: torch.__version__ if name == "torch" else _version(name) for name in PACKAGES},
        "platform": platform.platform(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "devices": {"accelerator": type(trainer.accelerator).__name__, "strategy": type(trainer.strategy).__name__,
                    "num_nodes": trainer.num_nodes, "world_size": trainer.world_size,
                    "precision": str(trainer.precision)},
    }
    if torch.cuda.is_available() and trainer.root_device.type == "cuda":
        info["devices"]["gpu"] = torch.cuda.get_device_name(trainer.root_device)
    return info


def git_state(folder: Path) -> dict[str, Any] | None:
    """`{"commit", "dirty"}` of the git checkout holding `folder`, or None outside one (or without git)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
