"""One command that checks the GPU path of the CIFAR recipes, in under 5 minutes on one GPU.

What it checks, on a generated folder in CIFAR-10's format (`vit.data.fake_cifar`, about 6 MB,
written into a temporary folder; no download):

  1. `configs/cifar10/vit.yaml` through the real command line (`vit.training.cli.main`, what
     `train.py fit` runs), for `--steps` optimizer steps in `bf16-mixed`, once eager and once with
     `--model.compile true` as the recipe is written; then `configs/cifar10/cnn.yaml` (the ResNet)
     eager. Only the data, the length of the run and where it writes are overridden. Each run
     reports the training loss at the start and at the end (the mean of the first and of the last
     10% of the steps; the generated classes are easy, so it must fall), the steps per second of
     the second half of the run (after compilation and warm-up) and the peak GPU memory
     (`torch.cuda.max_memory_allocated`).
  2. Images per second of our ViT against timm's ViT of the recipe's configuration, forward +
     backward under bf16 autocast, eager, timed alternately in this process (median [min-max] of
     `--repeats`), with `benchmarks/throughput.py`'s functions: timm's model is given our weights
     and must return the same logits first.

It prints one markdown table (and writes it to `--out`), with the device and the versions of
torch, timm and Lightning, and exits with status 1 if any run's loss did not fall.
About 2-4 minutes on one recent GPU, most of it `torch.compile`; not yet run on a GPU.

    python benchmarks/gpu_check.py --out docs/gpu_check.md
    # The plumbing, on a CPU:
    python benchmarks/gpu_check.py --device cpu --steps 3 --batch_size 8 --num_train 64 --skip_compile
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/gpu_check.py` puts benchmarks/, not the root, on the path
    sys.path.insert(0, str(ROOT))

import lightning as L
import timm
import torch

from benchmarks.throughput import build_pair, images_per_second, make_step, summary, synchronize
from vit.commands import EitherSpelling
from vit.data.cifar import DATASETS
from vit.data.fake_cifar import write_fake_cifar
from vit.training.cli import main as train_main

RUNS = (  # (row name, recipe, torch.compile)
    ("ViT, eager", "configs/cifar10/vit.yaml", False),
    ("ViT, compiled", "configs/cifar10/vit.yaml", True),
    ("ResNet, eager", "configs/cifar10/cnn.yaml", False),
)


class StepLog(L.Callback):
    """Records the training loss and the wall-clock time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.times: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))  # a sync per step, as the progress bar's loss already costs
        self.times.append(time.perf_counter())


@contextlib.contextmanager
def as_train_py(checksums: dict[str, str]):
    """Let torchvision's CIFAR10 accept the generated files (it checks each one's MD5), and run as `train.py`."""
    cls = DATASETS["cifar10"]
    saved = cls.train_list, cls.test_list, cls.meta, sys.argv
    sys.argv = ["train.py"]  # this script's own arguments are not train.py's (LightningCLI warns about them)
    cls.train_list = [[name, checksums[name]] for name, _ in cls.train_list]
    cls.test_list = [[name, checksums[name]] for name, _ in cls.test_list]
    cls.meta = {**cls.meta, "md5": checksums[cls.meta["filename"]]}
    try:
        yield
    finally:
        cls.train_list, cls.test_list, cls.meta, sys.argv = saved


