"""Every check made before a run starts (the pre-flight), and where `--ckpt_path` leads.

Everything here runs before any run folder exists, so a failure costs nothing. With `--ckpt_path`
the model is the checkpoint's: a value left at its default takes the checkpoint's silently (that is
how `--ckpt_path` is meant to be used), but one the user set that differs from it is checked:

- the backbone (its class and every `init_args` value) must match, for every subcommand: the
  weights are that architecture;
- the optimisation settings (`model.lr`, `weight_decay`, ...) must match for `fit`, which resumes
  the run's optimizer and schedule; for `validate`, `test` and `predict` one warning lists them;
- for `fit`, the data module's settings must match too (batch size, dataset size, seed, ...; not
  `NOT_THE_RUN`): they say where in the data the run is, and a different batch size would skip or
  repeat part of the epoch. The number of processes must also be the same (`check_resume`).
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from vit.checks import check_float, check_int, check_size
from vit.training.checkpoint import Checkpoint, CheckpointError
from vit.training.checkpoint.io import find_last_checkpoint, remove_partial_writes
from vit.training.checkpoint.schema import BACKBONES

# Data settings that say where and how fast the data are read, not which data: free to change on resume.
NOT_THE_RUN = frozenset({"data_dir", "root", "download", "num_workers", "pin_memory", "persistent_workers"})


class ConfigError(ValueError):
    """A configuration value or command-line argument that cannot work, found before any work starts."""


# --- Where --ckpt_path leads -----------------------------------------------------------------------


def is_local_file(ckpt_path) -> bool:
    """False for None and for the names Lightning resolves itself ("best", "last", "hpc")."""
    return ckpt_path is not None and str(ckpt_path) not in ("best", "last", "hpc")


def resolve_resume(subcommand: str, config) -> None:
    """Turn `--ckpt_path last` into a file, and make `fit` from a checkpoint continue in that run's folder.

    A new run gets a new `version_N` folder, where Lightning's own "last" finds nothing: here "last"
    is the newest `last.ckpt` under the logger's `save_dir/name/*/checkpoints/` (or the configured
    version's). `fit` from a run's newest `last.ckpt`, with no version set, continues in that run's
    folder; from an older checkpoint, in a new folder. Only loggers that lay runs out as
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


# --- The checkpoint's settings against the ones given (right after parsing) ------------------------


def check_given_config(subcommand: str, config, checkpoint: dict, model_class: type, ckpt_path) -> list[str]:
    """Raise `CheckpointError` for settings that must match (module docstring); return warnings for the rest."""
    errors, warnings = config_differences(subcommand, config, checkpoint, model_class)
    if errors:
        why = ("fit resumes the run as it was trained" if subcommand == "fit"
               else f"{subcommand} evaluates the architecture the checkpoint's weights belong to")
        raise CheckpointError(
            f"checkpoint {ckpt_path} was made with other settings than the ones given ({why}): " + "; ".join(errors)
            + ". Drop these options (or the --config that sets them) to use the checkpoint's values, or start a new run"
        )
    return warnings


