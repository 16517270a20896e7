"""What `fit --ckpt_path` may restore of a run: the trainer state, checked against this run before it starts.
`check_resume` returns the dict Lightning restores from, each part compared with what this run writes: loop counters;
one AdamW state of this model's groups; the schedule; `ModelCheckpoint`'s paths only as files inside this run's
checkpoint folder (dropped in a new folder); the data position; the gradient scaler. Other callbacks are left out."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from vit.training.checkpoint.schema import Checkpoint
from vit.training.checkpoint.trainer_state import checkpoint_paths, forget_paths
from vit.training.checkpoint.values import CheckpointError, is_int, is_number, not_allowed, same_structure, shown
from vit.training.classifier import warmup_cosine_schedule

SCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
# Above these an AdamW step overflows float32 (a learning rate of 1e300 passes a finiteness check, then makes every
# weight inf at the first step); no recipe comes near them.
MAX_GROUP_VALUE = {"lr": 100.0, "initial_lr": 100.0, "eps": 1.0, "weight_decay": 100.0, "lr_scale": 100.0}


def check_resume(checkpoint: Checkpoint, trainer: L.Trainer, model: L.LightningModule, datamodule) -> dict:
    """The checkpoint's dict as `fit` may restore it (module doc), or `CheckpointError` naming the first bad key."""
    source = checkpoint.source
    if not checkpoint.raw.get("optimizer_states"):
        raise CheckpointError(f"checkpoint {source} holds weights only (no optimizer or loop state), so `fit` cannot "
                              "resume from it; it can still be used by validate, test and predict")
    raw = dict(checkpoint.raw)
    try:
        loops = {name: getattr(trainer, name).state_dict() for name in ("fit_loop", "validate_loop", "test_loop",
                                                                        "predict_loop")}
        same_structure(raw.get("loops"), loops, "loops")
        _epochs(raw["loops"], trainer.max_epochs)
        _optimizer(raw["optimizer_states"], model)
        _schedulers(raw.get("lr_schedulers") or [], model)
        raw["callbacks"] = _callbacks(raw.get("callbacks") or {}, trainer)
        _data_position(raw, datamodule, trainer.world_size)
        _scaler(raw.get("MixedPrecision"))
    except CheckpointError as err:
        raise CheckpointError(f"checkpoint {source} cannot be resumed: {err}") from None
    return raw


def _epochs(loops: Mapping, max_epochs: int | None) -> None:
    """Lightning refuses a restored epoch past `max_epochs` only after the run's files are written: refuse it now."""
    done = loops["fit_loop"]["epoch_progress"]["current"]["completed"]
    if max_epochs is not None and max_epochs != -1 and done > max_epochs:
        raise CheckpointError(f"it has trained {done} epoch(s) and trainer.max_epochs={max_epochs} is below that: "
                              f"pass --trainer.max_epochs above {done} to train on (or -1 for no limit)")


