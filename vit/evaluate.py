"""Score a trained model on a labelled folder of your images, every image of it, as timm's `validate.py` does.

    python -m vit.evaluate --ckpt_path runs/folder/finetune_vit/version_0/checkpoints/last \\
        --input_dir labelled/ --output metrics.json

The folder holds one sub-folder per class (torchvision's `ImageFolder` layout), each matched to the model's class of
the same name: a folder no class of the model is named after is refused, naming it; a class without a folder is
named in a note and scores nothing. Printed and written as JSON (`--output`): the number of images scored, top-1 and
top-5 accuracy (top-5 with at least 5 classes), each class's count and accuracy, and the confusion matrix (a row per
true class, a column per predicted one, in the model's class order). Unreadable images are named and skipped. In
Python: `vit.load(...).evaluate("labelled/")` gives the same dictionary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vit.commands import check_output, fail, parser, print_skipped, run, write_failed, write_whole
from vit.scoring import EvaluateError, class_folders, listed

if TYPE_CHECKING:  # imported where used, after the arguments are parsed: `--help` loads no torch
    from vit.api import Predictor


def main(argv: list[str] | None = None) -> int:
    options = parser("vit.evaluate", __doc__)
    options.add_argument("--ckpt_path", required=True, help="model folder or checkpoint (as vit.predict takes)")
    options.add_argument("--input_dir", required=True, type=Path, help="folder of one sub-folder of images per class")
    options.add_argument("--output", type=Path, help="JSON file to write the metrics to (default: printed only)")
    options.add_argument("--overwrite", action="store_true", help="replace --output if it exists (a regular file only)")
    options.add_argument("--batch_size", type=int, default=256, help="images per forward pass")
    options.add_argument("--num_workers", type=int, default=2, help="processes decoding images (at most the cores)")
    options.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N or mps")
    options.add_argument(
        "--precision", default="32", choices=["32", "bf16", "fp16"], help="autocast the model to bfloat16 or float16"
    )
    return run(options.parse_args(argv), prepare, evaluate)


def prepare(args: argparse.Namespace) -> Predictor:
    """The arguments and the folder's classes checked, then the model on `--device`."""
    from vit.api import MAX_BATCH_SIZE, load, resolve_device

    if not 1 <= args.batch_size <= MAX_BATCH_SIZE:
        raise EvaluateError(f"--batch_size {args.batch_size} is not allowed: expected an int in [1, {MAX_BATCH_SIZE}]")
    if args.num_workers < 0:
        raise EvaluateError(f"--num_workers {args.num_workers} is not allowed: expected an int >= 0")
    if args.output is not None:
        if args.input_dir.resolve() in args.output.resolve().parents:
            raise EvaluateError(f"--output {args.output} is inside --input_dir {args.input_dir}; write it elsewhere")
        check_output("--output", args.output, args.overwrite)
    predictor = load(args.ckpt_path, resolve_device(args.device, "--device "), args.precision)
    class_folders(args.input_dir, predictor.class_names)  # refuse a folder of other classes before any work
    return predictor


def evaluate(args: argparse.Namespace, predictor: Predictor) -> int:
    """Score the folder, print the metrics, write them to `--output`; 1 when nothing could be scored."""
    from vit.api import NonFiniteError

    try:
        result = predictor.evaluate(args.input_dir, args.batch_size, args.num_workers)
    except (EvaluateError, NonFiniteError) as err:
        return fail(f"{err}; nothing was written", status=1)
    print_skipped(result["skipped"])
    if result["classes_without_images"]:
        print(f"note: no folder for class(es) {listed(result['classes_without_images'])}", file=sys.stderr)
    print(report(result))
    if args.output is not None:
        try:
            write_json(args.output, result)
        except OSError as err:
            return write_failed("--output", args.output, err)
        print(f"wrote {args.output}")
    return 0


def report(result: dict) -> str:
    """The metrics as a person reads them: the totals, then one line per class."""
    lines = [f"images: {result['images']}", f"top-1 accuracy: {result['top1']:.4f}"]
    if "top5" in result:
        lines.append(f"top-5 accuracy: {result['top5']:.4f}")
    width = max(len(name) for name in result["per_class"])
    for name, scores in result["per_class"].items():
        accuracy = "-" if scores["accuracy"] is None else f"{scores['accuracy']:.4f}"
        lines.append(f"  {name:<{width}}  {scores['images']:>6} images  accuracy {accuracy}")
    return "\n".join(lines)


def write_json(path: Path, result: dict) -> None:
    """`result` as JSON into `path`, whole (`vit.commands.write_whole`)."""

    def fill(f) -> bool:
        json.dump(result, f, indent=2)
        f.write("\n")
        return True

    write_whole(path, fill)


if __name__ == "__main__":
    sys.exit(main())
