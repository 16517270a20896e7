"""Which relevance method to trust: every method scored on two-circles, where the circles are known.

    python -m studies.explain.scores --out studies/explain/results --seeds 0 1 2 --jobs 2
    python -m studies.explain.scores --out studies/explain/results --report-only   # scores.md from scores.csv

For each task (`diagonal`, `relative`), model (ViT with learned / sincos2d / no positions, and the
ResNet) and seed, a model is trained briefly (2,000 images, 8 epochs, the study's models), then
every method that applies to it maps the same test images, and each map is scored
(`vit.explain.scores`): pointing game, relevance mass and average precision against the circles
(localisation), deletion and insertion AUC (faithfulness), and the rank correlation between the
maps of the trained model and of the same architecture with fresh random weights (sanity; lower
means the map depends more on what was learned). Writes `scores.csv` (one row per run and method)
and `scores.md` (mean ± std over seeds). Each finished run is appended to the CSV at once, and a
rerun skips the runs already there.
"""

from __future__ import annotations

import csv
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from studies.runner.rows import append_rows
from vit.commands import EitherSpelling
from vit.explain.relevance import FACTS, METHODS, relevance, usable_methods
from vit.explain.scores import average_precision, deletion_insertion, pointing_game, rank_correlation, relevance_mass

MODELS = {  # name: (kind, pos_embed, register tokens)
    "vit-learned": ("vit", "learned", 0),
    "vit-sincos2d": ("vit", "sincos2d", 0),
    "vit-none": ("vit", "none", 0),
    "cnn": ("cnn", None, 0),
    "vit-sincos2d-reg4": ("vit", "sincos2d", 4),  # with 4 registers (Darcet et al. 2024): do they change the maps?
}
TASKS = ("diagonal", "relative")
COLUMNS = (
    "task",
    "model",
    "seed",
    "test_acc",
    "method",
    "pointing_game",
    "relevance_mass",
    "average_precision",
    "deletion_auc",
    "insertion_auc",
    "sanity_rank_corr",
    "seconds_per_image",
)


def build(model: str, seed: int) -> torch.nn.Module:
    from vit.models import ResNet, VisionTransformer

    torch.manual_seed(seed)
    kind, pos, registers = MODELS[model]
    if kind == "cnn":
        return ResNet(img_size=32, in_chans=1, num_classes=2, widths=(16, 32, 64, 64))
    return VisionTransformer(
        img_size=32,
        in_chans=1,
        num_classes=2,
        patch_size=4,
        embed_dim=64,
        depth=4,
        num_heads=4,
        mlp_ratio=2.0,
        pos_embed=pos,
        reg_tokens=registers,
    )


def train(task: str, model: str, seed: int, num_train: int, epochs: int) -> tuple[torch.nn.Module, object, float]:
    import lightning as L

    from vit.data import TwoCirclesDataModule
    from vit.training.classifier import ImageClassifier

    L.seed_everything(seed, verbose=False)
    data = TwoCirclesDataModule(task=task, num_train=num_train, num_val=200, num_test=200, seed=seed, batch_size=128)
    system = ImageClassifier(build(model, seed), lr=2e-3, weight_decay=0.05, warmup_epochs=1.0)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(system, data)
    accuracy = trainer.test(system, data, verbose=False)[0]["test/acc"]
    return system.backbone.eval(), data.test_set, float(accuracy)


