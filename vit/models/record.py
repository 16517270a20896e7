"""Recording attention maps: `with record_attention(model) as maps: model(x)`.

`model(x)` always returns logits. To look inside, wrap the call: while the context is open,
every `Attention` module in `model` takes its explicit path (`softmax(f(Q, K) + M)`, the weights
materialised) and appends its weights `(B, H, M, N)` to `maps`, in the order the modules are
called: the blocks first to last, then, for `pool="map"`, the pooling query's `(B, H, 1, P)` over the P patch tokens.
The maps stay in the autograd graph, so gradients with respect to them can be taken (gradient
rollout, Chefer et al.). The same idea as lucidrains' `Recorder` and timm's attention hooks,
without wrapping or patching the model: each `Attention` checks one attribute, `recorder`.

The protocol is that attribute: any module with a `recorder` attribute (None when idle) is
recorded, so an attention layer of your own takes part by appending its weights to
`self.recorder` when it is a list.

While recording, activation checkpointing (`set_grad_checkpointing`, timm's `grad_checkpointing`
attribute) is off, and it is switched back on when the context closes. A checkpointed block runs its
attention a second time in the backward pass: inside the context that records every map twice, and
after it the layer takes the fused path, whose saved tensors differ, so the backward pass fails.
Recording is for looking inside at explanation-sized batches, where the memory checkpointing saves
is not needed; the maps and their gradients are those of the plain path.
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
    Activation checkpointing is off inside the context (see the module's docstring).
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
