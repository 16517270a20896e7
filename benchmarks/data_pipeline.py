"""Images per second that CIFARDataModule's training DataLoader delivers, by number of workers.

Runs the real loading code (torchvision's CIFAR reader, the v2 augmentations, the DataLoader) on
real CIFAR if `--data_dir` holds it, otherwise on a generated folder of the same format. Mixup and
CutMix are not included: they run on whole batches on the device, after the DataLoader.

    python benchmarks/data_pipeline.py                       # generated data, crop + flip + RandAugment
    python benchmarks/data_pipeline.py --data_dir data --auto_augment trivialaugment --random_erasing 0.25
    python benchmarks/data_pipeline.py --workers 0 --clock cpu   # one core's worth, on a busy machine
"""

import argparse
import tempfile
import time
from contextlib import ExitStack
from unittest import mock

import torch

from vit.commands import EitherSpelling
from vit.data.cifar import DATASETS, CIFARDataModule
from vit.data.fake_cifar import write_fake_cifar
from vit.data.transforms import AUTO_AUGMENTS


def images_per_second(dm: CIFARDataModule, num_batches: int, warmup_batches: int, clock=time.perf_counter) -> float:
    """Throughput of one pass of `num_batches` batches, after `warmup_batches` (worker start-up, caches)."""
    batches = iter(dm.train_dataloader())
    for _ in range(warmup_batches):
        next(batches)
    start = clock()
    count = 0
    for _ in range(num_batches):
        x, _ = next(batches)
        count += x.shape[0]
    return count / (clock() - start)


def _parse_args() -> argparse.Namespace:
    """The command line."""
    parser = EitherSpelling(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=None, help="folder holding real CIFAR; generated data if absent")
    parser.add_argument("--dataset", default="cifar10", choices=sorted(DATASETS))
    parser.add_argument("--workers", default="0,1,2", help="comma-separated num_workers values to time")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_batches", type=int, default=20, help="timed batches per worker count")
    parser.add_argument("--warmup_batches", type=int, default=2)
    parser.add_argument("--auto_augment", default="randaugment", choices=list(AUTO_AUGMENTS))
    parser.add_argument("--random_erasing", type=float, default=0.0)
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: elapsed time; cpu: CPU time of this process with one torch thread, i.e. what one "
        "loader worker delivers per second of a core it has to itself, however busy a shared machine "
        "is (needs --workers 0: workers are other processes)",
    )
    return parser.parse_args()


def _clock(args: argparse.Namespace):
    """The clock that `--clock` names (CPU time: one torch thread, and only with `--workers 0`)."""
    clock = time.perf_counter
    if args.clock == "cpu":
        if args.workers.strip() != "0":
            raise SystemExit(f"--clock cpu times this process only; it needs --workers 0, got --workers {args.workers}")
        torch.set_num_threads(1)  # as in a DataLoader worker
        clock = time.process_time
    return clock


def _data_source(args: argparse.Namespace, options: dict, stack: ExitStack) -> str:
    """The data to load, described: real CIFAR, or a generated folder (then `args.data_dir` and `options` name it)."""
    source = f"real {args.dataset} in {args.data_dir}"
    if args.data_dir is None or CIFARDataModule(data_dir=args.data_dir, **options).missing_files():
        # Enough generated images for warm-up and timed batches, plus a small validation split.
        num_train = (args.num_batches + args.warmup_batches) * args.batch_size + 500
        root = stack.enter_context(tempfile.TemporaryDirectory())
        checksums = write_fake_cifar(root, args.dataset, num_train=num_train, num_test=100)
        # torchvision checks the official MD5s; expect those of the generated files instead.
        cls = DATASETS[args.dataset]
        stack.enter_context(mock.patch.object(cls, "train_list", [[n, checksums[n]] for n, _ in cls.train_list]))
        stack.enter_context(mock.patch.object(cls, "test_list", [[n, checksums[n]] for n, _ in cls.test_list]))
        stack.enter_context(mock.patch.object(cls, "meta", {**cls.meta, "md5": checksums[cls.meta["filename"]]}))
        args.data_dir, options["val_size"] = root, 500
        source = f"generated {args.dataset}-format folder, {num_train} training images"
    return source


def _print_header(args: argparse.Namespace, source: str) -> None:
    """The data, the augmentations and the clock, then the table's heading."""
    print(f"data: {source}")
    print(
        f"augmentations: random crop, horizontal flip, auto_augment={args.auto_augment}, "
        f"random_erasing={args.random_erasing}; batch_size={args.batch_size}, "
        f"{args.num_batches} timed batches; torch threads={torch.get_num_threads()}"
    )
    if args.clock == "cpu":
        print("images per second of this process's CPU time (one core's worth of loading)")
    print(f"{'num_workers':>11} | {'images/s':>9}")
    print(f"{'-' * 11}-+-{'-' * 9}")


def main() -> None:
    args = _parse_args()
    clock = _clock(args)

    with ExitStack() as stack:
        options = dict(dataset=args.dataset, download=False, batch_size=args.batch_size)
        source = _data_source(args, options, stack)
        _print_header(args, source)
        for num_workers in [int(w) for w in args.workers.split(",")]:
            dm = CIFARDataModule(
                data_dir=args.data_dir,
                num_workers=num_workers,
                persistent_workers=False,
                auto_augment=args.auto_augment,
                random_erasing=args.random_erasing,
                **options,
            )
            dm.setup("fit")
            rate = images_per_second(dm, args.num_batches, args.warmup_batches, clock)
            print(f"{num_workers:>11} | {rate:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
