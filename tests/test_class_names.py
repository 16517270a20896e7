"""Class names travel with the model: data modules name their classes, checkpoints keep the names, and the
test metrics (per-class accuracy, top-5, calibration error) are what a brute-force count gives."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from vit.data import CIFARDataModule, ImageFolderDataModule, SameDifferentDataModule, TwoCirclesDataModule
from vit.models import VisionTransformer
from vit.training.classifier import ImageClassifier, format_test_results


def quiet_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_every_data_module_names_its_classes(tmp_path, fake_cifar):
    assert TwoCirclesDataModule().class_names == ["not_diagonal", "diagonal"]
    assert TwoCirclesDataModule(task="relative").class_names == ["not_above_left", "above_left"]
    assert SameDifferentDataModule().class_names == ["different", "same"]
    for name in ("dogs", "cats", "birds"):
        (tmp_path / "photos" / name).mkdir(parents=True)
    assert ImageFolderDataModule(root=str(tmp_path / "photos")).class_names == ["birds", "cats", "dogs"]
    # CIFAR's names are read from the meta file: the generated one names them fake_class_00, ...
    cifar10 = CIFARDataModule(dataset="cifar10", data_dir=str(fake_cifar("cifar10")), download=False)
    assert cifar10.class_names == [f"fake_class_{i:02d}" for i in range(10)]
    cifar100 = CIFARDataModule(dataset="cifar100", data_dir=str(fake_cifar("cifar100")), download=False)
    assert cifar100.class_names == [f"fake_class_{i:02d}" for i in range(100)]


def tiny_vit() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=1, num_heads=2)


def test_the_checkpoint_keeps_the_data_modules_class_names_and_refuses_a_checkpoint_without_them(tmp_path):
    model = ImageClassifier(tiny_vit())
    assert model.class_names == ["0", "1"]  # nothing known yet
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, SameDifferentDataModule(num_train=16, num_val=8, num_test=8, batch_size=8))
    trainer.save_checkpoint(tmp_path / "named.ckpt")
    checkpoint = torch.load(tmp_path / "named.ckpt", weights_only=True)
    assert checkpoint["class_names"] == ["different", "same"]  # a plain list of str, at the top level

    reloaded = ImageClassifier.load_from_checkpoint(tmp_path / "named.ckpt", backbone=tiny_vit(), weights_only=True)
    assert reloaded.class_names == ["different", "same"]

    del checkpoint["class_names"]  # as written before the names were stored: no door opens such a .ckpt any more
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(KeyError, match="class_names"):
        ImageClassifier.load_from_checkpoint(tmp_path / "old.ckpt", backbone=tiny_vit(), weights_only=True)

    checkpoint["class_names"] = ["one"]
    torch.save(checkpoint, tmp_path / "wrong.ckpt")
    with pytest.raises(
        ValueError,
        match=r"the checkpoint's class_names: class_names holds 1 name\(s\) \(1 distinct\); "
        r"the model has 2 classes",
    ):
        ImageClassifier.load_from_checkpoint(tmp_path / "wrong.ckpt", backbone=tiny_vit(), weights_only=True)


class Linear(nn.Module):
    """A fixed linear classifier of 12 numbers into 7 classes."""

    num_classes = 7

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * self.proj(x.flatten(1))


class SevenClasses(L.LightningDataModule):
    class_names = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu"]

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__()
        self.x, self.y = x, y

    def test_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16)  # 3 batches of 16, 16 and 8


def test_test_metrics_equal_a_brute_force_count():
    torch.manual_seed(0)
    x, y = torch.randn(40, 3, 2, 2), torch.randint(0, 6, (40,))  # no "gnu" (class 6) among the labels
    model = ImageClassifier(Linear())
    [results] = quiet_trainer().test(model, SevenClasses(x, y), verbose=False)

    with torch.no_grad():
        probs = model.backbone(x).softmax(-1)  # (40, 7)
    confidence, predicted = probs.max(-1)
    correct = (predicted == y).float()
    assert results["test/acc"] == pytest.approx(correct.mean().item())
    top5 = (probs.topk(5, dim=-1).indices == y[:, None]).any(-1).float().mean().item()
    assert results["test/top5_acc"] == pytest.approx(top5)
    assert 0 < top5 < 1 and top5 > correct.mean().item()  # a case where top-5 differs from top-1 and from 1
    # Expected calibration error: 15 bins [k/15, (k+1)/15) of the confidence; sum over bins of
    # |accuracy - mean confidence| weighted by the share of images in the bin.
    ece = 0.0
    for k in range(15):
        members = (confidence >= k / 15) & (confidence < (k + 1) / 15)
        if members.any():
            ece += members.float().mean() * (correct[members].mean() - confidence[members].mean()).abs()
    assert results["test/ece"] == pytest.approx(float(ece), abs=1e-6)
    for c, name in enumerate(SevenClasses.class_names[:6]):
        assert results[f"test/class_acc/{name}"] == pytest.approx(correct[y == c].mean().item()), name
    assert "test/class_acc/gnu" not in results  # no test image: no accuracy, rather than a made-up 0

    assert results["test/images"] == len(y)  # every test image counted once
    report = format_test_results(results, "some.ckpt").splitlines()
    assert report[0] == f"test/acc = {results['test/acc']:.4f} on {len(y)} images  (some.ckpt)"
    assert f"test/top5_acc = {top5:.4f}" in report and f"test/ece = {ece:.4f}" in report
    assert report[report.index("accuracy per class:") + 1] == f"  ant  {correct[y == 0].mean().item():.4f}"


def test_two_classes_have_no_top5():
    model = ImageClassifier(tiny_vit())
    x, y = torch.rand(8, 1, 32, 32), torch.tensor([0, 1] * 4)
    [results] = quiet_trainer().test(model, DataLoader(TensorDataset(x, y), batch_size=8), verbose=False)
    assert "test/top5_acc" not in results and "test/ece" in results
    assert {"test/class_acc/0", "test/class_acc/1"} <= set(results)  # no data module names: the indices


def test_sample_names_are_the_files_relative_to_the_image_folder(tmp_path):
    from PIL import Image

    from vit.training.predictions import sample_name

    for label in ("cats", "dogs"):
        (tmp_path / label).mkdir()
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / label / f"{i}.png")
    data = ImageFolderDataModule(root=str(tmp_path), img_size=8, val_fraction=0.25, test_fraction=0.5, num_workers=0)
    data.setup("predict")  # no test/ folder: the predict split is the held-out test half (a Subset)
    names = [sample_name(data.test_set, i) for i in range(len(data.test_set))]
    assert len(names) == 3 and all((tmp_path / name).is_file() for name in names)
    assert [name.split("/")[0] for name in names] == [data.class_names[int(data.test_set[i][1])] for i in range(3)]
    assert sample_name(TensorDataset(torch.zeros(4)), 2) == "2"  # data without files: the index in the split


@pytest.mark.slow
def test_train_py_predict_writes_named_predictions_in_its_run_folder(tmp_path_factory, tmp_path, monkeypatch, capsys):
    import csv

    from robust_helpers import cli, error_line, main_in_process, run_dirs, shared_run

    root = tmp_path_factory.getbasetemp() / "robust_reference"
    [run_dir] = run_dirs(shared_run(root, monkeypatch))
    last = run_dir / "checkpoints" / "last.ckpt"
    predict = ["predict", "--config", str(root / "tiny.yaml"), "--ckpt_path", str(last)]
    main_in_process([*predict, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")], monkeypatch)
    [written] = (tmp_path / "runs").glob("tiny/version_0/predictions.csv")
    assert f"wrote 64 predictions to {written}" in capsys.readouterr().out
    rows = list(csv.DictReader(written.open()))

    model = ImageClassifier.load_from_checkpoint(last, map_location="cpu", weights_only=True).eval()
    data = L.LightningDataModule.load_from_checkpoint(last, weights_only=True)
    data.setup("predict")
    with torch.no_grad():
        probs = model(data.test_set.images).softmax(-1)  # (64, 2): the predict split is the test split
    assert [r["file"] for r in rows] == [str(i) for i in range(64)]  # synthetic data: the index in the split
    for row, p in zip(rows, probs):
        assert row["class_name"] == ["not_diagonal", "diagonal"][int(p.argmax())] == data.class_names[int(p.argmax())]
        assert int(row["class_index"]) == int(p.argmax())
        assert float(row["probability"]) == pytest.approx(float(p.max()), abs=1e-6)

    code, err = cli(
        [
            *predict,
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "refused"),
            "--trainer.callbacks+=vit.training.predictions.PredictionWriter",
            "--trainer.callbacks.topk=3",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2 and error_line(err) == (
        "error: PredictionWriter topk=3 is not allowed: expected an int in [1, 2] (the model has 2 classes)"
    )
    assert not (tmp_path / "refused").exists()


def test_a_taken_file_name_gets_a_number_instead_of_being_overwritten(tmp_path):
    from vit.prediction_csv import free_path

    (tmp_path / "predictions.csv").write_text("earlier")
    (tmp_path / "predictions-1.csv").write_text("earlier too")
    assert free_path(tmp_path / "predictions.csv") == tmp_path / "predictions-2.csv"
    assert free_path(tmp_path / "other.csv") == tmp_path / "other.csv"
