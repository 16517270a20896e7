"""Pretrained weights: ours loads a timm file exactly as timm itself does at a new image size."""

import logging
import pickle
import re
import zipfile

import huggingface_hub.constants
import numpy as np
import pytest
import timm
import timm.models._hub
import torch
from safetensors.torch import load_file, save_file

from vit.models.pretrained import PretrainedError, create_vit

TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)  # vit_tiny_patch16_224
SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)  # where the weights are refused before use


@pytest.fixture(scope="module")
def timm_file(tmp_path_factory):
    """A vit_tiny_patch16_224 with random weights (no download here), saved as timm would ship it."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    path = tmp_path_factory.mktemp("weights") / "vit_tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.mark.parametrize("img_size, num_classes", [(224, 1000), (96, 10), (64, 5)])
def test_loading_equals_timms_own_pretrained_loading(timm_file, img_size, num_classes):
    reference = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=True,
        img_size=img_size,
        num_classes=num_classes,
        pretrained_cfg_overlay=dict(file=str(timm_file)),
    ).eval()
    ours = create_vit(img_size=img_size, num_classes=num_classes, pretrained=str(timm_file), **TINY).eval()
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        diff = (ours.forward_features(x) - reference.forward_features(x)).abs().max().item()
    assert diff < 1e-5
    if num_classes == 1000:  # same head: the logits agree too
        with torch.no_grad():
            assert (ours(x) - reference(x)).abs().max() < 1e-5


def test_another_patch_size_and_channel_count_are_resampled_as_timm_does(timm_file):
    reference = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=True,
        img_size=64,
        patch_size=8,
        in_chans=1,
        num_classes=3,
        pretrained_cfg_overlay=dict(file=str(timm_file)),
    ).eval()
    ours = create_vit(
        img_size=64, in_chans=1, num_classes=3, pretrained=str(timm_file), **{**TINY, "patch_size": 8}
    ).eval()
    x = torch.randn(2, 1, 64, 64)
    with torch.no_grad():
        assert (ours.forward_features(x) - reference.forward_features(x)).abs().max() < 1e-5


def test_a_new_head_is_logged_and_left_fresh(timm_file, caplog):
    with caplog.at_level(logging.WARNING):
        model = create_vit(img_size=32, num_classes=7, pretrained=str(timm_file), **TINY)
    assert "head.weight and head.bias re-initialised" in caplog.text
    assert model.head.weight.shape == (7, 192) and model.head.bias.abs().max() == 0


def test_a_learned_table_into_a_sincos_config_is_an_error(timm_file):
    with pytest.raises(PretrainedError, match="learned position table, and this config has pos_embed='sincos2d'"):
        create_vit(img_size=32, pos_embed="sincos2d", pretrained=str(timm_file), **TINY)


def test_weights_that_do_not_fit_name_the_tensors(timm_file):
    with pytest.raises(
        PretrainedError, match=r"blocks\.0\.attn\.qkv\.weight: \(576, 192\) in the weights, \(288, 96\) here"
    ):
        create_vit(img_size=32, pretrained=str(timm_file), **{**TINY, "embed_dim": 96})


HUB_ID = "timm/vit_tiny_patch16_224.augreg_in21k"  # where timm finds vit_tiny_patch16_224.augreg_in21k
IN21K = 21843  # the classes of its head


def serve_hub(monkeypatch, folder=None) -> list[tuple[str, str]]:
    """timm's Hub download replaced: files come from `folder` (or none exist); returns the (repo, file) pairs asked
    for."""
    asked = []

    def download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        if folder is None or not (folder / filename).is_file():
            raise FileNotFoundError(f"{filename} is not in {repo_id}")
        return str(folder / filename)

    monkeypatch.setattr(timm.models._hub, "hf_hub_download", download)
    return asked


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory):
    """What the Hub holds for HUB_ID (config.json and model.safetensors, random weights), and its state dict."""
    torch.manual_seed(1)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=IN21K)
    folder = tmp_path_factory.mktemp("hub")
    timm.models.save_for_hf(model, folder, safe_serialization=True)
    return folder, model.state_dict()


@pytest.mark.parametrize("source", [f"hf-hub:{HUB_ID}", HUB_ID, "vit_tiny_patch16_224.augreg_in21k"])
def test_hub_ids_and_names_are_downloaded_by_timm(hub_repo, monkeypatch, source):
    folder, reference = hub_repo
    asked = serve_hub(monkeypatch, folder)
    model = create_vit(img_size=224, num_classes=IN21K, pretrained=source, **TINY)
    assert (HUB_ID, "model.safetensors") in asked and {repo for repo, _ in asked} == {HUB_ID}
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("source", ["vit_tiny_patch16_224.augreg_in21k", f"hf-hub:{HUB_ID}", HUB_ID])
def test_a_name_that_cannot_be_downloaded_says_how_to_pass_a_file(monkeypatch, tmp_path, source):
    # Offline as huggingface_hub is with HF_HUB_OFFLINE=1 (it reads the variable once, at import), with an
    # empty cache: it fails at once, where the network's absence costs ~45 s of retries.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(PretrainedError) as err:
        create_vit(pretrained=source, **SMALL)
    message = str(err.value)
    assert message.startswith(f"the weights of {source!r}")
    assert "could not be downloaded (LocalEntryNotFoundError" in message
    assert message.endswith(
        f"(`hf download {HUB_ID} model.safetensors config.json --local-dir weights`) and pass the file "
        "instead: pretrained=weights/model.safetensors (its sizes are read from the file and the config.json "
        "beside it)"
    )
    assert "\n" not in message


@pytest.mark.parametrize("source", ["vit_tiny_patch16_224.augreg_in21k", f"hf-hub:{HUB_ID}"])
def test_where_the_hub_cannot_be_reached_the_download_reads_only_the_cache_after_one_connection_attempt(
    monkeypatch, tmp_path, source
):
    """Without network huggingface_hub retries every file for about a minute; the Hub's host is tried once instead
    (here a port that refuses), then only the cache is read, and huggingface_hub's offline switch is put back."""
    import socket

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # discard: refused
    monkeypatch.setattr(
        huggingface_hub.constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}",
    )
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    attempts, connect = [], socket.socket.connect

    def counted(sock, address):
        attempts.append(address)
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", counted)
    with pytest.raises(PretrainedError, match=r"could not be downloaded \(LocalEntryNotFoundError"):
        create_vit(pretrained=source, **SMALL)
    assert attempts == [("127.0.0.1", 9)]
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False


