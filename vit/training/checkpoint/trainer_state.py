"""The trainer state's part of the schema (loops, callbacks, optimizer, schedule, data position, gradient scaler),
checked for type and size by every door; `vit.training.checkpoint.resume` checks that it fits the run."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vit.training.checkpoint.values import CheckpointError, is_int, not_allowed, same_structure, shown, walk

# Lightning compares loop counters with float limits (max_steps, max_epochs): past 2^53 they lose their units. No
# run takes 2^31 steps.
MAX_COUNTER = 2**31 - 1
CHECKPOINT_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")  # ModelCheckpoint's state


def check_trainer_state(raw: Mapping, data_key: str | None) -> None:
    """The trainer state's outer types; its values are checked against the run by `resume.check_resume`."""
    for key, kind in (("loops", Mapping), ("callbacks", Mapping), ("optimizer_states", list),
                      ("lr_schedulers", list), ("MixedPrecision", Mapping)):
        if key in raw and not isinstance(raw[key], kind):
            raise CheckpointError(f"{key} is a {type(raw[key]).__name__}, not a {kind.__name__.lower()}")
    for i, state in enumerate(raw.get("optimizer_states") or []):
        if not isinstance(state, Mapping) or set(state) != {"state", "param_groups"}:
            raise CheckpointError(f"optimizer_states[{i}] is not a mapping of state and param_groups")
    for i, state in enumerate(raw.get("lr_schedulers") or []):
        if not isinstance(state, Mapping):
            raise CheckpointError(f"lr_schedulers[{i}] is a {type(state).__name__}, not a mapping")
    _counters(raw.get("loops", {}), "loops")
    for key, state in (raw.get("callbacks") or {}).items():
        if not isinstance(key, str):
            raise CheckpointError(f"callbacks has {shown(key)}, not a callback's state key")
        # The callbacks whose state names files or is replayed here are checked; any other (Timer, a user's own) is
        # plain data of bounded size (walked with the rest) that Lightning gives to the callback of that key the run
        # configured, as Lightning resumes it: a state no configured callback takes is never read.
        check = (_model_checkpoint if key.startswith("ModelCheckpoint{") else _early_stopping
                 if key.startswith("EarlyStopping{") else _rng if key.startswith("RestoreRNGState") else None)
        if check is not None:
            check(state, f"callbacks.{key}")
    if (key := data_key) in raw:  # the data module's own state, under its class name
        state = raw[key]
        if not isinstance(state, Mapping) or set(state) - {"train_position", "world_size"}:
            raise not_allowed(key, state, "train_position and world_size")
        if state:
            position, world = state.get("train_position"), state.get("world_size")
            if not (isinstance(position, Mapping) and set(position) == {"epoch", "batches_done"}
                    and all(is_int(v) for v in position.values())):
                raise not_allowed(f"{key}.train_position", position, "epoch and batches_done, ints >= 0")
            if not is_int(world, 1, 65_536):
                raise not_allowed(f"{key}.world_size", world, "an int >= 1")


def _counters(value: Any, key: str) -> None:
    """Lightning's loop state: mappings whose leaves are counters (ints >= 0) and flags (bools)."""
    for path, item in walk(value, key, tensors=False):
        if isinstance(item, Mapping):
            continue
        if not (isinstance(item, bool) or (isinstance(item, int) and 0 <= item <= MAX_COUNTER)):
            raise CheckpointError(f"{path}={shown(item)} is not allowed: expected a counter (an int in "
                                  f"[0, {MAX_COUNTER}]) or a flag")


