"""Recording attention maps: `with record_attention(model) as maps: model(x)`.

`model(x)` always returns logits. While the context is open, every `Attention` module in `model` takes its
explicit path (`softmax(f(Q, K) + M)`, the weights materialised) and appends its weights `(B, H, M, N)` to
`maps`, in call order: the blocks first to last, then, for `pool="map"`, the pooling query's `(B, H, 1, P)`
over the P patch tokens. The maps stay in the autograd graph, so gradients with respect to them can be taken
(gradient rollout, Chefer et al.). Like lucidrains' `Recorder` and timm's attention hooks, without wrapping
or patching the model: any module with a `recorder` attribute (None when idle) is recorded, so an attention
layer of your own takes part by appending its weights to `self.recorder` when it is a list.

Activation checkpointing (`set_grad_checkpointing`) is off while recording and back on after: a checkpointed
block runs its attention again in the backward pass, which inside the context records every map twice and
after it takes the fused path, whose saved tensors differ, so the backward pass fails. Recording is for
explanation-sized batches, where the memory checkpointing saves is not needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def record_attention(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Yield a list that fills with the attention weights of every attention layer in `model` it calls.

    Recording the same model twice at once is refused (the inner context would steal the outer
    one's maps). A model without attention layers (a CNN) records nothing: the list stays empty.
    """
    layers = [m for m in model.modules() if hasattr(m, "recorder")]
    if any(layer.recorder is not None for layer in layers):
        raise RuntimeError("record_attention is already recording this model; nested recording is not supported")
    checkpointed = [m for m in model.modules() if getattr(m, "grad_checkpointing", False) is True]
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