def train_run(recipe: str, compile: bool, args: argparse.Namespace, data_dir: Path, work: Path) -> dict:
    """One `train.py fit` of `recipe`, shortened to `args.steps` steps; its losses, speed and peak memory."""
    cuda = args.device == "cuda"
    callback = f"{StepLog.__module__}.{StepLog.__qualname__}"
    cli_args = [
        "fit",
        "--config", str(ROOT / recipe),
        "--data.data_dir", str(data_dir),
        "--data.download", "false",
        "--data.val_size", str(args.batch_size),  # one validation batch per epoch (the recipe validates every epoch)
        "--data.batch_size", str(args.batch_size),
        "--data.num_workers", str(args.num_workers),
        "--trainer.max_steps", str(args.steps),
        "--trainer.accelerator", "gpu" if cuda else "cpu",
        # bf16 autocast is the recipe's; on a CPU it is slower than float32 (docs/cifar.md), and this is a plumbing
        # test there.
        "--trainer.precision", "bf16-mixed" if cuda else "32-true",
        "--trainer.logger.init_args.save_dir", str(work / "runs"),
        # Replaces the recipe's ModelCheckpoint: nothing to keep.
        "--trainer.callbacks", f'[{{"class_path": "{callback}"}}]',
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--test_after_fit", "false",
        "--model.compile", str(compile).lower(),
    ]  # fmt: skip
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    cli = train_main(cli_args)
    wall = time.perf_counter() - start
    log = next(c for c in cli.trainer.callbacks if type(c).__name__ == StepLog.__name__)
    losses, times = log.losses, log.times
    if len(losses) != args.steps:
        raise RuntimeError(f"{recipe}: expected {args.steps} training steps, recorded {len(losses)}")
    k = max(1, args.steps // 10)
    half = len(times) // 2
    # The second half: compilation, cuDNN autotuning and the first loader workers are behind it.
    # Its steps include the epoch ends (validation of one batch, new loader iterators), as a real run's do.
    rate = (len(times) - 1 - half) / (times[-1] - times[half]) if len(times) - 1 > half else float("nan")
    return {
        "start": statistics.mean(losses[:k]),
        "end": statistics.mean(losses[-k:]),
        "steps_per_s": rate,
        "wall_s": wall,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "params_m": sum(p.numel() for p in cli.model.backbone.parameters()) / 1e6,
    }


def throughput(args: argparse.Namespace) -> dict:
    """Our ViT against timm's (the recipe's configuration), forward + backward, bf16 autocast, eager."""
    config = argparse.Namespace(
        img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=192, depth=9, num_heads=12,
        mlp_ratio=2.0, drop_path_rate=0.1,
    )  # fmt: skip
    device = torch.device(args.device)
    torch.manual_seed(0)
    ours, theirs = build_pair(config, device)
    x = torch.randn(args.batch_size, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    precision = "bf16" if device.type == "cuda" else "fp32"  # bf16's attention backward is slow on CPUs (docs/cifar.md)
    steps = {
        name: make_step(model, "fwd_bwd", precision, False, device)
        for name, model in (("ours", ours), ("timm", theirs))
    }
    peaks = {}
    for name, step in steps.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            step(x, y)
        synchronize(device)
        peaks[name] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    rates = {"ours": [], "timm": []}
    for r in range(args.repeats):
        for name in ("ours", "timm") if r % 2 == 0 else ("timm", "ours"):
            rates[name].append(images_per_second(steps[name], x, y, args.bench_steps, device, time.perf_counter))
    ratios = [a / b for a, b in zip(rates["ours"], rates["timm"])]
    return {"rates": rates, "ratios": ratios, "peaks": peaks}


def gib(value: float | None) -> str:
    return "n/a (CPU)" if value is None else f"{value:.2f}"


def table(args, device_name: str, runs: dict[str, dict | None], bench: dict) -> tuple[str, bool]:
    """The markdown report, and whether every run's loss fell."""
    precision = "bf16-mixed" if args.device == "cuda" else "32-true"
    lines = [
        f"device: {device_name}; torch {torch.__version__}, timm {timm.__version__}, lightning {L.__version__}, "
        f"Python {platform.python_version()}",
        "",
        f"Training: `train.py fit` of the recipe on generated CIFAR-10-format data, {args.steps} steps of batch "
        f"{args.batch_size}, precision {precision}. Loss: mean of the first / last {max(1, args.steps // 10)} steps. "
        "Steps/s: the second half of the run.",
        "",
        "| run | params (M) | loss start | loss end | loss fell | steps/s | wall (s) | peak GPU memory (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    all_fell = True
    for name, run in runs.items():
        if run is None:
            lines.append(f"| {name} | - | - | - | skipped (--skip_compile) | - | - | - |")
            continue
        fell = run["end"] < run["start"]
        all_fell &= fell
        lines.append(
            f"| {name} | {run['params_m']:.2f} | {run['start']:.4f} | {run['end']:.4f} | "
            f"{'yes' if fell else '**NO**'} | {run['steps_per_s']:.2f} | {run['wall_s']:.0f} | {gib(run['peak_gib'])} |"
        )
    r = bench["rates"]
    lines += [
        "",
        f"Throughput: the recipe's ViT, ours against timm's (same weights, same logits checked), forward + backward, "
        f"{'bf16 autocast' if args.device == 'cuda' else 'float32'}, eager, batch {args.batch_size}; "
        f"median [min-max] of {args.repeats} alternating repeats of {args.bench_steps} steps.",
        "",
        "| model | images/s | ours / timm | peak GPU memory (GiB) |",
        "|---|---|---|---|",
        f"| ours | {summary(r['ours'], '.0f')} | {summary(bench['ratios'], '.3f')} | {gib(bench['peaks']['ours'])} |",
        f"| timm | {summary(r['timm'], '.0f')} | 1 | {gib(bench['peaks']['timm'])} |",
    ]
    return "\n".join(lines) + "\n", all_fell


def main(argv: list[str] | None = None) -> int:
    parser = EitherSpelling(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a plumbing test, in float32")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per training run")
    parser.add_argument("--batch_size", type=int, default=128, help="the recipe's; also the throughput batch")
    parser.add_argument("--num_train", type=int, default=2048, help="generated training images (3 KB each)")
    parser.add_argument("--num_workers", type=int, default=8, help="loader workers (the recipe's 8)")
    parser.add_argument("--skip_compile", action="store_true", help="leave out the compiled ViT run (minutes on a CPU)")
    parser.add_argument("--repeats", type=int, default=7, help="alternating throughput repeats")
    parser.add_argument("--bench_steps", type=int, default=20, help="steps per throughput repeat")
    parser.add_argument("--warmup", type=int, default=5, help="untimed throughput steps per model")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "repeats", "bench_steps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.num_train < 2 * args.batch_size:
        parser.error(
            f"--num_train={args.num_train} must hold a validation batch and a training batch of {args.batch_size}"
        )
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available to torch (use --device cpu for the plumbing test)")
        device_name = torch.cuda.get_device_name()
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} torch threads"

    runs: dict[str, dict | None] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        checksums = write_fake_cifar(work / "data", "cifar10", num_train=args.num_train, num_test=args.batch_size)
        with as_train_py(checksums), contextlib.chdir(work):  # whatever a run writes stays in the temporary folder
            for name, recipe, compile in RUNS:
                if compile and args.skip_compile:
                    runs[name] = None
                    continue
                print(f"--- {name}: {recipe}", flush=True)
                runs[name] = train_run(recipe, compile, args, work / "data", work)
    print("--- throughput: ours against timm's", flush=True)
    bench = throughput(args)

    report, all_fell = table(args, device_name, runs, bench)
    print(report, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(argv if argv is not None else sys.argv[1:])
        args.out.write_text(f"# GPU check\n\n`python benchmarks/gpu_check.py {command}`\n\n{report}")
    if not all_fell:
        print("error: the training loss did not fall in every run (see 'loss fell')", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
