"""Screen ViT training recipes on `same_different` in a bare loop: does each seed leave the ln 2 plateau?

    python -m studies.recipe.screen --config studies/recipe/configs/screen.yaml \
        --candidates baseline,conv_stem --seeds 0,1
    python -m studies.recipe.screen --config studies/recipe/configs/screen.yaml --candidates report  # summary.md

Each (candidate, seed) trains the project's `VisionTransformer` (built by `studies.recipe.screened`,
which adds the two options the screen tried and the library dropped: `stem: conv`, `qk_init:
mimetic`) on `SameDifferentDataModule`'s splits with AdamW and the schedule the candidate names, in a plain
PyTorch loop with one thread (no Lightning, no logging: it is also the "bare step" of the speed comparison), and
appends one row to `<out_dir>/runs.csv`: test accuracy, the step at which the loss left the plateau, seconds
per step. Rows already in the CSV are skipped, so the command resumes. The recipe a screen
selects is then confirmed through `train.py` (`configs/same_different/vit.yaml`), on other seeds.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from timm.optim import param_groups_weight_decay

from studies.recipe import screened
from studies.recipe.diagnostics import attention_stats, grad_norms, token_probe
from studies.runner.rows import append_rows
from vit.commands import EitherSpelling
from vit.data.same_different import SameDifferentDataModule

COLUMNS = (
    "candidate",
    "seed",
    "lr",
    "steps",
    "steps_done",
    "test_acc",
    "left_plateau_at",
    "final_train_loss",
    "s_per_step",
    "settings",
)
PLATEAU = 0.6  # a running mean loss below this (ln 2 = 0.693) has left the chance plateau


def lr_factor(step: int, total: int, warmup: int, schedule: str, decay_fraction: float) -> float:
    """Warmup to 1, then `cosine` to 0, or `constant` with a linear decay to 0 over the last `decay_fraction`."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    decay_start = total - int(decay_fraction * total)
    return 1.0 if step < decay_start else max(0.0, (total - step) / max(1, total - decay_start))


def _data(settings: dict, seed: int) -> SameDifferentDataModule:
    """The run's splits, set up: the candidate's training and test sizes and 128 validation images for the probes."""
    data = SameDifferentDataModule(
        num_train=settings["num_train"],
        num_val=128,
        num_test=settings["num_test"],
        train_region="left",
        test_region="left",
        seed=seed,
        batch_size=64,
    )
    data.setup()
    return data


def _model_and_optimizer(settings: dict, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The seeded model the candidate describes and its AdamW (no weight decay where the model says none)."""
    torch.manual_seed(seed)
    model = screened.build(img_size=32, in_chans=1, num_classes=2, **settings["model"])
    groups = param_groups_weight_decay(model, settings["weight_decay"], no_weight_decay_list=model.no_weight_decay())
    optimizer = torch.optim.AdamW(groups, lr=settings["lr"], betas=tuple(settings["betas"]))
    return model, optimizer


def _diagnostics(model: torch.nn.Module, step: int, losses: list[float], x_probe, probe_labels) -> dict:
    """One point of the plateau curve at ``step``: the recent loss, gradient norms, attention and token probes."""
    model.eval()
    point = {
        "step": step,
        "loss": sum(losses[-50:]) / max(1, len(losses[-50:])),
        **grad_norms(model),
        **attention_stats(model, x_probe),
    }
    for block in (0, len(model.blocks) - 1):
        point[f"probe/block{block}_acc"] = token_probe(model, x_probe, probe_labels, block=block)
    model.train()
    return point


def _test_accuracy(model: torch.nn.Module, test_set) -> str:
    """The model's accuracy on the test split (in batches of 500), as the CSV writes it."""
    model.eval()
    with torch.no_grad():
        x_test, y_test = test_set.images, test_set.labels
        predicted = torch.cat([model(x_test[i : i + 500]).argmax(-1) for i in range(0, len(y_test), 500)])
    return f"{(predicted == y_test).float().mean().item():.4f}"


def train_one(settings: dict, seed: int, curve_path: Path | None = None) -> dict:
    """One bare training run; returns the CSV row's values. Every 50 steps, the plateau diagnostics
    (`studies.recipe.diagnostics`) on 128 validation images go to `curve_path` (JSON), untimed."""
    data = _data(settings, seed)
    x_train, y_train = data.train_set.images.contiguous(), data.train_set.labels
    x_probe, probe_labels = data.val_set.images, data.val_set.token_labels(settings["model"]["patch_size"])
    curve = []
    model, optimizer = _model_and_optimizer(settings, seed)
    steps, batch = settings["steps"], settings["batch_size"]
    warmup = int(settings["warmup_fraction"] * steps)
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    losses, left_at = [], None
    diagnostics_s = 0.0
    start = time.perf_counter()
    for step in range(steps):
        if len(order) < batch:
            order = torch.randperm(len(y_train), generator=generator)
        idx, order = order[:batch], order[batch:]
        for group in optimizer.param_groups:
            group["lr"] = settings["lr"] * lr_factor(
                step, steps, warmup, settings["schedule"], settings.get("decay_fraction", 0.2)
            )
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step % 50 == 0:
            tic = time.perf_counter()
            curve.append(_diagnostics(model, step, losses, x_probe, probe_labels))
            diagnostics_s += time.perf_counter() - tic
        if settings.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings["clip"])
        optimizer.step()
        losses.append(loss.item())
        if left_at is None and len(losses) >= 50 and sum(losses[-50:]) / 50 < PLATEAU:
            left_at = step + 1
        if settings.get("stop_loss") and len(losses) >= 50 and sum(losses[-50:]) / 50 < settings["stop_loss"]:
            break  # a screen needs to know that the run learned, not its last decimal
    steps_done = len(losses)
    seconds = time.perf_counter() - start - diagnostics_s
    if curve_path is not None:
        curve_path.write_text(json.dumps(curve))
    return {
        "test_acc": _test_accuracy(model, data.test_set),
        "left_plateau_at": left_at or "",
        "final_train_loss": f"{sum(losses[-50:]) / 50:.4f}",
        "s_per_step": f"{seconds / steps_done:.4f}",
        "steps_done": steps_done,
    }


