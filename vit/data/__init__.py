from vit.data.two_circles import TwoCirclesDataModule
from vit.data.two_circles import TwoCirclesDataset
