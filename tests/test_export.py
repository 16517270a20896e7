"""`python -m vit.export`: a checkpoint -> model.safetensors + config.json that timm's Hub loader reads, with equal
logits."""

import json
import os
import stat
from pathlib import Path

import pytest
import timm
import torch
from robust_helpers import error_line, run_dirs, save_with_folder, shared_run
from safetensors.torch import load_file

from vit.checks import CheckpointError
from vit.export import export, main
from vit.models import VisionTransformer
from vit.models.pretrained import create_vit
from vit.models.timm_compat import NotInTimm, timm_args
from vit.training.classifier import ImageClassifier

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5)
DATA = dict(mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.2), interpolation="bilinear", crop_pct=1.0, crop_mode="squash")


@pytest.fixture
def checkpoint(tmp_path_factory, monkeypatch) -> Path:
    """A train.py checkpoint (the tiny two-circles run the robust tests share), with class names as training stores
    them."""
    [run_dir] = run_dirs(shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch))
    named = tmp_path_factory.getbasetemp() / "named.ckpt"
    if not named.exists():
        content = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        save_with_folder({**content, "class_names": ["one circle", "two circles"]}, named)
    return named


def random_vit(**kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**{**SMALL, **kwargs}).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)  # large enough that every layer matters
    return model


def logits(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.slow
def test_the_export_is_read_by_timm_and_by_this_project_with_equal_logits(checkpoint, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["--ckpt_path", str(checkpoint), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    ours = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True).backbone.eval()
    assert sorted(load_file(out / "model.safetensors")) == sorted(ours.state_dict())  # timm's keys, no prefix
    config = json.loads((out / "config.json").read_text())
    assert config["label_names"] == ["one circle", "two circles"] and config["num_classes"] == 2
    assert config["num_features"] == ours.embed_dim and config["global_pool"] == "token"
    H, W = ours.patch_embed.img_size
    assert config["pretrained_cfg"]["input_size"] == [ours.patch_embed.in_chans, H, W]
    C = ours.patch_embed.in_chans
    assert config["pretrained_cfg"]["mean"] == [0.0] * C and config["pretrained_cfg"]["std"] == [1.0] * C  # raw pixels
    x = torch.rand(3, ours.patch_embed.in_chans, H, W)
    expected = logits(ours, x)
    # The Hub layout, read as timm reads a downloaded repo ...
    hub = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert (logits(hub.eval(), x) - expected).abs().max() < 1e-5
    # ... the file given to the architecture by name (the sizes from config.json's model_args) ...
    by_name = timm.create_model(
        config["architecture"],
        pretrained=True,
        **config["model_args"],
        pretrained_cfg_overlay=dict(file=str(out / "model.safetensors"), num_classes=2),
    )
    assert (logits(by_name.eval(), x) - expected).abs().max() < 1e-5
    # ... and this project's pretrained loader, from the folder or the file.
    hparams = torch.load(checkpoint, map_location="cpu", weights_only=True)["hyper_parameters"]
    init_args = hparams["backbone"]["init_args"]
    for source in (out, out / "model.safetensors"):
        back = create_vit(str(source), **init_args).eval()
        assert (logits(back, x) - expected).abs().max() < 1e-5


def test_a_timm_sized_vit_exports_under_its_timm_name(tmp_path):
    # The form: timm.create_model(<matching name>, pretrained=True, pretrained_cfg_overlay=dict(file=...)).
    model = random_vit(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3, num_classes=4)
    export(model, tmp_path / "out", dict(input_size=(3, 224, 224), **DATA), ["a", "b", "c", "d"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architecture"] == "vit_tiny_patch16_224"
    assert set(config["pretrained_cfg"]) >= {"input_size", "mean", "std", "num_classes"}
    assert "tag" not in config["pretrained_cfg"]  # timm's own weights' tag does not describe these
    reference = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=True,
        num_classes=4,
        pretrained_cfg_overlay=dict(file=str(tmp_path / "out" / "model.safetensors"), num_classes=4),
    ).eval()
    x = torch.randn(2, 3, 224, 224)
    assert (logits(reference, x) - logits(model, x)).abs().max() < 1e-5


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pool="mean", reg_tokens=2),
        dict(pool="map"),
        dict(pool="mean", fc_norm=False),
        dict(pos_embed="sincos2d"),
        dict(pos_embed="sincos1d", pool="mean"),  # fixed encodings: a table of their values
        dict(pos_embed="none", qk_norm=True, qkv_bias=False),
        dict(img_size=(32, 48), in_chans=1, mlp_ratio=2.0, reg_tokens=1, no_embed_class=True),
    ],
    ids=str,
)
def test_every_option_timm_has_exports_with_equal_logits(tmp_path, kwargs):
    model = random_vit(**kwargs)
    C, (H, W) = model.patch_embed.in_chans, model.patch_embed.img_size
    export(model, tmp_path / "out", dict(DATA, input_size=(C, H, W), mean=(0.5,) * C, std=(0.2,) * C), list("abcde"))
    exported = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    x = torch.randn(2, C, H, W)
    assert (logits(exported, x) - logits(model, x)).abs().max() < 1e-5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(patch_kernel=10), r"patch_kernel=10 cannot be exported: .* equal to the patch size \(8\)"),
        (dict(attn_score="additive"), "attn_score='additive' cannot be exported"),
    ],
)
def test_what_timm_cannot_compute_is_refused_naming_the_option(kwargs, message):
    with pytest.raises(NotInTimm, match=message):
        timm_args(VisionTransformer(**{**SMALL, **kwargs}))


