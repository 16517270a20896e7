"""The networks: a Vision Transformer and a convolutional baseline, both `(B, C, H, W) -> logits`."""

from vit.models.coordconv import CoordConvResNet
from vit.models.resnet import ResNet
from vit.models.vision_transformer import VisionTransformer

__all__ = ["CoordConvResNet", "ResNet", "VisionTransformer"]