def score_run(
    task: str, model: str, seed: int, num_train: int, epochs: int, num_images: int, flow_images: int
) -> list[dict]:
    torch.set_num_threads(1)
    net, test, accuracy = train(task, model, seed, num_train, epochs)
    fresh = build(model, seed + 1000).eval()  # the same architecture, untrained: the sanity check's reference
    x = test.images[:num_images]
    masks = torch.stack([test.circle_mask(i) for i in range(num_images)])  # (B, H, W)
    target = net(x).argmax(-1)
    rows = []
    for method in usable_methods(net, ["all"]):  # the CNN: the methods that need no attention layers
        n = flow_images if method == "flow" else num_images
        kwargs = {"target": target[:n]} if FACTS[method].class_specific else {}
        start = time.perf_counter()
        maps = relevance(net, x[:n], method, **kwargs)
        seconds = (time.perf_counter() - start) / n
        random_maps = (
            relevance(fresh, x[:n], method, seed=seed + 1)
            if method != "random"
            else relevance(net, x[:n], method, seed=seed + 1)
        )
        deletion, insertion = deletion_insertion(net, x[:n], maps, background=0.0, target=target[:n])
        rows.append(
            {
                "task": task,
                "model": model,
                "seed": seed,
                "test_acc": f"{accuracy:.4f}",
                "method": method,
                "pointing_game": f"{pointing_game(maps, masks[:n]).mean():.4f}",
                "relevance_mass": f"{relevance_mass(maps, masks[:n]).mean():.4f}",
                "average_precision": f"{np.nanmean(average_precision(maps, masks[:n]).numpy()):.4f}",
                "deletion_auc": f"{deletion.mean():.4f}",
                "insertion_auc": f"{insertion.mean():.4f}",
                "sanity_rank_corr": f"{np.nanmean(rank_correlation(maps, random_maps).numpy()):.4f}",
                "seconds_per_image": f"{seconds:.4f}",
            }
        )
    return rows


def write_table(rows: list[dict], path: Path) -> None:
    """`scores.md`: per task, model and method, mean ± std over seeds of each score."""
    metrics = COLUMNS[5:11]
    lines = [
        "Generated by `python -m studies.explain.scores`; mean ± std over seeds (n seeds in brackets).",
        "Localisation (pointing game, mass, AP) is against the circles; deletion AUC lower is better, "
        "insertion AUC higher; sanity: rank correlation with an untrained model's maps (lower is better).",
        "",
    ]
    for task in TASKS:
        lines += [
            f"### {task}",
            "",
            "| model (test acc) | method | " + " | ".join(metrics) + " |",
            "|---|---|" + "---|" * len(metrics),
        ]
        for model in MODELS:
            cell = [r for r in rows if r["task"] == task and r["model"] == model]
            if not cell:
                continue
            acc = np.array([float(r["test_acc"]) for r in cell if r["method"] == "random"])
            for method in METHODS:
                runs = [r for r in cell if r["method"] == method]
                if not runs:
                    continue
                values = [np.array([float(r[m]) for r in runs]) for m in metrics]
                text = [f"{v.mean():.3f} ± {v.std(ddof=1) if len(v) > 1 else 0:.3f}" for v in values]
                lines.append(f"| {model} ({acc.mean():.3f}) | {method} ({len(runs)}) | " + " | ".join(text) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = EitherSpelling(prog="python -m studies.explain.scores", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("studies/explain/results"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num_train", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--num_images", type=int, default=100, help="test images scored per run")
    parser.add_argument("--flow_images", type=int, default=20, help="of which attention flow (the costly one) maps")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--report_only", action="store_true", help="rewrite scores.md from scores.csv, train nothing")
    args = parser.parse_args(argv)
    csv_path = args.out / "scores.csv"
    if args.report_only:
        if not csv_path.exists():
            parser.error(f"--report_only: {csv_path} does not exist, so there is nothing to report")
        with csv_path.open() as f:
            write_table(list(csv.DictReader(f)), args.out / "scores.md")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    done = set()
    if csv_path.exists():
        with csv_path.open() as f:
            done = {(r["task"], r["model"], int(r["seed"])) for r in csv.DictReader(f)}
    todo = [(t, m, s) for s in args.seeds for t in args.tasks for m in args.models if (t, m, s) not in done]
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {
            pool.submit(score_run, t, m, s, args.num_train, args.epochs, args.num_images, args.flow_images): (t, m, s)
            for t, m, s in todo
        }
        for future in futures:
            rows = future.result()
            append_rows(csv_path, COLUMNS, rows)
            print(f"{futures[future]}: test acc {rows[0]['test_acc']}", flush=True)
    with csv_path.open() as f:
        write_table(list(csv.DictReader(f)), args.out / "scores.md")


if __name__ == "__main__":
    main()
