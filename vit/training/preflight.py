"""Checks made before a run starts (the pre-flight), and where `--ckpt_path` leads.

Everything here runs before any run folder exists, so a failure costs nothing: the checkpoint's
soundness and number of processes, the save directory, one training image through the model, and
the resolution of `--ckpt_path last` to a file and of a resumed run to its own folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from vit.training.callbacks import NonFiniteError, check_finite_weights
from vit.training.checkpointing import (
    CheckpointError,
    find_last_checkpoint,
    is_named_checkpoint,
    remove_partial_writes,
)


class ConfigError(ValueError):
    """A configuration value or command-line argument that cannot work, found before any work starts."""


def check_finite_weights_of(checkpoint: dict, ckpt_path) -> None:
    """A checkpoint whose weights hold NaN or infinity is refused by every subcommand."""
    try:
        check_finite_weights(checkpoint["state_dict"], int(checkpoint.get("global_step", 0)))
    except NonFiniteError as err:
        raise CheckpointError(f"checkpoint {ckpt_path} is unusable: {err}".replace(
            "; the checkpoint was not written, so the last one on disk is still a good one", "")) from err


def check_same_world_size(checkpoint: dict, ckpt_path, world_size: int) -> None:
    """Resuming mid-epoch needs the number of processes the checkpoint was written with."""
    for state in checkpoint.values():
        if isinstance(state, dict) and "train_position" in state and "world_size" in state:
            if state["world_size"] != world_size:
                raise ConfigError(
                    f"checkpoint {ckpt_path} was written by {state['world_size']} process(es) and this run has "
                    f"{world_size}: each process's share of the epoch differs, so the run cannot continue where it "
                    f"stopped. Resume with {state['world_size']} process(es) (trainer.devices x trainer.num_nodes)"
                )


def check_writable(folder: Path, option: str) -> None:
    """Raise `ConfigError` unless `folder` can be created and written; nothing is left behind.

    The deepest part of the path that exists must be a folder in which a file can be written.
    """
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option}={str(folder)!r} cannot be created: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ConfigError(f"{option}={str(folder)!r} cannot be written: {existing}: {err.strerror or err}") from err


def forward_one_image(model, datamodule) -> None:
    """One training image through the backbone (eager, eval mode, no gradient), so a shape or type error shows now."""
    if callable(getattr(datamodule, "missing_files", None)) and datamodule.missing_files():
        return  # prepare_data downloads them first, in the right process
    datamodule.setup("fit")
    dataset = getattr(datamodule, "train_set", None)
    if dataset is None or len(dataset) == 0:
        return
    x = dataset[0][0][None]  # (1, C, H, W)
    backbone = model.backbone
    was_training = backbone.training
    try:
        with torch.no_grad():
            backbone.eval()
            backbone.forward(x)  # .forward: not the compiled call, which would compile now
    finally:
        backbone.train(was_training)


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def is_local_file(ckpt_path) -> bool:
    """False for None and for the names Lightning resolves itself ("best", "last", "hpc")."""
    return ckpt_path is not None and not is_named_checkpoint(ckpt_path)


def resolve_resume(subcommand: str, config) -> None:
    """Turn `--ckpt_path last` into a file, and make `fit` from a checkpoint continue in that run's folder.

    A new run gets a new `version_N` folder, where Lightning's own "last" finds nothing. Here "last"
    is the newest `last.ckpt` under the logger's `save_dir/name/*/checkpoints/` (or under the
    version set in the config). When `fit` resumes from a checkpoint inside such a run folder and no
    version is set, and the checkpoint is that run's newest `last.ckpt`, the logger's version is set
    to that folder, so logs and checkpoints continue there; from an older checkpoint, training goes
    on in a new folder and the run is left as it is. Only loggers that lay runs out as
    `save_dir/name/version` (TensorBoard, CSV) are handled.
    """
    ckpt_path = config.get("ckpt_path")
    if ckpt_path is None:
        return
    logger = _logger_init_args(config)
    if logger is None:
        return
    root = Path(logger.save_dir) / (logger.get("name", "lightning_logs") or "")  # both loggers' default name
    version = logger.get("version")
    if ckpt_path == "last":
        runs = "*" if version is None else _version_dir(version)
        last = find_last_checkpoint(root, runs=runs)
        search = root / runs / "checkpoints"
        if last is None:
            if subcommand == "fit":
                rank_zero_warn(f"--ckpt_path last: no last.ckpt under {search}; starting a new run.")
                config.ckpt_path = None
                return
            raise ConfigError(f"--ckpt_path last: there is no last.ckpt under {search}")
        config.ckpt_path = ckpt_path = str(last)
    if subcommand != "fit" or version is not None or not is_local_file(ckpt_path):
        return
    run_dir = Path(ckpt_path).resolve().parent.parent  # <run>/checkpoints/<file>
    if run_dir.parent != root.resolve():
        return
    newest = find_last_checkpoint(root, runs=run_dir.name)
    if newest is not None and newest.resolve() == Path(ckpt_path).resolve():
        logger.version = run_dir.name
        remove_partial_writes(Path(ckpt_path).parent)
        rank_zero_info(f"Resuming the run in {run_dir} from {ckpt_path}")
    else:  # continuing there would overwrite what the run saved after this checkpoint
        rank_zero_info(f"{ckpt_path} is not the newest last.ckpt of {run_dir}, which is left as it is; "
                       "training continues from it in a new run folder")


def _logger_init_args(config):
    """The `init_args` of a single TensorBoardLogger / CSVLogger in the trainer config, else None."""
    logger = config.get("trainer", {}).get("logger")
    class_path = str(getattr(logger, "class_path", "") or "")
    if not class_path.endswith(("TensorBoardLogger", "CSVLogger")) or getattr(logger, "init_args", None) is None:
        return None
    return logger.init_args


def _version_dir(version) -> str:
    return version if isinstance(version, str) else f"version_{version}"
