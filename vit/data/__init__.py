"""Data modules: the synthetic two-circles relation task, CIFAR-10/100, and a folder of your own images."""

from vit.data.cifar import CIFARDataModule
from vit.data.image_folder import ImageFolderDataModule
from vit.data.two_circles import TwoCirclesDataModule, TwoCirclesDataset

__all__ = ["CIFARDataModule", "ImageFolderDataModule", "TwoCirclesDataModule", "TwoCirclesDataset"]