@pytest.mark.parametrize(
    "source",
    [
        "./weights/x.safetensors",
        "weights/x.pth",
        "missing/model.safetensors",
        "/nonexistent/model.bin",
        "../weights/x",
        "~/no/such/weights",
    ],
)
def test_a_missing_file_is_named_as_a_file(monkeypatch, source):
    asked = serve_hub(monkeypatch)
    with pytest.raises(PretrainedError, match=re.escape(f"pretrained={source!r}: there is no such file")):
        create_vit(pretrained=source, **SMALL)
    assert asked == []  # a path is never looked up on the Hub


def test_a_local_folder_named_like_a_hub_id_says_how_to_write_the_hub_id(hub_repo, monkeypatch, tmp_path):
    folder, _ = hub_repo
    asked = serve_hub(monkeypatch, folder)
    monkeypatch.chdir(tmp_path)
    (tmp_path / HUB_ID).mkdir(parents=True)  # e.g. a folder left by `hf download ... --local-dir` that failed
    with pytest.raises(PretrainedError) as err:
        create_vit(pretrained=HUB_ID, **SMALL)
    assert str(err.value) == (
        f"pretrained={HUB_ID!r} is a folder without a model.safetensors, not a weights file "
        f"(.safetensors, .pth or .bin); it was read as a local path because {HUB_ID} exists "
        f"here: a Hugging Face Hub id is written hf-hub:{HUB_ID}"
    )
    assert asked == []
    create_vit(img_size=224, num_classes=IN21K, pretrained=f"hf-hub:{HUB_ID}", **TINY)  # the advice works
    assert (HUB_ID, "model.safetensors") in asked


SUPPORTED = ".safetensors, or a torch.save file (.pth, .pt, .bin, .ckpt, .tar)"


@pytest.mark.parametrize("name", ["vit.npz", "vit.bin"])
def test_a_numpy_archive_is_named_as_an_unsupported_format_not_a_corrupted_file(tmp_path, name):
    path = tmp_path / name
    with open(path, "wb") as f:  # big_vision's layout: one array per parameter
        np.savez(f, **{"Transformer/encoder_norm/scale": np.ones(192, np.float32), "cls": np.zeros((1, 1, 192))})
    with pytest.raises(PretrainedError) as err:
        create_vit(pretrained=str(path), **SMALL)
    message = str(err.value)
    assert message.startswith(
        f"pretrained={str(path)!r} is a NumPy .npz archive (JAX / big_vision weights), a "
        f"format not supported here: expected {SUPPORTED}. "
    )
    assert "corrupted" not in message and "\n" not in message


