"""`python -m vit.predict`: a folder of the user's own images -> a CSV of classes and probabilities.

Every image a user may have is read at its real range (8-bit, 16-bit, float, any size and mode); what cannot
be read is skipped with the reason; bad options, paths and checkpoints are refused before any image is
decoded, and no file is overwritten.
"""

import copy
import csv
import hashlib
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from robust_helpers import run_dirs, shared_run

from vit.artifact.io import read_trainer_state as read
from vit.checks import CheckpointError
from vit.data import CIFARDataModule, TwoCirclesDataset
from vit.data.images import build_transform, to_input
from vit.predict import main
from vit.training.classifier import ImageClassifier
from vit.upgrade import main as write_folder


@pytest.fixture
def checkpoint(tmp_path_factory, monkeypatch) -> Path:
    [run_dir] = run_dirs(shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch))
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture
def images(tmp_path) -> Path:
    """Two-circles test images as 8-bit grayscale PNGs, an RGB copy at twice the size, two bad files and two hidden
    ones."""
    folder = tmp_path / "my images"
    folder.mkdir()
    dataset = TwoCirclesDataset(num_samples=6, noise=0.0, seed=11)
    for i in range(6):
        pixels = (dataset.images[i, 0].clamp(0, 1).numpy() * 255).round().astype(np.uint8)  # (32, 32)
        Image.fromarray(pixels).save(folder / f"circles_{i}.png")
    Image.fromarray(pixels).convert("RGB").resize((64, 64), Image.NEAREST).save(folder / "big_rgb.png")
    (folder / "cut.png").write_bytes((folder / "circles_0.png").read_bytes()[:70])
    (folder / "notes.txt").write_text("not an image")
    (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # hidden files are ignored, not listed as unreadable
    Image.fromarray(pixels).save(folder / ".circles_copy.png")
    return folder


def snapshot(folder: Path) -> dict[str, tuple[str, float]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime) for p in folder.iterdir()}


def predict(checkpoint: Path, folder: Path, output: Path, *extra: str) -> int:
    return main(["--ckpt_path", str(checkpoint), "--input_dir", str(folder), "--output", str(output), *extra])


# --- what it writes --------------------------------------------------------------------------------


@pytest.mark.slow
def test_predictions_csv_matches_the_model_on_the_same_pixels(checkpoint, images, tmp_path, capsys):
    before = snapshot(images)
    output = tmp_path / "predictions.csv"
    assert main(["--ckpt_path", str(checkpoint), "--input_dir", str(images), "--output", str(output)]) == 0
    assert snapshot(images) == before  # nothing in the input folder changed

    err = capsys.readouterr().err
    assert "skipped cut.png: not a readable image" in err and "skipped notes.txt: not a readable image" in err
    assert ".DS_Store" not in err
    rows = list(csv.DictReader(output.open()))
    assert [r["file"] for r in rows] == ["big_rgb.png", *[f"circles_{i}.png" for i in range(6)]]

    # Reference: the model on the PNG's own pixels scaled to [0, 1], as the two-circles data was in training.
    model = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    x = torch.stack(
        [torch.from_numpy(np.array(Image.open(images / f"circles_{i}.png"))).float()[None] / 255 for i in range(6)]
    )  # (6, 1, 32, 32)
    with torch.no_grad():
        probs = model(x).softmax(dim=-1)
    for i, row in enumerate(rows[1:]):
        assert int(row["class_index"]) == int(probs[i].argmax())
        assert row["class_name"] == ["not_diagonal", "diagonal"][int(probs[i].argmax())]
        assert float(row["probability"]) == pytest.approx(float(probs[i].max()), abs=1e-6)
    assert 0.5 <= float(rows[0]["probability"]) <= 1.0


