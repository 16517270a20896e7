"""What the commands write, and nothing else: an output that is not a regular file (a link, a device, a pipe, a
folder) is refused even with `--overwrite`, a full disk is one line that leaves the earlier output as it was, the
model card shows a checkpoint's text as text, and thousands of unreadable files are summed up, not listed."""

import argparse
import errno
import os
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import yaml
from PIL import Image
from safetensors import SafetensorError

from vit.api import Predictor
from vit.commands import check_output, print_skipped, write_failed
from vit.data import ImageFolderDataModule
from vit.data.files import first_skipped
from vit.explain.__main__ import check_paths as explain_check_paths
from vit.export import check_out, model_card, write
from vit.export import main as export_main
from vit.models import VisionTransformer
from vit.models.timm_compat import timm_args
from vit.predict import check_paths as predict_check_paths
from vit.predict import predict
from vit.training.record import training_record

DATA = {
    "input_size": (3, 32, 32),
    "mean": (0.5, 0.4, 0.3),
    "std": (0.2, 0.2, 0.2),
    "interpolation": "bilinear",
    "crop_pct": 1.0,
    "crop_mode": "squash",
}
FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
# What safetensors (0.8) raises when its file cannot be written, quoting Rust's io::Error.
SAFETENSORS_FULL = SafetensorError(
    'Error while serializing: I/O error: No space left on device (os error 28) at path "/data/.exported.x/.tmpAbC123"'
)


def tiny_vit(num_classes: int = 4) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=4, num_classes=num_classes)


def image(path: Path, seed: int = 0) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(24, 24, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


# ----------------------------------------------------------------------------- only a regular file is replaced


def _link_to_a_file(tmp_path: Path) -> Path:
    (tmp_path / "mine.csv").write_text("mine")
    (tmp_path / "out.csv").symlink_to(tmp_path / "mine.csv")
    return tmp_path / "out.csv"


def _dangling_link(tmp_path: Path) -> Path:
    (tmp_path / "out.csv").symlink_to(tmp_path / "nowhere.csv")
    return tmp_path / "out.csv"


def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "out.csv")
    return tmp_path / "out.csv"


def _folder(tmp_path: Path) -> Path:
    (tmp_path / "out.csv").mkdir()
    return tmp_path / "out.csv"


@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize(
    "make, kind",
    [
        (_link_to_a_file, "a symbolic link"),
        (_dangling_link, "a symbolic link"),
        (_fifo, "a named pipe (FIFO)"),
        (_folder, "a folder"),
        (lambda tmp_path: Path("/dev/null"), "a character device"),
    ],
)
def test_an_output_that_is_not_a_regular_file_is_refused_even_with_overwrite(make, kind, overwrite, tmp_path):
    path = make(tmp_path)
    before = os.lstat(path)
    with pytest.raises(ValueError) as caught:
        check_output("--output", path, overwrite)
    assert str(caught.value) == f"--output {path} is {kind}; only a regular file is replaced: give another path"
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)
    assert not (tmp_path / "nowhere.csv").exists()  # nothing was written through the dangling link
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_regular_file_is_replaced_only_with_overwrite_and_a_new_one_needs_its_folder(tmp_path):
    (tmp_path / "old.csv").write_text("old")
    with pytest.raises(ValueError, match=re.escape(f"--out {tmp_path / 'old.csv'} already exists; pass --overwrite")):
        check_output("--out", tmp_path / "old.csv", overwrite=False)
    check_output("--out", tmp_path / "old.csv", overwrite=True)
    check_output("--out", tmp_path / "new.csv", overwrite=False)
    missing = tmp_path / "missing" / "new.csv"
    with pytest.raises(ValueError, match=re.escape(f"--out {missing}: its folder {missing.parent} does not exist")):
        check_output("--out", missing, overwrite=True)


