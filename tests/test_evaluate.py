"""`python -m vit.evaluate` and `Predictor.evaluate`: every image of a labelled folder scored, the metrics equal to
torchmetrics' on the same probabilities, class folders matched to the model's classes by name, bad folders refused
in one line before any image is decoded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

import vit
from vit import artifact
from vit.evaluate import main
from vit.models import VisionTransformer
from vit.models.timm_compat import timm_state_dict

NAMES = ["ant", "bee", "cat", "dog", "eel", "fox"]
INPUTS = {"img_size": [32, 32], "in_chans": 3, "mean": [0.5] * 3, "std": [0.25] * 3, "interpolation": "bicubic"}


@pytest.fixture
def model_folder(tmp_path):
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=len(NAMES))
    model = VisionTransformer(**args).eval()
    config = artifact.describe(model, {"class_path": "vit.models.VisionTransformer", "init_args": args}, INPUTS, NAMES)
    return artifact.write(tmp_path / "model", config, timm_state_dict(model))


@pytest.fixture
def labelled(tmp_path):
    """Class folders for five of the six classes ("fox" has none), 3-5 photos each, one unreadable file."""
    rng = np.random.default_rng(0)
    root = tmp_path / "labelled"
    for k, name in enumerate(NAMES[:5]):
        (root / name).mkdir(parents=True)
        for i in range(3 + k % 3):
            pixels = rng.integers(0, 256, (20 + i, 28, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    (root / "cat" / "broken.png").write_bytes(b"not an image")
    return root


def reference(predictor, root):
    """Probabilities and labels image by image through `predict`'s path, and torchmetrics' scores of them."""
    files = sorted(p for p in root.glob("*/*.png") if p.name != "broken.png")
    probs = predictor.probabilities(files)
    labels = torch.tensor([NAMES.index(p.parent.name) for p in files])
    K = len(NAMES)
    top1 = MulticlassAccuracy(num_classes=K, top_k=1, average="micro")(probs, labels)
    top5 = MulticlassAccuracy(num_classes=K, top_k=5, average="micro")(probs, labels)
    confusion = MulticlassConfusionMatrix(num_classes=K)(probs, labels)
    return len(files), float(top1), float(top5), confusion


def test_every_image_is_scored_and_the_metrics_equal_torchmetrics(model_folder, labelled):
    predictor = vit.load(model_folder)
    result = predictor.evaluate(labelled)
    count, top1, top5, confusion = reference(predictor, labelled)
    assert result["images"] == count == 3 + 4 + 5 + 3 + 4
    assert result["top1"] == pytest.approx(top1) and result["top5"] == pytest.approx(top5)
    assert result["confusion_matrix"] == confusion.tolist()
    assert result["skipped"] == {"cat/broken.png": result["skipped"]["cat/broken.png"]}
    assert result["classes_without_images"] == ["fox"]
    assert result["per_class"]["fox"] == {"images": 0, "accuracy": None}
    bee = NAMES.index("bee")
    assert result["per_class"]["bee"] == {"images": 4, "accuracy": pytest.approx(float(confusion[bee, bee] / 4))}


def test_the_command_prints_and_writes_what_the_python_call_gives(model_folder, labelled, tmp_path, capsys):
    out = tmp_path / "metrics.json"
    assert main(["--ckpt_path", str(model_folder), "--input_dir", str(labelled), "--output", str(out)]) == 0
    printed = capsys.readouterr()
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(vit.load(model_folder).evaluate(labelled)))
    assert "images: 19" in printed.out and "top-5 accuracy" in printed.out
    assert "cat/broken.png" in printed.err and "no folder for class(es) 'fox'" in printed.err
    assert main(["--ckpt_path", str(model_folder), "--input_dir", str(labelled), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err  # never overwritten without --overwrite


def test_a_folder_naming_no_class_of_the_model_is_refused_naming_it(model_folder, labelled, capsys):
    (labelled / "gnu").mkdir()
    assert main(["--ckpt_path", str(model_folder), "--input_dir", str(labelled)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"error: --input_dir {labelled} has folder(s) 'gnu' that name no class of the model; its classes are "
        "'ant', 'bee', 'cat', 'dog', 'eel', 'fox' (the folders are matched to them by name)"
    )


def test_a_flat_folder_or_a_missing_one_is_refused_saying_what_to_give(model_folder, tmp_path, capsys):
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.new("RGB", (8, 8)).save(flat / "x.png")
    assert main(["--ckpt_path", str(model_folder), "--input_dir", str(flat)]) == 2
    assert "has no class folders: give a folder of one sub-folder per class" in capsys.readouterr().err
    assert main(["--ckpt_path", str(model_folder), "--input_dir", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder (it does not exist)" in capsys.readouterr().err


def test_fewer_than_five_classes_report_no_top5(tmp_path):
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=2)
    model = VisionTransformer(**args).eval()
    config = artifact.describe(
        model, {"class_path": "vit.models.VisionTransformer", "init_args": args}, INPUTS, ["a", "b"]
    )
    folder = artifact.write(tmp_path / "model", config, timm_state_dict(model))
    for name in ("a", "b"):
        (tmp_path / "data" / name).mkdir(parents=True)
        Image.new("RGB", (32, 32), (200, 10, 10)).save(tmp_path / "data" / name / "x.png")
    result = vit.load(folder).evaluate(tmp_path / "data")
    assert "top5" not in result and result["images"] == 2 and result["top1"] == 0.5  # one image, one class right