def test_other_sizes_and_modes_are_converted_like_the_training_data():
    # A 64x48 RGB image, dark on the left half and light grey on the right, for a 1-channel 32x32 model.
    pixels = np.zeros((48, 64, 3), dtype=np.uint8)
    pixels[:, 32:] = 180
    x = build_transform(32, 1, None)(Image.fromarray(pixels))
    assert x.shape == (1, 32, 32) and x.dtype == torch.float32
    # Grey RGB -> luma is the same grey; [0, 1] scaling; the halves stay halves (antialiasing blurs
    # the one column pair at the border).
    torch.testing.assert_close(x[0, :, :15], torch.zeros(32, 15), rtol=0, atol=1 / 255)
    torch.testing.assert_close(x[0, :, 17:], torch.full((32, 15), 180 / 255), rtol=0, atol=1 / 255)

    # CIFAR inputs are normalised with the data module's mean and std after scaling to [0, 1].
    dm = CIFARDataModule(dataset="cifar10")
    colour = Image.new("RGBA", (40, 20), (200, 100, 50, 128))  # alpha is dropped
    y = build_transform(dm.img_size, dm.in_chans, dm.normalization)(colour)
    mean, std = torch.tensor(dm.normalization[0]), torch.tensor(dm.normalization[1])
    expected = (torch.tensor([200, 100, 50]) / 255 - mean) / std
    assert y.shape == (3, 32, 32)
    torch.testing.assert_close(y, expected[:, None, None].expand(3, 32, 32), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_sixteen_bit_and_float_images_are_scaled_by_their_real_range(checkpoint, tmp_path, capsys):
    gray = np.zeros((32, 32), np.float64)
    gray[4:12, 4:12] = 0.8  # a bright square on black
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray((gray * 255).round().astype(np.uint8)).save(folder / "eight.png")
    Image.fromarray((gray * 65535).round().astype(np.uint16)).save(folder / "sixteen.png")  # opens as I;16 or I
    Image.fromarray((gray * 65535).round().astype(np.uint16)).save(folder / "sixteen.tif")
    Image.fromarray(gray.astype(np.float32)).save(folder / "float.tif")  # mode F, already in [0, 1]
    for name in ("sixteen.png", "sixteen.tif", "float.tif"):
        with Image.open(folder / name) as image:
            x = to_input(image)
            assert isinstance(x, torch.Tensor) and x.shape == (1, 32, 32)
            assert abs(float(x.max()) - 0.8) < 1e-4 and float(x.min()) == 0.0  # not clipped to white
    assert abs(float(to_input(Image.fromarray((gray * 4 - 1).astype(np.float32))).max()) - 1.0) < 1e-6  # min-max
    output = tmp_path / "p.csv"
    assert predict(checkpoint, folder, output) == 0
    rows = {r["file"]: r for r in csv.DictReader(output.open())}
    assert set(rows) == {"eight.png", "sixteen.png", "sixteen.tif", "float.tif"}
    for name in ("sixteen.png", "sixteen.tif", "float.tif"):  # the same picture gives the same answer
        assert rows[name]["class_index"] == rows["eight.png"]["class_index"]
        assert abs(float(rows[name]["probability"]) - float(rows["eight.png"]["probability"])) < 0.02


@pytest.mark.slow
def test_topk_writes_the_k_best_classes_with_their_names(checkpoint, images, tmp_path, capsys):
    output = tmp_path / "top2.csv"
    assert (
        main(["--ckpt_path", str(checkpoint), "--input_dir", str(images), "--output", str(output), "--topk", "2"]) == 0
    )
    rows = list(csv.DictReader(output.open()))
    assert list(rows[0]) == [
        "file",
        "class_name",
        "class_index",
        "probability",
        "class_name_2",
        "class_index_2",
        "probability_2",
    ]
    model = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).eval()
    x = torch.stack(
        [torch.from_numpy(np.array(Image.open(images / r["file"]))).float()[None] / 255 for r in rows[1:]]
    )  # (6, 1, 32, 32): the 32x32 grayscale files
    with torch.no_grad():
        probs = model(x).softmax(dim=-1)
    for row, p in zip(rows[1:], probs):
        best, second = int(p.argmax()), int(p.argmin())  # two classes: the second is the other one
        assert (row["class_name"], row["class_name_2"]) == (model.class_names[best], model.class_names[second])
        assert (int(row["class_index"]), int(row["class_index_2"])) == (best, second)
        assert float(row["probability_2"]) == pytest.approx(float(p[second]), abs=1e-6)


