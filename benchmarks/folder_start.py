"""How fast a big image folder starts: `ImageFolderDataModule` against torchvision's `ImageFolder`, in one process.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/folder_start.py                       # 4,000 and 40,000 photos
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/folder_start.py --cache /tmp/folders  # generate once, reuse

Synthetic folders of JPEG photos of 500x375 (10 class folders; smooth colour fields with noise, about 40 kB each, as
a camera's photo compresses) are generated with PIL and numpy, in a temporary folder or once in `--cache`. Two
things are timed, alternating the two sides in each repeat (which goes first swaps), and printed as the median and
the range over `--repeats`:

- setup: `ImageFolderDataModule(root=...)` and `setup("fit")` (listing, split) against `ImageFolder(root)`;
- first batch: the same, then the first batch of `train_dataloader()`, against `ImageFolder(root, transform)` (the
  data module's own training transform) and the first batch of a shuffled `DataLoader` of the same batch size, for
  each `--workers` (workers started in the timed part, as a run starts them).

The files are in the page cache after generation (a second launch's case, not a cold disk's).

Measured on 2 shared cores (a CPU-only VM, load average 1.2-1.3 before and after), median [range] of 5, batch 64,
img_size 224, with the folders already generated in --cache (generating 4,000 took 14 s, 40,000 took 168 s):
    /usr/bin/time -v env PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/folder_start.py \
        --cache /tmp/folder_start_cache --repeats 5          # 25 s wall, 1.0 GB peak resident
                               ImageFolderDataModule     torchvision ImageFolder
    4,000   setup              0.021 s [0.021-0.042]     0.005 s [0.005-0.005]
    4,000   first batch, 0 w.  0.242 s [0.204-0.393]     0.204 s [0.193-0.207]
    4,000   first batch, 2 w.  0.485 s [0.461-0.610]     0.474 s [0.451-0.481]
    40,000  setup              0.227 s [0.222-0.250]     0.049 s [0.049-0.049]
    40,000  first batch, 0 w.  0.423 s [0.403-0.445]     0.268 s [0.250-0.285]
    40,000  first batch, 2 w.  0.698 s [0.690-0.794]     0.564 s [0.556-0.583]
Before setup stopped decoding, setup alone took 2.24 s for the 4,000 (num_workers=2 threads, one run).
"""

from __future__ import annotations

import io
import statistics
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets

from benchmarks import spread
from vit.commands import EitherSpelling
from vit.data.image_folder import ImageFolderDataModule

WIDTH, HEIGHT, CLASSES = 500, 375, 10
COMPLETE = "complete.txt"  # written last: a cached folder without it is one whose generation was cut short


def _write_photos(args: tuple[str, int, int, int]) -> None:
    """Photos `start` to `stop - 1` of `folder`: a smooth random colour field plus noise, as a JPEG of quality 85."""
    folder, start, stop, seed = args
    rng = np.random.default_rng(seed)
    noise = rng.integers(-12, 13, size=(HEIGHT + 32, WIDTH + 32, 3)).astype(np.int16)  # (H + 32, W + 32, 3)
    for i in range(start, stop):
        field = Image.fromarray(rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)).resize((WIDTH, HEIGHT))
        y, x = rng.integers(0, 32, size=2)
        pixels = np.clip(np.asarray(field, dtype=np.int16) + noise[y : y + HEIGHT, x : x + WIDTH], 0, 255)
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buffer, "JPEG", quality=85)
        Path(folder, f"class{i % CLASSES}", f"{i:06d}.jpg").write_bytes(buffer.getvalue())


def photo_folder(parent: Path, count: int) -> Path:
    """`parent/photos_<count>`, a folder of `count` photos in `CLASSES` class folders, generated unless complete."""
    root = parent / f"photos_{count}"
    if (root / COMPLETE).is_file():
        return root
    if root.exists() and any(root.iterdir()):
        raise SystemExit(
            f"error: {root} holds files but no {COMPLETE} (an interrupted generation?): remove it, or give "
            "another --cache"
        )
    for c in range(CLASSES):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    chunks = [(str(root), i, min(i + 1000, count), i) for i in range(0, count, 1000)]
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(_write_photos, chunks))
    (root / COMPLETE).write_text(f"{count} photos of {WIDTH}x{HEIGHT}\n")  # not in a class folder: never listed
    print(f"generated {count} photos under {root} in {time.perf_counter() - start:.1f} s", flush=True)
    return root


def ours(root: Path, workers: int | None, batch_size: int) -> float:
    """Seconds to build and set up the data module, then (unless `workers` is None) to its first training batch."""
    start = time.perf_counter()
    dm = ImageFolderDataModule(root=str(root), img_size=224, batch_size=batch_size, num_workers=workers or 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that num_workers is capped at the cores
        dm.setup("fit")
        if workers is not None:
            x, _ = next(iter(dm.train_dataloader()))
            assert x.shape == (batch_size, 3, 224, 224)
    return time.perf_counter() - start


def torchvisions(root: Path, workers: int | None, batch_size: int, transform) -> float:
    """The same with torchvision's `ImageFolder` (its own walk and PIL loader) and a shuffled `DataLoader`."""
    start = time.perf_counter()
    folder = datasets.ImageFolder(str(root), transform=transform)
    if workers is not None:
        loader = DataLoader(folder, batch_size=batch_size, shuffle=True, num_workers=workers)
        x, _ = next(iter(loader))
        assert x.shape == (batch_size, 3, 224, 224)
    return time.perf_counter() - start


def compare(root: Path, workers: int | None, repeats: int, batch_size: int) -> tuple[list[float], list[float]]:
    """`repeats` timings of each side, alternating which goes first."""
    transform = ImageFolderDataModule(root=str(root), img_size=224).train_transform
    times = {"ours": [], "torchvision": []}
    for repeat in range(repeats):
        order = ("ours", "torchvision") if repeat % 2 == 0 else ("torchvision", "ours")
        for side in order:
            if side == "ours":
                times[side].append(ours(root, workers, batch_size))
            else:
                times[side].append(torchvisions(root, workers, batch_size, transform))
    return times["ours"], times["torchvision"]


def main(argv: list[str] | None = None) -> None:
    parser = EitherSpelling(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4000,40000", help="comma-separated numbers of photos, one folder each")
    parser.add_argument("--workers", default="0,2", help="comma-separated num_workers values for the first batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--cache", type=Path, default=None, help="keep the generated folders here and reuse them")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        parent = args.cache or Path(tmp)
        for count in map(int, args.sizes.split(",")):
            root = photo_folder(parent, count)
            cases = [("setup", None)] + [(f"first batch, num_workers={w}", int(w)) for w in args.workers.split(",")]
            for name, workers in cases:
                mine, theirs = compare(root, workers, args.repeats, args.batch_size)
                ratios = [a / b for a, b in zip(mine, theirs)]
                print(
                    f"{count} photos, {name}: ImageFolderDataModule {spread(mine, 3, ' s')}, torchvision ImageFolder "
                    f"{spread(theirs, 3, ' s')}; difference "
                    f"{statistics.median(mine) - statistics.median(theirs):+.3f} s, "
                    f"ratio {spread(ratios)} (median [range] of {args.repeats})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
