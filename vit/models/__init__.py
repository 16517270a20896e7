"""The networks: a Vision Transformer and convolutional baselines, all `(B, C, H, W) -> logits`."""

from vit.models.cnn import ConvNet
from vit.models.coordconv import CoordConvResNet
from vit.models.record import record_attention
from vit.models.resnet import ResNet
from vit.models.vision_transformer import VisionTransformer

__all__ = ["ConvNet", "CoordConvResNet", "ResNet", "VisionTransformer", "record_attention"]
