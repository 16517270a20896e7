"""`python -m vit.predict` against timm's own inference loop, on the same exported model and the same folder.

Measures, each run a separate process under `/usr/bin/time -v`, vit and timm alternating (which goes first swaps
every repeat):
- images/s over a folder: `vit.predict --batch_size B --num_workers W` against `timm.create_model("local-dir:...")`,
  `resolve_data_config`, `create_transform` and a DataLoader with the same batch size and workers (timm's
  `ImageDataset` of the same files), both writing the top-1 class of every image to a CSV;
- peak RSS (the largest process, as `/usr/bin/time` reports it) of `vit.predict` on folders of two sizes;
- start-up: `vit.load(ckpt)` + one prediction as a whole process, against `timm.create_model` + one prediction.

    python benchmarks/predict_vs_timm.py --work /tmp/predict_bench --sizes 500,5000 --repeats 3

`--work` keeps what is built once (a ViT-Tiny/16 checkpoint written by `train.py fit` in two steps on generated
images: its weights do not matter, its work does; the `vit.export` folder; the JPEG folders), so a rerun only
measures. Figures: median and [min-max] over repeats, ratios paired within a repeat.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from vit.commands import EitherSpelling

ROOT = Path(__file__).resolve().parents[1]
TIMM_LOOP = """
import csv, json, sys, time
import timm, torch
from timm.data import ImageDataset, create_transform, resolve_data_config
export, folder, output, batch_size, workers = sys.argv[1:6]
model = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
transform = create_transform(**resolve_data_config({}, model=model))
dataset = ImageDataset(folder, transform=transform)
loader = torch.utils.data.DataLoader(dataset, batch_size=int(batch_size), num_workers=int(workers))
names, start, count = dataset.filenames(basename=True), time.monotonic(), 0
with open(output, "w", newline="") as f, torch.no_grad():
    writer = csv.writer(f)
    for x, _ in loader:
        probs = model(x).float().softmax(dim=-1)
        for p, k in zip(*probs.max(dim=-1)):
            writer.writerow([names[count], int(k), f"{float(p):.6f}"])
            count += 1
print(json.dumps({"images": count, "images_per_s": count / (time.monotonic() - start)}))
"""
VIT_START = "import sys, vit; vit.load(sys.argv[1]).predict(sys.argv[2])"
TIMM_START = """
import sys, timm, torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
model = timm.create_model(f"local-dir:{sys.argv[1]}", pretrained=True).eval()
transform = create_transform(**resolve_data_config({}, model=model))
with torch.no_grad():
    model(transform(Image.open(sys.argv[2]).convert("RGB"))[None]).softmax(dim=-1)
"""


def timed(command: list[str]) -> tuple[float, float, str]:
    """Run `command` under `/usr/bin/time -v`: (wall seconds, peak RSS in MB, its stdout + stderr)."""
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", done.stderr)
    seconds = int(wall[1] or 0) * 3600 + int(wall[2]) * 60 + float(wall[3])
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)[1]) / 1024
    return seconds, rss, done.stdout + done.stderr


def write_images(folder: Path, count: int, seed: int = 0) -> None:
    """`count` JPEGs of 320x240, smooth random colour fields (photo-like to decode), written once."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(len(list(folder.glob("*.jpg"))), count):
        coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        Image.fromarray(coarse).resize((320, 240), Image.BICUBIC).save(folder / f"{i:06d}.jpg", quality=90)


