"""Recording attention maps: `with record_attention(model) as maps: model(x)`.

Every `Recorded` layer (`vit.models.contract`) appends its weights `(B, H, M, N)`, in the autograd graph,
to `maps` in call order: the blocks first to last, then for `pool="map"` the pooling query's `(B, H, 1, P)`.
Activation checkpointing is off while recording: a checkpointed block would run its attention again in backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from vit.models.contract import Backbone, Recorded


@contextlib.contextmanager
def record_attention(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Yield a list that fills with the weights of every attention layer `model` calls (none for a CNN)."""
    layers = [m for m in model.modules() if isinstance(m, Recorded)]
    if any(layer.recorder is not None for layer in layers):
        raise RuntimeError("record_attention is already recording this model; nested recording is not supported")
    checkpointed = [m for m in model.modules() if isinstance(m, Backbone) and m.grad_checkpointing]
    maps: list[torch.Tensor] = []
    for layer in layers:
        layer.recorder = maps
    for module in checkpointed:
        module.grad_checkpointing = False
    try:
        yield maps
    finally:
        for layer in layers:
            layer.recorder = None
        for module in checkpointed:
            module.grad_checkpointing = True