def plateau_figure(curves: dict[str, Path], out: Path) -> None:
    """Loss, block-0 attention entropy, q/k gradient norm and token probe against the step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("loss", "training loss (50-step mean)", False),
        ("attn/block0_entropy", "block 0 attention entropy (nats)", False),
        ("grad/qk", "|grad| of the q/k projections", True),
        ("probe/block0_acc", "token probe after block 0", False),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for label, path in curves.items():
        points = [p for p in json.loads(path.read_text()) if p["step"] > 0]
        steps = [p["step"] for p in points]
        for ax, (key, title, log) in zip(axes, panels):
            ax.plot(steps, [max(p.get(key, float("nan")), 1e-8) if log else p.get(key) for p in points], label=label)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
            if log:
                ax.set_yscale("log")
    axes[0].axhline(math.log(2), color="grey", lw=0.6, ls=":")
    axes[1].axhline(math.log(64), color="grey", lw=0.6, ls=":")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def summary(csv_path: Path, config: dict) -> str:
    """The ablation table: per candidate, what changed, successes (test >= 95%) / seeds, steps to leave the plateau."""
    rows = list(csv.DictReader(csv_path.open()))
    lines = [
        "| candidate | what changed (from the defaults) | seeds | test acc. (%) | success (>= 95%) | "
        "left the plateau at step |",
        "|---|---|---|---|---|---|",
    ]
    for name, changes in config["candidates"].items():
        runs = sorted((r for r in rows if r["candidate"] == name), key=lambda r: int(r["seed"]))
        if not runs:
            continue
        accs = [float(r["test_acc"]) for r in runs]
        left = [r["left_plateau_at"] or "never" for r in runs]
        what = (
            ", ".join(
                f"{k}={v}"
                for k, v in {**changes.get("model", {}), **{k: v for k, v in changes.items() if k != "model"}}.items()
            )
            or "-"
        )
        lines.append(
            f"| {name} | {what} | {', '.join(r['seed'] for r in runs)} | "
            f"{' '.join(f'{100 * a:.1f}' for a in accs)} | {sum(a >= 0.95 for a in accs)}/{len(runs)} | "
            f"{' '.join(left)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = EitherSpelling(prog="python -m studies.recipe.screen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument(
        "--candidates",
        required=True,
        help="comma-separated names from the config's candidates; 'report' writes summary.md",
    )
    parser.add_argument("--seeds", default="", help="comma-separated ints")
    parser.add_argument(
        "--figure", type=Path, help="instead of training: plot the diagnostics of these runs to this PNG"
    )
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    if args.candidates == "report":
        table = summary(Path(config["out_dir"]) / "runs.csv", config)
        (Path(config["out_dir"]) / "summary.md").write_text(table)
        print(table)
        return
    if args.figure:
        paths = {
            f"{c} seed {s}": Path(config["out_dir"]) / "curves" / f"{c}-s{s}.json"
            for c in args.candidates.split(",")
            for s in args.seeds.split(",")
        }
        plateau_figure({label: path for label, path in paths.items() if path.exists()}, args.figure)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(config["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "runs.csv"
    curves = out / "curves"
    curves.mkdir(exist_ok=True)
    for name in args.candidates.split(","):
        if name not in config["candidates"]:
            raise SystemExit(
                f"error: candidate {name!r} is not in {args.config}: expected one of {list(config['candidates'])}"
            )
        settings = {**config["defaults"], **config["candidates"][name]}
        settings["model"] = {**config["defaults"]["model"], **config["candidates"][name].get("model", {})}
        for seed in map(int, args.seeds.split(",")):
            done = csv_path.exists() and any(
                r["candidate"] == name and int(r["seed"]) == seed for r in csv.DictReader(csv_path.open())
            )
            if done:
                continue
            row = {
                "candidate": name,
                "seed": seed,
                "lr": settings["lr"],
                "steps": settings["steps"],
                **train_one(settings, seed, curves / f"{name}-s{seed}.json"),
                "settings": yaml.safe_dump(settings, default_flow_style=True).strip(),
            }
            append_rows(csv_path, COLUMNS, [row])
            print(
                f"{name} seed {seed}: test {row['test_acc']}, left the plateau at {row['left_plateau_at'] or '-'}, "
                f"{row['s_per_step']} s/step",
                flush=True,
            )


if __name__ == "__main__":
    main()
