"""`python -m vit.explain`: relevance maps of your images (or of a checkpoint's test images), one column per method.

    python -m vit.explain --ckpt_path runs/folder/finetune_vit/version_0/checkpoints/last.ckpt \\
        --input_dir new_photos/ --method all --out maps.png
    python -m vit.explain --ckpt_path CKPT --image cat.jpg --target dog --out why_not_dog.png

Works for any checkpoint written by `train.py` (the CNN gets `gradcam` and `random`); without images, the
checkpoint's test split. The class-specific methods (`CLASS_METHODS`) explain the prediction or `--target`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vit.commands import Progress, check_output, fail, parser, print_skipped, run
from vit.explain.methods import CLASS_METHODS, FACTS, METHODS, SCALES

if TYPE_CHECKING:  # imported where used, after the arguments are parsed: `--help` loads no torch
    import lightning as L
    import torch
    from torch import nn
    from torchvision.transforms import v2


@dataclass(frozen=True)
class Prepared:
    """What `prepare` opened before any work: the model and its class names, its input transform and the colour
    transform the images are drawn with, the methods to draw, the `--target` class, and the checkpoint's test data
    when no image is given."""

    model: nn.Module
    class_names: list[str]
    transform: v2.Compose
    colour: v2.Compose
    methods: list[str]
    target: int | None
    data: L.LightningDataModule | None


def main(argv: list[str] | None = None) -> int:
    options = parser("vit.explain", __doc__)
    options.add_argument("--ckpt_path", required=True, help="checkpoint written by train.py (a path or URL)")
    source = options.add_mutually_exclusive_group()
    source.add_argument("--input_dir", type=Path, help="folder of images to explain (not searched recursively)")
    source.add_argument("--image", type=Path, action="append", help="an image to explain (repeat for more)")
    options.add_argument(
        "--method",
        default="rollout,chefer,gradcam",
        help=f"comma-separated, from {list(METHODS)}, or 'all' (what the model allows, less "
        f"{'/'.join(m for m in METHODS if FACTS[m].baseline)})",
    )
    options.add_argument("--target", help="class to explain (a name or an index); default: each image's prediction")
    options.add_argument("--out", required=True, type=Path, help="image file to write (.png, .pdf, .svg, ...)")
    options.add_argument("--num_images", type=int, default=6, help="at most this many images (rows)")
    options.add_argument(
        "--scale",
        choices=SCALES,
        default="row",
        help="which maps share one colour scale, from 0 to their largest value: each image's row "
        "(a flat map looks flat beside a peaked one), the whole figure (rows comparable too), "
        "or each panel alone, from its own min to max (every map looks sharp, however flat)",
    )
    options.add_argument(
        "--save_maps",
        "--save-maps",  # the spelling of earlier releases; the commands spell options with underscores
        dest="save_maps",
        type=Path,
        help="also write the raw maps to this .npz: one (B, gh, gw) array per method, and files, "
        "predicted, probability, class_names, methods, target (-1: each prediction)",
    )
    options.add_argument(
        "--overwrite", action="store_true", help="replace --out and --save_maps if they exist (regular files only)"
    )
    return run(options.parse_args(argv), prepare, explain)


def prepare(args: argparse.Namespace) -> Prepared:
    """Check the arguments, open the checkpoint: model, transforms (input; colour image), methods, target, data."""
    import vit.artifact as artifact
    from vit.checks import CheckpointError, class_index
    from vit.explain.relevance import usable_methods
    from vit.registry import inference_transform, test_data

    methods = parse_methods(args.method)
    if args.num_images < 1:
        raise ValueError(f"--num_images {args.num_images} is not allowed: expected an int >= 1")
    check_paths(args)
    ckpt = artifact.load(args.ckpt_path)
    model = ckpt.model
    colour = inference_transform({**ckpt.inputs, "in_chans": 3, "mean": None})
    usable = usable_methods(model, methods, option="--method ")
    methods = [m for m in usable if not FACTS[m].baseline] if methods == ["all"] else usable
    target = None if args.target is None else class_index(args.target, ckpt.class_names, option="--target ")
    try:  # without images, the checkpoint's own test images
        data = test_data(ckpt.data, ckpt.inputs, ckpt.source) if args.input_dir is None and not args.image else None
    except CheckpointError as err:
        raise CheckpointError(f"{err}; give images to explain with --input_dir or --image") from err
    return Prepared(model, ckpt.class_names, inference_transform(ckpt.inputs), colour, methods, target, data)


def explain(args: argparse.Namespace, prepared: Prepared) -> int:
    """Draw the relevance maps over the images in colour, one row per image, a column per method; 1 without an image."""
    import torch

    from vit.explain.plot import rollout_grid
    from vit.explain.relevance import relevance

    backbone, names, methods, target = prepared.model, prepared.class_names, prepared.methods, prepared.target
    if prepared.data is None:
        read = _your_images(args, prepared)
        if read is None:
            return fail("no readable image to explain; nothing was written", status=1)
        x, shown, files = read
        labels = None
    else:  # the checkpoint's own test images, with their labels
        prepared.data.setup("test")
        test_set = prepared.data.test_set
        batch = [test_set[i] for i in range(min(args.num_images, len(test_set)))]
        shown = x = torch.stack([b[0] for b in batch])  # generated: drawn as the model sees them
        labels, files = [int(b[1]) for b in batch], [f"test image {i}" for i in range(len(batch))]

    with torch.no_grad():
        probs = backbone(x).softmax(-1)  # (B, num_classes)
    maps, progress = {}, Progress(f"explaining {len(x)} images", len(methods), "methods", every=0)
    try:  # a line per method (flow and Chefer's take seconds each), with the time left
        for method in methods if torch.isfinite(probs).all() else []:  # an overflowing model: no map to compute
            explains_target = target is not None and method in CLASS_METHODS
            column = f"{method}: {names[target]}" if explains_target else method
            maps[column] = relevance(backbone, x, method, target if explains_target else None)
            progress.update(note=method)
    finally:
        progress.close()
    finite = torch.isfinite(probs).all(dim=-1)  # (B,)
    for m in maps.values():
        finite &= torch.isfinite(m).flatten(1).all(dim=1)
    if not finite.all():  # from finite pixels: the model's arithmetic overflows; no figure of NaN maps is drawn
        return fail(
            f"{files[int((~finite).nonzero()[0])]}: the model's probabilities or relevance maps are NaN or "
            "infinite although the image is finite (its logits overflow float32); nothing was written",
            status=1,
        )
    rollout_grid(shown, maps, titles=row_titles(files, probs, names, labels, target), scale=args.scale).savefig(
        args.out, dpi=80
    )
    print(f"wrote {args.out}: {len(x)} images x {len(methods)} methods")
    if args.save_maps is not None:
        save_maps(args.save_maps, dict(zip(methods, maps.values())), files, probs, names, target)
        print(f"wrote {args.save_maps}: the maps of {list(methods)}")
    return 0


def _your_images(args: argparse.Namespace, prepared: Prepared):
    """`(model inputs, RGB images as decoded, names)` of the first `--num_images` readable images (only those, and
    the unreadable ones before them, decoded), the skipped ones named; None when none is readable."""
    import torch

    from vit.data.images import NON_FINITE, ImageFiles, image_files, readable_batches

    transform, colour = prepared.transform, prepared.colour
    paths = image_files(args.input_dir) if args.input_dir is not None else args.image
    images = ImageFiles(paths, transform)  # JPEGs drafted at the model's size
    images.transform = lambda image: torch.cat([transform(image), colour(image)])  # one decode, (C + 3, H, W)
    files, x, skipped = [], [], {}
    for indices, batch, unread in readable_batches(images, 1):
        skipped.update({images.names[i]: why for i, why in unread.items()})
        if batch is not None and not torch.isfinite(batch).all():  # the file's fault: skipped, as unreadable
            skipped[images.names[indices[0]]] = NON_FINITE
            continue
        files += [images.names[i] for i in indices]
        x += [] if batch is None else [batch[0]]
        if len(x) == args.num_images:
            break
    print_skipped(skipped)
    if not x:
        return None
    if len(x) + len(skipped) < len(paths):
        print(
            f"note: explaining the first {len(x)} readable images of {len(paths)} files (--num_images)", file=sys.stderr
        )
    model_input, shown = torch.stack(x).tensor_split([-3], dim=1)  # the input; RGB as decoded, unnormalised
    return model_input, shown, files


def save_maps(
    path: Path,
    maps: dict[str, torch.Tensor],
    files: list[str],
    probs: torch.Tensor,
    class_names: list[str],
    target: int | None,
) -> None:
    """Write the raw maps, method -> `(B, gh, gw)`, with what the rows are, to an `.npz` (plain arrays, no pickles)."""
    import numpy as np

    confidence, predicted = probs.max(dim=-1)
    np.savez(
        path,
        **{method: m.detach().cpu().numpy() for method, m in maps.items()},
        methods=np.array(list(maps)),
        files=np.array(files),
        predicted=predicted.numpy(),
        probability=confidence.numpy(),
        class_names=np.array(class_names),
        target=np.array(-1 if target is None else target),
    )


def parse_methods(text: str) -> list[str]:
    """The methods of `--method` (comma-separated, or `all`); `ValueError` naming what is not a method."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if methods == ["all"]:
        return methods
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(
            f"--method {text!r}: {bad or 'nothing'} is not allowed: expected names from {list(METHODS)} or 'all'"
        )
    return methods


