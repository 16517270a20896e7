"""Hostile model folders for the fuzz test and `benchmarks/fuzz_checkpoints.py --doors artifact`.

A reference folder is written once (a tiny ViT, `vit.artifact.write`); each variant copies it, then changes one
value of its `config.json` at any key path (a value of another type, a huge or negative number, a class path, a long
or control-laden string, a deep nesting, the key deleted, an unknown key added), or its `model.safetensors` (the
header changes, byte flips and special files of `input_mutations`), or `config.json` as a file (a FIFO, a link,
bytes that are not JSON). The door is `vit.load(folder)` and one forward pass."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from input_mutations import (
    AS_WRITTEN,
    MARKER,
    Change,
    Outcome,
    _one_line,
    byte_changes,
    safetensors_changes,
    special_files,
)

TINY = dict(img_size=32, patch_size=8, in_chans=3, num_classes=3, embed_dim=32, depth=2, num_heads=2)
INPUTS = {
    "img_size": [32, 32],
    "in_chans": 3,
    "mean": [0.5, 0.5, 0.5],
    "std": [0.25, 0.25, 0.25],
    "interpolation": "bilinear",
}


def reference_folder(root: Path) -> Path:
    """The tiny ViT's model folder under `root` (written once per root)."""
    import vit.artifact as artifact
    from vit.models import VisionTransformer
    from vit.models.timm_compat import timm_state_dict

    folder = root / "reference_model"
    if not (folder / artifact.CONFIG).exists():
        torch.manual_seed(0)
        model = VisionTransformer(**TINY).eval()
        config = artifact.describe(
            model,
            {"class_path": "vit.models.VisionTransformer", "init_args": TINY},
            INPUTS,
            ["a", "b", "c"],
            {"class_path": "vit.data.TwoCirclesDataModule", "init_args": {"num_test": 8}},
        )
        artifact.write(folder, config, timm_state_dict(model))
    return folder


def key_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path in a JSON value: mapping keys and list indices, the containers themselves included."""
    paths = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            paths += key_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:4]):  # the first items of a list stand for the rest
            paths += key_paths(item, (*prefix, i))
    return paths


DELETE = object()  # the value that deletes the key
# Values an attacker or a broken writer puts anywhere (the JSON encoder writes NaN and Infinity as those tokens).
HOSTILE_VALUES = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    10**100,
    1e308,
    -1e308,
    0.5,
    float("nan"),
    float("inf"),
    "",
    "x",
    "subprocess.Popen",
    "os.system",
    "vit.models.VisionTransformer",
    "../../../etc/passwd",
    "/dev/zero",
    "http://127.0.0.1:1/x",
    "\x1b[2J\u202e",
    "x" * 5000,
    [],
    [1] * 100_000,
    {},
    [[[[[[]]]]]],
    {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", MARKER]}},
    {"__class__": "os.system"},
    [0, 0],
    [4096, 4096],
    [1, 100000],
    DELETE,
)


@dataclass(frozen=True)
class FolderVariant:
    """A copy of the reference folder changed by `change` (`label` shows it, `group` sorts it in a summary)."""

    label: str
    group: str
    change: Any = field(compare=False, repr=False)

    def __repr__(self) -> str:
        return self.label

    def write(self, folder: Path) -> Path:
        """A fresh `folder` holding this variant's model folder (`folder/model`), which is returned."""
        if folder.exists() or folder.is_symlink():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        model = folder / "model"
        shutil.copytree(reference_folder(folder.parent), model)
        self.change(model)
        return model


