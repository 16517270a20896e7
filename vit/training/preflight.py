"""Every check made before a run starts (the pre-flight), and where `--ckpt_path` leads.

With `--ckpt_path` the model is the checkpoint's: a value left at its default takes the checkpoint's, one set that
differs is checked. The backbone must match for every subcommand; the model's and data module's settings (except
`NOT_THE_RUN`) must match for `fit`, which resumes the run; for the others one warning lists the model's."""

from __future__ import annotations

import inspect
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from vit.checks import CheckpointError, check_float, check_int, check_size
from vit.data.base import SplitDataModule
from vit.messages import first_line
from vit.registry import BACKBONES, DATA_MODULES, check_arguments, check_backbone, data_module
from vit.training.run_dir import find_last_checkpoint, remove_partial_writes, version_dir

# Data settings that say where and how fast the data are read, not which data: free to change on resume.
HPC_CHECKPOINT = re.compile(r"hpc_ckpt_(\d+)\.ckpt")  # what Lightning's SLURM connector saves on SIGUSR1
NOT_THE_RUN = frozenset({"data_dir", "root", "download", "num_workers", "pin_memory", "persistent_workers"})


class ConfigError(ValueError):
    """A configuration value or command-line argument that cannot work, found before any work starts."""


def as_config_error(check, *args, hint: str = "", **kwargs) -> None:
    """Run a `vit.checks` check; its `ValueError` (followed by `hint`) is raised as a `ConfigError`."""
    try:
        check(*args, **kwargs)
    except ValueError as err:
        raise ConfigError(f"{err}{hint}") from None


def is_local_file(ckpt_path) -> bool:
    """False for None and for the names Lightning resolves itself ("best", "last", "hpc")."""
    return ckpt_path is not None and str(ckpt_path) not in ("best", "last", "hpc")


def resolve_hpc(subcommand: str, config) -> None:
    """Turn `--ckpt_path hpc`, and SLURM's requeue (no `--ckpt_path`, or `last` with no last.ckpt, under SLURM),
    into the newest `hpc_ckpt_N.ckpt` of `trainer.default_root_dir`, as Lightning would: the file then passes the
    checks of any other `--ckpt_path`. `best` names a checkpoint of a `fit` in the same process: refused here."""
    ckpt_path = config.get("ckpt_path")
    if ckpt_path == "best":
        raise ConfigError(
            f"--ckpt_path best is the best checkpoint of a fit in the same process, and {subcommand} "
            "starts a new one: pass the checkpoint's file (runs/<name>/version_N/checkpoints/...)"
        )
    folder = Path(config.get("trainer", {}).get("default_root_dir") or os.getcwd())
    if ckpt_path == "hpc" or (ckpt_path is None and SLURMEnvironment.detect()):
        found = hpc_checkpoint(folder)
        if found is None and ckpt_path == "hpc":
            raise ConfigError(
                f"--ckpt_path hpc: there is no hpc_ckpt_N.ckpt in {folder} (trainer.default_root_dir, "
                "where Lightning saves SLURM's requeue checkpoints)"
            )
        if found is not None:
            rank_zero_info(f"Restoring SLURM's requeue checkpoint {found}")
            config.ckpt_path = str(found)


def hpc_checkpoint(folder: Path) -> Path | None:
    """The `hpc_ckpt_N.ckpt` of largest N in `folder` (Lightning's requeue checkpoint), or None."""
    numbered = [(int(m.group(1)), p) for p in folder.glob("hpc_ckpt_*.ckpt") if (m := HPC_CHECKPOINT.fullmatch(p.name))]
    return max(numbered, default=(None, None))[1]


def resolve_resume(subcommand: str, config) -> None:
    """Turn `--ckpt_path last` into the newest `last.ckpt` under the logger's `save_dir/name/*/checkpoints/` (or the
    configured version's); `fit` from a run's newest `last.ckpt`, with no version set, continues in that run's folder,
    from an older checkpoint in a new one. Only a single TensorBoard or CSV logger is handled."""
    ckpt_path, logger = config.get("ckpt_path"), config.get("trainer", {}).get("logger")
    # None, `false` or a list of several loggers is not one logger's config
    class_path = str(logger.get("class_path") or "") if isinstance(logger, Namespace) else ""
    if ckpt_path is None or not class_path.endswith(("TensorBoardLogger", "CSVLogger")) or not logger.get("init_args"):
        return
    logger = logger.init_args
    root = Path(logger.save_dir) / (logger.get("name", "lightning_logs") or "")  # both loggers' default name
    version = logger.get("version")
    if ckpt_path == "last":
        runs = "*" if version is None else version_dir(version)
        search = root / runs / "checkpoints"
        if (last := find_last_checkpoint(root, runs=runs)) is None:
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
        rank_zero_info(
            f"{ckpt_path} is not the newest last.ckpt of {run_dir}, which is left as it is; "
            "training continues from it in a new run folder"
        )


