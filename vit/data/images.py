"""One image file as the model's input: decoded upright at a useful scale (`decode_image`, `to_input`), resized and
normalised as in training (`build_transform`); a folder's or a list's images, decoded when used (`ImageFiles`, and
`ListedImageFolder` for training)."""

from __future__ import annotations

import functools
import math
import os
import struct
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets
from torchvision.transforms import v2

from vit.checks import check_choice, check_float, check_size
from vit.data.files import not_a_file, text_name
from vit.messages import first_line

# A JPEG is decoded at 1/2, 1/4 or 1/8 scale while it stays this many times the input's longest side, so that
# even RandomResizedCrop's smallest crop (0.28 of a side) keeps the input's resolution.
DRAFT_MARGIN = 4

# The formats an image file is opened in, whatever its name: the raster formats cameras, phones (a multi-picture
# JPEG opens through JPEG), scanners and image tools write, each decoded by Pillow or a library linked into it. Never
# EPS/PostScript, whose reader hands the file's own program to Ghostscript, nor Pillow's rarer readers: a file whose
# name says .jpg is no reason to run them. Tried in this order: TGA has no signature, so it comes last.
IMAGE_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP", "PPM", "TGA")
# What a file refused as no image format is, named from its first bytes, beside the signatures of Pillow's readers.
OTHER_SIGNATURES = ((0, b"%PDF-", "PDF"), (4, b"ftypheic", "HEIC"), (4, b"ftypheix", "HEIC"), (4, b"ftypmif1", "HEIF"))
NON_FINITE = "has NaN or infinite pixels"  # the reason an image, a file or a tensor, cannot be classified
GREY_MODES = ("1", "L", "LA")  # 8-bit images of these modes are read as "L", of every other mode as "RGB"


@functools.cache
def image_extensions() -> frozenset[str]:
    """The lower-case endings Pillow names `IMAGE_FORMATS` files with (`.jpg`, `.jpeg`, `.png`, `.tif`, ...): what an
    image folder lists, by name alone as torchvision's `ImageFolder` lists, so that starting reads no file. Cached:
    it imports every Pillow reader once."""
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in IMAGE_FORMATS)


def usable_workers(num_workers: int) -> int:
    """`num_workers` capped at the cores this process may run on (torch warns about more). `sched_getaffinity`
    is Linux's (a job's cores); elsewhere the machine's count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(num_workers, cores)


class UnreadableImageError(ValueError):
    """A file that cannot be decoded as an image: the message is `file: why`, one line; `reason` is the why."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)  # one argument, as a DataLoader worker re-raises it in the main process
        self.reason = message if reason is None else reason

    @classmethod
    def for_file(cls, path: str | os.PathLike, reason: str) -> UnreadableImageError:
        """The error `path: reason`, both as text to show (`text_name`): a reason may quote the file's own bytes."""
        reason = text_name(reason)
        return cls(f"{text_name(str(path))}: {reason}", reason)


def decode_image(path: str | os.PathLike, size: tuple[int, int] | None = None) -> Image.Image | torch.Tensor:
    """The image at `path`, upright by its EXIF orientation, as `to_input` gives it, else `UnreadableImageError`. Only
    `IMAGE_FORMATS` are read. With `size` (the model's input `(H, W)`), a JPEG is decoded at a reduced scale."""
    if (why := not_a_file(path)) is not None:
        raise UnreadableImageError.for_file(path, why)
    try:
        with Image.open(path, formats=IMAGE_FORMATS) as image:
            if size is not None:  # only Pillow's JPEG reader drafts; the others ignore it
                side = DRAFT_MARGIN * max(size)  # square: the image may be turned by its orientation
                image.draft(None, (side, side))
            image.load()
            ImageOps.exif_transpose(image, in_place=True)
            return to_input(image)
    except UnreadableImageError as err:
        raise UnreadableImageError.for_file(path, err.reason) from None
    except Image.DecompressionBombError as err:
        raise UnreadableImageError.for_file(
            path,
            f"too large to decode safely ({str(err).split(',')[0]}, twice "
            "PIL.Image.MAX_IMAGE_PIXELS, Pillow's guard against decompression "
            "bombs; raise that limit only for a file you trust)",
        ) from None
    except UnidentifiedImageError:  # Pillow's message is the whole path again
        raise UnreadableImageError.for_file(path, not_an_image(path)) from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as err:  # what Pillow's readers raise on bad data
        raise UnreadableImageError.for_file(path, first_line(err)) from None


