"""What a checkpoint says of its training, for the model card `vit.export` writes (`training_record`): run facts,
the model's settings and the monitored scores, as plain JSON values."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def training_record(checkpoint: Mapping) -> dict:
    """What a checkpoint says of its training, for a model card: run facts, `model` settings, `metrics` (finite
    monitored scores). Only strings, ints, floats, bools and lists of those: config.json is strict JSON."""
    data = checkpoint.get("datamodule_hyper_parameters") or {}
    hparams = checkpoint.get("hyper_parameters") or {}
    facts = {
        "data_module": data.get("_class_path"),
        "dataset": data.get("dataset"),
        "seed": data.get("seed"),
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "pretrained": hparams.get("pretrained"),
    }
    record = {key: value for key, value in facts.items() if type(value) in (str, int)}
    settings = {k: v for k, v in hparams.items() if not k.startswith("_") and k != "backbone" and _json(v)}
    if settings:
        record["model"] = settings
    metrics = {}
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, Mapping) and isinstance(state.get("monitor"), str):
            for key, label in (("best_model_score", "best"), ("current_score", "at this checkpoint")):
                score = state.get(key)
                score = score.item() if isinstance(score, torch.Tensor) and score.numel() == 1 else score
                if isinstance(score, float) and math.isfinite(score):
                    metrics[f"{state['monitor']} ({label})"] = score
    if metrics:
        record["metrics"] = metrics
    return record


def _json(value: Any) -> bool:
    """Whether `value` is a plain JSON value: a str, an int, a finite float, a bool, or a list of those."""
    if isinstance(value, list):
        return all(_json(v) for v in value)
    return isinstance(value, (str, int, bool)) or (isinstance(value, float) and math.isfinite(value))
