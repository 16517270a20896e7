"""Data modules: the synthetic relation tasks (two circles, same-different), CIFAR-10/100, and your own images."""

from vit.data.cifar import CIFARDataModule
from vit.data.image_folder import ImageFolderDataModule
from vit.data.same_different import SameDifferentDataModule, SameDifferentDataset
from vit.data.two_circles import TwoCirclesDataModule, TwoCirclesDataset

__all__ = ["CIFARDataModule", "ImageFolderDataModule", "SameDifferentDataModule", "SameDifferentDataset",
           "TwoCirclesDataModule", "TwoCirclesDataset"]
