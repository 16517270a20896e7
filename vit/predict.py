"""Classify a folder of your own images with a trained checkpoint and write the predictions to a CSV.

    python -m vit.predict --ckpt_path runs/two_circles/vit/version_0/checkpoints/last.ckpt \\
        --input_dir my_images/ --output predictions.csv

Everything comes from the checkpoint: the model (LightningCLI records the backbone's config in
it) and the data module of its config, which says the image size, the channels and the
normalisation the model was trained with. Each image is converted the same way:

1. decoded with Pillow (PNG, JPEG, TIFF and anything else Pillow reads); 16-bit and float images
   are scaled to [0, 1] by their real range (`vit.data.image_folder.to_input`), not clipped;
2. converted to RGB (3 channels) or to grayscale (1 channel, ITU-R 601 luma), per the model's
   `in_chans`; an alpha channel is dropped;
3. resized to the data module's `img_size`, a side or `[H, W]` (bilinear, antialiased; the aspect
   ratio is not kept, so nothing is cropped away);
4. scaled to [0, 1] and normalised with the data module's `(mean, std)` (CIFAR) or left as is
   (two-circles, whose training pixels are raw values in [0, 1]).

Files that cannot be read as images are reported by name and skipped; hidden files (a name starting
with '.', such as `.DS_Store`) are ignored. The CSV has one row per
image: `file` (relative to the input folder), `class` (index) and `probability` (softmax of that
class). Nothing in the input folder is written; an existing output file is kept unless
`--overwrite` is given, and the CSV is written to a temporary file first, then renamed.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.transforms import v2

import vit.data  # noqa: F401  (the data module classes a checkpoint may name must be imported)
from vit.checks import first_line
from vit.data.image_folder import build_transform, to_input
from vit.training.callbacks import NonFiniteError, check_finite_weights
from vit.training.checkpointing import CheckpointError, fetch_checkpoint, read_checkpoint
from vit.training.classifier import ImageClassifier


class PredictError(ValueError):
    """Arguments or inputs that `vit.predict` cannot work with."""


def load_for_prediction(ckpt_path: str | os.PathLike) -> tuple[ImageClassifier, v2.Compose]:
    """The model (eval mode, CPU) and the input transform recorded in a LightningCLI checkpoint (a path or URL)."""
    ckpt_path = fetch_checkpoint(ckpt_path)
    checkpoint = read_checkpoint(ckpt_path)
    try:
        check_finite_weights(checkpoint["state_dict"], int(checkpoint.get("global_step", 0)))
    except NonFiniteError as err:
        raise CheckpointError(f"checkpoint {ckpt_path} is unusable: {str(err).split(';')[0]}") from err
    if "backbone" not in checkpoint.get("hyper_parameters", {}):
        raise CheckpointError(
            f"checkpoint {ckpt_path} does not record its backbone (it was not trained with train.py), "
            "so the model cannot be rebuilt from it"
        )
    if "_class_path" not in checkpoint.get("datamodule_hyper_parameters", {}):
        raise CheckpointError(
            f"checkpoint {ckpt_path} does not record its data module (it was not trained with train.py), "
            "so the image size, channels and normalisation are unknown"
        )
    model = ImageClassifier.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True).eval()
    datamodule = L.LightningDataModule.load_from_checkpoint(ckpt_path, weights_only=True)
    if not hasattr(datamodule, "normalization"):
        raise CheckpointError(
            f"data module {type(datamodule).__name__} of checkpoint {ckpt_path} does not say how its inputs are "
            "normalised (no `normalization` attribute)"
        )
    return model, build_transform(datamodule.img_size, datamodule.in_chans, datamodule.normalization)


def read_images(input_dir: Path, transform: v2.Compose) -> tuple[list[str], list[torch.Tensor], dict[str, str]]:
    """Names and tensors of the readable images directly in `input_dir` (sorted), and `{name: reason}` of the rest.

    Sub-folders are not searched and hidden files (`.DS_Store`, `._photo.jpg`) are ignored; a broken
    symbolic link, a link loop and an image over Pillow's decompression-bomb limit are skipped with
    the reason, like unreadable files.
    """
    names, images, skipped = [], [], {}
    for path in sorted(input_dir.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_symlink():
            try:
                path.resolve(strict=True)
            except FileNotFoundError:
                skipped[path.name] = "a symbolic link to nothing (dangling)"
                continue
            except (RuntimeError, OSError):
                skipped[path.name] = "a symbolic link loop"
                continue
        if not path.is_file():
            continue
        try:
            with Image.open(path) as image:
                image.load()  # decode now: a truncated file fails here, not later
                images.append(transform(to_input(image)))
            names.append(path.name)
        except Image.DecompressionBombError as err:
            skipped[path.name] = f"too large to decode safely ({str(err).split('.')[0]})"
        except (UnidentifiedImageError, OSError, ValueError) as err:
            skipped[path.name] = first_line(err)
    return names, images, skipped


@torch.no_grad()
def predict_folder(model: ImageClassifier, images: list[torch.Tensor], batch_size: int = 256,
                   device: str = "cpu") -> torch.Tensor:
    """Class probabilities `(N, num_classes)` of the images."""
    model.to(device)
    probs = [model(torch.stack(images[i : i + batch_size]).to(device)).softmax(dim=-1).cpu()
             for i in range(0, len(images), batch_size)]
    return torch.cat(probs)


def write_csv(output: Path, names: list[str], probs: torch.Tensor) -> None:
    """`file,class,probability` rows, written to a temporary file in the same folder, then renamed."""
    confidence, classes = probs.max(dim=-1)
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["file", "class", "probability"])
            for name, c, p in zip(names, classes.tolist(), confidence.tolist()):
                writer.writerow([name, c, f"{p:.6f}"])
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_paths(input_dir: Path, output: Path, overwrite: bool) -> None:
    """Refuse bad paths before any work: a missing input folder, an output inside it, or one that exists."""
    if not input_dir.is_dir():
        raise PredictError(f"--input_dir {input_dir} is not a folder" + ("" if input_dir.exists() else " (it does not exist)"))
    if input_dir.resolve() in output.resolve().parents:
        raise PredictError(f"--output {output} is inside --input_dir {input_dir}; write it elsewhere, the input folder is left untouched")
    if output.is_dir():
        raise PredictError(f"--output {output} is a folder; give a file name such as predictions.csv")
    if output.exists() and not overwrite:
        raise PredictError(f"--output {output} already exists; pass --overwrite to replace it")
    if not output.parent.is_dir():
        raise PredictError(f"--output {output}: its folder {output.parent} does not exist")
    try:
        with tempfile.TemporaryFile(dir=output.parent):
            pass
    except OSError as err:
        raise PredictError(f"--output {output}: its folder {output.parent} cannot be written ({err.strerror or err})") from None


def check_options(batch_size: int, device: str) -> None:
    """Refuse a batch size or device that cannot work, before any image is decoded."""
    if batch_size < 1:
        raise PredictError(f"--batch_size {batch_size} is not allowed: expected an int >= 1")
    try:
        target = torch.device(device)
    except RuntimeError:
        raise PredictError(f"--device {device!r} is not a device: expected cpu, cuda or cuda:N") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise PredictError(f"--device {device} was asked for, but this machine has no CUDA GPU: use --device cpu")
    if target.type == "cuda" and target.index is not None and target.index >= torch.cuda.device_count():
        raise PredictError(f"--device {device}: there are only {torch.cuda.device_count()} GPUs")
    if target.type not in ("cpu", "cuda"):
        raise PredictError(f"--device {device!r} is not supported: expected cpu, cuda or cuda:N")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vit.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by train.py")
    parser.add_argument("--input_dir", required=True, type=Path, help="folder of images (not searched recursively)")
    parser.add_argument("--output", required=True, type=Path, help="CSV file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        check_paths(args.input_dir, args.output, args.overwrite)
        check_options(args.batch_size, args.device)
        model, transform = load_for_prediction(args.ckpt_path)
    except (PredictError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    names, images, skipped = read_images(args.input_dir, transform)
    for name, reason in skipped.items():
        print(f"skipped {name}: not a readable image ({reason})", file=sys.stderr)
    if not images:
        print(f"error: no readable image in {args.input_dir}; nothing was written", file=sys.stderr)
        return 1
    write_csv(args.output, names, predict_folder(model, images, args.batch_size, args.device))
    print(f"wrote {len(names)} predictions to {args.output}" + (f"; skipped {len(skipped)} file(s)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
