"""What the training code and the callbacks rely on in a LightningModule or LightningDataModule, declared once.

`ImageClassifier` and `SplitDataModule` implement all of it. A user's own module may implement part: a module
that names its classes (`NamesClasses`) gets them in the reports, a data module that declares its inputs
(`DeclaresInputs`) gets them recorded in the checkpoint for inference, a validation set with ground-truth masks
(`HasRegionMasks`) gets the relevance scores. The callbacks read these through `isinstance` instead of probing
attribute names, so what a module must have is written here and nowhere else (docs/code.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from vit.models.contract import Backbone


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


def explained_network(module: nn.Module, *, evaluated: bool = False) -> nn.Module:
    """The network the explain callbacks read in `module`: an `ImageClassifier`'s backbone (its `evaluated` weights,
    the EMA's when there is one, if `evaluated`), else `module` itself when it is a `Backbone`, else its first child
    that is one (a user's LightningModule wrapping a backbone), else `module` (which the methods then refuse, in
    one line naming its type)."""
    from vit.training.classifier import ImageClassifier  # the classifier imports this module

    if isinstance(module, ImageClassifier):
        return module.evaluated if evaluated else module.backbone
    if isinstance(module, Backbone):
        return module
    return next((child for child in module.children() if isinstance(child, Backbone)), module)