@pytest.mark.slow
def test_a_checkpoint_without_class_names_is_refused_in_one_line(checkpoint, images, tmp_path, capsys):
    old = torch.load(checkpoint, weights_only=True)
    del old["class_names"]  # as written before class names were stored
    torch.save(old, tmp_path / "old.ckpt")
    output = tmp_path / "p.csv"
    assert main(["--ckpt_path", str(tmp_path / "old.ckpt"), "--input_dir", str(images), "--output", str(output)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: checkpoint {tmp_path / 'old.ckpt'} has no model folder beside it (old/): it was written before model "
        f"folders; write one with `python -m vit.upgrade --ckpt_path {tmp_path / 'old.ckpt'}`"
    )
    assert not output.exists()
    # Its folder cannot be written either: there is nothing to name its classes by.
    assert write_folder(["--ckpt_path", str(tmp_path / "old.ckpt")]) == 2
    assert "class_names=None is not allowed: expected a list of non-empty strings" in capsys.readouterr().err


# --- what it skips and what it refuses -------------------------------------------------------------


@pytest.mark.slow
def test_bombs_and_broken_links_are_skipped_with_the_reason(checkpoint, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(folder / "fine.png")
    Image.fromarray(np.zeros((64, 64), np.uint8)).save(folder / "bomb.png")
    os.symlink(folder / "missing.png", folder / "dangling.png")
    os.symlink(folder / "loop_b.png", folder / "loop_a.png")
    os.symlink(folder / "loop_a.png", folder / "loop_b.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64 x 64 = 4096 > 2 x 1000: a "bomb"
    output = tmp_path / "p.csv"
    assert predict(checkpoint, folder, output) == 0
    err = capsys.readouterr().err
    assert "skipped dangling.png: not a readable image (a symbolic link to nothing (dangling))" in err
    assert "skipped loop_a.png: not a readable image (a symbolic link loop)" in err
    assert "skipped bomb.png: not a readable image (too large to decode safely" in err
    assert [r["file"] for r in csv.DictReader(output.open())] == ["fine.png"]


@pytest.mark.slow
def test_output_is_never_overwritten_or_put_in_the_input_folder(checkpoint, images, tmp_path, capsys):
    output = tmp_path / "predictions.csv"
    output.write_text("earlier results")
    args = ["--ckpt_path", str(checkpoint), "--input_dir", str(images), "--output", str(output)]
    assert main(args) == 2
    assert f"error: --output {output} already exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert output.read_text() == "earlier results"
    assert main([*args, "--overwrite"]) == 0
    assert output.read_text().startswith("file,class_name,class_index,probability\n")

    inside = images / "predictions.csv"
    assert main(["--ckpt_path", str(checkpoint), "--input_dir", str(images), "--output", str(inside)]) == 2
    assert "is inside --input_dir" in capsys.readouterr().err and not inside.exists()


@pytest.mark.slow
def test_bad_paths_and_checkpoints_are_reported(checkpoint, images, tmp_path, capsys):
    output = str(tmp_path / "p.csv")
    assert main(["--ckpt_path", str(checkpoint), "--input_dir", str(tmp_path / "nope"), "--output", output]) == 2
    assert f"error: --input_dir {tmp_path / 'nope'} is not a folder (it does not exist)" in capsys.readouterr().err
    assert main(["--ckpt_path", str(tmp_path / "x.ckpt"), "--input_dir", str(images), "--output", output]) == 2
    assert f"error: checkpoint {tmp_path / 'x.ckpt'} does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--ckpt_path", str(checkpoint), "--input_dir", str(empty), "--output", output]) == 1
    assert "error: no readable image in" in capsys.readouterr().err and not Path(output).exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch_size", "0"], "--batch_size 0 is not allowed: expected an int in [1, 65536]"),
        (["--batch_size", "1" + "0" * 30], f"--batch_size 1{'0' * 30} is not allowed: expected an int in [1, 65536]"),
        (["--num_workers", "-1"], "--num_workers -1 is not allowed: expected an int >= 0"),
        (["--device", "tpu9"], "--device 'tpu9' is not"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda was asked for, but this machine has no CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there"),
        ),
        (["--device", "cpu", "--precision", "fp16"], "precision='fp16' runs on a GPU; on the CPU use precision='bf16'"),
    ],
)
def test_bad_options_are_refused_before_any_image_is_decoded(extra, message, checkpoint, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(folder / "fine.png")
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("an image was decoded"))
    assert predict(checkpoint, folder, tmp_path / "p.csv", *extra) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.slow
