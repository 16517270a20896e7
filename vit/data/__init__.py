"""Data modules: the synthetic two-circles relation task and CIFAR-10/100."""

from vit.data.cifar import CIFARDataModule
from vit.data.two_circles import TwoCirclesDataModule, TwoCirclesDataset

__all__ = ["CIFARDataModule", "TwoCirclesDataModule", "TwoCirclesDataset"]
