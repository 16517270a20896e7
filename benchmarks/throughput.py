"""Images per second of our VisionTransformer against timm's, built with the same configuration.

Both models are built in the same process from one configuration; timm's is given our weights
(`load_state_dict`, strict) and must return the same logits, which proves the two compute the
same function before any timing. They are then timed alternately (ours first on even repeats,
timm first on odd ones) so that a slow stretch of a shared machine hits both. Every repeat
gives one images/second figure per model and one paired ratio ours / timm; the table shows the
median and, in brackets, the smallest and largest of the repeats.

Modes (`--modes`, comma-separated):
  - `infer`: `model.eval()` forward under `torch.inference_mode()`.
  - `fwd_bwd`: `model.train()` forward, cross-entropy, backward.
  - `train`: the full training step: forward, cross-entropy, backward, AdamW step, zero_grad.

Each setting of `--precision` (fp32, bf16 = bf16 autocast) and `--compile` (off, on) is timed.

    python benchmarks/throughput.py                                # CPU, fp32 + bf16, eager
    python benchmarks/throughput.py --compile off,on --precision bf16
    python benchmarks/throughput.py --device cuda --batch_size 512 --compile off,on   # on a GPU
    python benchmarks/throughput.py --embed_dim 192 --depth 9 --num_heads 12 --mlp_ratio 2  # the CIFAR recipe's ViT
    # The two-circles ViT:
    python benchmarks/throughput.py --in_chans 1 --num_classes 2 --embed_dim 64 --depth 4 --num_heads 4 --mlp_ratio 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vit.commands import EitherSpelling
from vit.models import VisionTransformer

MODES = ("infer", "fwd_bwd", "train")
PRECISIONS = ("fp32", "bf16")


def build_pair(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """Our ViT and timm's, same configuration, same weights; checks that they agree."""
    shared = dict(
        img_size=args.img_size,
        patch_size=args.patch_size,
        in_chans=args.in_chans,
        num_classes=args.num_classes,
        embed_dim=args.embed_dim,
        depth=args.depth,
        num_heads=args.num_heads,
        mlp_ratio=args.mlp_ratio,
        drop_path_rate=args.drop_path_rate,
    )
    ours = VisionTransformer(**shared, pos_embed="learned")
    theirs = TimmVisionTransformer(**shared, global_pool="token", class_token=True, pos_embed="learn")
    theirs.load_state_dict(ours.state_dict())  # strict: the same parameters under the same names
    ours, theirs = ours.to(device), theirs.to(device)
    x = torch.randn(4, args.in_chans, args.img_size, args.img_size, device=device)
    with torch.no_grad():
        ours.eval(), theirs.eval()
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)
    return ours, theirs