def row_titles(
    files: list[str], probs: torch.Tensor, class_names: list[str], labels: list[int] | None, target: int | None
) -> list[str]:
    """Each row's title: the image, its label (test images), the predicted class and probability, and the target's."""
    (confidence, predicted), titles = probs.max(dim=-1), []
    for i, (file, c, p) in enumerate(zip(files, confidence.tolist(), predicted.tolist())):
        lines = [file] + ([f"label {class_names[labels[i]]}"] if labels is not None else [])
        lines.append(f"predicted {class_names[p]} ({c:.2f})")
        if target is not None and target != p:
            lines.append(f"target {class_names[target]} ({float(probs[i, target]):.2f})")
        titles.append("\n".join(lines))
    return titles


def check_paths(args: argparse.Namespace) -> None:
    """Raise `ValueError`, before any work, for outputs that cannot be written or images that are not there."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if args.out.suffix.lower().lstrip(".") not in formats:
        raise ValueError(
            f"--out {args.out}: {args.out.suffix or 'no extension'} is not an image format matplotlib "
            f"writes: expected a name ending in one of {', '.join('.' + f for f in formats)}"
        )
    check_output("--out", args.out, args.overwrite)
    if args.save_maps is not None:
        if args.save_maps.suffix != ".npz":
            raise ValueError(f"--save_maps {args.save_maps}: expected a name ending in .npz")
        check_output("--save_maps", args.save_maps, args.overwrite)
    if args.input_dir is not None and not args.input_dir.is_dir():
        raise ValueError(
            f"--input_dir {args.input_dir} is not a folder"
            + ("" if args.input_dir.exists() else " (it does not exist)")
        )
    for image in args.image or []:
        if not image.is_file():
            raise ValueError(f"--image {image} is not a file" + ("" if image.exists() else " (it does not exist)"))


if __name__ == "__main__":
    sys.exit(main())
