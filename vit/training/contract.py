"""What the training code and the callbacks rely on in a LightningModule or LightningDataModule, declared once.

`ImageClassifier` and `SplitDataModule` implement all of it. A user's own module may implement part: a module
that names its classes (`NamesClasses`) gets them in the reports, a data module that declares its inputs
(`DeclaresInputs`) gets them recorded in the checkpoint for inference, a validation set with ground-truth masks
(`HasRegionMasks`) gets the relevance scores; the explain callbacks read its first `Backbone`
(`vit.training.classifier.explained_network`). The callbacks read these through `isinstance` instead of probing
attribute names, so what a module must have is written here and nowhere else (docs/code.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class NamesClasses(Protocol):
    """A module with `class_names` (None while unknown): the names the reports, tables and CSVs show."""

    class_names: Sequence[str] | None


@runtime_checkable
class DeclaresInputs(Protocol):
    """A data module whose `inputs()` says what a model trained on it takes (size, channels, normalisation)."""

    def inputs(self) -> dict: ...


@runtime_checkable
class HasRegionMasks(Protocol):
    """A dataset whose `circle_mask(i)` is the `(H, W)` boolean ground truth of image i's evidence."""

    def circle_mask(self, index: int) -> Tensor: ...


def class_names_of(module: object) -> list[str] | None:
    """`module`'s class names, or None when it declares none."""
    names = module.class_names if isinstance(module, NamesClasses) else None
    return None if names is None else list(names)
