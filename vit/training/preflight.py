"""Every check made before a run starts (the pre-flight), and where `--ckpt_path` leads.

Everything here runs before any run folder exists, so a failure costs nothing. In the order the
command line makes them:

1. right after parsing: `--ckpt_path last` resolved to a file and a resumed run to its own folder
   (`resolve_resume`); the checkpoint's recorded settings against the ones typed
   (`check_given_config`), before LightningCLI lets the checkpoint's values replace them;
2. once the model and trainer exist: for `fit`, the trainer's optimisation settings
   (`check_trainer_options`); the checkpoint against the model, its weights and its number of
   processes (`check_checkpoint`); the loggers' save folders (`check_writable`); one training
   image through the model (`forward_one_image`).

Reading a checkpoint file safely (`read_checkpoint`) is I/O and lives in `vit.training.checkpointing`.

What a checkpoint may override of the config a user typed: LightningCLI reads a checkpoint's
hyperparameters (`model.*`) into the config before it builds anything, so without a check a value
typed on the command line or in a `--config` is silently replaced by the checkpoint's. For values
the user set (that differ from the default) and that differ from the checkpoint's:

- the backbone (its class and every `init_args` value) must match, for every subcommand: the
  weights are that architecture, and evaluating or resuming another one is not what was asked;
- the optimisation settings (`model.lr`, `weight_decay`, ...) must match for `fit`, which resumes
  the run as it was (its optimizer and schedule state come from the checkpoint); for `validate`,
  `test` and `predict` they do not matter, and one warning line lists them;
- for `fit`, the data module's settings must match too (batch size, dataset size, seed, ...; not
  where the files are or how many loader workers read them): they define where in the data the
  run is, and a different batch size would skip or repeat part of the epoch. The number of
  processes must also be the same (`check_checkpoint`).

A value left at its default takes the checkpoint's silently: that is how `--ckpt_path` is meant
to be used.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from vit.checks import check_float, check_int
from vit.models.pretrained import PretrainedError, check_layout
from vit.training.callbacks import NonFiniteError, check_finite_weights
from vit.training.checkpointing import (
    CheckpointError,
    find_last_checkpoint,
    read_checkpoint,
    remove_partial_writes,
)
from vit.training.rebuild import BACKBONES

# Data settings that say where and how fast the data are read, not which data: free to change on resume.
NOT_THE_RUN = frozenset({"data_dir", "root", "download", "num_workers", "pin_memory", "persistent_workers"})


class ConfigError(ValueError):
    """A configuration value or command-line argument that cannot work, found before any work starts."""


# --- Where --ckpt_path leads -----------------------------------------------------------------------


def is_local_file(ckpt_path) -> bool:
    """False for None and for the names Lightning resolves itself to a checkpoint of the trainer ("best", "last", "hpc")."""
    return ckpt_path is not None and str(ckpt_path) not in ("best", "last", "hpc")


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


# --- The checkpoint's settings against the ones given (right after parsing) ------------------------


def check_given_config(subcommand: str, config, checkpoint: dict, model_class: type, ckpt_path) -> list[str]:
    """Raise `CheckpointError` for settings that must match (module docstring); return the warning lines for the rest."""
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
        if ours.get("class_path") != theirs["class_path"]:
            errors.append(f"model.backbone.class_path: {theirs['class_path']} in the checkpoint vs {ours.get('class_path')} given")
        else:
            defaults = _defaults(theirs["class_path"])
            given_args = ours.get("init_args") or {}
            for key, value in (theirs.get("init_args") or {}).items():
                if key == "pretrained":  # where the weights started from: the checkpoint's replace them
                    continue
                if key in given_args and _differs(given_args[key], value, defaults.get(key, inspect.Parameter.empty)):
                    errors.append(f"model.backbone.init_args.{key}: {value!r} in the checkpoint vs {given_args[key]!r} given")
    defaults = {k: p.default for k, p in inspect.signature(model_class).parameters.items()}
    for key, value in hparams.items():
        if key == "backbone" or key.startswith("_") or key not in given_model:
            continue
        if _differs(given_model[key], value, defaults.get(key, inspect.Parameter.empty)):
            line = f"model.{key}: {value!r} in the checkpoint vs {given_model[key]!r} given"
            (errors if subcommand == "fit" else warnings).append(line)
    if subcommand == "fit":
        theirs_data = {k: v for k, v in (checkpoint.get("datamodule_hyper_parameters") or {}).items() if not k.startswith("_")}
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


# --- The checkpoint against the model (once it is built) -------------------------------------------


def check_checkpoint(path: str | os.PathLike, model: nn.Module, *, subcommand: str, world_size: int = 1) -> dict[str, Any]:
    """Read `path` and check that `model` can load it, and for `fit` resume from it; return the checkpoint.

    Raises `CheckpointError` naming the file and what is wrong: the backbone class or its
    hyperparameters when the checkpoint recorded them (e.g. "num_classes=10 ... num_classes=2"),
    else the parameters whose names or shapes differ; weights only, for `fit`; not written by
    Lightning; NaN or infinite weights. `ConfigError` when `fit` would resume mid-epoch with
    another number of processes than the checkpoint was written with.
    """
    checkpoint = read_checkpoint(path)
    theirs, ours = _in_backbone_layout(checkpoint["state_dict"], model, path), model.state_dict()
    missing = sorted(ours.keys() - theirs.keys())
    unexpected = sorted(theirs.keys() - ours.keys())
    reshaped = sorted(k for k in ours.keys() & theirs.keys() if tuple(ours[k].shape) != tuple(theirs[k].shape))
    if missing or unexpected or reshaped:
        details = [f"{k} {tuple(theirs[k].shape)} in the checkpoint, {tuple(ours[k].shape)} here" for k in reshaped[:3]]
        details += [f"{k} missing from the checkpoint" for k in missing[:3]]
        details += [f"{k} not in this model" for k in unexpected[:3]]
        why = _hparams_difference(checkpoint.get("hyper_parameters", {}), getattr(model, "hparams", {}))
        shared = len(ours.keys() & theirs.keys())
        if not why and shared < len(theirs) / 2:
            why = f"it holds another architecture: only {shared} of its {len(theirs)} tensors have names this model uses"
        raise CheckpointError(
            f"checkpoint {path} does not fit this config: "
            + (f"{why}. " if why else "")
            + f"Tensors that differ ({len(missing) + len(unexpected) + len(reshaped)}): {'; '.join(details)}"
        )
    if subcommand == "fit" and not checkpoint.get("optimizer_states"):
        raise CheckpointError(
            f"checkpoint {path} holds weights only (no optimizer or loop state), so `fit` cannot resume from it; "
            "it can still be used by validate, test and predict"
        )
    if subcommand == "fit" and any("lr_lambdas" in s for s in checkpoint.get("lr_schedulers") or [] if isinstance(s, dict)):
        # Written before the schedule became torch's LinearLR + CosineAnnealingLR (and timm's
        # parameter groups, in another order): its optimizer and schedule states do not load.
        raise CheckpointError(
            f"checkpoint {path} was written by an earlier version of this project (a LambdaLR schedule), whose "
            "optimizer and schedule states this version cannot continue; validate, test and predict can use it, "
            "or fine-tune from its weights in a new run"
        )
    if "pytorch-lightning_version" not in checkpoint:
        raise CheckpointError(
            f"checkpoint {path} is not a checkpoint of this project: Lightning did not write it (no "
            "'pytorch-lightning_version'). A plain state dict can be loaded in Python with "
            "`model.load_state_dict(...)`"
        )
    try:
        check_finite_weights(checkpoint["state_dict"], int(checkpoint.get("global_step", 0)))
    except NonFiniteError as err:
        raise CheckpointError(f"checkpoint {path} is unusable: {err}".replace(
            "; the checkpoint was not written, so the last one on disk is still a good one", "")) from err
    if subcommand == "fit":
        _check_same_world_size(checkpoint, path, world_size)
    return checkpoint


def _in_backbone_layout(state: dict, model: nn.Module, path) -> dict:
    """`state` with its `backbone.*` keys as the backbone's `load_state_dict` will see them (`check_layout`: an
    older MAP head renamed), or `CheckpointError` saying which option loads a norm on the other side of the pooling."""
    backbone = getattr(model, "backbone", None)
    if not hasattr(backbone, "use_fc_norm"):
        return state
    inner = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
    try:
        fixed = check_layout(inner, backbone)
    except PretrainedError as err:
        raise CheckpointError(f"checkpoint {path} does not fit this config: {err}") from None
    if fixed is inner:
        return state
    return {**{k: v for k, v in state.items() if not k.startswith("backbone.")},
            **{f"backbone.{k}": v for k, v in fixed.items()}}


def _check_same_world_size(checkpoint: dict, ckpt_path, world_size: int) -> None:
    """Resuming mid-epoch needs the number of processes the checkpoint was written with."""
    for state in checkpoint.values():
        if isinstance(state, dict) and "train_position" in state and "world_size" in state:
            if state["world_size"] != world_size:
                raise ConfigError(
                    f"checkpoint {ckpt_path} was written by {state['world_size']} process(es) and this run has "
                    f"{world_size}: each process's share of the epoch differs, so the run cannot continue where it "
                    f"stopped. Resume with {state['world_size']} process(es) (trainer.devices x trainer.num_nodes)"
                )


def _hparams_difference(saved: dict, current: dict) -> str:
    """'it was trained with A, this config has B' for the backbone's class and hyperparameters, or ''."""
    before, now = _backbone_config(saved), _backbone_config(current)
    if before is None or now is None:
        return ""
    if before[0] != now[0]:
        return f"it was trained with backbone {before[0]}, this config has {now[0]}"
    keys = [k for k in before[1] if k in now[1] and _plain(before[1][k]) != _plain(now[1][k])]
    if not keys:
        return ""
    then = ", ".join(f"{k}={before[1][k]!r}" for k in keys)
    here = ", ".join(f"{k}={now[1][k]!r}" for k in keys)
    return f"checkpoint trained with {then}, this config has {here}"


def _backbone_config(hparams) -> tuple[str, dict] | None:
    """`(class_path, init_args)` of the backbone recorded by LightningCLI, or None."""
    backbone = dict(hparams).get("backbone") if hparams else None
    if backbone is None or isinstance(backbone, nn.Module):
        return None
    backbone = dict(backbone)
    if "class_path" not in backbone:
        return None
    return str(backbone["class_path"]), dict(backbone.get("init_args") or {})


# --- The trainer's optimisation settings ---------------------------------------------------------


def check_trainer_options(trainer) -> None:
    """Raise `ConfigError` for the `fit` settings the Trainer takes without a check.

    `accumulate_grad_batches=0` divides by zero once training starts (a traceback, a run folder
    already made), and a negative `gradient_clip_val` turns clipping off without a word, as 0 does.
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