def _set(config: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = config
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return config


def config_value(path: tuple, value: Any) -> FolderVariant:
    def change(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        changed = _set(config, path, value if value is DELETE else copy.deepcopy(value))  # DELETE: the very object
        (model / "config.json").write_text(json.dumps(changed))

    shown = "deleted" if value is DELETE else json.dumps(value)[:60]
    return FolderVariant(f"config.json {'.'.join(map(str, path))} = {shown}", f"config {path[0]}", change)


def config_unknown_key(path: tuple) -> FolderVariant:
    def change(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        node = config
        for key in path:
            node = node[key]
        if isinstance(node, dict):
            node["__init__"] = {"class_path": "subprocess.Popen"}
        (model / "config.json").write_text(json.dumps(config))

    return FolderVariant(
        f"config.json {'.'.join(map(str, path)) or '.'} + an unknown key", "config unknown key", change
    )


def file_change(name: str, change: Change) -> FolderVariant:
    """`change` (of `input_mutations`) applied to the folder's `name` file."""
    return FolderVariant(f"{name}: {change!r}", f"{name}: {change.group}", lambda model: change.apply(model / name))


def folder_variants(reference: Path) -> st.SearchStrategy[FolderVariant]:
    """A config value at any key path, an unknown key in any mapping, or a change to either file."""
    config = json.loads((reference / "config.json").read_text())
    paths = key_paths(config)
    mappings = [()] + [p for p in paths if isinstance(_get(config, p), dict)]
    return st.one_of(
        st.builds(config_value, st.sampled_from(paths), st.sampled_from(HOSTILE_VALUES)),
        st.builds(config_unknown_key, st.sampled_from(mappings)),
        st.builds(
            file_change,
            st.just("model.safetensors"),
            st.one_of(st.sampled_from(safetensors_changes()), byte_changes(), st.sampled_from(special_files())),
        ),
        st.builds(file_change, st.just("config.json"), st.one_of(byte_changes(), st.sampled_from(special_files()))),
    )


def _get(config: Any, path: tuple) -> Any:
    for key in path:
        config = config[key]
    return config


def notable_folder_variants() -> list[FolderVariant]:
    """What an attacker tries first: a class path of their own, arguments beyond the bounds, a header that lies."""
    return [
        FolderVariant("as written", "as written", lambda model: None),
        config_value(("vit", "backbone", "class_path"), "subprocess.Popen"),
        config_value(("vit", "backbone"), {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", MARKER]}}),
        config_value(("vit", "backbone", "init_args", "depth"), 1024),
        config_value(("vit", "backbone", "init_args", "embed_dim"), 65536),
        config_value(("vit", "backbone", "init_args", "img_size"), 4096),
        config_value(("vit", "data", "class_path"), "vit.data.ImageFolderDataModule"),
        config_value(("vit", "inputs", "img_size"), [4096, 4096]),
        file_change("model.safetensors", AS_WRITTEN),
        *[file_change("model.safetensors", change) for change in safetensors_changes()],
        *[file_change("config.json", change) for change in special_files()],
    ]


def artifact_door(path: Path) -> Outcome:
    """`vit.load(path)`, then one forward pass (and the test data a model names, for `vit.explain`): accepted with
    finite logits of the model's classes, refused with one `ValueError` line."""
    import vit
    import vit.artifact as artifact
    from vit.registry import test_data

    try:
        predictor = vit.load(path)
        inputs = predictor.inputs
        if predictor.model.num_classes != len(predictor.class_names):
            return Outcome("failed", f"{predictor.model.num_classes} classes, {len(predictor.class_names)} names")
        x = torch.zeros(1, inputs["in_chans"], *inputs["img_size"])
        with torch.no_grad():
            logits = predictor.model(x)
        data = artifact.load(path)
        if data.data is not None:
            test_data(data.data, data.inputs, data.source)
    except ValueError as err:
        return _one_line(err)
    if logits.shape != (1, len(predictor.class_names)):
        return Outcome("failed", f"accepted, and its logits are of shape {tuple(logits.shape)}")
    if not torch.isfinite(logits).all():
        weights_finite = all(
            bool(torch.isfinite(p).all()) for p in predictor.model.state_dict().values() if p.is_floating_point()
        )
        if not weights_finite:
            return Outcome("failed", f"accepted, and its logits are {logits.tolist()}")
        return Outcome("accepted", "finite weights whose logits overflow float32")
    return Outcome("accepted", f"{sum(p.numel() for p in predictor.model.parameters())} parameters")
