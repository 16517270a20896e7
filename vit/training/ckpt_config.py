"""What a checkpoint may override of the config a user typed, and what must match.

LightningCLI reads a checkpoint's recorded hyperparameters (`model.*`) into the config before it
builds anything, so without this check a value typed on the command line or in a `--config` is
silently replaced by the checkpoint's. The rule, for values the user set (that differ from the
default) and that differ from the checkpoint's:

- the backbone (its class and every `init_args` value) must match, for every subcommand: the
  weights are that architecture, and evaluating or resuming another one is not what was asked;
- the optimisation settings (`model.lr`, `weight_decay`, ...) must match for `fit`, which resumes
  the run as it was (its optimizer and schedule state come from the checkpoint); for `validate`,
  `test` and `predict` they do not matter, and one warning line lists them;
- for `fit`, the data module's settings must match too (batch size, dataset size, seed, ...; not
  where the files are or how many loader workers read them):
  they define where in the data the run is, and a different batch size would skip or repeat part
  of the epoch. The number of processes must also be the same (not recorded in the checkpoint:
  `run_info.json` has it).

A value left at its default takes the checkpoint's silently: that is how `--ckpt_path` is meant
to be used.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from vit.training.checkpointing import CheckpointError

# Data settings that say where and how fast the data are read, not which data: free to change on resume.
NOT_THE_RUN = frozenset({"data_dir", "root", "download", "num_workers", "pin_memory", "persistent_workers"})


def differences(subcommand: str, config, checkpoint: dict, model_class: type) -> tuple[list[str], list[str]]:
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


def check(subcommand: str, config, checkpoint: dict, model_class: type, ckpt_path) -> list[str]:
    """Raise `CheckpointError` for settings that must match; return the warning lines for the rest."""
    errors, warnings = differences(subcommand, config, checkpoint, model_class)
    if errors:
        why = ("fit resumes the run as it was trained" if subcommand == "fit"
               else f"{subcommand} evaluates the architecture the checkpoint's weights belong to")
        raise CheckpointError(
            f"checkpoint {ckpt_path} was made with other settings than the ones given ({why}): " + "; ".join(errors)
            + ". Drop these options (or the --config that sets them) to use the checkpoint's values, or start a new run"
        )
    return warnings


def _differs(given: Any, recorded: Any, default: Any) -> bool:
    given, recorded = _plain(given), _plain(recorded)
    if given == recorded:
        return False
    return default is inspect.Parameter.empty or given != _plain(default)  # a default leaves it to the checkpoint


def _defaults(class_path: str) -> dict[str, Any]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return {}
    return {k: p.default for k, p in inspect.signature(cls).parameters.items()}


def _plain(value: Any) -> Any:
    """Namespaces as dicts and tuples as lists, so YAML values and Python values compare equal."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