def _score(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def _model_checkpoint(state: Any, key: str) -> None:
    expected = {"monitor", "best_model_score", "best_model_path", "current_score", "dirpath", "best_k_models",
                "kth_best_model_path", "kth_value", "last_model_path"}
    if not isinstance(state, Mapping) or not set(state) <= expected or "best_model_path" not in state:
        raise CheckpointError(f"{key} does not hold ModelCheckpoint's state")
    if not isinstance(state.get("monitor"), (str, type(None))):
        raise not_allowed(f"{key}.monitor", state["monitor"], "a metric name")
    for name in ("best_model_score", "current_score", "kth_value"):
        if state.get(name) is not None and not _score(state[name]):
            raise not_allowed(f"{key}.{name}", state[name], "a score (one number)")
    best_k = state.get("best_k_models", {})
    if not isinstance(best_k, Mapping) or not all(_score(v) for v in best_k.values()):
        raise CheckpointError(f"{key}.best_k_models is not a mapping of checkpoint paths to scores")
    paths = checkpoint_paths(state)
    for name, path in paths.items():
        if path is not None and not isinstance(path, str):
            raise not_allowed(f"{key}.{name}", path, "a path")
        if path and "://" in path:
            raise CheckpointError(f"{key}.{name}={shown(path, 100)} is not allowed: a checkpoint's paths are local "
                                  "files of its run, never URLs")
    # ModelCheckpoint compares each new score with best_k_models[kth_best_model_path].
    if best_k and paths["kth_best_model_path"] not in best_k:
        raise CheckpointError(f"{key}.kth_best_model_path={shown(paths['kth_best_model_path'], 100)} is not one of "
                              "its best_k_models")


def checkpoint_paths(state: Mapping) -> dict[str, Any]:
    """ModelCheckpoint's paths in its `state`, by key: its `*_model_path`s, `dirpath`, `best_k_models[i]`."""
    paths = {name: state.get(name, "") for name in (*CHECKPOINT_PATHS, "dirpath")}
    return paths | {f"best_k_models[{i}]": p for i, p in enumerate(state.get("best_k_models", {}))}


def forget_paths(state: Mapping) -> dict:
    """`ModelCheckpoint`'s `state` with no file to track: the run that restores it tracks its own from there."""
    return {**state, **{name: "" for name in CHECKPOINT_PATHS if name in state}, "best_k_models": {}}


def without_checkpoint_paths(raw: Mapping) -> dict:
    """The checkpoint `raw` with every `ModelCheckpoint` state's paths forgotten (`forget_paths`)."""
    callbacks = {key: forget_paths(state) if key.startswith("ModelCheckpoint{") else state
                 for key, state in (raw.get("callbacks") or {}).items()}
    return {**raw, "callbacks": callbacks} if "callbacks" in raw else dict(raw)


def _early_stopping(state: Any, key: str) -> None:
    required = {"wait_count", "stopped_epoch", "patience", "best_score"}
    optional = {"stopping_reason", "stopping_reason_message"}  # written by Lightning 2.6
    if not isinstance(state, Mapping) or not required <= set(state) <= required | optional:
        raise CheckpointError(f"{key} does not hold EarlyStopping's state")
    counters = {"wait_count", "stopped_epoch", "patience", "stopping_reason"} & set(state)
    same_structure({k: state[k] for k in counters}, dict.fromkeys(counters, 0), key)
    if not isinstance(state.get("stopping_reason_message"), (str, type(None))):
        raise CheckpointError(f"{key}.stopping_reason_message is not a message")
    if not _score(state["best_score"]):
        raise CheckpointError(f"{key}.best_score is not a score (one number)")


def _rng(state: Any, key: str) -> None:
    reference = rng_states()
    if not isinstance(state, Mapping) or not set(reference) - {"cuda"} <= set(state) <= set(reference) | {"cuda"}:
        raise CheckpointError(f"{key} does not hold the torch, numpy and python random states")
    same_structure(state["torch"], reference["torch"], f"{key}.torch")
    numpy = state["numpy"]
    if not (isinstance(numpy, Mapping) and set(numpy) == set(reference["numpy"]) and numpy["kind"] == "MT19937"):
        raise CheckpointError(f"{key}.numpy is not numpy's MT19937 state")
    same_structure(numpy["keys"], reference["numpy"]["keys"], f"{key}.numpy.keys")
    if not (torch.all((numpy["keys"] >= 0) & (numpy["keys"] < 2**32))
            and isinstance(numpy["pos"], int) and 0 <= numpy["pos"] <= 624
            and type(numpy["has_gauss"]) is int and numpy["has_gauss"] in (0, 1)
            and isinstance(numpy["cached_gaussian"], float)):
        raise CheckpointError(f"{key}.numpy holds values outside MT19937's state")
    python = state["python"]
    ok = (isinstance(python, (list, tuple)) and len(python) == 3 and type(python[0]) is int and python[0] == 3
          and isinstance(python[1], (list, tuple)) and len(python[1]) == 625
          and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in python[1])
          and 1 <= python[1][-1] <= 624 and (python[2] is None or isinstance(python[2], float)))
    if not ok:
        raise CheckpointError(f"{key}.python is not Python's random state (version 3, 625 words)")
    if "cuda" in state and not (isinstance(state["cuda"], torch.Tensor) and state["cuda"].dtype == torch.uint8
                                and state["cuda"].ndim == 1):
        raise CheckpointError(f"{key}.cuda is not a CUDA generator state")


def rng_states() -> dict:
    """The global random-number states, as tensors and plain values (loadable with `weights_only=True`)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {"torch": torch.get_rng_state(),
              "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
              "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return states