def test_a_zip_archive_that_torch_save_did_not_write_lists_the_formats(tmp_path):
    path = tmp_path / "weights.pth"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("weights.json", "{}")
    with pytest.raises(
        PretrainedError,
        match=re.escape(
            f"pretrained={str(path)!r} is a zip archive, but not one torch.save writes (it has no data.pkl): "
            f"expected {SUPPORTED}"
        ),
    ):
        create_vit(pretrained=str(path), **SMALL)


def test_a_wrong_tag_lists_the_tags_timm_has():
    with pytest.raises(
        PretrainedError,
        match=r"pretrained='vit_tiny_patch16_224\.in1k': timm has no pretrained tag "
        r"'in1k' for vit_tiny_patch16_224; it has \['augreg_in21k'",
    ):
        create_vit(pretrained="vit_tiny_patch16_224.in1k", **SMALL)


class WritesAMarker:
    """Unpickles as a call to `exec` that creates `marker`: what a malicious .pth file does when it is loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def write_bad_file(folder, kind: str, timm_file) -> tuple[object, str]:
    """A broken weights file of `kind` in `folder`; returns its path and the regex its error must match."""
    state = {"w": torch.arange(1000.0)}
    good_pth = folder / "good.pth"
    torch.save(state, good_pth)
    path = folder / kind
    if kind == "empty.safetensors" or kind == "empty.pth":
        path.write_bytes(b"")
        return path, r"is empty \(0 bytes\)"
    if kind == "truncated.safetensors":
        path.write_bytes(timm_file.read_bytes()[:50_000])
        return path, r"is truncated: it starts like a safetensors file but its end is missing \(50000 bytes;"
    if kind == "truncated.pth":
        path.write_bytes(good_pth.read_bytes()[:2000])
        return path, r"is truncated: it starts like a torch.save file but its end is missing \(2000 bytes;"
    if kind in ("garbage.safetensors", "garbage.pth"):
        path.write_bytes(b"these are not weights\n" * 10)
        return path, (
            r"is not a safetensors file, or it is corrupted \(header too large\)"
            if kind.endswith("tensors")
            else r"is not a PyTorch weights file \(neither the zip archive torch.save writes nor a pickle\)"
        )
    if kind in ("malicious.pth", "malicious_pickle.pth"):
        if kind == "malicious.pth":
            torch.save({"w": torch.zeros(3), "payload": WritesAMarker(folder / "marker")}, path)
        else:  # a bare pickle, the format of torch.save before PyTorch 1.6
            path.write_bytes(pickle.dumps({"payload": WritesAMarker(folder / "marker")}, protocol=2))
        return path, r"holds Python objects, not only tensors \(it asks for exec\); loading it could run arbitrary code"
    if kind == "list.pth":
        torch.save([torch.zeros(2)], path)
        return path, r"does not hold a state dict \(a mapping of names to tensors\)"
    raise AssertionError(kind)


BAD_FILES = [
    "empty.safetensors",
    "truncated.safetensors",
    "garbage.safetensors",
    "empty.pth",
    "truncated.pth",
    "garbage.pth",
    "malicious.pth",
    "malicious_pickle.pth",
    "list.pth",
]


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_broken_or_unsafe_file_is_named_with_what_is_wrong(tmp_path, timm_file, kind):
    path, expected = write_bad_file(tmp_path, kind, timm_file)
    with pytest.raises(PretrainedError, match=re.escape(f"pretrained={str(path)!r} ") + expected) as err:
        create_vit(pretrained=str(path), **SMALL)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "marker").exists()  # the malicious payload never ran
    if kind.startswith("malicious"):  # ... and it would have: run by hand, it makes its marker
        call, args = WritesAMarker(tmp_path / "control").__reduce__()
        call(*args)
        assert (tmp_path / "control").exists()


@pytest.mark.parametrize("key, value", [("blocks.3.mlp.fc1.weight", float("nan")), ("pos_embed", float("-inf"))])
def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(timm_file, tmp_path, key, value):
    state = load_file(str(timm_file))
    state[key].view(-1)[5] = value
    path = tmp_path / "broken.safetensors"
    save_file(state, str(path))
    with pytest.raises(
        PretrainedError,
        match=re.escape(
            f"pretrained={str(path)!r} is unusable: {key} holds NaN or infinite values (1 of {state[key].numel()})"
        ),
    ):
        create_vit(pretrained=str(path), **SMALL)


@pytest.mark.slow
def test_the_cli_reports_bad_weights_in_one_line_and_writes_nothing(tmp_path, timm_file, monkeypatch, capsys):
    from robust_helpers import main_in_process, tiny_config

    nan = tmp_path / "nan.safetensors"
    save_file({"pos_embed": torch.tensor([[[0.0, float("nan")]]])}, str(nan))
    cases = [write_bad_file(tmp_path, kind, timm_file) for kind in ("malicious.pth", "truncated.safetensors")]
    cases.append((nan, r"is unusable: pos_embed holds NaN or infinite values \(1 of 2\)"))
    config = tiny_config(tmp_path / "run")
    for path, expected in cases:
        with pytest.raises(SystemExit) as exit_info:
            main_in_process(["fit", "--config", str(config), "--model.pretrained", str(path)], monkeypatch)
        stderr = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in stderr
        [line] = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert re.fullmatch("error: " + re.escape(f"pretrained={str(path)!r} ") + expected + ".*", line), line
        assert not (tmp_path / "run" / "runs").exists() and not (tmp_path / "marker").exists()


def test_non_square_images_load_pretrained_weights_as_timm_does(timm_file):
    reference = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=True,
        img_size=(96, 128),
        num_classes=4,
        pretrained_cfg_overlay=dict(file=str(timm_file)),
    ).eval()
    ours = create_vit(img_size=(96, 128), num_classes=4, pretrained=str(timm_file), **TINY).eval()
    assert ours.patch_embed.grid_size == (6, 8)
    x = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        assert (ours.forward_features(x) - reference.forward_features(x)).abs().max() < 1e-5


def test_width_depth_and_heads_come_from_a_timm_name_without_a_download(monkeypatch):
    from vit.models.pretrained import pretrained_shape

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert pretrained_shape("vit_small_patch16_224.augreg_in21k_ft_in1k") == dict(embed_dim=384, depth=12, num_heads=6)
    assert pretrained_shape("hf-hub:timm/vit_tiny_patch16_224.augreg_in21k") == dict(
        embed_dim=192, depth=12, num_heads=3
    )
    with pytest.raises(PretrainedError, match=r"'resnet18' is not a ViT of timm's layout \(ResNet\): set embed_dim"):
        pretrained_shape("resnet18")


def test_width_and_depth_come_from_a_file_and_the_model_equals_timms(timm_file):
    reference = timm.create_model(
        "vit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(timm_file))
    ).eval()
    ours = create_vit(img_size=224, num_classes=1000, patch_size=16, num_heads=3, pretrained=str(timm_file)).eval()
    assert (ours.embed_dim, len(ours.blocks)) == (192, 12)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (ours(x) - reference(x)).abs().max() < 1e-5
    # The heads are in no tensor's shape: asked for by name, not guessed.
    with pytest.raises(
        PretrainedError,
        match=r"number of attention heads is not in the weights' shapes "
        r"\(embed_dim=192, depth=12 are\): set num_heads",
    ):
        create_vit(img_size=224, patch_size=16, pretrained=str(timm_file))
    # What is given wins, so weights of another width are still refused.
    with pytest.raises(PretrainedError, match="does not fit this config"):
        create_vit(img_size=224, patch_size=16, embed_dim=96, num_heads=3, pretrained=str(timm_file))


def test_the_offline_hints_command_gives_a_folder_whose_sizes_are_all_read(timm_file, tmp_path):
    # `hf download timm/<model> model.safetensors config.json`: a timm repo's config.json names the architecture
    # and no model_args; the heads come from the architecture, so the hinted command builds the model.
    import json
    import shutil

    folder = tmp_path / "weights"
    folder.mkdir()
    shutil.copy(timm_file, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224", "num_classes": 1000}))
    model = create_vit(img_size=224, patch_size=16, num_classes=1000, pretrained=str(folder / "model.safetensors"))
    assert (model.embed_dim, len(model.blocks), model.blocks[0].attn.num_heads) == (192, 12, 3)


def test_heads_come_from_the_config_json_of_a_hub_layout_folder(timm_file, tmp_path):
    import json
    import shutil

    from vit.models.pretrained import DEFAULT_SHAPE, resolve_shape

    folder = tmp_path / "exported"
    folder.mkdir()
    shutil.copy(timm_file, folder / "model.safetensors")
    (folder / "config.json").write_text(
        json.dumps({"architecture": "vit_tiny_patch16_224", "model_args": {"num_heads": 3}})
    )
    assert resolve_shape(str(folder), embed_dim=None, depth=4, num_heads=None) == dict(
        embed_dim=192, depth=4, num_heads=3
    )
    assert (
        resolve_shape(None, embed_dim=None, depth=None, num_heads=None)
        == DEFAULT_SHAPE
        == dict(embed_dim=192, depth=6, num_heads=3)
    )