def flops_per_image(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs per image, counted by torch's FlopCounterMode (fp32, eager)."""
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    # FlopCounterMode counts matmuls, convolutions and attention (2 FLOPs per multiply-add);
    # norms, GELU and softmax are left out, as in every MFU convention.
    by_op = counter.get_flop_counts()["Global"]
    total = sum(by_op.values())
    backward = sum(v for op, v in by_op.items() if "backward" in str(op))
    with torch.no_grad(), FlopCounterMode(display=False) as fwd_counter:
        model(x)
    forward = fwd_counter.get_total_flops()
    assert total >= forward > 0 and backward >= 0
    return forward / x.shape[0], total / x.shape[0]


def make_step(
    model: nn.Module, mode: str, precision: str, compile: bool, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One benchmark step of `mode` on a batch `(x, y)`."""
    run = torch.compile(model) if compile else model

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()

    if mode == "infer":
        model.eval()

        def step(x, y):
            with torch.inference_mode(), autocast():
                run(x)

        return step

    model.train()
    # The same AdamW in both runs; foreach (one kernel per group of tensors) is its default on CPU and GPU.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05) if mode == "train" else None

    def step(x, y):
        with autocast():
            loss = F.cross_entropy(run(x), y)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def images_per_second(step, x, y, num_steps: int, device: torch.device, clock: Callable[[], float]) -> float:
    synchronize(device)
    start = clock()
    for _ in range(num_steps):
        step(x, y)
    synchronize(device)
    return num_steps * x.shape[0] / (clock() - start)


def summary(values: list[float], fmt: str) -> str:
    """`median [min-max]`."""
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def csv_choices(value: str, allowed: tuple[str, ...], name: str) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"--{name}={value!r}: expected a comma-separated list of {list(allowed)}")
    return chosen


def _parse_args() -> argparse.Namespace:
    """The command line."""
    parser = EitherSpelling(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--precision", default="fp32,bf16", help="comma-separated: fp32 (float32), bf16 (bf16 autocast)"
    )
    parser.add_argument("--compile", default="off", help="comma-separated: off, on (torch.compile the model)")
    parser.add_argument("--modes", default="infer,fwd_bwd,train", help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--img_size", type=int, default=32)
    parser.add_argument("--patch_size", type=int, default=4)
    parser.add_argument("--in_chans", type=int, default=3)
    parser.add_argument("--num_classes", type=int, default=10)
    parser.add_argument("--embed_dim", type=int, default=192)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--num_heads", type=int, default=3)
    parser.add_argument("--mlp_ratio", type=float, default=4.0)
    parser.add_argument("--drop_path_rate", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per model and setting")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model and setting (compiles)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: elapsed time (a dedicated machine, any device); cpu: this process's CPU time, "
        "which other processes on a shared machine barely change (CPU only; use with --threads 1, "
        "since with more threads, time spent spinning at barriers counts too)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def _settings(args: argparse.Namespace) -> tuple[list[str], list[bool], list[str]]:
    """The precisions, compile settings and modes to time, after checking the counts are positive."""
    precisions = csv_choices(args.precision, PRECISIONS, "precision")
    compiles = [c == "on" for c in csv_choices(args.compile, ("off", "on"), "compile")]
    modes = csv_choices(args.modes, MODES, "modes")
    for name in ("batch_size", "repeats", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}={getattr(args, name)} must be >= 1")
    return precisions, compiles, modes


def _device(args: argparse.Namespace) -> tuple[torch.device, Callable[[], float], str]:
    """The device (threads and TF32 set), the clock, and a description of where the models run."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "cpu" and device.type != "cpu":
        raise SystemExit(f"--clock cpu measures CPU time and only makes sense with --device cpu, not {args.device}")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available to torch")
        torch.backends.cuda.matmul.allow_tf32 = True  # what float32_matmul_precision("high") sets
        torch.backends.cudnn.allow_tf32 = True
        where = torch.cuda.get_device_name(device)
    else:
        where = f"CPU, {torch.get_num_threads()} torch threads"
    return device, clock, where


def _print_header(args: argparse.Namespace, ours: nn.Module, x: torch.Tensor, where: str) -> None:
    """Count our model's parameters and FLOPs, then print the configuration, the device and the table's heading."""
    params = sum(p.numel() for p in ours.parameters())
    fwd_flops, train_flops = flops_per_image(ours, x[: min(8, args.batch_size)])

    tokens = (args.img_size // args.patch_size) ** 2 + 1
    print(
        f"config: img {args.img_size}x{args.img_size}x{args.in_chans}, patch {args.patch_size} ({tokens} tokens), "
        f"width {args.embed_dim}, depth {args.depth}, heads {args.num_heads}, mlp_ratio {args.mlp_ratio}, "
        f"{params / 1e6:.2f}M params, batch {args.batch_size}"
    )
    print(f"FLOPs per image: forward {fwd_flops / 1e9:.3f} G, forward+backward {train_flops / 1e9:.3f} G")
    print(
        f"device: {where}; torch {torch.__version__}; {args.repeats} repeats x {args.steps} steps, alternating; "
        f"images per {'second of process CPU time' if args.clock == 'cpu' else 'second (wall clock)'}"
    )
    print("timm's model was given our weights and returns the same logits (checked)")
    header = f"{'mode':>7} | {'prec':>4} | {'compile':>7} | {'ours img/s':>22} | {'timm img/s':>22} | {'ours/timm':>19}"
    print(header)
    print("-" * len(header), flush=True)


def _warm_up(
    steps: dict[str, Callable], x: torch.Tensor, y: torch.Tensor, warmup: int, device: torch.device
) -> dict[str, float]:
    """Run each model's `warmup` untimed steps; the wall seconds each took (compilation included)."""
    compile_note = {}
    for name, step in steps.items():
        start = time.perf_counter()
        for _ in range(warmup):
            step(x, y)
        synchronize(device)
        compile_note[name] = time.perf_counter() - start
    return compile_note


def _rates(
    steps: dict[str, Callable],
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    clock: Callable[[], float],
) -> dict[str, list[float]]:
    """Images/s of each model per repeat, ours first on even repeats and timm first on odd ones."""
    rates = {"ours": [], "timm": []}
    for r in range(args.repeats):
        for name in ("ours", "timm") if r % 2 == 0 else ("timm", "ours"):
            rates[name].append(images_per_second(steps[name], x, y, args.steps, device, clock))
    return rates


def _print_row(mode: str, precision: str, compile: bool, rates: dict, compile_note: dict) -> None:
    """One line of the table (and, when compiled, the warm-up's seconds beneath it)."""
    ratios = [a / b for a, b in zip(rates["ours"], rates["timm"])]
    print(
        f"{mode:>7} | {precision:>4} | {'on' if compile else 'off':>7} | "
        f"{summary(rates['ours'], '6.0f'):>22} | {summary(rates['timm'], '6.0f'):>22} | "
        f"{summary(ratios, '5.3f'):>19}",
        flush=True,
    )
    if compile:
        print(
            f"{'':>7}   warm-up incl. compilation: ours {compile_note['ours']:.0f} s, "
            f"timm {compile_note['timm']:.0f} s",
            flush=True,
        )


def main() -> None:
    args = _parse_args()
    precisions, compiles, modes = _settings(args)
    device, clock, where = _device(args)
    torch.manual_seed(args.seed)
    ours, theirs = build_pair(args, device)
    x = torch.randn(args.batch_size, args.in_chans, args.img_size, args.img_size, device=device)
    y = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    _print_header(args, ours, x, where)

    for precision in precisions:
        for compile in compiles:
            for mode in modes:
                torch.manual_seed(args.seed)
                steps = {
                    "ours": make_step(ours, mode, precision, compile, device),
                    "timm": make_step(theirs, mode, precision, compile, device),
                }
                compile_note = _warm_up(steps, x, y, args.warmup, device)
                rates = _rates(steps, x, y, args, device, clock)
                _print_row(mode, precision, compile, rates, compile_note)


if __name__ == "__main__":
    main()