def not_an_image(path: str | os.PathLike) -> str:
    """Why a file that opens in none of `IMAGE_FORMATS` is not read: what it is, when its first bytes say so."""
    try:
        with open(path, "rb") as file:
            found = signature_format(file.read(16))  # as much as Pillow's readers look at to recognise a file
    except OSError as err:
        return err.strerror or str(err)
    if found is None or found in IMAGE_FORMATS:  # an image format, but broken before its reader knew it
        return "cannot identify image file: not a format Pillow reads"
    article = "an" if found[0] in "AEFHILMNORSX" else "a"  # as the letter is spoken: an EPS, an HEIC, a PDF
    return f"{article} {found} file; images are read as {', '.join(IMAGE_FORMATS[:-1])} or {IMAGE_FORMATS[-1]}"


def signature_format(prefix: bytes) -> str | None:
    """The format whose signature `prefix` (a file's first bytes) starts with, by byte tests alone: nothing decoded."""
    for at, signature, name in OTHER_SIGNATURES:
        if prefix[at:].startswith(signature):
            return name
    Image.init()  # every reader registered, each with its byte test (`accept`)
    for name, (_, accept) in Image.OPEN.items():
        if accept is None:  # a reader without a signature would claim any file
            continue
        try:
            if accept(prefix) is True:  # a string is a warning: a near miss
                return name
        except Exception:  # noqa: BLE001 - a test that cannot read these few bytes does not recognise them
            continue
    return None


def to_input(image: Image.Image) -> Image.Image | torch.Tensor:
    """8-bit images as an "L" (`GREY_MODES`) or "RGB" image, which every transform reads; 16-bit and 32-bit ones as a
    `(1, H, W)` float tensor in [0, 1], by their real range (16-bit values / 65535, other `I` / (2**31 - 1), `F` as it
    is when in [0, 1], else min-max scaled). `UnreadableImageError` for an image without pixels, with NaN or
    infinite ones, or of a mode Pillow cannot convert."""
    if image.width == 0 or image.height == 0:
        raise _unreadable(f"has no pixels ({image.width}x{image.height})")
    if not image.mode.startswith(("I", "F")):
        target = "L" if image.mode in GREY_MODES else "RGB"
        try:
            return image if image.mode == target else image.convert(target)
        except ValueError:  # "La"; "LAB" in Pillow versions without its conversion to "RGB"
            raise _unreadable(f"a {image.mode} image, which Pillow cannot convert to {target}") from None
    pixels = np.asarray(image, dtype=np.float64)
    if not np.isfinite(pixels).all():  # min-max scaling would skip them and the model would answer NaN
        raise _unreadable(NON_FINITE)
    if image.mode.startswith("I;16"):
        pixels = pixels / 65535.0
    elif image.mode == "I":
        pixels = pixels / (65535.0 if pixels.min() >= 0 and pixels.max() <= 65535 else 2**31 - 1)
    elif pixels.min() < 0 or pixels.max() > 1:
        span = pixels.max() - pixels.min()
        pixels = (pixels - pixels.min()) / span if span > 0 else np.zeros_like(pixels)
    return torch.from_numpy(pixels.clip(0.0, 1.0).astype(np.float32))[None]  # (1, H, W)


def _unreadable(reason: str) -> UnreadableImageError:
    """`reason` for an image given in memory; `decode_image` puts the file's name in front."""
    return UnreadableImageError(f"PIL image: {reason}", reason)


CROP_MODES = ("squash", "center")  # timm's eval crops this project reproduces