@pytest.mark.slow
def test_bad_outputs_and_checkpoints_are_refused_in_one_line_before_anything_is_written(checkpoint, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    assert main(["--ckpt_path", str(checkpoint), "--out", str(full)]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"error: --out {full} is a folder that is not empty; pass "
        "--overwrite to write model.safetensors, config.json and README.md "
        "into it (other files are left alone)"
    )
    assert sorted(p.name for p in full.iterdir()) == ["notes.txt"]
    assert main(["--ckpt_path", str(checkpoint), "--out", str(full), "--overwrite"]) == 0
    assert sorted(p.name for p in full.iterdir()) == ["README.md", "config.json", "model.safetensors", "notes.txt"]
    capsys.readouterr()
    (tmp_path / "file").write_text("x")
    assert main(["--ckpt_path", str(checkpoint), "--out", str(tmp_path / "file")]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"error: --out {tmp_path / 'file'} is a file; give a folder (it is created)"
    )
    assert main(["--ckpt_path", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "new")]) == 2
    missing = f"error: checkpoint {tmp_path / 'missing.ckpt'} does not exist: give "
    assert error_line(capsys.readouterr().err).startswith(missing)
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_checkpoint_without_class_names_is_not_exported(checkpoint, tmp_path, capsys):
    plain = tmp_path / "plain.ckpt"
    content = torch.load(checkpoint, map_location="cpu", weights_only=True)
    del content["class_names"]
    torch.save(content, plain)
    assert main(["--ckpt_path", str(plain), "--out", str(tmp_path / "out")]) == 2
    assert f"error: checkpoint {plain} has no model folder beside it" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="class_names=None is not allowed: expected a list of non-empty strings"):
        save_with_folder(content, plain)  # nor can one be written
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_the_weights_file_gets_the_permissions_of_the_config_the_umask_decides(tmp_path, umask):
    previous = os.umask(umask)
    try:
        export(random_vit(), tmp_path / "out", dict(input_size=(3, 32, 32), **DATA), [str(i) for i in range(5)])
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    mode = {name: stat.S_IMODE(os.stat(out / name).st_mode) for name in ("model.safetensors", "config.json")}
    assert mode == {"model.safetensors": 0o666 & ~umask, "config.json": 0o666 & ~umask}  # as open() makes a new file