def check_given_config(subcommand: str, config, checkpoint: dict, model_class: type, ckpt_path) -> list[str]:
    """Raise `CheckpointError` for settings that must match (module docstring); return warnings for the rest."""
    errors, warnings = config_differences(subcommand, config, checkpoint, model_class)
    if errors:
        why = (
            "fit resumes the run as it was trained"
            if subcommand == "fit"
            else f"{subcommand} evaluates the architecture the checkpoint's weights belong to"
        )
        raise CheckpointError(
            f"checkpoint {ckpt_path} was made with other settings than the ones given ({why}): "
            f"{'; '.join(errors)}. Drop these options (or the --config that sets them) to use the "
            "checkpoint's values, or start a new run"
        )
    return warnings


def config_differences(subcommand: str, config, checkpoint: dict, model_class: type) -> tuple[list[str], list[str]]:
    """`(errors, warnings)`: one `key: checkpoint value vs given value` line per differing setting."""
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    errors, warnings, given_model = [], [], _plain(config.get("model")) or {}
    theirs, ours = hparams.get("backbone"), given_model.get("backbone")
    if isinstance(theirs, dict) and isinstance(ours, dict) and "class_path" in theirs:
        cls = BACKBONES.get(theirs["class_path"])  # a checkpoint's class path is only looked up, never imported
        if BACKBONES.get(ours.get("class_path"), ours.get("class_path")) is not cls:
            errors.append(
                f"model.backbone.class_path: {theirs['class_path']} in the checkpoint vs {ours.get('class_path')} given"
            )
        else:  # not `pretrained`: the checkpoint's weights replace it
            errors += _differences(
                "model.backbone.init_args.",
                theirs.get("init_args") or {},
                ours.get("init_args") or {},
                cls,
                skip={"pretrained"},
            )
    model = _differences("model.", hparams, given_model, model_class, skip={"backbone"})
    (errors if subcommand == "fit" else warnings).extend(model)
    if subcommand == "fit":
        ours_data = _plain(config.get("data")) or {}
        their_class = (checkpoint.get("datamodule_hyper_parameters") or {}).get("_class_path")
        our_class = ours_data.get("class_path") if isinstance(ours_data, dict) else None
        known = {their_class, our_class} <= DATA_MODULES.keys()
        if (
            their_class is not None
            and our_class is not None
            and not (their_class == our_class or (known and data_module(their_class) is data_module(our_class)))
        ):
            # Its data position (the images it has seen) is the position in another data set.
            errors.append(f"data.class_path: {their_class} in the checkpoint vs {our_class} given")
        ours_data = ours_data.get("init_args", ours_data) if isinstance(ours_data, dict) else {}
        errors += _differences(
            "data.", checkpoint.get("datamodule_hyper_parameters") or {}, ours_data, skip=NOT_THE_RUN
        )
    return errors, warnings


def _differences(prefix: str, recorded: dict, given: dict, cls: type | None = None, skip=()) -> list[str]:
    """A line per key of `recorded` given another value; a value given that is `cls`'s default does not count."""
    defaults = {} if cls is None else {k: p.default for k, p in inspect.signature(cls).parameters.items()}
    return [
        f"{prefix}{key}: {value!r} in the checkpoint vs {given[key]!r} given"
        for key, value in recorded.items()
        if key in given
        and key not in skip
        and not key.startswith("_")
        and _plain(given[key]) != _plain(value)
        and (key not in defaults or _plain(given[key]) != _plain(defaults[key]))
    ]  # a default: the checkpoint's