def test_workers_write_the_same_rows_and_progress_is_plain_lines_off_a_terminal(checkpoint, images, tmp_path, capsys):
    assert predict(checkpoint, images, tmp_path / "serial.csv", "--num_workers", "0", "--batch_size", "3") == 0
    serial = capsys.readouterr().err
    assert predict(checkpoint, images, tmp_path / "workers.csv", "--num_workers", "2", "--batch_size", "3") == 0
    assert (tmp_path / "workers.csv").read_text() == (tmp_path / "serial.csv").read_text()
    assert "\r" not in serial  # captured stderr is not a terminal: whole lines, the last one when all are done
    assert re.search(rf"{re.escape(str(images))}: 9/9 images, [0-9.]+ images/s\n", serial), serial


@pytest.mark.slow
@pytest.mark.parametrize(
    "topk, message",
    [
        ("0", "error: --topk 0 is not allowed: expected an int >= 1"),
        ("3", "error: --topk 3 is not allowed: expected an int in [1, 2] (the model has 2 classes)"),
        (
            "1" + "0" * 30,
            f"error: --topk 1{'0' * 30} is not allowed: expected an int in [1, 2] (the model has 2 classes)",
        ),
    ],
)
def test_a_topk_the_model_cannot_give_is_refused_before_any_image_is_read(
    topk, message, checkpoint, images, tmp_path, capsys, monkeypatch
):
    import vit.data.images

    monkeypatch.setattr(vit.data.images, "decode_image", lambda *a: pytest.fail("images were read"))
    output = tmp_path / "p.csv"
    assert (
        main(["--ckpt_path", str(checkpoint), "--input_dir", str(images), "--output", str(output), "--topk", topk]) == 2
    )
    assert capsys.readouterr().err.strip() == message and not output.exists()


@pytest.mark.slow
def test_a_checkpoint_with_non_finite_weights_is_refused_by_predict(checkpoint, tmp_path, capsys):
    broken = torch.load(checkpoint, weights_only=True)
    bias = broken["state_dict"]["backbone.head.bias"]
    broken["state_dict"]["backbone.head.bias"] = torch.full_like(bias, float("nan"))
    import vit.artifact

    path = vit.artifact.write(tmp_path / "nan", *vit.artifact.from_checkpoint(broken))
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(folder / "fine.png")
    assert predict(path, folder, tmp_path / "p.csv") == 2
    assert "head.bias holds NaN or infinite values" in capsys.readouterr().err
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.slow
def test_checkpoints_of_other_layouts_are_refused_in_one_line(checkpoint, tmp_path):
    good = torch.load(checkpoint, weights_only=True)
    as_list = tmp_path / "list.ckpt"
    torch.save([1, 2], as_list)
    with pytest.raises(CheckpointError, match="is not a Lightning checkpoint"):
        read(as_list)
    no_weights = tmp_path / "string.ckpt"
    torch.save({**copy.copy(good), "state_dict": "lr=0.1"}, no_weights)
    with pytest.raises(CheckpointError, match="is not a Lightning checkpoint"):
        read(no_weights)


def test_sub_folders_are_named_and_searched_with_recursive(checkpoint, images, tmp_path, capsys):
    sub = images / "more" / "deeper"
    sub.mkdir(parents=True)
    shutil.copy(images / "circles_0.png", sub / "again.png")
    shutil.copy(images / "circles_1.png", images / "more" / "twice.png")
    flat, deep = tmp_path / "flat.csv", tmp_path / "deep.csv"
    assert predict(checkpoint, images, flat) == 0
    assert "note: 1 sub-folder(s) of " in capsys.readouterr().err
    assert predict(checkpoint, images, deep, "--recursive") == 0
    rows = {row["file"]: row for row in csv.DictReader(deep.open())}
    flat_rows = {row["file"]: row for row in csv.DictReader(flat.open())}
    assert set(rows) == set(flat_rows) | {"more/twice.png", "more/deeper/again.png"}
    assert rows["more/deeper/again.png"]["probability"] == flat_rows["circles_0.png"]["probability"]
    assert rows["more/twice.png"]["class_name"] == flat_rows["circles_1.png"]["class_name"]