@pytest.mark.slow
def test_the_model_card_says_what_a_person_needs_and_its_code_runs(checkpoint, tmp_path, monkeypatch):
    import re

    from PIL import Image

    out = tmp_path / "out"
    assert main(["--ckpt_path", str(checkpoint), "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: timm\n")  # the Hub's front matter: its timm loading widget
    config = json.loads((out / "config.json").read_text())
    args, cfg = config["model_args"], config["pretrained_cfg"]
    assert f"width (`embed_dim`) {args['embed_dim']}, depth {args['depth']} blocks, {args['num_heads']} heads" in card
    exported = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert f"{sum(p.numel() for p in exported.parameters()) / 1e6:.2f} M parameters" in card
    assert "2 classes, label i is the i-th (`config.json`'s `label_names`): one circle, two circles." in card
    C, H, W = cfg["input_size"]
    assert f"{C} channel(s), resized to {H} x {W} pixels" in card
    assert f"normalised with mean {list(cfg['mean'])} and std {list(cfg['std'])}" in card
    content = torch.load(checkpoint, map_location="cpu", weights_only=True)
    data = content["datamodule_hyper_parameters"]
    assert f"- data module: {data['_class_path']}\n- seed of its splits: {data['seed']}\n" in card
    assert f"- written after epoch {content['epoch']}, step {content['global_step']}\n" in card
    assert f"lr: {content['hyper_parameters']['lr']}" in card
    # The metric each ModelCheckpoint monitored, as the checkpoint records it.
    states = [s for s in content["callbacks"].values() if s.get("monitor") == "val/acc"]
    assert states and f"- val/acc (best): {float(states[0]['best_model_score']):.4f}\n" in card
    # The card's code, run as written (this folder, a photo here), gives the model's probabilities.
    code = re.search(r"```python\n(.*?)```", card, re.DOTALL)[1].replace("path/to/this/folder", str(out))
    Image.new("RGB", (W + 7, H + 3), (200, 30, 30)).save(tmp_path / "photo.jpg")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(code, scope)
    assert scope["probabilities"].shape == (1, 2) and torch.allclose(scope["probabilities"].sum(), torch.tensor(1.0))


def test_a_model_card_without_a_training_record_says_so(tmp_path):
    export(random_vit(), tmp_path / "out", dict(input_size=(3, 32, 32), **DATA), list("abcde"))
    card = (tmp_path / "out" / "README.md").read_text()
    assert "## Training\n\n- not recorded in the checkpoint\n" in card
    assert "5 classes, label i is the i-th (`config.json`'s `label_names`): a, b, c, d, e." in card


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(img_size=96, patch_size=16, embed_dim=192, depth=12, num_heads=3), "vit_tiny_patch16_224"),
        (dict(img_size=(96, 128), patch_size=16, embed_dim=192, depth=12, num_heads=3), "vit_tiny_patch16_224"),
        (dict(img_size=32, patch_size=8, embed_dim=40, depth=2, num_heads=4), "test_vit"),  # no timm ViT this wide
        (dict(img_size=96, patch_size=16, embed_dim=192, depth=12, num_heads=3, reg_tokens=1), "test_vit"),
    ],
    ids=str,
)
def test_the_architecture_names_a_timm_vit_of_the_same_size_or_none(tmp_path, kwargs, name):
    model = random_vit(**kwargs)
    C, (H, W) = model.patch_embed.in_chans, model.patch_embed.img_size
    export(model, tmp_path / "out", dict(DATA, input_size=(C, H, W)), list("abcde"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architecture"] == name and config["model_args"]["img_size"] == [H, W]
    if name != "test_vit":  # the name's own sizes are the model's: timm builds it from the name and the image size
        with torch.device("meta"):
            default = timm.create_model(name, pretrained=False, img_size=(H, W))
        assert (
            default.embed_dim,
            len(default.blocks),
            default.blocks[0].attn.num_heads,
            default.patch_embed.patch_size[0],
        ) == (model.embed_dim, len(model.blocks), model.blocks[0].attn.num_heads, model.patch_embed.patch_size)
    exported = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    x = torch.randn(2, C, H, W)
    assert (logits(exported, x) - logits(model, x)).abs().max() < 1e-5


def test_the_card_front_matter_says_what_the_hub_shows(tmp_path):
    import yaml

    from vit.export import hub_base_model, hub_dataset, model_card

    args = timm_args(random_vit())
    training = {
        "data_module": "vit.data.cifar.CIFARDataModule",
        "dataset": "cifar10",
        "pretrained": "vit_tiny_patch16_224.augreg_in21k",
    }  # what a run records (`training_record`)
    card = model_card(args, dict(input_size=(3, 32, 32), **DATA), list("abcde"), training, "apache-2.0")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front == {
        "library_name": "timm",
        "license": "apache-2.0",
        "pipeline_tag": "image-classification",
        "base_model": "timm/vit_tiny_patch16_224.augreg_in21k",
        "datasets": ["cifar10"],
        "metrics": ["accuracy"],
        "tags": ["image-classification", "timm", "vision-transformer"],
    }
    bare = yaml.safe_load(model_card(args, dict(input_size=(3, 32, 32), **DATA), list("abcde")).split("---\n")[1])
    assert set(bare) == {"library_name", "pipeline_tag", "metrics", "tags"}  # no license unless given, no base, no data
    assert hub_dataset({"data_module": "vit.data.image_folder.ImageFolderDataModule", "dataset": "cifar10"}) is None
    # A name without a tag: the repo of timm's default tag, where `pretrained="vit_small_patch16_224"` downloads from.
    assert hub_base_model("vit_small_patch16_224") == timm.models.get_pretrained_cfg("vit_small_patch16_224").hf_hub_id
    assert hub_base_model("vit_small_patch16_224").startswith("timm/vit_small_patch16_224.")
    assert hub_base_model("hf-hub:org/my-vit@main") == "org/my-vit" and hub_base_model("org/my-vit") == "org/my-vit"
    for local in (str(tmp_path / "weights.safetensors"), "runs/x/last.ckpt", "not_a_timm_model", None):
        assert hub_base_model(local) is None


@pytest.mark.slow
@pytest.mark.parametrize("pretrained", ["w" * 4000, "hf-hub:org/name\nlicense: mit", "hf-hub:/home/me/weights"])
def test_a_pretrained_setting_that_is_no_hub_id_exports_without_a_base_model(pretrained, checkpoint, tmp_path):
    import yaml

    recorded = torch.load(checkpoint, weights_only=True)
    recorded["hyper_parameters"]["pretrained"] = pretrained  # 4,000 characters: longer than a file name may be
    odd = save_with_folder(recorded, tmp_path / "odd.ckpt")
    assert main(["--ckpt_path", str(odd), "--out", str(tmp_path / "out")]) == 0
    front = yaml.safe_load((tmp_path / "out" / "README.md").read_text().split("---\n")[1])
    assert "base_model" not in front and set(front) == {"library_name", "pipeline_tag", "metrics", "tags"}


def test_a_license_that_is_not_a_hub_id_is_refused_naming_the_form(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--ckpt_path", "x.ckpt", "--out", str(tmp_path / "out"), "--license", "Apache 2.0"])
    assert "'Apache 2.0' is not a Hub license id" in capsys.readouterr().err


@pytest.mark.slow
def test_the_card_code_as_written_gives_the_checkpoints_logits_on_a_rotated_jpeg(checkpoint, tmp_path, monkeypatch):
    import re

    import numpy as np
    from PIL import Image

    import vit

    out = tmp_path / "out"
    assert main(["--ckpt_path", str(checkpoint), "--out", str(out), "--license", "mit"]) == 0
    card = (out / "README.md").read_text()
    assert "\nlicense: mit\n" in card.split("---")[1]
    # A photo stored sideways, with the EXIF tag (orientation 6: turn 90 degrees clockwise) that makes it upright.
    y, x = np.mgrid[0:40, 0:64]
    pixels = np.stack([x * 4, y * 6, (x * y) % 256], axis=-1).astype(np.uint8)  # no symmetry a turn would keep
    exif = Image.Exif()
    exif[0x0112] = 6
    photo = tmp_path / "rotated.jpg"
    Image.fromarray(pixels).save(photo, exif=exif, quality=95)
    code = re.search(r"```python\n(.*?)```", card, re.DOTALL)[1]
    code = code.replace("path/to/this/folder", str(out)).replace('"photo.jpg"', repr(str(photo)))
    scope = {}
    exec(code, scope)
    predictor = vit.load(checkpoint)
    with torch.no_grad():
        expected = predictor.model(predictor.images(photo))
        card_logits = scope["model"](scope["x"])
        mode = "RGB" if scope["x"].shape[1] == 3 else "L"  # as the card converts
        unturned = scope["transform"](Image.open(photo).convert(mode))[None]
        sideways = scope["model"](unturned)
    assert (card_logits - expected).abs().max() < 1e-5
    # Read without the EXIF turn the input differs, and so do the logits by more than the tolerance: the test can fail.
    assert (unturned - scope["x"]).abs().max() > 0.1 and (sideways - expected).abs().max() > 1e-5


@pytest.mark.slow
def test_the_card_reports_the_runs_test_metrics_as_the_model_index(checkpoint, tmp_path):
    import shutil

    from huggingface_hub import ModelCard

    from vit.training.cli import record_test_metrics

    folder = tmp_path / "model"
    shutil.copytree(checkpoint.with_suffix(""), folder)
    record_test_metrics(folder, {"test/acc": 0.75, "test/ece": 0.125, "test/loss": float("nan")})
    assert main(["--ckpt_path", str(folder), "--out", str(tmp_path / "out")]) == 0
    card = ModelCard.load(tmp_path / "out" / "README.md")
    results = {(r.metric_type, r.dataset_split): r.metric_value for r in card.data.eval_results}
    assert results == {("accuracy", "test"): 0.75, ("ece", "test"): 0.125}  # the NaN loss is not recorded
    assert "- test/acc (the test split, after training): 0.7500" in card.text


@pytest.mark.slow
def test_pushing_uploads_the_export_and_offline_says_so_in_one_line(checkpoint, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(
        huggingface_hub.HfApi, "create_repo", lambda self, repo, **kw: calls.append(("create", repo, kw))
    )
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: calls.append(("upload", kw)))
    out = tmp_path / "out"
    assert main(["--ckpt_path", str(checkpoint), "--out", str(out), "--push_to_hub", "me/tiny-vit", "--private"]) == 0
    assert calls[0] == ("create", "me/tiny-vit", {"private": True, "exist_ok": True})
    assert calls[1][1]["repo_id"] == "me/tiny-vit" and calls[1][1]["folder_path"] == out
    assert calls[1][1]["allow_patterns"] == ["model.safetensors", "config.json", "README.md"]
    assert "pushed to https://huggingface.co/me/tiny-vit" in capsys.readouterr().out
    monkeypatch.undo()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["--ckpt_path", str(checkpoint), "--out", str(tmp_path / "offline"), "--push_to_hub", "me/x"]) == 1
    line = error_line(capsys.readouterr().err)
    assert line.startswith(
        f"error: --push_to_hub me/x: {tmp_path / 'offline'} is written, but it could not be "
        "uploaded: OfflineModeIsEnabled"
    ), line
    assert (tmp_path / "offline" / "model.safetensors").is_file()
    with pytest.raises(SystemExit):
        main(["--ckpt_path", str(checkpoint), "--out", str(tmp_path / "x"), "--push_to_hub", "../etc/passwd"])
    assert "is not a Hub repo id: org/name" in capsys.readouterr().err


@pytest.mark.slow
def test_the_test_after_fit_is_recorded_in_the_best_checkpoints_model_folder(tmp_path, monkeypatch, capsys):
    import json

    from robust_helpers import main_in_process, tiny_config

    main_in_process(["fit", "--config", str(tiny_config(tmp_path, max_epochs=1))], monkeypatch)
    out = capsys.readouterr().out
    [best] = [
        p
        for p in (tmp_path / "runs" / "tiny" / "version_0" / "checkpoints").glob("*.ckpt")
        if p.name.startswith("epoch")
    ]
    recorded = json.loads((best.with_suffix("") / "config.json").read_text())["vit"]["training"]["test"]
    assert f"test/acc = {recorded['test/acc']:.4f} on {int(recorded['test/images'])} images  ({best})" in out
