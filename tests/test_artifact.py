"""The trained model as a folder of its own (`vit.artifact`): written beside every checkpoint a run keeps, opened alike
by timm, transformers and `vit.load`, and refused in one line when its files are hostile."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from robust_helpers import main_in_process, run_dirs, tiny_config
from safetensors.torch import load_file, save_file

import vit
from vit import artifact
from vit.artifact import ArtifactError
from vit.hub import HubError
from vit.models import ConvNet, VisionTransformer
from vit.models.timm_compat import timm_state_dict
from vit.models.weights import MAX_CONFIG_BYTES

NAMES = ["cat", "dog", "eel"]
INPUTS = {
    "img_size": [32, 32],
    "in_chans": 3,
    "mean": [0.5, 0.4, 0.3],
    "std": [0.2, 0.25, 0.3],
    "interpolation": "bicubic",
}
VIT = dict(img_size=32, patch_size=8, in_chans=3, num_classes=3, embed_dim=32, depth=2, num_heads=2)


def photos(count: int = 20, seed: int = 0, mode: str = "RGB") -> list[Image.Image]:
    """Smooth random images of other sizes than the model's (so every door resizes), as photos are."""
    rng = np.random.default_rng(seed)
    images = []
    for i in range(count):
        height, width = 24 + 5 * i, 64 - 2 * i
        coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
        images.append(image.convert(mode))
    return images


def written(
    folder: Path, model: torch.nn.Module, init_args: dict, inputs: dict = INPUTS, names: list[str] = NAMES
) -> Path:
    class_path = f"vit.models.{type(model).__name__}"
    config = artifact.describe(model, {"class_path": class_path, "init_args": init_args}, inputs, names)
    return artifact.write(folder, config, timm_state_dict(model))


def random_vit(**options) -> tuple[VisionTransformer, dict]:
    torch.manual_seed(0)
    args = {**VIT, **options}
    model = VisionTransformer(**args).eval()
    with torch.no_grad():
        model.head.bias.copy_(torch.tensor([0.3, -0.2, 0.1])[: model.num_classes])  # probabilities far from uniform
    return model, args


