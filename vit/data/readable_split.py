"""A split of an image folder that reads on through files that fail to decode (`vit.data.images.ListedImageFolder`
counts them in `failures`): a bad file never stops a loader worker.

Training substitutes: the next image of the split that decodes takes a bad file's place, so that every batch keeps
its size (Mixup mixes a batch with its flip). Evaluation leaves it out: a loader's batch holds only the images that
decode, so that every image scored is scored once (`test/images` counts them) and `train.py predict` writes a row
for each file that was read, under its own name (`PredictionWriter`, through `left_out`)."""

from __future__ import annotations

import torch
from torch.utils.data import Subset

from vit.data.base import DataNotFoundError
from vit.data.files import text_name
from vit.data.images import ListedImageFolder, UnreadableImageError


class NoReadableImageError(DataNotFoundError):
    """A class folder without one image file, or a split (or evaluation batch) none of whose files decodes; the
    message names why."""


class ReadableSplit(Subset):
    """The split of `dataset` at `indices`. Item `i` is its `i`-th image, or, when that file fails to decode, the next
    one of the split that decodes (wrapping round). A loader's batch (`__getitems__`) is made of such items when
    `substitute` (training); otherwise (evaluation) of the batch's own images that decode, the others left out. A file
    that failed before is tried again only at its own place."""

    dataset: ListedImageFolder

    def __init__(self, dataset: ListedImageFolder, indices: list[int], substitute: bool = True) -> None:
        super().__init__(dataset, indices)
        self.substitute = substitute

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        n, failures = len(self.indices), self.dataset.failures
        if not -n <= i < n:  # as a list: `for x, y in split` stops at the end
            raise IndexError(f"index {i} is out of range for a split of {n} images")
        for k in range(n):
            j = self.indices[(i + k) % n]
            if k and failures[j]:
                continue
            try:
                return self.dataset[j]
            except UnreadableImageError:
                continue
        raise NoReadableImageError(
            text_name(f"none of the {n} files of this split under {self.dataset.root} decodes as an image")
        )

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        if self.substitute:
            return [self[i] for i in indices]  # what a DataLoader asks of a Subset, item by item here
        items = []
        for i in indices:
            try:
                items.append(self.dataset[self.indices[i]])
            except UnreadableImageError:
                continue  # counted in `failures`, named at the epoch's end
        if not items:
            raise NoReadableImageError(
                text_name(f"none of the {len(indices)} files of a batch under {self.dataset.root} decodes as an image")
            )
        return items

    def left_out(self, i: int) -> bool:
        """Whether item `i` was left out of an evaluation batch: its file failed to decode when it was read."""
        return not self.substitute and bool(self.dataset.failures[self.indices[i]])