def _plain(value: Any) -> Any:
    """Namespaces as dicts and tuples as lists, so YAML values and Python values compare equal."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def check_data_fits(source: str, backbone_args: dict, datamodule) -> None:
    """Raise `ConfigError` when the data module's images or classes are not the ones the model of `source` (its
    backbone built with `backbone_args`) takes."""
    for name in ("num_classes", "in_chans", "img_size"):
        # the data link's names (train.py): a user's data module gives those it has
        ours, theirs = getattr(datamodule, name, None), backbone_args.get(name)
        if ours is None or theirs is None:
            continue
        if name == "img_size":
            ours, theirs = list(check_size("data.img_size", ours)), list(check_size("img_size", theirs))
        if ours != theirs:
            raise ConfigError(
                f"{_named(source)} does not fit this config: its model was trained with "
                f"{name}={theirs!r}, the data module gives {name}={ours!r}"
            )


MAX_RUN_CONFIG_BYTES = 2**20  # a run's config.yaml is a few KB


def run_record(ckpt_path: str) -> dict | None:
    """What the run of `ckpt_path` (`<run>/checkpoints/<file>`) was made with, from its `config.yaml`, shaped as
    Lightning records hyperparameters (`hyper_parameters`, `datamodule_hyper_parameters`); None for SLURM's requeue
    checkpoint, which the same command restores. A URL or a checkpoint outside a run folder is refused."""
    import yaml

    if "://" in ckpt_path:
        raise CheckpointError(
            f"--ckpt_path {ckpt_path} is a URL: fit resumes a run from its own folder; to start from "
            "a model, give its model folder as --model.pretrained"
        )
    path = Path(ckpt_path).resolve()
    if HPC_CHECKPOINT.fullmatch(path.name):
        return None
    config = path.parent.parent / "config.yaml"
    if path.parent.name != "checkpoints" or not config.is_file():
        raise CheckpointError(
            f"--ckpt_path {ckpt_path} is not in a run folder (<run>/checkpoints/ beside "
            "<run>/config.yaml): fit resumes a run from its own config; to start from its model, "
            "give the model folder beside it as --model.pretrained"
        )
    with open(config, "rb") as f:
        text = f.read(MAX_RUN_CONFIG_BYTES + 1)
    try:
        recorded = yaml.safe_load(text) if len(text) <= MAX_RUN_CONFIG_BYTES else None
    except yaml.YAMLError as err:
        raise CheckpointError(f"{config} is not valid YAML: {first_line(err)}") from None
    model, data = (recorded or {}).get("model"), (recorded or {}).get("data")
    if not isinstance(model, dict) or not isinstance(data, dict) or not isinstance(data.get("init_args", {}), dict):
        raise CheckpointError(f"{config} does not record the run's model and data (model:, data: class_path)")
    hparams = {"_class_path": data.get("class_path"), **(data.get("init_args") or {})}
    return {"hyper_parameters": model, "datamodule_hyper_parameters": hparams, "source": str(config)}


def _named(source: str) -> str:
    """How a message names a model's source: a checkpoint file as `checkpoint <path>`, a model folder by its path."""
    return f"checkpoint {source}" if source.endswith(".ckpt") or "://" in source else f"model folder {source}"


def record_model(config, recorded: dict) -> None:
    """Write the run's model (`run_record`), checked, into this command's config: the run continues as it was made.
    Only registered backbones with arguments of their constructor's types are taken (`vit.registry`)."""
    from vit.training.classifier import ImageClassifier

    model = dict(recorded["hyper_parameters"])
    cls, args = check_backbone(model.pop("backbone", None), "model.backbone")
    settings = check_arguments(ImageClassifier, {k: v for k, v in model.items() if not k.startswith("_")}, "model")
    given = config.model.get("backbone")
    if isinstance(given, Namespace) and given.get("init_args") is not None:
        # The sizes linked from the data (num_classes, in_chans, img_size) are not in config.yaml: they stay linked.
        args = {**given.init_args.as_dict(), **args}
    record_backbone(config, {"class_path": f"{cls.__module__}.{cls.__name__}", "init_args": args})
    for key, value in settings.items():
        config.model[key] = value


def record_backbone(config, backbone: dict) -> None:
    """Write a model's backbone (`{"class_path", "init_args"}`, checked) into the run's config."""
    config.model.backbone = Namespace(class_path=backbone["class_path"], init_args=Namespace(**backbone["init_args"]))


def check_trainer_options(trainer) -> None:
    """Refuse what the Trainer takes unchecked: `accumulate_grad_batches` < 1, a negative `gradient_clip_val`."""
    as_config_error(
        check_int,
        "trainer.accumulate_grad_batches",
        trainer.accumulate_grad_batches,
        1,
        hint=" (1: a step after every batch)",
    )
    if trainer.gradient_clip_val is not None:
        as_config_error(
            check_float, "trainer.gradient_clip_val", trainer.gradient_clip_val, 0, hint=" (0 or null: no clipping)"
        )


def check_writable(folder: Path, option: str) -> None:
    """Raise `ConfigError` unless `folder` can be created and a file written in it; nothing is left behind."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option}={str(folder)!r} cannot be created: {existing} is a file, not a folder")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise ConfigError(f"{option}={str(folder)!r} cannot be written: {existing}: {err.strerror or err}") from err


def forward_one_image(model, datamodule) -> None:
    """One training image through the backbone (eager, eval mode, no gradient), so a shape or type error shows now;
    for this project's data modules (a user's own LightningDataModule declares no training split to read)."""
    if not isinstance(datamodule, SplitDataModule) or datamodule.missing_files():
        return  # missing files: prepare_data downloads them first, in the right process
    datamodule.setup("fit")
    dataset = datamodule.train_set
    if dataset is None or len(dataset) == 0:
        return
    backbone, was_training = model.backbone, model.backbone.training
    try:
        with torch.no_grad():
            backbone.eval()
            backbone.forward(dataset[0][0][None])  # .forward: not the compiled call, which would compile now
    finally:
        backbone.train(was_training)
