"""A trained checkpoint in Python: `vit.load(path_or_url)` -> a `Predictor`, the model ready for inference.

    import vit

    predictor = vit.load("runs/folder/vit/version_0/checkpoints/last.ckpt")
    predictor.predict(["cat.jpg", "dog.png"], topk=2)   # [[Prediction('cat', 0.93), Prediction('dog', 0.05)], ...]
    predictor.explain("cat.jpg", method="chefer", target="dog")   # (gh, gw) relevance, summing to 1

The checkpoint is opened as the commands open it (no code from it runs), and images are read as `vit.predict`
reads them, then resized and normalised as the checkpoint records (`Predictor.transform`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from PIL import Image, ImageOps
from torch import Tensor

from vit.checks import check_choice
from vit.data.images import decode_image, to_input
from vit.explain.relevance import CLASS_METHODS, Method, relevance, usable_methods
from vit.training.checkpoint.build import open_model
from vit.training.classifier import class_index
from vit.training.predictions import check_topk, class_probabilities, inference_transform

if TYPE_CHECKING:
    from torchvision.transforms import v2

    from vit.training.classifier import ImageClassifier

ImageLike = str | os.PathLike | Image.Image


class Prediction(NamedTuple):
    """One of an image's top-k classes: its name and softmax probability (unpacks as `name, probability`)."""

    class_name: str
    probability: float


class Predictor:
    """A checkpoint's model for inference (inputs go where `model` is): `model` (eval mode), `class_names`, `inputs`
    (what the checkpoint records of its input), `transform` (PIL image -> input `(C, H, W)`). Safe to share between
    threads: `explain` runs one call at a time (it hooks the model's attention)."""

    def __init__(self, model: ImageClassifier, inputs: dict) -> None:
        self.model, self.inputs = model.eval(), inputs
        self.class_names: list[str] = list(model.class_names)
        self.transform: v2.Compose = inference_transform(inputs)
        self._explaining = threading.Lock()

    def images(self, images: ImageLike | Sequence[ImageLike] | Tensor) -> Tensor:
        """The model's input `(B, C, H, W)`: files and PIL images read and transformed, a batch tensor as it is."""
        if isinstance(images, Tensor):
            if images.ndim != 4:
                raise ValueError(f"images: a tensor must be a batch (B, C, H, W), got shape {tuple(images.shape)}")
            return images
        if isinstance(images, (str, os.PathLike, Image.Image)):
            images = [images]
        size = tuple(self.inputs["img_size"])
        return torch.stack([self.transform(decode_image(Path(image), size) if not isinstance(image, Image.Image)
                                           else to_input(ImageOps.exif_transpose(image)))
                            for image in images])

    def probabilities(self, images: ImageLike | Sequence[ImageLike] | Tensor) -> Tensor:
        """Class probabilities `(B, num_classes)` on the CPU, computed as `vit.predict` computes them."""
        return class_probabilities(self.model, self.images(images))

    def predict(self, images: ImageLike | Sequence[ImageLike] | Tensor, topk: int = 1) -> list[list[Prediction]]:
        """Per image (a file, a PIL image, a list of them, or a batch), its `topk` most probable classes, best first."""
        check_topk(topk, len(self.class_names), option="topk=")
        confidence, classes = self.probabilities(images).topk(topk, dim=-1)  # (B, K) each, best first
        return [[Prediction(self.class_names[k], p) for k, p in zip(ks, ps)]
                for ks, ps in zip(classes.tolist(), confidence.tolist())]

    def explain(self, image: ImageLike | Tensor, method: str = "rollout", target: str | int | None = None) -> Tensor:
        """The relevance map `(gh, gw)` of one image (a file, a PIL image or a model input `(C, H, W)`), summing to 1;
        `target` (a class name or index, default: the prediction) is the class the class-specific methods explain."""
        check_choice("method", method, Method)
        usable_methods(self.model.backbone, [method])
        if target is not None and method in CLASS_METHODS:  # for the others, relevance refuses the target as given
            target = class_index(target, self.class_names)
        x = image[None] if isinstance(image, Tensor) and image.ndim == 3 else self.images(image)
        if x.shape[0] != 1:
            raise ValueError(f"explain takes one image, got {x.shape[0]}; call it once per image")
        with self._explaining:
            return relevance(self.model.backbone, x.to(next(self.model.parameters()).device), method, target)[0].cpu()


def load(path_or_url: str | os.PathLike, device: str | torch.device = "cpu") -> Predictor:
    """The trained model of a `train.py` checkpoint (a path or an http(s) URL), ready for inference on `device`."""
    model, checkpoint = open_model(path_or_url)
    return Predictor(model.to(device), checkpoint.inputs)
