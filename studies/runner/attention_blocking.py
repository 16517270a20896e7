"""Does attention carry the relation? Block attention between the two strokes at test time and measure.

    python -m studies.runner.attention_blocking --ckpt_paths runs/same_different/vit/version_*/checkpoints/step*.ckpt \
        --out_dir studies/recipe/results/same_different/attention_blocking --name recipe

For each trained ViT (a `same_different` checkpoint written by `train.py`) and each test image, the
tokens that *see* stroke A are those whose receptive window in the patch embedding (found by
gradients, so it holds for overlapping patches and convolutional stems) touches one of A's ink
pixels; likewise for B. Then, in every attention layer at once (`vit.models.masks.mask_attention`):

* `none`: nothing blocked (the model's own accuracy);
* `cross`: A's tokens may not attend to B's, nor B's to A's;
* `random`: as many (query, key) pairs as `cross` blocks in that image, drawn at random among all
  pairs of distinct tokens (the control for blocking that many pairs);
* `within`: each stroke's tokens may not attend to the other tokens of the same stroke;
* `isolate`: B's tokens attend only to each other, and no other token attends to them: B's
  information never leaves B's tokens and nothing enters them, so no token ever holds both
  strokes (the mean pooling then adds a part that knows A to a part that knows B);
* `isolate_random`: the same for as many tokens that see neither stroke (its control);
* `self_only`: every token attends only to itself, which makes the model a bag of local
  features (no token ever reads another).

For a model with a CLS token, the CLS token's own reading (`CLS_CONDITIONS`, in every layer):

* `cls_a`, `cls_b`: the CLS token may not attend to the tokens that see part A (B);
* `cls_parts`: to neither part's tokens (it can still read what other tokens took from them);
* `cls_random`: to as many tokens that see neither part (the control for `cls_parts`);
* `cls_self`: to nothing but itself: it never reads the image, so the head sees a constant.

The same conditions apply to the two discs of the `arrangement` task (its parts A and B).

Images where a token sees both strokes (they lie closer than a receptive window) are left out:
there the relation can be read by the patch embedding alone. The accuracy of each condition on the
remaining test images goes to `<out_dir>/runs.csv`, one row per checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import yaml

import vit.artifact as artifact
from studies.runner import arrangement
from studies.runner.arrangement import ArrangementDataModule
from studies.runner.models import StudyViT
from studies.runner.rows import append_rows
from vit.checks import CheckpointError, check_size
from vit.commands import EitherSpelling
from vit.data import SameDifferentDataModule
from vit.data.same_different import make_shapes, render
from vit.models import VisionTransformer
from vit.models.masks import mask_attention
from vit.registry import allow_backbone, check_data, test_data

allow_backbone(StudyViT)  # the studies' ViT checkpoints (local attention, a sized learned table) open here

CONDITIONS = ("none", "cross", "random", "within", "isolate", "isolate_random", "self_only")
CLS_CONDITIONS = ("cls_a", "cls_b", "cls_parts", "cls_random", "cls_self")


def receptive_windows(model, img_size: int | tuple[int, int], in_chans: int) -> torch.Tensor:
    """`(num_patches, H, W)` bool: the pixels each token's patch embedding reads (nonzero gradient)."""
    embed = model.patch_embed
    return _windows(embed, img_size, in_chans)


@torch.enable_grad()
def _windows(embed, img_size: int | tuple[int, int], in_chans: int) -> torch.Tensor:
    was_training = embed.training
    embed.eval()
    x = torch.randn(1, in_chans, *check_size("img_size", img_size), dtype=torch.float64, requires_grad=True)
    embed64 = embed.double()
    tokens = embed64(x)[0]  # (N, D)
    windows = []
    for t in range(tokens.shape[0]):
        (grad,) = torch.autograd.grad(tokens[t].sum(), x, retain_graph=True)
        windows.append(grad[0].abs().sum(0) > 0)
    embed.float().train(was_training)
    return torch.stack(windows)


def stroke_tokens(
    windows: torch.Tensor, positions: torch.Tensor, shape_ids: torch.Tensor, img_size: int | tuple[int, int]
) -> torch.Tensor:
    """`(n, 2, num_patches)` bool: for each image and stroke, the tokens whose window touches its ink."""
    shapes = make_shapes()
    out = []
    for k in range(2):
        ink = (
            torch.from_numpy(
                render(
                    positions[:, k : k + 1].repeat(1, 2, 1).numpy(),
                    shape_ids[:, k : k + 1].repeat(1, 2).numpy(),
                    shapes,
                    img_size,
                )
            )
            > 0
        )
        out.append((ink[:, None] & windows[None]).flatten(2).any(-1))  # (n, N)
    return torch.stack(out, 1)


