"""A trained checkpoint in Python: `vit.load(path_or_url)` -> a `Predictor`, the model ready for inference.

    import vit

    predictor = vit.load("runs/folder/finetune_vit/version_0/checkpoints/last", device="auto")
    predictor.predict(["cat.jpg", "dog.png"], topk=2)   # [[Prediction('cat', 0.93), Prediction('dog', 0.05)], ...]
    predictor("cat.jpg")                                     # the same as predict
    predictor.explain("cat.jpg", method="chefer", target="dog")   # (gh, gw) relevance, summing to 1

The checkpoint is opened as the commands open it (no code from it runs) and only its backbone is built.

An image is a file path, a PIL image, a NumPy array of pixels (`H x W x 3` RGB or `H x W` gray, uint8, as PIL and
OpenCV give them: convert OpenCV's BGR to RGB first) or a uint8 tensor `(C, H, W)` as `torchvision.io.decode_image`
gives it; each is read as `vit.predict` reads a file, then resized and normalised as the checkpoint records
(`Predictor.transform`). A float tensor is taken as the model's input, already resized and normalised: `(C, H, W)`
one image, `(B, C, H, W)` a batch. A `Prediction` is transformers' pipeline output under other names: `class_name`
is its `label`, `probability` its `score`; `topk` above the number of classes gives all of them, as the pipeline and
timm do.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor, nn

from vit.checks import CheckpointError, check_choice, check_int, class_index
from vit.data.images import NON_FINITE, ImageFiles, decode_image, to_input
from vit.explain.relevance import CLASS_METHODS, Method, relevance, usable_methods
from vit.registry import inference_transform

ImageLike = str | os.PathLike | Image.Image | np.ndarray
Images = ImageLike | Iterable[ImageLike] | Tensor
AUTOCAST = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --precision: the dtype autocast runs in
# The float32 input one forward pass may hold. A checkpoint may ask for images of up to 4096 x 4096 x 64 (the schema's
# LIMITS), so the default 256 images per batch could be tens of GB. A larger batch gives the same predictions (each
# image's pass is its own; only the rounding of blocked products differs), so the batch is shrunk to fit rather than
# refused: the default batch size works for every checkpoint. One image larger than this still runs, alone.
INPUT_BYTES = 2**30
MAX_BATCH_SIZE = 2**16  # images per forward pass; more brings no speed, and Python's slicing overflows far beyond it


class Prediction(NamedTuple):
    """One of an image's top-k classes: its name and softmax probability (unpacks as `name, probability`)."""

    class_name: str
    probability: float


class NonFiniteError(ValueError):
    """The model gives NaN or infinite probabilities for an image: `image` names it, `index` is its place in the call,
    `reason` says whether its input or the model's arithmetic is at fault."""

    def __init__(self, image: str, index: int, reason: str) -> None:
        super().__init__(f"{image}: {reason}")
        self.image, self.index, self.reason = image, index, reason


class NonFiniteModelError(NonFiniteError, CheckpointError):
    """`NonFiniteError` of a finite image: the weights overflow, so the checkpoint is at fault whatever the image (as
    for NaN weights, which reading it refuses)."""


