"""What the rest of the project relies on in a backbone and in an attention layer, declared once.

`Backbone` is the base of every network in `vit.models` (and of a study's): `(B, C, H, W) -> (B, num_classes)`
logits, `num_classes`, `num_prefix_tokens` (timm's name: the tokens before the patches, none in a CNN),
`has_attention` (whether the attention methods of `vit.explain` can read it) and `gradcam_target` (the layer
Grad-CAM reads). The explain, export and registry code read these instead of probing for attributes, so a new
backbone is one class that implements them (docs/code.md). `Recorded` marks a layer whose attention weights
`vit.models.record_attention` collects.

`Classifies`, `GroupsLayers` and `ExemptsFromDecay` are the parts of timm's model interface that training reads in
any backbone, timm's or this project's (timm's models share no base class that declares them)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

ToMaps = Callable[[torch.Tensor], torch.Tensor]  # a layer's output -> (B, K, gh, gw) maps


class Backbone(nn.Module, abc.ABC):
    """The contract of a backbone (module doc): a subclass sets `num_classes` (and `num_prefix_tokens` where it has
    such tokens) in its `__init__` and implements `gradcam_target`."""

    num_classes: int
    num_prefix_tokens: int = 0
    grad_checkpointing: bool = False  # timm's name: blocks recompute their activations in backward (memory for time)
    # True for a ViT: its `Recorded` layers give the maps the attention methods read, over a ViT's tokens (its
    # `pool`, `num_reg_tokens` and `patch_embed.grid_size` say how they are laid out).
    has_attention: ClassVar[bool] = False

    @abc.abstractmethod
    def gradcam_target(self) -> tuple[nn.Module, ToMaps]:
        """The layer whose output Grad-CAM weighs by its gradient (the last one with a spatial layout), and the
        function turning that output into `(B, K, gh, gw)` maps."""


class Recorded(nn.Module):
    """An attention layer that appends its weights `(B, H, M, N)` to `recorder` while `record_attention` sets it
    (None when idle): `vit.models.attention.Attention` and the MAP head's query."""

    recorder: list[torch.Tensor] | None = None


@runtime_checkable
class Classifies(Protocol):
    """A network with timm's `num_classes`: the width of its logits."""

    num_classes: int


@runtime_checkable
class GroupsLayers(Protocol):
    """A network with timm's `group_matcher`: which parameters form each layer, for layer-wise learning-rate decay
    (`timm.optim.param_groups_layer_decay`)."""

    def group_matcher(self, coarse: bool = False) -> dict: ...


@runtime_checkable
class ExemptsFromDecay(Protocol):
    """A network with timm's `no_weight_decay`: the names of parameters kept out of weight decay (positions, CLS)."""

    def no_weight_decay(self) -> set[str]: ...
