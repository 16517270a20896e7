"""Classify a folder of your own images with a trained checkpoint and write the predictions to a CSV.

    python -m vit.predict --ckpt_path runs/two_circles/vit/version_0/checkpoints/last.ckpt \\
        --input_dir my_images/ --output predictions.csv

Everything comes from the checkpoint alone; unreadable images are reported by name and skipped. The CSV has one
row per image: `file`, `class_name`, `class_index`, `probability`, and `class_name_2`, ... with `--topk`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from vit.commands import Progress, check_output, fail, parser, print_skipped, run, write_failed

if TYPE_CHECKING:  # imported where used, after the arguments are parsed: `--help` loads no torch
    from vit.api import Predictor
    from vit.data.images import ImageFiles


class PredictError(ValueError):
    """Arguments or inputs that `vit.predict` cannot work with."""


def check_paths(input_dir: Path, output: Path, overwrite: bool) -> None:
    """Refuse bad paths before any work: a missing input folder, an output inside it, or one that cannot be written."""
    if not input_dir.is_dir():
        raise PredictError(
            f"--input_dir {input_dir} is not a folder" + ("" if input_dir.exists() else " (it does not exist)")
        )
    if input_dir.resolve() in output.resolve().parents:
        raise PredictError(
            f"--output {output} is inside --input_dir {input_dir}; write it elsewhere, "
            "the input folder is left untouched"
        )
    check_output("--output", output, overwrite)
    try:
        tempfile.TemporaryFile(dir=output.parent).close()
    except OSError as err:
        raise PredictError(
            f"--output {output}: its folder {output.parent} cannot be written ({err.strerror or err})"
        ) from None


def listed_files(input_dir: Path, recursive: bool, transform) -> ImageFiles:
    """The files to classify: those directly in `input_dir`, or with `recursive` every file under it (links to a
    folder listed once, hidden ones left out), named by their path under it; a note names the sub-folders left out."""
    import os

    from vit.data.files import list_files, text_name, visible_folders
    from vit.data.images import ImageFiles, image_files

    if not recursive:
        folders = visible_folders(input_dir)
        if folders:
            shown = ", ".join(f"{text_name(f)}/" for f in folders[:5]) + (", ..." if len(folders) > 5 else "")
            print(
                f"note: {len(folders)} sub-folder(s) of {input_dir} not searched ({shown}): pass --recursive",
                file=sys.stderr,
            )
        return ImageFiles(image_files(input_dir), transform)
    [paths], unlisted = list_files([str(input_dir)])
    print_skipped({os.path.relpath(path, input_dir): why for path, why in unlisted.items()})
    files = ImageFiles([Path(path) for path in paths], transform)
    files.names = [text_name(os.path.relpath(path, input_dir)) for path in paths]
    return files


def main(argv: list[str] | None = None) -> int:
    options = parser("vit.predict", __doc__)
    options.add_argument("--ckpt_path", required=True, help="checkpoint written by train.py (a path or URL)")
    options.add_argument("--input_dir", required=True, type=Path, help="folder of images")
    options.add_argument(
        "--recursive", action="store_true", help="also the images in --input_dir's sub-folders (named sub/file.jpg)"
    )
    options.add_argument("--output", required=True, type=Path, help="CSV file to write")
    options.add_argument("--overwrite", action="store_true", help="replace --output if it exists (a regular file only)")
    options.add_argument("--topk", type=int, default=1, help="write the K most probable classes of each image")
    options.add_argument("--batch_size", type=int, default=256, help="images per forward pass")
    options.add_argument("--num_workers", type=int, default=2, help="processes decoding images (at most the cores)")
    options.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N or mps")
    options.add_argument(
        "--precision",
        default="32",
        choices=["32", "bf16", "fp16"],
        help="autocast the model to bfloat16 or float16 (fp16: on a GPU)",
    )
    return run(options.parse_args(argv), prepare, predict)


def prepare(args: argparse.Namespace) -> Predictor:
    """The arguments checked, then the checkpoint's model on `--device`, ready for inference."""
    from vit.api import MAX_BATCH_SIZE, load, resolve_device
    from vit.checks import check_topk

    check_paths(args.input_dir, args.output, args.overwrite)
    if not 1 <= args.batch_size <= MAX_BATCH_SIZE:
        raise PredictError(f"--batch_size {args.batch_size} is not allowed: expected an int in [1, {MAX_BATCH_SIZE}]")
    for option, value, minimum in (("topk", args.topk, 1), ("num_workers", args.num_workers, 0)):  # maxima: below
        if value < minimum:
            raise PredictError(f"--{option} {value} is not allowed: expected an int >= {minimum}")
    predictor = load(args.ckpt_path, resolve_device(args.device, "--device "), args.precision)
    check_topk(args.topk, len(predictor.class_names))
    return predictor


def predict(args: argparse.Namespace, predictor: Predictor) -> int:
    """Classify `--input_dir`'s readable images batch by batch, writing rows as they come; 1 if none, no CSV, or the
    model's probabilities for an image are NaN or infinite (then nothing is written: no row of NaN, no CSV lacking
    the image)."""
    import torch

    from vit.api import INPUT_BYTES, NonFiniteError, fitting_batch_size
    from vit.prediction_csv import prediction_table, write_csv

    files, skipped, names = listed_files(args.input_dir, args.recursive, predictor.transform), {}, predictor.class_names
    batch_size = fitting_batch_size(args.batch_size, predictor.inputs)  # before any image is decoded
    if batch_size < args.batch_size:
        channels, (height, width) = predictor.inputs["in_chans"], predictor.inputs["img_size"]
        print(
            f"note: --batch_size {args.batch_size} images of {channels} x {height} x {width} would hold "
            f"{args.batch_size * 4 * channels * height * width / 2**30:.1f} GiB of input; decoding {batch_size} "
            f"per batch (at most {INPUT_BYTES / 2**30:g} GiB)",
            file=sys.stderr,
        )

    def rows():  # each batch's rows; progress on stderr (`vit.commands.Progress`)
        progress = Progress(str(args.input_dir), len(files), "images")
        for indices, probs, skipped_here in predictor.file_batches(files, batch_size, args.num_workers):
            skipped.update(skipped_here)
            if probs is not None:
                yield from prediction_table([files.names[i] for i in indices], probs, names, args.topk)[1]
            progress.update(len(indices) + len(skipped_here))
        progress.close()

    header = prediction_table([], torch.zeros(0, len(names)), names, args.topk)[0]
    try:
        count = write_csv(args.output, header, rows(), keep_empty=False)
    except OSError as err:  # a full disk: write_csv has removed its temporary file, --output is untouched
        return write_failed("--output", args.output, err)
    except NonFiniteError as err:  # no row is written for it, and no CSV that would lack it
        return fail(f"{err}; nothing was written", status=1)
    print_skipped(skipped)
    if not count:
        return fail(f"no readable image in {args.input_dir}; nothing was written", status=1)
    print(f"wrote {count} predictions to {args.output}" + (f"; skipped {len(skipped)} file(s)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
