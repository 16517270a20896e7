"""Data modules: the synthetic relation tasks (two circles, same-different), CIFAR-10/100, and your own images.

Each is imported when first used (`vit.data.CIFARDataModule`): reading images for inference imports no Lightning."""

import importlib

MODULES = {
    "CIFARDataModule": "vit.data.cifar",
    "ImageFolderDataModule": "vit.data.image_folder",
    "SameDifferentDataModule": "vit.data.same_different",
    "SameDifferentDataset": "vit.data.same_different",
    "TwoCirclesDataModule": "vit.data.two_circles",
    "TwoCirclesDataset": "vit.data.two_circles",
}
__all__ = list(MODULES)


def __getattr__(name: str):
    if name not in MODULES:
        raise AttributeError(f"module 'vit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(MODULES[name]), name)