def fitting_batch_size(batch_size: int, inputs: dict, budget: int | None = None) -> int:
    """`batch_size`, or fewer images so that one batch of float32 inputs `(B, C, H, W)` (`inputs`: a checkpoint's
    `img_size` and `in_chans`) holds at most `budget` bytes (default `INPUT_BYTES`); never fewer than one."""
    check_int("batch_size", batch_size, 1, MAX_BATCH_SIZE)
    per_image = 4 * inputs["in_chans"] * math.prod(inputs["img_size"])  # float32 bytes of one (C, H, W)
    return max(1, min(batch_size, (INPUT_BYTES if budget is None else budget) // per_image))


def check_source(path_or_url: object) -> None:
    """Raise unless `path_or_url` names a checkpoint: a non-empty str (a path or URL) or an `os.PathLike` of one."""
    text = os.fspath(path_or_url) if isinstance(path_or_url, os.PathLike) else path_or_url
    if not isinstance(text, str):  # bytes paths too: the commands and the cache name files by text
        raise TypeError(
            f"path_or_url={path_or_url!r} is not allowed: expected a path (a str or os.PathLike) or an http(s) URL"
        )
    if not text.strip():
        raise ValueError(
            f"path_or_url={path_or_url!r} is not allowed: expected a path or an http(s) URL, not an empty string"
        )


def resolve_device(device: str | torch.device, option: str = "device=") -> torch.device:
    """`device` as a torch device (`auto`: cuda, else mps, else cpu), or `ValueError` if this machine has none."""
    if device == "auto":
        return torch.device(
            "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
        )
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        target = None
    if target is None or target.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{option}{device!r} is not allowed: expected auto, cpu, cuda, cuda:N or mps")
    count = torch.cuda.device_count() if target.type == "cuda" else int(torch.backends.mps.is_available())
    if target.type != "cpu" and (target.index or 0) >= count:
        name = "CUDA GPU" if target.type == "cuda" else "Apple GPU (MPS)"
        raise ValueError(
            f"{option}{device} was asked for, but this machine has {count or 'no'} {name}(s): use {option}cpu"
        )
    return target


class Predictor:
    """A checkpoint's backbone for inference: `model` (eval mode), `class_names`, `inputs` (what the checkpoint
    records of its input), `transform` (PIL image -> input `(C, H, W)`), `precision` (`32`, or autocast to `bf16` or
    `fp16`). Inputs go where the model is (`.to(device)`); results come back on the CPU. Safe to share between
    threads: images are decoded in parallel, the model runs one forward pass at a time."""

    def __init__(self, model: nn.Module, inputs: dict, class_names: list[str], precision: str = "32") -> None:
        self.model, self.inputs, self.class_names = model.eval(), inputs, list(class_names)
        self.transform = inference_transform(inputs)
        # Every use of the model holds this lock: `explain` changes the model itself while it runs (it sets each
        # attention layer's recorder, which also turns off the fused kernel, hooks Grad-CAM's layer and flips the
        # eval/train flags), so a forward pass of another thread meanwhile would be recorded into its maps, or
        # computed on the other path, or refused as nested recording.
        self._model_lock = threading.Lock()
        self._said_batch_size = False  # the note that a batch was shrunk to fit INPUT_BYTES is given once
        check_choice("precision", precision, AUTOCAST)
        self.precision = precision

    def __call__(self, images: Images, topk: int = 1, batch_size: int = 256) -> list[list[Prediction]]:
        """`predict`, as a pipeline is called."""
        return self.predict(images, topk, batch_size)

    def __repr__(self) -> str:
        (height, width), shown = self.inputs["img_size"], ", ".join(map(repr, self.class_names[:5]))
        more = f", ... ({len(self.class_names)} classes)" if len(self.class_names) > 5 else ""
        return (
            f"Predictor({type(self.model).__name__}, classes [{shown}{more}], input {self.inputs['in_chans']} x "
            f"{height} x {width}, device {self.device}, precision {self.precision!r})"
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str | torch.device) -> Predictor:
        """Move the model to `device` (`auto`, `cpu`, `cuda`, `cuda:N` or `mps`); returns the predictor."""
        target = resolve_device(device)
        with self._model_lock:
            self.model.to(target)
        if self.precision == "fp16" and self.device.type == "cpu":
            raise ValueError("precision='fp16' runs on a GPU; on the CPU use precision='bf16' or '32'")
        return self

    def images(self, images: Images) -> Tensor:
        """The model's input `(B, C, H, W)`: each image read and transformed (the module doc says what an image is); a
        float tensor as it is, `(C, H, W)` one image, `(B, C, H, W)` a batch."""
        if isinstance(images, Tensor) and images.is_floating_point():
            if images.ndim not in (3, 4):
                raise ValueError(
                    f"images: a float tensor is the model's input, (C, H, W) or (B, C, H, W); got shape "
                    f"{tuple(images.shape)}"
                )
            return images[None] if images.ndim == 3 else images
        if isinstance(images, Tensor) and images.ndim == 4:  # a uint8 batch (B, C, H, W) of pixels
            images = list(images)
        elif isinstance(images, (str, os.PathLike, Image.Image, np.ndarray, Tensor)):
            images = [images]
        return torch.stack([self.transform(self._pixels(image, i)) for i, image in enumerate(images)])

    def _pixels(self, image: object, index: int) -> Image.Image | Tensor:
        """One image as the transform takes it: a file decoded (a JPEG at the model's size), pixels as a PIL image."""
        if isinstance(image, Image.Image):
            return to_input(ImageOps.exif_transpose(image))
        if isinstance(image, np.ndarray) or (isinstance(image, Tensor) and image.dtype == torch.uint8):
            return to_input(Image.fromarray(_pixel_array(image, index)))
        if isinstance(image, str) and "://" in image:
            raise ValueError(f"images[{index}]={image!r}: a URL is not downloaded here; download it and pass the file")
        if isinstance(image, (str, os.PathLike)):
            return decode_image(Path(image), tuple(self.inputs["img_size"]))
        kind = f"a {image.dtype} tensor" if isinstance(image, Tensor) else type(image).__name__
        raise TypeError(
            f"images[{index}] is {kind}: expected a file path, a PIL image, a uint8 NumPy array (H x W x 3 or H x W) "
            "or uint8 tensor (C, H, W) of pixels, or a float tensor of model inputs"
        )

    def batches(self, images: Images, batch_size: int) -> Iterator[Tensor]:
        """The model's input `batch_size` images at a time (fewer where a batch would hold more than `INPUT_BYTES`):
        an iterable is read only as far as each batch needs."""
        for _, x in self._named_batches(images, batch_size):
            yield x

    def _named_batches(self, images: Images, batch_size: int) -> Iterator[tuple[list[str], Tensor]]:
        """`(names, x)` per batch of `batches`: each image as an error names it (a path, else `images[i]`)."""
        fitting = fitting_batch_size(batch_size, self.inputs)  # checks batch_size too
        if fitting < batch_size and not self._said_batch_size:
            self._said_batch_size = True
            channels, (height, width) = self.inputs["in_chans"], self.inputs["img_size"]
            warnings.warn(
                f"batch_size={batch_size} images of {channels} x {height} x {width} would hold "
                f"{batch_size * 4 * channels * height * width / 2**30:.1f} GiB of input; running {fitting} "
                f"per forward pass (at most {INPUT_BYTES / 2**30:g} GiB)",
                stacklevel=3,
            )
        if isinstance(images, (Tensor, str, os.PathLike, Image.Image, np.ndarray)):
            x = self.images(images)
            names = (
                [image_name(images, 0)] if not isinstance(images, Tensor) else [f"images[{i}]" for i in range(len(x))]
            )
            for start in range(0, len(x), fitting):
                yield names[start : start + fitting], x[start : start + fitting]
            return
        iterator, start = iter(images), 0
        while chunk := list(islice(iterator, fitting)):
            yield [image_name(image, start + i) for i, image in enumerate(chunk)], self.images(chunk)
            start += len(chunk)

    @torch.no_grad()
    def probabilities(self, images: Images, batch_size: int = 256) -> Tensor:
        """Class probabilities `(B, num_classes)` on the CPU, `batch_size` images per forward pass on the model's
        device, under autocast to `precision`: what `vit.predict` writes. `NonFiniteError` naming the first image
        whose probabilities are NaN or infinite."""
        device, dtype, start, out = self.device, AUTOCAST[self.precision], 0, []
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            for names, x in self._named_batches(images, batch_size):
                with self._model_lock:
                    probs = self.model(x.to(device)).float().softmax(dim=-1).cpu()  # (B, num_classes)
                self._check_finite(probs, x, names, start)
                out.append(probs)
                start += len(x)
        return torch.cat(out) if out else torch.zeros(0, len(self.class_names))

    def _check_finite(self, probs: Tensor, x: Tensor, names: list[str], start: int) -> None:
        """Raise `NonFiniteError` for the first row of `probs` that is not finite, saying whether its input is."""
        bad = (~torch.isfinite(probs).all(dim=-1)).nonzero().flatten().tolist()
        if not bad:
            return
        i = bad[0]
        if not torch.isfinite(x[i]).all():
            raise NonFiniteError(names[i], start + i, f"the image {NON_FINITE}; the model cannot classify it")
        where = "float32" if self.precision == "32" else f"precision {self.precision} (try '32')"
        raise NonFiniteModelError(
            names[i],
            start + i,
            f"the model's probabilities are NaN or infinite although the "
            f"image is finite: its logits overflow {where}; the checkpoint's weights cannot "
            "classify it",
        )

    def predict(self, images: Images, topk: int = 1, batch_size: int = 256) -> list[list[Prediction]]:
        """Per image (a file, a PIL image, any iterable of them, or a batch), its `topk` most probable classes, best
        first; images are decoded `batch_size` at a time. An empty iterable gives an empty list."""
        check_int("topk", topk, 1)
        topk = min(topk, len(self.class_names))  # all of them, as transformers' pipeline and timm give
        confidence, classes = self.probabilities(images, batch_size).topk(topk, dim=-1)  # (B, K) each, best first
        return [
            [Prediction(self.class_names[k], p) for k, p in zip(ks, ps)]
            for ks, ps in zip(classes.tolist(), confidence.tolist())
        ]

    def evaluate(self, input_dir: str | os.PathLike, batch_size: int = 256, num_workers: int = 0) -> dict:
        """The scores on a labelled folder, one sub-folder per class named as the model's classes, every readable image
        of it (`vit.scoring.metrics`: `images`, `top1`, `top5` with 5 classes or more, `per_class`,
        `confusion_matrix`), with `skipped` (file: why) and `classes_without_images`; `EvaluateError` when no image
        can be read. `python -m vit.evaluate` prints and writes the same."""
        from vit.data.files import text_name
        from vit.scoring import EvaluateError, labelled_files, metrics

        root = Path(input_dir)
        paths, labels, missing = labelled_files(root, self.class_names)
        files = ImageFiles(paths, self.transform)
        files.names = [text_name(os.path.relpath(path, root)) for path in paths]  # class/file, as a reader finds it
        scored, probs, skipped = [], [], {}
        for indices, batch_probs, batch_skipped in self.file_batches(files, batch_size, num_workers):
            skipped.update(batch_skipped)
            if batch_probs is not None:
                probs.append(batch_probs)
                scored += indices
        if not scored:
            raise EvaluateError(f"no readable image in the class folders of {root}; nothing was scored")
        result = metrics(torch.cat(probs), torch.tensor([labels[i] for i in scored]), self.class_names)
        return {**result, "skipped": skipped, "classes_without_images": missing}

    def file_batches(
        self, files: ImageFiles, batch_size: int, num_workers: int = 0
    ) -> Iterator[tuple[list[int], Tensor | None, dict[str, str]]]:
        """Per batch of `files`, decoded a batch ahead in `num_workers` processes: the indices of its readable images,
        their probabilities (None when it has none), and the files it skipped (name: why). An image of NaN pixels is
        the file's fault, skipped as an unreadable one; NaN probabilities from finite pixels are the model's fault,
        a `NonFiniteError` naming the file. What `vit.predict` and `evaluate` both run."""
        from vit.data.images import readable_batches, usable_workers  # looked up here: a test replaces the decoder

        for indices, x, unread in readable_batches(files, batch_size, usable_workers(num_workers)):
            skipped = {files.names[i]: why for i, why in unread.items()}
            if x is not None:
                finite = torch.isfinite(x).flatten(1).all(dim=1).tolist()
                skipped.update({files.names[i]: NON_FINITE for i, ok in zip(indices, finite) if not ok})
                indices, x = [i for i, ok in zip(indices, finite) if ok], x[torch.tensor(finite)]
            if x is None or not indices:
                yield [], None, skipped
                continue
            try:
                probs = self.probabilities(x, batch_size)
            except NonFiniteError as err:  # from finite pixels: every image may meet it
                raise NonFiniteError(files.names[indices[err.index]], indices[err.index], err.reason) from None
            yield indices, probs, skipped

    def explain(self, image: ImageLike | Tensor, method: str = "rollout", target: str | int | None = None) -> Tensor:
        """The relevance map `(gh, gw)` of one image (a file, a PIL image or a model input `(C, H, W)`), summing to 1
        (all zeros where a clamped method, chefer or gradcam, finds no positive evidence);
        `target` (a class name or index, default: the prediction) is the class the class-specific methods explain."""
        check_choice("method", method, Method)
        usable_methods(self.model, [method])
        if target is not None and method in CLASS_METHODS:  # for the others, relevance refuses the target as given
            target = class_index(target, self.class_names)
        x = self.images(image)
        if x.shape[0] != 1:
            raise ValueError(f"explain takes one image, got {x.shape[0]}; call it once per image")
        with self._model_lock:
            result = relevance(self.model, x.to(self.device), method, target)[0].cpu()  # (gh, gw)
        if not torch.isfinite(result).all():
            name = image_name(image, 0) if not isinstance(image, Tensor) else "the input"
            what = "the image holds" if not torch.isfinite(x).all() else "the model's arithmetic gives"
            raise NonFiniteError(name, 0, f"its {method} map is NaN or infinite: {what} NaN or infinite values")
        return result


def _pixel_array(image: np.ndarray | Tensor, index: int) -> np.ndarray:
    """uint8 pixels `H x W x 3` (RGB) or `H x W` (gray) from a NumPy array of that layout or a `(C, H, W)` tensor."""
    if isinstance(image, Tensor):
        if image.ndim != 3 or image.shape[0] not in (1, 3):
            raise ValueError(
                f"images[{index}]: a uint8 tensor is (C, H, W) with 1 or 3 channels, got {tuple(image.shape)}"
            )
        image = image.permute(1, 2, 0).squeeze(-1).cpu().numpy()
    if image.dtype != np.uint8:
        raise ValueError(
            f"images[{index}]: an array of pixels is uint8 (0-255), got {image.dtype}; pass model inputs as a float "
            "tensor"
        )
    if not (image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in (1, 3))):
        raise ValueError(f"images[{index}]: an array of pixels is H x W x 3 (RGB) or H x W, got shape {image.shape}")
    return image.squeeze(-1) if image.ndim == 3 and image.shape[-1] == 1 else image


def image_name(image: object, index: int) -> str:
    """How an error names an image of a call: a file by its path, anything else by its place, `images[i]`."""
    return os.fspath(image) if isinstance(image, (str, os.PathLike)) else f"images[{index}]"


def load(path_or_url: str | os.PathLike, device: str | torch.device = "cpu", precision: str = "32") -> Predictor:
    """The trained model of a model folder (`vit.artifact`: what a run writes beside each checkpoint, or
    `vit.export` writes), a `train.py` checkpoint (the model folder beside it), an `hf-hub:org/name` id, a timm model
    name with pretrained weights, or an http(s) URL of a model folder, ready for inference on `device` (`auto`: a GPU
    when there is one) with `precision` `32`, `bf16` or `fp16` (autocast; `fp16` on a GPU)."""
    import vit.artifact as artifact

    check_source(path_or_url)
    check_choice("precision", precision, AUTOCAST)
    target = resolve_device(device)  # before anything is read
    model = artifact.load(path_or_url)  # only the backbone is built: no Lightning, no training classes
    return Predictor(model.model, model.inputs, model.class_names, precision).to(target)