def build_transform(
    img_size: int | tuple[int, int],
    in_chans: int,
    normalization,
    interpolation: str = "bilinear",
    crop_pct: float = 1.0,
    crop_mode: str = "squash",
) -> v2.Compose:
    """PIL image -> float tensor `(in_chans, H, W)` as the model saw in training, as timm's eval transform does it:
    `squash` resizes to `(floor(H / crop_pct), floor(W / crop_pct))` (the aspect ratio not kept; with crop_pct 1, to
    `img_size`), `center` resizes the shorter side to `floor(H / crop_pct)` (a square `img_size` only); then the
    centre `img_size` is cut out."""
    check_choice("interpolation", interpolation, ("bilinear", "bicubic", "nearest"))
    check_choice("crop_mode", crop_mode, CROP_MODES)
    check_float("crop_pct", crop_pct, 0.0, 1.0, low_open=True)
    (height, width), mode = check_size("img_size", img_size), v2.InterpolationMode(interpolation)
    scaled = (math.floor(height / crop_pct), math.floor(width / crop_pct))
    if crop_mode == "center" and height != width:
        raise ValueError(f"crop_mode='center' needs a square img_size, got {height} x {width}: use crop_mode='squash'")
    resize = [v2.Resize(scaled if crop_mode == "squash" else scaled[0], interpolation=mode, antialias=True)]
    if crop_mode == "center" or crop_pct != 1.0:
        resize.append(v2.CenterCrop((height, width)))
    # Resized before `ToImage`: a PIL image by Pillow, as timm's and transformers' transforms resize it, so that the
    # three give the same pixels (a uint8 tensor resized by torch rounds some of them one level apart).
    steps = [
        v2.Grayscale(num_output_channels=1) if in_chans == 1 else v2.RGB(),
        *resize,
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
    ]
    if normalization is not None:
        steps.append(v2.Normalize(*map(list, normalization)))
    return v2.Compose(steps)


class ListedImageFolder(datasets.ImageFolder):
    """torchvision's `ImageFolder` over samples listed beforehand (`vit.data.files`), not by its own walk; it counts
    the files that fail to decode (`failures`) and raises `UnreadableImageError` as its loader does."""

    def __init__(self, root: str, folders: list[str], samples: list[tuple[str, int]], **kwargs) -> None:
        self._listed = folders, samples  # read by find_classes and make_dataset, which ImageFolder calls
        super().__init__(root, **kwargs)
        self.classes = [text_name(name) for name in folders]
        # In shared memory: a loader's worker processes count there, and the main process reads the counts once
        # the batches are back (`vit.data.image_folder.UnreadableImages`): no message between them to lose.
        self.failures = torch.zeros(len(samples), dtype=torch.int32).share_memory_()  # (N,)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        folders = self._listed[0]
        return folders, {name: i for i, name in enumerate(folders)}

    def make_dataset(self, directory: str, class_to_idx: dict[str, int], *args, **kwargs) -> list[tuple[str, int]]:
        return self._listed[1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        try:
            return super().__getitem__(index)
        except UnreadableImageError:
            self.failures[index] += 1  # one process reads a sample at a time: no lost update
            raise


def image_files(input_dir: Path) -> list[Path]:
    """The entries directly in `input_dir` that are read as images, sorted: sub-folders and hidden files left out."""
    return [path for path in sorted(input_dir.iterdir()) if not path.name.startswith(".") and not path.is_dir()]


class ImageFiles(Dataset):
    """`paths` decoded (`decode_image`, a JPEG at `transform`'s size) and transformed only when indexed: item `i` is
    `(i, image)`, or `(i, reason)` for a file that cannot be read; `names[i]` is file `i`'s name as text."""

    def __init__(self, paths: list[Path], transform) -> None:
        self.paths, self.transform = list(paths), transform
        self.names = [text_name(path.name) for path in self.paths]
        steps = transform.transforms if isinstance(transform, v2.Compose) else []
        self.size = next((tuple(t.size) for t in steps if isinstance(t, v2.Resize)), None)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor | str]:
        try:
            return i, self.transform(decode_image(self.paths[i], self.size))
        except UnreadableImageError as err:
            return i, err.reason


def readable_batches(files: ImageFiles, batch_size: int, num_workers: int = 0):
    """`(indices, images or None, {index: reason})` per batch of `files`, decoded and stacked by `num_workers` processes
    a batch ahead (`DataLoader`): memory holds a few batches, whatever the number of files."""
    yield from DataLoader(files, batch_size=batch_size, num_workers=num_workers, collate_fn=_readable)


def _readable(items: list[tuple[int, torch.Tensor | str]]) -> tuple[list[int], torch.Tensor | None, dict[int, str]]:
    read = [(i, x) for i, x in items if isinstance(x, torch.Tensor)]  # stacked in the worker: one tensor to pass
    return (
        [i for i, _ in read],
        torch.stack([x for _, x in read]) if read else None,
        {i: x for i, x in items if isinstance(x, str)},
    )
