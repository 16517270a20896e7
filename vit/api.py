"""A trained checkpoint in Python: `vit.load(path_or_url)` -> a `Predictor`, the model ready for inference.

    import vit

    predictor = vit.load("runs/folder/vit/version_0/checkpoints/last.ckpt", device="auto")
    predictor.predict(["cat.jpg", "dog.png"], topk=2)   # [[Prediction('cat', 0.93), Prediction('dog', 0.05)], ...]
    predictor.explain("cat.jpg", method="chefer", target="dog")   # (gh, gw) relevance, summing to 1

The checkpoint is opened as the commands open it (no code from it runs) and only its backbone is built; images are
read as `vit.predict` reads them, then resized and normalised as the checkpoint records (`Predictor.transform`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image, ImageOps
from torch import Tensor, nn

from vit.checks import check_choice, check_int, check_topk, class_index
from vit.data.images import decode_image, to_input
from vit.explain.relevance import CLASS_METHODS, Method, relevance, usable_methods
from vit.training.checkpoint import read
from vit.training.checkpoint.build import inference_transform, trained_backbone

ImageLike = str | os.PathLike | Image.Image
Images = ImageLike | Iterable[ImageLike] | Tensor
AUTOCAST = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --precision: the dtype autocast runs in


class Prediction(NamedTuple):
    """One of an image's top-k classes: its name and softmax probability (unpacks as `name, probability`)."""

    class_name: str
    probability: float


def resolve_device(device: str | torch.device, option: str = "device=") -> torch.device:
    """`device` as a torch device (`auto`: cuda, else mps, else cpu), or `ValueError` if this machine has none."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available()
                            else "cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        target = None
    if target is None or target.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{option}{device!r} is not allowed: expected auto, cpu, cuda, cuda:N or mps")
    count = torch.cuda.device_count() if target.type == "cuda" else int(torch.backends.mps.is_available())
    if target.type != "cpu" and (target.index or 0) >= count:
        name = "CUDA GPU" if target.type == "cuda" else "Apple GPU (MPS)"
        raise ValueError(f"{option}{device} was asked for, but this machine has {count or 'no'} {name}(s): use "
                         f"{option}cpu")
    return target


class Predictor:
    """A checkpoint's backbone for inference: `model` (eval mode), `class_names`, `inputs` (what the checkpoint
    records of its input), `transform` (PIL image -> input `(C, H, W)`), `precision` (`32`, or autocast to `bf16` or
    `fp16`). Inputs go where the model is (`.to(device)`); results come back on the CPU. Safe to share between
    threads: `explain` runs one call at a time (it hooks the model's attention)."""

    def __init__(self, model: nn.Module, inputs: dict, class_names: list[str], precision: str = "32") -> None:
        self.model, self.inputs, self.class_names = model.eval(), inputs, list(class_names)
        self.transform = inference_transform(inputs)
        self._explaining = threading.Lock()
        check_choice("precision", precision, AUTOCAST)
        self.precision = precision

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> Predictor:
        """Move the model to `device` (`auto`, `cpu`, `cuda`, `cuda:N` or `mps`); returns the predictor."""
        self.model.to(resolve_device(device))
        if self.precision == "fp16" and self.device.type == "cpu":
            raise ValueError("precision='fp16' runs on a GPU; on the CPU use precision='bf16' or '32'")
        return self

    def images(self, images: ImageLike | Iterable[ImageLike] | Tensor) -> Tensor:
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

    def batches(self, images: Images, batch_size: int) -> Iterator[Tensor]:
        """The model's input `batch_size` images at a time: an iterable is read only as far as each batch needs."""
        check_int("batch_size", batch_size, 1)
        if isinstance(images, (Tensor, str, os.PathLike, Image.Image)):
            yield from self.images(images).split(batch_size)
            return
        iterator = iter(images)
        while chunk := list(islice(iterator, batch_size)):
            yield self.images(chunk)

    @torch.no_grad()
    def probabilities(self, images: Images, batch_size: int = 256) -> Tensor:
        """Class probabilities `(B, num_classes)` on the CPU, `batch_size` images per forward pass on the model's
        device, under autocast to `precision`: what `vit.predict` writes."""
        device, dtype = self.device, AUTOCAST[self.precision]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            return torch.cat([self.model(x.to(device)).float().softmax(dim=-1).cpu()
                              for x in self.batches(images, batch_size)])

    def predict(self, images: Images, topk: int = 1, batch_size: int = 256) -> list[list[Prediction]]:
        """Per image (a file, a PIL image, any iterable of them, or a batch), its `topk` most probable classes, best
        first; images are decoded `batch_size` at a time."""
        check_topk(topk, len(self.class_names), option="topk=")
        confidence, classes = self.probabilities(images, batch_size).topk(topk, dim=-1)  # (B, K) each, best first
        return [[Prediction(self.class_names[k], p) for k, p in zip(ks, ps)]
                for ks, ps in zip(classes.tolist(), confidence.tolist())]

    def explain(self, image: ImageLike | Tensor, method: str = "rollout", target: str | int | None = None) -> Tensor:
        """The relevance map `(gh, gw)` of one image (a file, a PIL image or a model input `(C, H, W)`), summing to 1;
        `target` (a class name or index, default: the prediction) is the class the class-specific methods explain."""
        check_choice("method", method, Method)
        usable_methods(self.model, [method])
        if target is not None and method in CLASS_METHODS:  # for the others, relevance refuses the target as given
            target = class_index(target, self.class_names)
        x = image[None] if isinstance(image, Tensor) and image.ndim == 3 else self.images(image)
        if x.shape[0] != 1:
            raise ValueError(f"explain takes one image, got {x.shape[0]}; call it once per image")
        with self._explaining:
            return relevance(self.model, x.to(self.device), method, target)[0].cpu()


def load(path_or_url: str | os.PathLike, device: str | torch.device = "cpu", precision: str = "32") -> Predictor:
    """The trained backbone of a `train.py` checkpoint (a path or an http(s) URL), ready for inference on `device`
    (`auto`: a GPU when there is one) with `precision` `32`, `bf16` or `fp16` (autocast; `fp16` on a GPU)."""
    check_choice("precision", precision, AUTOCAST)
    target = resolve_device(device)  # before the checkpoint is read
    checkpoint = read(path_or_url, training=False)  # only the backbone is built: no Lightning, no training classes
    return Predictor(trained_backbone(checkpoint), checkpoint.inputs, checkpoint.class_names, precision).to(target)