def build_model(work: Path) -> tuple[Path, Path]:
    """A ViT-Tiny/16 224-px checkpoint (two training steps on a generated two-class folder) and its export."""
    ckpt, export = work / "runs" / "bench" / "version_0" / "checkpoints" / "last.ckpt", work / "export"
    if not ckpt.exists():
        for label in ("a", "b"):
            write_images(work / "train" / label, 12, seed=hash(label) % 100)
        subprocess.run(
            [
                sys.executable,
                "train.py",
                "fit",
                "--config",
                "configs/folder/finetune_vit.yaml",
                "--data.root",
                str(work / "train"),
                "--data.num_workers",
                "0",
                "--data.batch_size",
                "8",
                "--model.pretrained",
                "null",
                "--model.backbone.init_args.embed_dim",
                "192",
                "--model.backbone.init_args.depth",
                "12",
                "--model.backbone.init_args.num_heads",
                "3",
                "--trainer.max_steps",
                "2",
                "--trainer.accelerator",
                "cpu",
                "--trainer.precision",
                "32",
                "--trainer.logger.init_args.save_dir",
                str(work / "runs"),
                "--trainer.logger.init_args.name",
                "bench",
                "--test_after_fit",
                "false",
            ],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
    if not export.exists():
        subprocess.run(
            [sys.executable, "-m", "vit.export", "--ckpt_path", str(ckpt), "--out", str(export)],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
    return ckpt, export


def summary(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def _parse_args() -> argparse.Namespace:
    """The command line."""
    parser = EitherSpelling(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/predict_bench"))
    parser.add_argument("--sizes", default="500,5000", help="folder sizes: throughput on the largest, RSS on each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--num_workers", type=int, default=2)
    return parser.parse_args()


def _folder_commands(
    args: argparse.Namespace, ckpt: Path, export: Path, folder: Path, out: Path
) -> tuple[list[str], list[str]]:
    """The `vit.predict` and timm-loop commands over `folder`, writing `vit.csv` and `timm.csv` into `out`."""
    options = ["--batch_size", str(args.batch_size), "--num_workers", str(args.num_workers), "--device", "cpu"]
    vit_run = [
        sys.executable,
        "-m",
        "vit.predict",
        "--ckpt_path",
        str(ckpt),
        "--input_dir",
        str(folder),
        "--output",
        str(out / "vit.csv"),
        "--overwrite",
        *options,
    ]
    timm_run = [
        sys.executable,
        "-c",
        TIMM_LOOP,
        str(export),
        str(folder),
        str(out / "timm.csv"),
        str(args.batch_size),
        str(args.num_workers),
    ]
    return vit_run, timm_run


def _agreement(out: Path) -> tuple[float, int]:
    """The share of images whose top-1 class is the same in `out`'s `vit.csv` and `timm.csv`, and vit's count."""
    with open(out / "vit.csv") as a, open(out / "timm.csv") as b:
        ours = {row[0]: row[2] for row in list(csv.reader(a))[1:]}
        theirs = {row[0]: row[1] for row in csv.reader(b)}
    agree = sum(ours[k] == theirs.get(k) for k in ours) / len(ours)
    return agree, len(ours)


def _time_folder(
    args: argparse.Namespace, ckpt: Path, export: Path, n: int, largest: bool, repeat: int, results: dict[str, list]
) -> None:
    """One repeat on the folder of `n` images into `results`: vit.predict's peak RSS; on the `largest`, both loops'
    images/s (and timm's RSS), in this repeat's order, and how often their top-1 classes agree."""
    folder, out = args.work / f"images_{n}", args.work / "out"
    vit_run, timm_run = _folder_commands(args, ckpt, export, folder, out)
    out.mkdir(exist_ok=True)
    order = ["vit", "timm"] if repeat % 2 == 0 else ["timm", "vit"]
    measured = {}
    for side in order if largest else ["vit"]:
        _, rss, text = timed(vit_run if side == "vit" else timm_run)
        if side == "vit":
            results[f"rss_{n}"].append(rss)
            measured["vit"] = float(re.findall(r"([\d.]+) images/s", text)[-1])
        else:
            results["rss_timm"].append(rss)
            measured["timm"] = json.loads(text.strip().splitlines()[0])["images_per_s"]
    if largest:
        results["vit_ips"].append(measured["vit"])
        results["timm_ips"].append(measured["timm"])
        results["ratio"].append(measured["vit"] / measured["timm"])
        agree, count = _agreement(out)
        print(f"repeat {repeat}: top-1 class agrees on {agree:.1%} of {count} images", flush=True)


def _time_start(ckpt: Path, export: Path, image: str, repeat: int, results: dict[str, list]) -> None:
    """One repeat of start-up + one prediction of `image`, vit and timm in this repeat's order, into `results`."""
    starts = {}
    for side in ["vit", "timm"] if repeat % 2 == 0 else ["timm", "vit"]:
        code, model = (VIT_START, str(ckpt)) if side == "vit" else (TIMM_START, str(export))
        starts[side] = timed([sys.executable, "-c", code, model, image])[0]
    results["vit_start"].append(starts["vit"])
    results["timm_start"].append(starts["timm"])
    results["start_ratio"].append(starts["vit"] / starts["timm"])


def _print_summary(args: argparse.Namespace, sizes: list[int], results: dict[str, list]) -> None:
    """The figures over the repeats: images/s, peak RSS per folder size, start-up."""
    print(
        f"\nimages/s on {sizes[-1]} images (batch {args.batch_size}, {args.num_workers} workers, cpu): "
        f"vit.predict {summary(results['vit_ips'], 1)}, timm {summary(results['timm_ips'], 1)}, "
        f"ratio {summary(results['ratio'])}"
    )
    small, large = results[f"rss_{sizes[0]}"], results[f"rss_{sizes[-1]}"]
    print(
        "peak RSS of vit.predict, MB: "
        + ", ".join(f"{n} images {summary(results[f'rss_{n}'], 0)}" for n in sizes)
        + f"; ratio largest/smallest {summary([b / a for a, b in zip(small, large)])}"
        + f"; timm's loop on {sizes[-1]} images {summary(results['rss_timm'], 0)}"
    )
    print(
        f"start-up + one prediction, s: vit.load {summary(results['vit_start'])}, timm.create_model "
        f"{summary(results['timm_start'])}, ratio {summary(results['start_ratio'])}"
    )


def main() -> None:
    args = _parse_args()
    sizes = sorted(int(n) for n in args.sizes.split(","))
    ckpt, export = build_model(args.work)
    for n in sizes:
        write_images(args.work / f"images_{n}", n)
    results: dict[str, list] = {
        "vit_ips": [],
        "timm_ips": [],
        "ratio": [],
        **{f"rss_{n}": [] for n in sizes},
        "rss_timm": [],
        "vit_start": [],
        "timm_start": [],
        "start_ratio": [],
    }
    for repeat in range(args.repeats):
        for n in sizes:  # vit.predict on each size: its RSS; on the largest, its images/s against timm's
            _time_folder(args, ckpt, export, n, n == sizes[-1], repeat, results)
        image = str(next((args.work / f"images_{sizes[0]}").glob("*.jpg")))
        _time_start(ckpt, export, image, repeat, results)
        print(f"repeat {repeat}: " + json.dumps({k: round(v[-1], 3) for k, v in results.items()}), flush=True)
    _print_summary(args, sizes, results)


if __name__ == "__main__":
    main()
