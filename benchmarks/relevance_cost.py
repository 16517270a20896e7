"""Cost of each relevance method per batch, as a ratio to attention rollout, measured in one process.

    OMP_NUM_THREADS=1 python benchmarks/relevance_cost.py --repeats 7

The two-circles ViT of the study (32x32, patch 4, width 64, depth 4, 4 heads: 65 tokens) and the
ResNet baseline, random weights (the cost does not depend on training), batch 32. Each round times
every method once, in a rotated order, against rollout in the same round; the table gives the
median [min-max] over rounds of the milliseconds per batch and of the ratio to rollout.
"""

from __future__ import annotations

import statistics
import time

import torch

from vit.commands import EitherSpelling
from vit.explain.relevance import METHODS, relevance
from vit.models import ResNet, VisionTransformer


def main() -> None:
    parser = EitherSpelling(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=32, patch_size=4, in_chans=1, num_classes=2, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0
    ).eval()
    cnn = ResNet(img_size=32, in_chans=1, num_classes=2, widths=(16, 32, 64, 64)).eval()
    x = torch.randn(args.batch_size, 1, 32, 32)
    cases = [("vit", m, vit) for m in METHODS] + [("cnn", m, cnn) for m in ("gradcam", "random")]
    for _, method, model in cases:  # warm-up
        relevance(model, x[:2], method)
    times = {(name, m): [] for name, m, _ in cases}
    for r in range(args.repeats):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]
        for name, method, model in order:
            start = time.perf_counter()
            relevance(model, x, method)
            times[(name, method)].append((time.perf_counter() - start) * 1000)
    reference = times[("vit", "rollout")]
    print(f"batch {args.batch_size}, {args.repeats} rounds, {torch.get_num_threads()} thread(s)\n")
    print("| model | method | ms per batch | x rollout |\n|---|---|---|---|")
    for (name, method), ms in times.items():
        ratios = [a / b for a, b in zip(ms, reference)]
        print(
            f"| {name} | {method} | {statistics.median(ms):.1f} [{min(ms):.1f}-{max(ms):.1f}] | "
            f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] |"
        )


if __name__ == "__main__":
    main()