def _optimizer(states: list, model) -> None:
    reference = model.optimizer()
    if len(states) != 1:
        raise CheckpointError(f"optimizer_states holds {len(states)} optimizer states; this model trains with one")
    state, groups = states[0]["state"], states[0]["param_groups"]
    fresh = reference.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(fresh):
        raise CheckpointError(f"optimizer_states[0].param_groups holds {len(groups) if isinstance(groups, list) else 0}"
                              f" group(s); this model's optimizer has {len(fresh)} (another `trainable` or "
                              "`layer_decay`?)")
    params = [p for group in reference.param_groups for p in group["params"]]
    for i, (group, ref) in enumerate(zip(groups, fresh)):
        key = f"optimizer_states[0].param_groups[{i}]"
        if not isinstance(group, Mapping) or not set(ref) <= set(group) <= set(ref) | {"initial_lr"}:
            raise CheckpointError(f"{key} does not hold AdamW's settings")
        if not (isinstance(group["params"], list) and all(type(i) is int for i in group["params"])
                and group["params"] == ref["params"]):
            raise CheckpointError(f"{key}.params does not list this model's parameters (another architecture or "
                                  "`trainable`?)")
        for name in ("lr", "initial_lr", "eps", "weight_decay", "lr_scale"):
            above, high = name in ("eps", "lr_scale"), MAX_GROUP_VALUE.get(name, math.inf)
            if name in group and not (is_number(group[name], 0, above=above) and group[name] <= high):
                raise not_allowed(f"{key}.{name}", group[name], ("a number > 0" if above else "a number >= 0")
                                  + (f" and at most {high:g}" if high < math.inf else " (finite)"))
        betas = group["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(is_number(b, 0) and b < 1 for b in betas)):
            raise not_allowed(f"{key}.betas", betas, "two numbers in [0, 1)")
        for name in ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay"):
            if name in group and not isinstance(group[name], bool):
                raise not_allowed(f"{key}.{name}", group[name], "true or false")
        for name in ("foreach", "fused"):
            if not isinstance(group.get(name), (bool, type(None))):
                raise not_allowed(f"{key}.{name}", group[name], "true, false or null")
    if not isinstance(state, Mapping):
        raise CheckpointError("optimizer_states[0].state is not a mapping")
    for index, moments in state.items():
        key = f"optimizer_states[0].state.{index}"
        if not is_int(index, 0, len(params) - 1):
            raise CheckpointError(f"{key}: {shown(index)} is not the index of one of this model's "
                                  f"{len(params)} trained parameters")
        if not isinstance(moments, Mapping) or not {"step", "exp_avg", "exp_avg_sq"} <= set(moments) <= {
                "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}:
            raise CheckpointError(f"{key} does not hold AdamW's step and moments")
        step = moments["step"]
        if not isinstance(step, torch.Tensor) or step.numel() != 1 or not torch.isfinite(step).all() or step < 0:
            raise CheckpointError(f"{key}.step is not allowed: expected one finite number >= 0")
        for name in set(moments) - {"step"}:
            tensor, shape = moments[name], tuple(params[index].shape)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or not tensor.is_floating_point():
                raise CheckpointError(f"{key}.{name} is not a float tensor of its parameter's shape {shape}")
            if not torch.isfinite(tensor.to(params[index].dtype)).all():  # in the dtype the optimizer steps in
                raise CheckpointError(f"{key}.{name} holds NaN or infinite values (as {params[index].dtype})")


def _schedulers(states: list, model) -> None:
    if len(states) != 1:
        raise CheckpointError(f"lr_schedulers holds {len(states)} schedule state(s); this model has one")
    references = [warmup_cosine_schedule(model.optimizer(), warmup_steps=w, total_steps=4).state_dict() for w in (2, 0)]
    errors = []
    for reference in references:  # with a warmup (SequentialLR), or without (the cosine alone)
        try:
            same_structure(states[0], _floats_as_numbers(reference), "lr_schedulers[0]")
            return
        except CheckpointError as err:
            errors.append(str(err))
    raise CheckpointError(min(errors, key=len))


def _floats_as_numbers(reference: Any) -> Any:
    """A scheduler's reference state, its int-or-float values (`eta_min`, `start_factor`) read as floats."""
    if isinstance(reference, Mapping):
        return {k: _floats_as_numbers(v) for k, v in reference.items()}
    if isinstance(reference, list):
        return [_floats_as_numbers(v) for v in reference]
    if isinstance(reference, float):
        return 0.0
    return reference


def _callbacks(states: Mapping, trainer: L.Trainer) -> dict:
    ours = {callback.state_key: callback for callback in trainer.callbacks}
    kept = {}
    for key, state in states.items():  # each a state the schema knows, of the right types
        callback = ours.get(key)
        if callback is None:
            continue  # not in this run: Lightning would not restore it either
        if isinstance(callback, ModelCheckpoint):
            state = _model_checkpoint(state, callback, trainer, f"callbacks.{key}")
        kept[key] = state
    return kept


def _model_checkpoint(state: Any, callback: ModelCheckpoint, trainer: L.Trainer, key: str) -> dict:
    """The state with every path checked (module doc); paths are dropped when the run continues in a new folder."""
    paths = checkpoint_paths(state)  # types and URLs checked by the schema
    folder = _checkpoint_folder(callback, trainer)
    state = dict(state)
    if state.get("dirpath") is None or Path(state["dirpath"]).resolve() != folder:
        # Continued in a new folder: ModelCheckpoint keeps only best_model_path of another folder, and the test
        # after fit would read it. The new run tracks its own best checkpoints from here.
        return forget_paths(state)
    for name, path in paths.items():
        if name == "dirpath" or not path:
            continue
        resolved = Path(path).resolve()
        if folder not in resolved.parents or not resolved.is_file():
            raise CheckpointError(f"{key}.{name}={shown(path, 100)} is not allowed: it must be a checkpoint file "
                                  f"inside this run's checkpoint folder {folder}")
    return state


def _checkpoint_folder(callback: ModelCheckpoint, trainer: L.Trainer) -> Path:
    """Where `callback` writes in this run (ModelCheckpoint resolves it the same way when training starts)."""
    if callback.dirpath is not None:
        return Path(callback.dirpath).resolve()
    if trainer.loggers:
        logger = trainer.loggers[0]
        save_dir = logger.save_dir or trainer.default_root_dir
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        return Path(save_dir, str(logger.name), version, "checkpoints").resolve()
    return Path(trainer.default_root_dir, "checkpoints").resolve()


def _data_position(raw: dict, datamodule, world_size: int) -> None:
    key = type(datamodule).__qualname__ if datamodule is not None else None
    state = raw.get(key) if key else None
    if not state:
        return
    if state["world_size"] != world_size:
        raise CheckpointError(
            f"{key}.world_size: it was written by {state['world_size']} process(es) and this run has {world_size}: "
            "each process's share of the epoch differs, so the run cannot continue where it stopped. Resume with "
            f"{state['world_size']} process(es) (trainer.devices x trainer.num_nodes)")
    train_set, batch_size = getattr(datamodule, "train_set", None), datamodule.hparams.get("batch_size")
    if train_set is not None and isinstance(batch_size, int):  # set up by the pre-flight's forward pass
        share = math.ceil(len(train_set) / world_size)  # this process's samples in an epoch (DistributedSampler's)
        done = state["train_position"]["batches_done"]
        if done * batch_size > share:
            raise CheckpointError(f"{key}.train_position.batches_done={done} is past the end of the epoch: "
                                  f"{math.ceil(share / batch_size)} batches of {batch_size} hold its {share} images")


def _scaler(state: Any) -> None:
    if state is None:
        return
    if not isinstance(state, Mapping) or not set(state) <= SCALER_KEYS:
        raise CheckpointError(f"MixedPrecision={shown(state)} is not a gradient scaler's state")
    for name, value in state.items():
        if not is_number(value, 0):
            raise not_allowed(f"MixedPrecision.{name}", value, "a finite number >= 0")
