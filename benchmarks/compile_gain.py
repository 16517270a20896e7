"""What `torch.compile` gains on a training step: our ViT against timm's, measured in one process.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/compile_gain.py --repeats 12

The models are the relation study's ViT (32x32 grey images, patch 4, width 64, depth 4, 4 heads,
MLP ratio 2, mean pooling, 2 classes): ours as the study trains it (`configs/same_different/vit.yaml`:
8x8 overlapping patch windows), ours with plain 4x4 patches, and timm's `VisionTransformer` with the
same plain architecture (`global_pool="avg"`, no class token). A training step is forward,
cross-entropy, backward and AdamW on one batch of random images. Each model is stepped eagerly and
through `torch.compile` (default inductor backend), every variant with its own copy of the weights
and optimizer; compilation happens in untimed warm-up steps. Then, `--repeats` times, every variant
runs `--steps` steps, in an order rotated from one repeat to the next; each repeat gives one gain
per model, eager time / compiled time, and one ratio of our gain to timm's. Medians and ranges are
printed. Time is this process's CPU time (`--clock cpu`, one torch thread: other processes on a
shared machine barely change it) or wall time.
"""

from __future__ import annotations

import copy
import statistics
import time

import timm
import torch
import torch.nn.functional as F

from vit.commands import EitherSpelling
from vit.models import VisionTransformer

ARCH = dict(img_size=32, patch_size=4, in_chans=1, num_classes=2, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0)


def models() -> dict[str, torch.nn.Module]:
    return {
        "ours (study recipe)": VisionTransformer(**ARCH, pool="mean", patch_kernel=8, qk_init_std=0.25),
        "ours (plain patches)": VisionTransformer(**ARCH, pool="mean"),
        "timm": timm.models.vision_transformer.VisionTransformer(**ARCH, global_pool="avg", class_token=False),
    }


def training_step(model: torch.nn.Module, compiled: bool, x: torch.Tensor, y: torch.Tensor):
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(forward(x), y).backward()
        optimizer.step()

    return step


def main() -> None:
    parser = EitherSpelling(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant and repeat")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compilation)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    x, y = torch.randn(args.batch_size, 1, 32, 32), torch.randint(0, 2, (args.batch_size,))
    steps = {}
    for name, model in models().items():
        for compiled in (False, True):
            step = training_step(model, compiled, x, y)
            start = time.perf_counter()
            for _ in range(args.warmup):
                step()
            warmup_s = time.perf_counter() - start
            print(f"{name}, compile {'on' if compiled else 'off'}: warm-up {warmup_s:.1f} s", flush=True)
            steps[name, compiled] = step
    times = {key: [] for key in steps}
    keys = list(steps)
    for repeat in range(args.repeats):
        for key in keys[repeat % len(keys) :] + keys[: repeat % len(keys)]:
            start = clock()
            for _ in range(args.steps):
                steps[key]()
            times[key].append((clock() - start) / args.steps)
    names = list(models())
    gains = {name: [e / c for e, c in zip(times[name, False], times[name, True])] for name in names}

    def fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
        values = [scale * v for v in values]
        return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"

    print(
        f"\nbatch {args.batch_size}, {args.repeats} repeats of {args.steps} steps, {args.clock} clock, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, timm {timm.__version__}"
    )
    print("| model | eager ms/step | compiled ms/step | compile gain (eager / compiled) | gain / timm's gain |")
    print("|---|---|---|---|---|")
    for name in names:
        relative = [g / t for g, t in zip(gains[name], gains["timm"])]
        print(
            f"| {name} | {fmt(times[name, False], 1000, 1)} | {fmt(times[name, True], 1000, 1)} | "
            f"{fmt(gains[name])} | {fmt(relative)} |"
        )


if __name__ == "__main__":
    main()