def test_predict_and_explain_check_each_output_with_the_shared_rule(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    link = _link_to_a_file(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"--output {link} is a symbolic link; only a regular file")):
        predict_check_paths(images, link, overwrite=True)
    with pytest.raises(ValueError, match=re.escape("--output /dev/null is a character device; only a regular file")):
        predict_check_paths(images, Path("/dev/null"), overwrite=True)

    (tmp_path / "maps.png").symlink_to(tmp_path / "elsewhere.png")  # savefig would create elsewhere.png through it
    args = argparse.Namespace(out=tmp_path / "maps.png", save_maps=None, overwrite=True, input_dir=images, image=None)
    with pytest.raises(ValueError, match=re.escape(f"--out {tmp_path / 'maps.png'} is a symbolic link; only a")):
        explain_check_paths(args)
    os.mkfifo(tmp_path / "maps.npz")
    args = argparse.Namespace(
        out=tmp_path / "new.png", save_maps=tmp_path / "maps.npz", overwrite=True, input_dir=images, image=None
    )
    with pytest.raises(ValueError, match=re.escape(f"--save_maps {tmp_path / 'maps.npz'} is a named pipe (FIFO)")):
        explain_check_paths(args)
    assert not (tmp_path / "elsewhere.png").exists()


def test_export_refuses_an_out_or_a_file_in_it_that_is_not_what_it_replaces_before_opening_the_checkpoint(
    tmp_path, capsys
):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "config.json").symlink_to(tmp_path / "precious.json")
    with pytest.raises(ValueError, match=re.escape(f"--out {out / 'config.json'} is a symbolic link; only a regular")):
        check_out(out, overwrite=True)
    with pytest.raises(ValueError, match=re.escape("--out /dev/null is a character device; give a folder")):
        check_out(Path("/dev/null"), overwrite=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    # The checkpoint does not exist either: --out is checked first, and nothing is created through the link.
    assert (
        export_main(["--ckpt_path", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "dangling"), "--overwrite"])
        == 2
    )
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out {tmp_path / 'dangling'} is a symbolic link; give a folder (it is created)"
    ]
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "precious.json").exists()
    check_out(out.parent / "new", overwrite=False)  # a folder to create is fine
    os.unlink(out / "config.json")
    (out / "config.json").write_text("{}")
    check_out(out, overwrite=True)  # regular files are replaced with --overwrite


# ----------------------------------------------------------------------------- a full disk at the end


@pytest.mark.parametrize("err", [FULL, SAFETENSORS_FULL])
def test_write_failed_is_one_line_with_the_systems_reason_and_status_1(err, capsys):
    assert write_failed("--out", Path("exported/model.safetensors"), err) == 1
    assert capsys.readouterr().err == (
        "error: --out exported/model.safetensors could not be written: No space left on device\n"
    )


@pytest.mark.parametrize("err", [FULL, SAFETENSORS_FULL])
def test_export_on_a_full_disk_is_one_line_and_leaves_the_earlier_export_and_no_temporary_folder(
    err, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "exported"
    out.mkdir()
    for name in ("model.safetensors", "config.json", "README.md"):
        (out / name).write_text(f"earlier {name}")

    def full_disk(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"half a file")  # what a write that ran out of space leaves behind
        raise err

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)  # the writer timm's save_for_hf calls
    prepared = (tiny_vit(), DATA, list("abcd"), {})
    assert write(argparse.Namespace(out=out, overwrite=True, license=None), prepared) == 1
    where = out / "model.safetensors" if isinstance(err, SafetensorError) else out
    assert capsys.readouterr() == ("", f"error: --out {where} could not be written: No space left on device\n")
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        name: f"earlier {name}" for name in ("model.safetensors", "config.json", "README.md")
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # the temporary folder is gone


def test_predict_on_a_full_disk_is_one_line_and_leaves_the_earlier_csv_and_no_temporary_file(
    tmp_path, monkeypatch, capsys
):
    import csv

    images = tmp_path / "images"
    images.mkdir()
    image(images / "a.png")
    output = tmp_path / "predictions.csv"
    output.write_text("earlier predictions\n")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(2))

        def forward(self, x):
            return self.bias.expand(len(x), 2)

    class FullWriter:  # the header fits, the first prediction does not
        def __init__(self, f):
            self.f, self.rows = f, 0

        def writerow(self, row):
            self.rows += 1
            if self.rows > 1:
                raise FULL
            self.f.write(",".join(row) + "\n")

    monkeypatch.setattr(csv, "writer", lambda f, *args, **kwargs: FullWriter(f))
    args = argparse.Namespace(
        ckpt_path="model.ckpt",
        input_dir=images,
        output=output,
        topk=1,
        batch_size=4,
        device="cpu",
        num_workers=0,
        recursive=False,
    )
    inputs = {"img_size": [16, 16], "in_chans": 3, "mean": None, "std": None, "interpolation": "bilinear"}
    assert predict(args, Predictor(Model(), inputs, ["red", "blue"])) == 1
    assert capsys.readouterr() == ("", f"error: --output {output} could not be written: No space left on device\n")
    assert output.read_text() == "earlier predictions\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "predictions.csv"]  # no temporary file left