def three_doors(folder: Path, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Class probabilities `(B, C)` of timm (`local-dir:` with its data config and transform), transformers' pipeline
    and `vit.load`, in the model's class order."""
    import timm
    from transformers import pipeline

    names = vit.load(folder).class_names
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    with torch.no_grad():
        by_timm = model(torch.stack([transform(image.convert("RGB")) for image in images])).softmax(-1)
    rows = pipeline("image-classification", model=str(folder), device="cpu")(images, top_k=len(names))
    by_transformers = torch.tensor([[{r["label"]: r["score"] for r in row}[name] for name in names] for row in rows])
    return by_timm, by_transformers, vit.load(folder).probabilities(images)


def test_timm_transformers_and_vit_load_give_the_same_probabilities_from_a_model_folder(tmp_path):
    model, args = random_vit(pos_embed="sincos2d")  # a fixed table: written as timm's parameter
    folder = written(tmp_path / "model", model, args)
    images = photos()
    by_timm, by_transformers, ours = three_doors(folder, images)
    assert (by_timm.argmax(-1) == ours.argmax(-1)).all() and (by_transformers.argmax(-1) == ours.argmax(-1)).all()
    torch.testing.assert_close(by_timm, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(by_transformers, ours, rtol=0, atol=1e-4)
    assert ours.max(-1).values.min() < 0.99 and (ours.argmax(-1) != ours.argmax(-1)[0]).any()  # not a flat answer


@pytest.mark.parametrize(
    "options",
    [
        dict(reg_tokens=100),
        dict(pool="mean"),
        dict(pool="map"),
        dict(pos_embed="none", qk_norm=True),
        dict(attn_score="additive"),
    ],
    ids=["reg_tokens=100", "mean", "map", "no-positions-qk-norm", "additive"],
)
def test_a_model_of_any_size_its_constructor_takes_round_trips_exactly(tmp_path, options):
    model, args = random_vit(**options)
    folder = written(tmp_path / "model", model, args)
    opened = artifact.read(folder)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(opened.model(x), model(x), rtol=0, atol=0)
    assert opened.class_names == NAMES and opened.inputs == INPUTS
    config = json.loads((folder / "config.json").read_text())
    if options.get("attn_score") == "additive":  # timm has no such attention: this project opens it alone
        assert "architecture" not in config and "attn_score='additive' cannot be exported" in config["vit"]["timm"]
    else:
        import timm

        assert "num_classes" not in config["model_args"]  # timm passes it itself: twice is transformers' TypeError
        with torch.no_grad():
            theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()(x)
        torch.testing.assert_close(theirs, model(x), rtol=0, atol=1e-5)


def test_a_cnn_backbone_has_a_model_folder_that_this_project_opens(tmp_path):
    torch.manual_seed(0)
    args = dict(img_size=32, in_chans=3, num_classes=3)
    model = ConvNet(**args).eval()
    folder = written(tmp_path / "cnn", model, args)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit.load(folder).model(x), model(x), rtol=0, atol=0)
    assert (
        "ConvNet; only a VisionTransformer exports to timm"
        in json.loads((folder / "config.json").read_text())["vit"]["timm"]
    )


@pytest.mark.slow
def test_every_checkpoint_a_run_keeps_has_its_model_folder_with_the_weights_the_commands_run(tmp_path, monkeypatch):
    from vit.artifact import inference_state

    config = tiny_config(tmp_path, max_epochs=3, in_chans=3)
    main_in_process(
        ["fit", "--config", str(config), "--test_after_fit", "false", "--model.ema_decay", "0.5"], monkeypatch
    )
    [run_dir] = run_dirs(tmp_path)
    folder = run_dir / "checkpoints"
    checkpoints = sorted(folder.glob("*.ckpt"))
    assert len(checkpoints) == 2  # the best and last.ckpt: the step checkpoints in between were rotated away
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == sorted(p.stem for p in checkpoints)
    x = torch.rand(4, 3, 32, 32)
    for path in checkpoints:
        state = torch.load(path, weights_only=True)["state_dict"]
        weights = load_file(path.with_suffix("") / "model.safetensors")
        for key, tensor in weights.items():  # the EMA average, as every command runs it
            torch.testing.assert_close(tensor, state[f"ema.module.{key}"], rtol=0, atol=0)
        from_checkpoint = vit.load(path).model
        from_checkpoint.load_state_dict(inference_state(state))  # the weights a command runs, taken by hand
        with torch.no_grad():
            torch.testing.assert_close(vit.load(path).model(x), from_checkpoint(x), rtol=0, atol=0)
    by_timm, by_transformers, ours = three_doors(folder / "last", photos())
    assert (by_timm.argmax(-1) == ours.argmax(-1)).all() and (by_transformers.argmax(-1) == ours.argmax(-1)).all()
    torch.testing.assert_close(by_timm, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(by_transformers, ours, rtol=0, atol=1e-4)


def test_an_hf_hub_id_opens_from_the_local_cache_offline(tmp_path, monkeypatch):
    model, args = random_vit()
    cache = tmp_path / "hub"
    commit = "0" * 40
    snapshot = cache / "models--someone--tiny-vit" / "snapshots" / commit
    snapshot.parent.mkdir(parents=True)
    written(snapshot, model, args)
    (cache / "models--someone--tiny-vit" / "refs").mkdir()
    (cache / "models--someone--tiny-vit" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit.load("hf-hub:someone/tiny-vit").model(x), model(x), rtol=0, atol=0)
    with pytest.raises(HubError) as err:
        vit.load("hf-hub:someone/elsewhere")
    assert str(err.value) == (
        "hf-hub:someone/elsewhere is not in the local Hugging Face cache and the Hub cannot be "
        "reached (offline, or HF_HUB_OFFLINE=1): download it where the network allows (`hf "
        "download someone/elsewhere`), or give its folder"
    )


def test_an_exported_folder_opens_in_vit_load_and_in_transformers(tmp_path):
    from vit.export import export

    model, _ = random_vit()
    data = dict(
        input_size=(3, 32, 32),
        mean=INPUTS["mean"],
        std=INPUTS["std"],
        interpolation="bicubic",
        crop_pct=1.0,
        crop_mode="squash",
    )
    export(model, tmp_path / "out", data, NAMES)
    images = photos(6)
    by_timm, by_transformers, ours = three_doors(tmp_path / "out", images)
    torch.testing.assert_close(by_timm, ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(by_transformers, ours, rtol=0, atol=1e-4)
    assert vit.load(tmp_path / "out").inputs == INPUTS


def hostile(folder: Path, change) -> Path:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def set_in(path: str, value):
    def change(config: dict) -> None:
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node[key]
        node[last] = value

    return change


HOSTILE_CONFIGS = [
    (
        set_in("vit.backbone.class_path", "subprocess.Popen"),
        "vit.backbone.class_path='subprocess.Popen' is not allowed: a saved model may name only the backbones",
    ),
    (
        set_in("vit.backbone.init_args.depth", 10**9),
        "vit.backbone.init_args.depth=1000000000 is not allowed: expected at most 1024",
    ),
    (set_in("vit.backbone.init_args.args", ["touch", "x"]), "VisionTransformer has no argument 'args'; refused"),
    (
        set_in("vit.backbone.init_args.embed_dim", 64),
        "model.safetensors does not fit the backbone config.json records (",
    ),
    (set_in("vit.format_version", 99), "vit.format_version=99 is not allowed"),
    (set_in("vit.inputs.img_size", [64, 64]), "inputs.img_size=[64, 64] disagrees with the backbone's img_size=32"),
    (set_in("vit.class_names", ["a", "b"]), "class_names holds 2 name(s) (2 distinct); the model has 3 classes"),
    (set_in("vit.class_names", ["a", "b", "\x1b[2J"]), "class_names[2]='\\x1b[2J' is not allowed"),
    (set_in("vit", [1]), "vit=[1] is not allowed: expected a mapping"),
    (set_in("vit.inputs.std", [0.0, 1.0, 1.0]), "inputs.std=[0.0, 1.0, 1.0] is not allowed"),
]


@pytest.mark.parametrize("change, message", HOSTILE_CONFIGS, ids=[m[:40] for _, m in HOSTILE_CONFIGS])
def test_a_hostile_config_is_refused_in_one_line_naming_the_value(tmp_path, change, message):
    model, args = random_vit()
    folder = hostile(written(tmp_path / "model", model, args), change)
    with pytest.raises(ArtifactError) as err:
        vit.load(folder)
    assert str(err.value).startswith(f"model folder {folder}: ") and message in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "x").exists()


def test_config_files_that_are_not_plain_json_are_refused(tmp_path):
    model, args = random_vit()
    folder = written(tmp_path / "model", model, args)
    config = folder / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"mlp_ratio": 4.0', '"mlp_ratio": NaN', 1))
    with pytest.raises(ArtifactError, match=r"config.json is not valid JSON: NaN is not a JSON number"):
        vit.load(folder)
    config.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ArtifactError, match=r"config.json (is not valid JSON|holds a list)"):
        vit.load(folder)
    with open(config, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(ArtifactError, match=r"config.json is larger than 16 MiB"):
        vit.load(folder)
    config.unlink()
    os.mkfifo(config)  # a FIFO would block a plain open() forever
    with pytest.raises(ArtifactError, match=r"config.json is a named pipe \(FIFO\), not a regular file"):
        vit.load(folder)
    config.unlink()
    with pytest.raises(ArtifactError, match=r"has no config.json: it is not a model folder"):
        vit.load(folder)


def test_hostile_weights_are_refused_before_memory_is_spent(tmp_path):
    model, args = random_vit()
    folder = written(tmp_path / "model", model, args)
    weights = load_file(folder / "model.safetensors")
    cases = [
        ({**weights, "payload": torch.zeros(3)}, "(1 tensors differ): payload not in this model"),
        (
            {k: v for k, v in weights.items() if k != "head.bias"},
            "(1 tensors differ): head.bias missing from the weights",
        ),
        (
            {**weights, "head.bias": torch.full((3,), 1e300, dtype=torch.float64)},
            "head.bias holds 3 of 3 values that are not finite as this model's float32 (the weights' float64 values",
        ),
        (
            {**weights, "head.bias": torch.tensor([1, 2, 3])},
            "head.bias is a tensor of integers (int64) in the weights and of floating-point numbers (float32)",
        ),
    ]
    for tensors, message in cases:
        save_file(tensors, folder / "model.safetensors")
        with pytest.raises(ArtifactError) as err:
            vit.load(folder)
        assert message in str(err.value)
    # A header that promises a 4096 x 65536 head in a file of a few bytes: refused from the header alone.
    header = json.dumps({"head.weight": {"dtype": "F32", "shape": [4096, 65536], "data_offsets": [0, 0]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(
        ArtifactError,
        match=r"model.safetensors is not a safetensors file, or it is corrupted "
        r"\(head.weight: data_offsets \[0, 0\] hold 0 bytes, and a F32 tensor of shape \[4096, 65536\] "
        r"has 1073741824\)",
    ):
        vit.load(folder)


def test_a_run_removes_only_model_folders_it_wrote(tmp_path):
    from vit.artifact.io import AtomicCheckpointIO

    foreign = tmp_path / "epoch1"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine\n")
    (tmp_path / "epoch1.ckpt").write_bytes(b"x")
    AtomicCheckpointIO().remove_checkpoint(tmp_path / "epoch1.ckpt")
    assert (foreign / "keep.txt").read_text() == "mine\n" and not (tmp_path / "epoch1.ckpt").exists()
    with pytest.raises(ArtifactError, match="exists and is not a model folder this project wrote; it is left alone"):
        written(foreign, *random_vit())
    model, args = random_vit()
    ours = written(tmp_path / "epoch2", model, args)
    written(ours, model, args)  # written again over its own folder: replaced whole
    (tmp_path / "epoch2.ckpt").write_bytes(b"x")
    AtomicCheckpointIO().remove_checkpoint(tmp_path / "epoch2.ckpt")
    assert not ours.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["epoch1"]
    shutil.rmtree(foreign)


@pytest.mark.slow
def test_a_run_with_timer_and_early_stopping_resumes_and_its_checkpoints_open(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import EarlyStopping, Timer

    config = tiny_config(tmp_path, max_epochs=1)
    # Timer's interval is given: its default, an enum, is what jsonargparse cannot write into config.yaml.
    callbacks = [
        "--trainer.callbacks+=Timer",
        "--trainer.callbacks.interval=step",
        "--trainer.callbacks+=EarlyStopping",
        "--trainer.callbacks.monitor=val/loss",
        "--trainer.callbacks.patience=10",
    ]
    main_in_process(["fit", "--config", str(config), "--test_after_fit", "false", *callbacks], monkeypatch)
    [run_dir] = run_dirs(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    first = torch.load(last, weights_only=True)
    states = {key.split("{")[0] for key in first["callbacks"]}
    assert {Timer.__name__, EarlyStopping.__name__} <= states
    main_in_process(
        [
            "fit",
            "--config",
            str(config),
            "--test_after_fit",
            "false",
            *callbacks,
            "--trainer.max_epochs",
            "2",
            "--ckpt_path",
            "last",
        ],
        monkeypatch,
    )
    resumed = torch.load(last, weights_only=True)
    assert resumed["epoch"] == 1 and resumed["global_step"] == 2 * first["global_step"]
    timer = next(state for key, state in resumed["callbacks"].items() if key.startswith("Timer"))
    assert (
        timer["time_elapsed"]["train"]
        > next(state for key, state in first["callbacks"].items() if key.startswith("Timer"))["time_elapsed"]["train"]
    )
    # validate restores the checkpoint, Timer's and EarlyStopping's states with it (a SystemExit would be a refusal)
    main_in_process(["validate", "--config", str(config), *callbacks, "--ckpt_path", str(last)], monkeypatch)
    x = torch.rand(2, 1, 32, 32)
    with torch.no_grad():
        assert (
            torch.isfinite(vit.load(last).model(x)).all()
            and torch.isfinite(vit.load(last.with_suffix("")).model(x)).all()
        )


@pytest.mark.slow
def test_a_checkpoint_without_a_model_folder_gets_one_from_the_command(tmp_path, monkeypatch, capsys):
    from vit.upgrade import main

    config = tiny_config(tmp_path, max_epochs=1)
    main_in_process(["fit", "--config", str(config), "--test_after_fit", "false"], monkeypatch)
    [run_dir] = run_dirs(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    written_by_the_run = load_file(last.with_suffix("") / "model.safetensors")
    shutil.rmtree(last.with_suffix(""))  # as a checkpoint of an earlier version has it
    assert main(["--ckpt_path", str(last)]) == 0
    assert f"wrote {last.with_suffix('') / 'model.safetensors'}" in capsys.readouterr().out
    made = load_file(last.with_suffix("") / "model.safetensors")
    assert made.keys() == written_by_the_run.keys()
    for key, tensor in made.items():
        torch.testing.assert_close(tensor, written_by_the_run[key], rtol=0, atol=0)
    assert main(["--ckpt_path", str(last)]) == 2
    assert capsys.readouterr().err == f"error: --out {last.with_suffix('')} exists; pass --overwrite to replace it\n"
    assert main(["--ckpt_path", str(last), "--overwrite"]) == 0
    (tmp_path / "mine").mkdir()
    assert main(["--ckpt_path", str(last), "--out", str(tmp_path / "mine"), "--overwrite"]) == 2
    assert "it is not a model folder this project wrote, so it is left alone" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_with_100_register_tokens_trains_saves_and_opens_through_every_door(tmp_path, monkeypatch):
    from vit.upgrade import main as write_folder

    config = tiny_config(tmp_path, max_epochs=1)
    main_in_process(
        ["fit", "--config", str(config), "--test_after_fit", "false", "--model.backbone.init_args.reg_tokens", "100"],
        monkeypatch,
    )
    [run_dir] = run_dirs(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    alone = tmp_path / "alone.ckpt"  # without its folder: written by the command, under the constructor's bounds
    alone.write_bytes(last.read_bytes())
    assert write_folder(["--ckpt_path", str(alone)]) == 0
    x = torch.rand(2, 1, 32, 32)
    with torch.no_grad():
        by_folder, by_command = vit.load(last).model(x), vit.load(alone).model(x)
    torch.testing.assert_close(by_folder, by_command, rtol=0, atol=0)
    assert vit.load(last).model.num_reg_tokens == 100
    main_in_process(["validate", "--config", str(config), "--ckpt_path", str(alone)], monkeypatch)
    before = torch.load(last, weights_only=True)["global_step"]
    resumed = tiny_config(tmp_path, max_epochs=2)
    main_in_process(
        [
            "fit",
            "--config",
            str(resumed),
            "--test_after_fit",
            "false",
            "--ckpt_path",
            "last",
            "--model.backbone.init_args.reg_tokens",
            "100",
        ],
        monkeypatch,
    )
    assert torch.load(last, weights_only=True)["global_step"] == 2 * before  # one epoch more
    assert vit.load(last).model.num_reg_tokens == 100


def hub_cache(cache: Path, repo: str) -> Path:
    """The snapshot folder of `repo` in a Hugging Face cache laid out as huggingface_hub lays it out."""
    commit = "1" * 40
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.mark.slow
def test_a_timm_model_name_opens_from_timms_cache_offline_as_timm_runs_it(tmp_path, monkeypatch):
    import timm
    from timm.models import get_pretrained_cfg, save_for_hf

    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    with torch.no_grad():
        reference.head.weight.mul_(50)  # probabilities far from uniform
    cache = tmp_path / "hub"
    save_for_hf(
        reference, hub_cache(cache, get_pretrained_cfg("vit_tiny_patch16_224").hf_hub_id), safe_serialization=True
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    predictor = vit.load("vit_tiny_patch16_224")
    assert predictor.inputs["crop_pct"] == 0.9 and predictor.inputs["crop_mode"] == "center"  # timm's eval crop
    assert predictor.class_names[:2] == ["tench, Tinca tinca", "goldfish, Carassius auratus"]
    assert "crane (n02012849)" in predictor.class_names and len(set(predictor.class_names)) == 1000
    images = photos(6)
    config = timm.data.resolve_data_config(model=reference)
    transform = timm.data.create_transform(**config)
    with torch.no_grad():
        theirs = reference(torch.stack([transform(image) for image in images])).softmax(-1)
    ours = predictor.probabilities(images)
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    with pytest.raises(
        HubError,
        match=r"hf-hub:timm/vit_small_patch16_224\.augreg_in21k_ft_in1k is not in the "
        r"local Hugging Face cache",
    ):
        vit.load("vit_small_patch16_224")
