"""`python -m vit.explain`: relevance maps of a checkpoint's test images, one column per method, as an image.

    python -m vit.explain --ckpt_path runs/two_circles/vit/version_0/checkpoints/last.ckpt \\
        --method rollout,chefer,gradcam --out maps.png

Works for any checkpoint written by `train.py`, the CNN included (it gets `gradcam` and `random`).
The images are the first `--num_images` of the checkpoint's data module's test split; each row is
titled with the label, the prediction and its probability.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

import vit.data  # noqa: F401  (the data module classes a checkpoint may name must be imported)
from vit.explain.plot import rollout_grid
from vit.explain.relevance import ATTENTION_METHODS, METHODS, has_attention, relevance
from vit.training.checkpointing import CheckpointError, fetch_checkpoint, read_checkpoint
from vit.training.classifier import ImageClassifier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vit.explain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="checkpoint written by train.py")
    parser.add_argument("--method", default="rollout,chefer,gradcam", help=f"comma-separated, from {list(METHODS)}")
    parser.add_argument("--out", required=True, type=Path, help="image file to write (.png, .pdf, .svg, ...)")
    parser.add_argument("--num_images", type=int, default=6)
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    try:
        bad = [m for m in methods if m not in METHODS]
        if bad or not methods:
            raise ValueError(f"--method {args.method!r}: {bad or 'nothing'} is not allowed: expected names from {list(METHODS)}")
        if args.num_images < 1:
            raise ValueError(f"--num_images {args.num_images} is not allowed: expected an int >= 1")
        check_image_format(args.out)
        if args.out.exists() and not args.overwrite:
            raise ValueError(f"--out {args.out} already exists; pass --overwrite to replace it")
        if not args.out.parent.is_dir():
            raise ValueError(f"--out {args.out}: its folder {args.out.parent} does not exist")
        args.ckpt_path = fetch_checkpoint(args.ckpt_path)  # a URL is downloaded, then checked like a file
        checkpoint = read_checkpoint(args.ckpt_path)
        if "_class_path" not in checkpoint.get("datamodule_hyper_parameters", {}):
            raise CheckpointError(f"checkpoint {args.ckpt_path} does not record its data module (it was not "
                                  "trained with train.py), so there are no test images to explain")
        model = ImageClassifier.load_from_checkpoint(args.ckpt_path, map_location="cpu", weights_only=True).eval()
        backbone = model.backbone
        if not has_attention(backbone):
            unusable = [m for m in methods if m in ATTENTION_METHODS]
            if unusable:
                raise ValueError(f"--method {','.join(unusable)} needs attention layers; "
                                 f"{type(backbone).__name__} has none: use gradcam or random")
    except (ValueError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    data = L.LightningDataModule.load_from_checkpoint(args.ckpt_path, weights_only=True)
    data.setup("test")
    batch = [data.test_set[i] for i in range(min(args.num_images, len(data.test_set)))]
    x, y = torch.stack([b[0] for b in batch]), torch.tensor([int(b[1]) for b in batch])
    maps = {method: relevance(backbone, x, method) for method in methods}
    with torch.no_grad():
        confidence, predicted = backbone(x).softmax(-1).max(-1)
    titles = [f"y={int(t)} pred={int(p)} ({c:.2f})" for t, p, c in zip(y, predicted, confidence)]
    figure = rollout_grid(x, maps, titles=titles)  # each map drawn min-max scaled
    figure.savefig(args.out, dpi=80)
    print(f"wrote {args.out}: {len(batch)} images x {len(methods)} methods")
    return 0


def check_image_format(out: Path) -> None:
    """Raise `ValueError` unless matplotlib can write `out` in the format its extension names.

    Without an extension matplotlib would append one and write another file than `out`.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if out.suffix.lower().lstrip(".") not in formats:
        raise ValueError(f"--out {out}: {out.suffix or 'no extension'} is not an image format matplotlib writes: "
                         f"expected a name ending in one of {', '.join('.' + f for f in formats)}")


if __name__ == "__main__":
    sys.exit(main())