# ----------------------------------------------------------------------------- the model card


HOSTILE = ["<script>alert(1)</script>", "# Heading", "a|b", "line\nbreak"]
CARD_HEADINGS = [
    "# Vision Transformer image classifier",
    "## Architecture",
    "## Classes",
    "## Input",
    "## Use with timm",
    "## Training",
    "## Metrics",
    "## Use with this project",
]


def test_the_model_card_shows_a_checkpoints_text_as_text():
    checkpoint = {
        "datamodule_hyper_parameters": {"_class_path": "<img src=x onerror=alert(1)>", "seed": "`7`"},
        "epoch": 3,
        "global_step": 12,
        "hyper_parameters": {"lr": 0.001, "note": "![pixel](https://tracker.example/p.gif)", "a|b": "x"},
        "callbacks": {"ModelCheckpoint": {"monitor": "# val/acc\n---", "best_model_score": 0.5}},
    }
    model = tiny_vit(num_classes=len(HOSTILE))
    card = model_card(timm_args(model), DATA, HOSTILE, training_record(checkpoint))

    front, body = card.split("---\n", 2)[1:]
    assert yaml.safe_load(front) == {
        "library_name": "timm",
        "pipeline_tag": "image-classification",
        "metrics": ["accuracy"],
        "tags": ["image-classification", "timm", "vision-transformer"],
    }
    for raw in ["<script>alert(1)</script>", "a|b", "line\nbreak", "<img", "](https", "`7`", "---\n"]:
        assert raw not in body, raw
    # A leading '#' is kept, escaped: shown as written, never a heading.
    assert re.findall(r"(.)# Heading", body) == ["\\"] and re.findall(r"(.)# val/acc", body) == ["\\"]
    assert [line for line in body.splitlines() if line.startswith("#")] == CARD_HEADINGS  # no heading of its own
    assert (
        "4 classes, label i is the i-th (`config.json`'s `label_names`): &lt;script&gt;alert(1)&lt;/script&gt;, "
        "\\# Heading, a\\|b, line break."
    ) in body
    assert "- data module: &lt;img src=x onerror=alert(1)&gt;\n- seed of its splits: \\`7\\`\n" in body
    assert "- settings: lr: 0.001, note: ![pixel]\\(https://tracker.example/p.gif), a\\|b: x\n" in body
    assert "- \\# val/acc --- (best): 0.5000\n" in body


# ----------------------------------------------------------------------------- thousands of skipped files


def test_first_skipped_lists_twenty_then_counts_the_rest():
    assert first_skipped({}, "{name}") == []
    twenty = {f"f{i:02d}": "bad" for i in range(20)}
    assert first_skipped(twenty, "{name}: {why}") == [f"f{i:02d}: bad" for i in range(20)]
    lines = first_skipped({**twenty, "g": "bad", "h": "bad"}, "{name}: {why}")
    assert lines == [f"f{i:02d}: bad" for i in range(20)] + ["... and 2 more skipped file(s)"]


def test_twenty_thousand_unreadable_files_print_twenty_one_lines(capsys):
    print_skipped({f"f{i:05d}.png": "cannot identify image file" for i in range(20_000)})
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 21
    assert lines[0] == "skipped f00000.png: not a readable image (cannot identify image file)"
    assert lines[19].startswith("skipped f00019.png") and lines[20] == "... and 19980 more skipped file(s)"


def test_the_image_folders_warning_lists_twenty_skipped_files_then_counts_the_rest(tmp_path):
    root = tmp_path / "data"
    for label, seed in (("a", 0), ("b", 100)):
        (root / label).mkdir(parents=True)
        for i in range(3):
            image(root / label / f"{i}.png", seed=seed + i)
    for i in range(25):
        (root / "a" / f"notes{i:02d}.txt").write_text("not an image")
    dm = ImageFolderDataModule(root=str(root), img_size=32, val_fraction=0.34)
    with pytest.warns(UserWarning) as warned:
        dm.setup("fit")
    [message] = [str(w.message) for w in warned if "skipped" in str(w.message)]
    assert message.startswith(f"skipped 25 file(s) under {root}: a/notes00.txt: ")
    parts = message.split("; ")
    assert len(parts) == 21 and parts[19].startswith("a/notes19.txt: ")
    assert parts[20] == "... and 5 more skipped file(s)"