def config_differences(subcommand: str, config, checkpoint: dict, model_class: type) -> tuple[list[str], list[str]]:
    """`(errors, warnings)`: one `key: checkpoint value vs given value` line per differing setting."""
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    errors, warnings = [], []
    given_model = _plain(config.get("model")) or {}
    theirs = hparams.get("backbone")
    ours = given_model.get("backbone")
    if isinstance(theirs, dict) and isinstance(ours, dict) and "class_path" in theirs:
        if BACKBONES.get(ours.get("class_path"), ours.get("class_path")) is not BACKBONES.get(theirs["class_path"]):
            errors.append(f"model.backbone.class_path: {theirs['class_path']} in the checkpoint "
                          f"vs {ours.get('class_path')} given")
        else:
            defaults = _defaults(theirs["class_path"])
            given_args = ours.get("init_args") or {}
            for key, value in (theirs.get("init_args") or {}).items():
                if key == "pretrained":  # where the weights started from: the checkpoint's replace them
                    continue
                if key in given_args and _differs(given_args[key], value, defaults.get(key, inspect.Parameter.empty)):
                    errors.append(f"model.backbone.init_args.{key}: {value!r} in the checkpoint "
                                  f"vs {given_args[key]!r} given")
    defaults = {k: p.default for k, p in inspect.signature(model_class).parameters.items()}
    for key, value in hparams.items():
        if key == "backbone" or key.startswith("_") or key not in given_model:
            continue
        if _differs(given_model[key], value, defaults.get(key, inspect.Parameter.empty)):
            line = f"model.{key}: {value!r} in the checkpoint vs {given_model[key]!r} given"
            (errors if subcommand == "fit" else warnings).append(line)
    if subcommand == "fit":
        theirs_data = {k: v for k, v in (checkpoint.get("datamodule_hyper_parameters") or {}).items()
                       if not k.startswith("_")}
        ours_data = _plain(config.get("data")) or {}
        ours_data = ours_data.get("init_args", ours_data) if isinstance(ours_data, dict) else {}
        for key, value in theirs_data.items():
            if key in NOT_THE_RUN:
                continue
            if key in ours_data and _plain(ours_data[key]) != _plain(value):
                errors.append(f"data.{key}: {value!r} in the checkpoint vs {ours_data[key]!r} given")
    return errors, warnings


def _differs(given: Any, recorded: Any, default: Any) -> bool:
    given, recorded = _plain(given), _plain(recorded)
    if given == recorded:
        return False
    return default is inspect.Parameter.empty or given != _plain(default)  # a default leaves it to the checkpoint


def _defaults(class_path: str) -> dict[str, Any]:
    cls = BACKBONES.get(class_path)  # a checkpoint's class path is never imported, only looked up
    return {} if cls is None else {k: p.default for k, p in inspect.signature(cls).parameters.items()}


def _plain(value: Any) -> Any:
    """Namespaces as dicts and tuples as lists, so YAML values and Python values compare equal."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# --- The checkpoint's model in this run (once the classes are built) -------------------------------


def check_data_fits(checkpoint: Checkpoint, datamodule) -> None:
    """Raise `ConfigError` when the data module's images or classes are not the ones the checkpoint's model takes."""
    args = checkpoint.backbone_args
    for name in ("num_classes", "in_chans", "img_size"):
        ours, theirs = getattr(datamodule, name, None), args.get(name)
        if ours is None or theirs is None:
            continue
        if name == "img_size":
            ours, theirs = list(check_size("data.img_size", ours)), list(check_size("img_size", theirs))
        if ours != theirs:
            raise ConfigError(f"checkpoint {checkpoint.source} does not fit this config: its model was trained with "
                              f"{name}={theirs!r}, the data module gives {name}={ours!r}")


def record_model(config, checkpoint: Checkpoint) -> None:
    """Write the checkpoint's model settings into the run's config (plain values), so config.yaml says what ran."""
    model = config.model
    model.backbone = Namespace(class_path=checkpoint.hyper_parameters["backbone"]["class_path"],
                               init_args=Namespace(**checkpoint.backbone_args))
    for key, value in checkpoint.settings.items():
        model[key] = value


# --- The trainer's optimisation settings ---------------------------------------------------------


def check_trainer_options(trainer) -> None:
    """Raise `ConfigError` for the `fit` settings the Trainer takes without a check.

    `accumulate_grad_batches=0` divides by zero once training starts, and a negative
    `gradient_clip_val` turns clipping off without a word, as 0 does.
    """
    try:
        check_int("trainer.accumulate_grad_batches", trainer.accumulate_grad_batches, 1)
    except ValueError as err:
        raise ConfigError(f"{err} (1: a step after every batch)") from None
    if trainer.gradient_clip_val is not None:
        try:
            check_float("trainer.gradient_clip_val", trainer.gradient_clip_val, 0)
        except ValueError as err:
            raise ConfigError(f"{err} (0 or null: no clipping)") from None


# --- The run's surroundings ------------------------------------------------------------------------


def check_writable(folder: Path, option: str) -> None:
    """Raise `ConfigError` unless `folder` can be created and a file written in it; nothing is left behind."""
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