def _first(test, n: int):
    """A view of the first ``n`` images of an in-memory synthetic test set, with the metadata blocking reads."""
    from types import SimpleNamespace

    names = ("images", "labels", "positions", "shape_ids")
    return SimpleNamespace(
        img_size=test.img_size, in_chans=test.in_chans, **{k: getattr(test, k)[:n] for k in names if hasattr(test, k)}
    )


def part_tokens(windows: torch.Tensor, test) -> torch.Tensor:
    """`(n, 2, num_patches)` bool: the tokens that see each part of every image of a `same_different`
    (strokes) or `arrangement` (discs) test set."""
    if hasattr(test, "shape_ids"):
        return stroke_tokens(windows, test.positions, test.shape_ids, test.img_size)
    out = []
    for k in range(2):  # one disc: both of render's discs at the same place
        both = test.positions[:, k : k + 1].repeat(1, 2, 1).numpy()
        ink = torch.from_numpy(arrangement.render(both, test.img_size)) > 0
        out.append((ink[:, None] & windows[None]).flatten(2).any(-1))  # (n, N)
    return torch.stack(out, 1)


def _random_free_tokens(
    a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """`(n, N)` bool: in image `i`, `counts[i]` tokens drawn at random among those that see neither part."""
    group = torch.zeros_like(a)
    for i, count in enumerate(counts.tolist()):
        free = (~(a[i] | b[i])).nonzero().squeeze(1)
        group[i, free[torch.randperm(len(free), generator=generator)[:count]]] = True
    return group


def _cls_allowed(
    condition: str, a: torch.Tensor, b: torch.Tensor, prefix: int, generator: torch.Generator
) -> torch.Tensor:
    """`(n, 1, T, T)` bool for a CLS condition: only the CLS token's row (query 0) loses keys."""
    n, num_patches = a.shape
    allowed = torch.ones(n, prefix + num_patches, prefix + num_patches, dtype=torch.bool)
    if condition == "cls_self":
        allowed[:, 0] = False
        allowed[:, 0, 0] = True
    else:
        if condition == "cls_random":
            group = _random_free_tokens(a, b, (a | b).sum(1), generator)
        else:
            group = {"cls_a": a, "cls_b": b, "cls_parts": a | b}[condition]
        allowed[:, 0, prefix:] = ~group
    return allowed[:, None]


def allowed_pairs(condition: str, sees: torch.Tensor, prefix: int, generator: torch.Generator) -> torch.Tensor:
    """`(n, 1, T, T)` bool, True where a query may attend to a key, T = prefix + num_patches tokens."""
    n, _, num_patches = sees.shape
    a, b = sees[:, 0], sees[:, 1]  # (n, N)
    eye = torch.eye(num_patches, dtype=torch.bool)
    if condition in CLS_CONDITIONS:
        if prefix < 1:
            raise ValueError(f"condition={condition!r} needs a model with a CLS token (pool='cls')")
        return _cls_allowed(condition, a, b, prefix, generator)
    if condition == "none":
        blocked = torch.zeros(n, num_patches, num_patches, dtype=torch.bool)
    elif condition == "cross":
        blocked = (a[:, :, None] & b[:, None, :]) | (b[:, :, None] & a[:, None, :])
    elif condition == "within":
        blocked = ((a[:, :, None] & a[:, None, :]) | (b[:, :, None] & b[:, None, :])) & ~eye
    elif condition in ("isolate", "isolate_random"):
        group = b
        if condition == "isolate_random":
            group = _random_free_tokens(a, b, b.sum(1), generator)
        blocked = group[:, :, None] ^ group[:, None, :]  # in the group to outside it, and outside to in
    elif condition == "self_only":
        blocked = ~eye.expand(n, -1, -1)
    elif condition == "random":
        cross = (a[:, :, None] & b[:, None, :]) | (b[:, :, None] & a[:, None, :])
        blocked = torch.zeros(n, num_patches * num_patches, dtype=torch.bool)
        off_diagonal = (~eye).flatten().nonzero().squeeze(1)
        for i, count in enumerate(cross.flatten(1).sum(1).tolist()):
            chosen = off_diagonal[torch.randperm(len(off_diagonal), generator=generator)[:count]]
            blocked[i, chosen] = True
        blocked = blocked.view(n, num_patches, num_patches)
    else:
        raise ValueError(f"condition={condition!r} is not allowed: expected one of {list(CONDITIONS + CLS_CONDITIONS)}")
    allowed = torch.ones(n, prefix + num_patches, prefix + num_patches, dtype=torch.bool)
    allowed[:, prefix:, prefix:] = ~blocked
    return allowed[:, None]


@torch.no_grad()
def blocking_accuracies(
    ckpt_path: str | Path,
    seed: int = 0,
    batch_size: int = 250,
    conditions: tuple[str, ...] = CONDITIONS,
    max_images: int | None = None,
) -> dict[str, float]:
    """Test accuracy of one checkpoint under each condition, on the images whose parts no token sees both of
    (a CLS condition is "" for a model without a CLS token); with ``max_images``, on the first so many
    test images only."""
    opened = artifact.load(ckpt_path)
    model, data_class = opened.model, check_data(opened.data)[0] if opened.data is not None else None
    if not isinstance(model, VisionTransformer) or data_class not in (SameDifferentDataModule, ArrangementDataModule):
        raise CheckpointError(
            f"{opened.source} holds a {type(model).__name__} trained on "
            f"{getattr(data_class, '__name__', 'unrecorded data')}: attention blocking "
            "needs a VisionTransformer trained on SameDifferentDataModule or ArrangementDataModule, "
            "whose test images say where the two parts are"
        )
    data = test_data(opened.data, opened.inputs, opened.source)
    data.setup("test")
    test = data.test_set
    if max_images is not None and max_images < len(test):
        test = _first(test, max_images)
    windows = receptive_windows(model, test.img_size, test.in_chans)
    sees = part_tokens(windows, test)
    separate = ~(sees[:, 0] & sees[:, 1]).any(1)
    x, y, sees = test.images[separate], test.labels[separate], sees[separate]
    generator = torch.Generator().manual_seed(seed)
    config = Path(ckpt_path).resolve().parents[1] / "config.yaml"  # the run folder's resolved config
    seed_everything = yaml.safe_load(config.read_text()).get("seed_everything", "") if config.exists() else ""
    result = {
        "ckpt_path": str(ckpt_path),
        "seed_everything": seed_everything,
        "images": int(separate.sum()),
        "left_out": int((~separate).sum()),
    }
    for condition in conditions:
        if condition in CLS_CONDITIONS and not model.num_prefix_tokens:
            result[condition] = ""
            continue
        correct = 0
        for i in range(0, len(y), batch_size):
            allowed = allowed_pairs(condition, sees[i : i + batch_size], model.num_prefix_tokens, generator)
            with mask_attention(model, allowed):
                correct += (model(x[i : i + batch_size]).argmax(-1) == y[i : i + batch_size]).sum().item()
        result[condition] = round(correct / len(y), 4)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = EitherSpelling(prog="python -m studies.runner.attention_blocking", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ckpt_paths", nargs="+", required=True, help="same_different or arrangement ViT checkpoints of train.py"
    )
    parser.add_argument("--out_dir", required=True, type=Path)
    parser.add_argument("--name", default="", help="a label for these checkpoints in the CSV (e.g. the recipe)")
    parser.add_argument(
        "--cls",
        action="store_true",
        help=f"also the CLS token's conditions {', '.join(CLS_CONDITIONS)} (empty for mean pooling)",
    )
    parser.add_argument("--max_images", type=int, default=None, help="score the first N test images only")
    args = parser.parse_args(argv)
    if args.max_images is not None and args.max_images < 1:
        parser.error(f"--max_images={args.max_images} is not allowed: expected an int >= 1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = args.out_dir / "runs.csv"
    conditions = CONDITIONS + (CLS_CONDITIONS if args.cls else ())
    columns = ["name", "ckpt_path", "seed_everything", "images", "left_out", *conditions]
    for ckpt_path in args.ckpt_paths:
        try:
            row = {
                "name": args.name,
                **blocking_accuracies(ckpt_path, conditions=conditions, max_images=args.max_images),
            }
        except CheckpointError as err:  # the rows of the checkpoints before it are kept
            print(f"error: {err}", file=sys.stderr)
            return 2
        append_rows(csv_path, columns, [row])
        print(" ".join(f"{k}={row[k]}" for k in ("name", "images", *CONDITIONS)), ckpt_path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
