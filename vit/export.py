"""Export a trained checkpoint as timm and the Hugging Face Hub read it:
`model.safetensors`, `config.json`, `README.md`.

    python -m vit.export --ckpt_path runs/folder/finetune_vit/version_0/checkpoints/last --out exported/

The backbone's weights go into a timm `VisionTransformer` of the same configuration, written by timm's `save_for_hf`
(docs/finetune.md, "Export"); what timm cannot compute is refused in one line naming the option."""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from vit.artifact import ArtifactError as ExportError  # what cannot be exported, as what cannot be opened: one line
from vit.checks import file_kind, first_line
from vit.commands import check_output, parser, run, write_failed
from vit.hub import hub_base_model, hub_dataset, is_hub_id

if TYPE_CHECKING:  # imported where used, after the arguments are parsed: `--help` loads no torch
    from torch import nn

    from vit.models import VisionTransformer

# What config.json's pretrained_cfg keeps of the architecture's default cfg (the rest describes timm's weights).
_PRETRAINED_CFG_KEYS = (
    "architecture",
    "input_size",
    "fixed_input_size",
    "interpolation",
    "crop_pct",
    "crop_mode",
    "mean",
    "std",
    "num_classes",
    "pool_size",
    "first_conv",
    "classifier",
)
_LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # the Hub's license ids: apache-2.0, mit, cc-by-4.0, other, ...
FILES = ("model.safetensors", "config.json", "README.md")  # what `export` writes into --out


def to_timm(model: VisionTransformer, data_config: dict) -> nn.Module:
    """A timm `VisionTransformer` with `model`'s weights (loaded strictly), in eval mode, `data_config` in its cfg."""
    import timm

    from vit.models.timm_compat import architecture, timm_args, timm_state_dict

    args = timm_args(model)
    exported = timm.create_model(architecture(args), pretrained=False, **args)
    exported.load_state_dict(timm_state_dict(model))
    cfg = {k: v for k, v in exported.pretrained_cfg.items() if k in _PRETRAINED_CFG_KEYS}
    exported.pretrained_cfg = {**cfg, **data_config}
    return exported.eval()


def model_card(
    args: dict, data_config: dict, names: list[str], training: dict | None = None, license: str | None = None
) -> str:
    """The export's `README.md` from `timm_args` and `training_record`; checkpoint text goes through `markdown_text`."""
    from vit.models.timm_compat import architecture

    name = architecture(args)
    channels, height, width = data_config["input_size"]
    shown = ", ".join(markdown_text(n) for n in names[:20])
    shown += f", ... ({len(names)} in all)" if len(names) > 20 else ""
    training = training or {}
    snippet = [  # "Use with timm": load this folder and classify one photo
        "```python",
        "import timm",
        "import torch",
        "from PIL import Image, ImageOps",
        "",
        'model = timm.create_model("local-dir:path/to/this/folder", pretrained=True).eval()  # or "hf-hub:org/name"',
        "config = timm.data.resolve_data_config(model=model)",
        "transform = timm.data.create_transform(**config)",
        'image = ImageOps.exif_transpose(Image.open("photo.jpg"))  # upright, as the camera held it',
        f'x = transform(image.convert("{"RGB" if channels == 3 else "L"}"))[None]',
        "with torch.no_grad():",
        "    probabilities = model(x).softmax(-1)  # (1, num_classes), in the order of the classes above",
        "```",
    ]
    sections = {  # "## title" -> the lines under it
        "Architecture": _card_architecture(name, args),
        "Classes": [f"{len(names)} classes, label i is the i-th (`config.json`'s `label_names`): {shown}."],
        "Input": [
            (
                f"- {channels} channel(s), resized to {height} x {width} pixels (height x width) without cropping "
                f"({markdown_text(data_config['interpolation'])} interpolation; the aspect ratio is not kept)"
            ),
            (
                f"- pixels scaled to [0, 1], then normalised with mean {markdown_text(list(data_config['mean']))} "
                f"and std {markdown_text(list(data_config['std']))}"
            ),
        ],
        "Use with timm": snippet,
        **_card_training(training),
        "Use with this project": [
            "The checkpoint this folder was exported from opens with "
            '`vit.load("last.ckpt")` (`.predict(...)`, `.explain(...)`), and this folder\'s weights with '
            '`vit.models.pretrained.create_vit("path/to/this/folder/model.safetensors", ...)` and the sizes above.'
        ],
    }
    lines = _card_intro(name, training, license)
    for title, body in sections.items():
        lines += ["", f"## {title}", "", *body]
    return "\n".join(lines) + "\n"


def _card_intro(name: str, training: dict, license: str | None) -> list[str]:
    """The card's front matter (`card_data`), its title, and a paragraph on what the folder holds."""
    from vit.models.timm_compat import GENERIC_ARCHITECTURE

    named = (
        f"timm's `{name}` entry point: no timm ViT has these sizes, and `{name}` builds the one the sizes "
        "in `model_args` describe"
        if name == GENERIC_ARCHITECTURE
        else f"`{name}`, at the image size and with the head and pooling in `model_args`"
    )
    return [
        "---",
        *card_data(name, training, license).to_yaml().splitlines(),
        "---",
        "",
        "# Vision Transformer image classifier",
        "",
        (
            f"A ViT exported by `vit.export` for timm: `model.safetensors` holds the weights and `config.json` the "
            f"architecture ({named})."
        ),
    ]


def _card_architecture(name: str, args: dict) -> list[str]:
    """The card's "Architecture" lines: the sizes, pooling and positions in `args`, and the parameter count."""
    import timm
    import torch

    with torch.device("meta"):  # the exported model's parameter count, without memory
        params = sum(p.numel() for p in timm.create_model(name, pretrained=False, **args).parameters())
    return [
        (
            f"- width (`embed_dim`) {args['embed_dim']}, depth {args['depth']} blocks, {args['num_heads']} heads, "
            f"MLP ratio {args['mlp_ratio']:g}, patch size {args['patch_size']}"
        ),
        (
            f"- pooling `{args['global_pool']}`, {args.get('reg_tokens', args.get('num_reg_tokens', 0))} register "
            f"token(s), "
            + (
                f"rotary positions (`{args['rope_type']}`)"
                if args.get("use_rot_pos_emb")
                else "relative position bias"
                if args.get("rel_pos_type")
                else f"position table `{args['pos_embed']}`"
            )
        ),
        f"- {params / 1e6:.2f} M parameters",
    ]


def _card_training(training: dict) -> dict[str, list[str]]:
    """The card's "Training" section (data, seed, epoch, settings) and, when there is a record, its "Metrics"."""
    if not training:
        return {"Training": ["- not recorded in the checkpoint"]}
    lines = [
        f"- data module: {markdown_text(training.get('data_module', 'not recorded'))}",
        f"- seed of its splits: {markdown_text(training.get('seed', 'not recorded'))}",
    ]
    if "epoch" in training:
        lines.append(
            f"- written after epoch {markdown_text(training['epoch'])}, "
            f"step {markdown_text(training.get('global_step', '?'))}"
        )
    if "model" in training:
        lines.append(
            "- settings: " + ", ".join(f"{markdown_text(k)}: {markdown_text(v)}" for k, v in training["model"].items())
        )
    measured = {
        **training.get("metrics", {}),
        **{f"{k} (the test split, after training)": v for k, v in training.get("test", {}).items()},
    }
    metrics = [f"- {markdown_text(name)}: {value:.4f}" for name, value in measured.items()]
    return {"Training": lines, "Metrics": metrics or ["- none recorded in the checkpoint"]}


# The test metrics a run records (`test/<name>`) and how the Hub's model index names them.
HUB_METRICS = {"test/acc": ("accuracy", "Accuracy"), "test/ece": ("ece", "Expected calibration error")}


def card_data(architecture: str, training: dict, license: str | None):
    """The card's front matter, as `huggingface_hub.ModelCardData`: the library, license, pipeline, the base model
    and dataset when they are Hub ids (`vit.hub`), and the run's test metrics as the model index's results."""
    from huggingface_hub import EvalResult, ModelCardData

    dataset = hub_dataset(training)
    results = [
        EvalResult(
            task_type="image-classification",
            dataset_type=dataset or "custom",
            dataset_name=dataset or str(training.get("data_module", "custom")).rsplit(".", 1)[-1],
            dataset_split="test",
            metric_type=kind,
            metric_name=label,
            metric_value=float(value),
        )
        for key, (kind, label) in HUB_METRICS.items()
        if isinstance(value := training.get("test", {}).get(key), (int, float)) and not isinstance(value, bool)
    ]
    return ModelCardData(
        library_name="timm",
        license=license,
        pipeline_tag="image-classification",
        base_model=hub_base_model(training.get("pretrained")),
        datasets=[dataset] if dataset else None,
        metrics=["accuracy"],
        tags=["image-classification", "timm", "vision-transformer"],
        model_name=architecture if results else None,
        eval_results=results or None,
    )


def markdown_text(value: object) -> str:
    """`value` as Markdown that shows as written: no HTML, heading, list, code, link or table cell comes of it."""
    text = " ".join(str(value).splitlines())  # a line break would end the list item and start a block of its own
    text = html.escape(text, quote=False)  # <, >, &: no tag, no entity
    text = re.sub(r"([\\`|])", r"\\\1", text)  # no code span or table cell
    text = text.replace("](", "]\\(")  # no link or image: `[text](url)` needs the two together
    return re.sub(r"^(\s*)([#*+_-])", r"\1\\\2", text)  # no heading, list or rule where it starts a list item


def load(ckpt_path: str | os.PathLike) -> tuple[VisionTransformer, dict, list[str], dict]:
    """`(backbone, data_config in timm's keys, class names, training_record)` of a model folder or checkpoint."""
    import vit.artifact as artifact
    from vit.models.timm_compat import NotInTimm, timm_args
    from vit.models.timm_compat import data_config as timm_data_config

    model = artifact.load(ckpt_path)
    try:
        timm_args(model.model)  # refuse what timm cannot compute before anything else is done
    except NotInTimm as err:
        raise ExportError(str(err)) from None
    config = timm_data_config(model.inputs)
    data_config = {
        **config,
        "input_size": tuple(config["input_size"]),
        "mean": tuple(config["mean"]),
        "std": tuple(config["std"]),
    }
    return model.model, data_config, list(model.class_names), dict(model.training)


def export(
    backbone: VisionTransformer,
    out: Path,
    data_config: dict,
    names: list[str],
    training: dict | None = None,
    license: str | None = None,
) -> None:
    """Write `FILES` into `out` (created), through a temporary folder beside it."""
    from timm.models import save_for_hf

    from vit.models.timm_compat import timm_args

    exported, args = to_timm(backbone, data_config), timm_args(backbone)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        (Path(tmp) / "README.md").write_text(model_card(args, data_config, names, training, license))
        # model_args given explicitly: timm versions that do not record a model's arguments write them too.
        save_for_hf(exported, tmp, model_config={"label_names": names, "model_args": args}, safe_serialization=True)
        # timm passes num_classes from config.json's own key; a second one in model_args is "got multiple values" in
        # transformers' TimmWrapper (timm's own loader tolerates it).
        config = json.loads((Path(tmp) / "config.json").read_text())
        config["model_args"].pop("num_classes", None)
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # safetensors writes mode 0600, config.json the umask's: whoever may read one reads both.
        os.chmod(Path(tmp) / "model.safetensors", stat.S_IMODE(os.stat(Path(tmp) / "config.json").st_mode))
        out.mkdir(exist_ok=True)
        for name in FILES:
            os.replace(Path(tmp) / name, out / name)  # each file replaced whole, never half-written


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an `--out` that is no folder, is not empty without `--overwrite`, or whose `FILES` cannot be replaced."""
    if not out.is_dir():  # a link to a folder counts as the folder: the files are written into it
        if os.path.lexists(out):
            raise ExportError(f"--out {out} is {file_kind(os.lstat(out).st_mode)}; give a folder (it is created)")
        return
    if any(out.iterdir()) and not overwrite:
        raise ExportError(
            f"--out {out} is a folder that is not empty; pass --overwrite to write model.safetensors, "
            "config.json and README.md into it (other files are left alone)"
        )
    for name in FILES:
        check_output("--out", out / name, overwrite)


def main(argv: list[str] | None = None) -> int:
    options = parser("vit.export", __doc__)
    options.add_argument("--ckpt_path", required=True, help="checkpoint written by train.py (a path or URL)")
    options.add_argument(
        "--out", required=True, type=Path, help="folder to write model.safetensors, config.json and README.md"
    )
    options.add_argument("--overwrite", action="store_true", help="write into --out even if it is not empty")
    options.add_argument(
        "--license",
        type=hub_license,
        help="the Hub license id for the model card's front matter "
        "(apache-2.0, mit, cc-by-4.0, other, ...); default: none written, because the weights' "
        "license follows from the base model's and the data's, which only you know",
    )
    options.add_argument(
        "--push_to_hub",
        type=hub_repo,
        metavar="ORG/NAME",
        help="after writing --out, upload its files to this Hugging Face Hub repo (created if it does "
        "not exist); needs the network and a token (`hf auth login`)",
    )
    options.add_argument("--private", action="store_true", help="with --push_to_hub: create the repo private")
    return run(options.parse_args(argv), prepare, write)


def hub_repo(text: str) -> str:
    """`--push_to_hub` as the Hub spells a model repo (`org/name`), else an error naming the form."""
    if text.count("/") != 1 or not is_hub_id(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Hub repo id: org/name, of letters, digits, '-', '_' and '.'"
        )
    return text


def push(out: Path, repo: str, private: bool) -> int:
    """Upload the export's `FILES` in `out` to the Hub repo `repo` (through `huggingface_hub`); 1 in one line when
    it cannot be (offline, no token, no right to the repo): the export itself is written either way."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo,
            folder_path=out,
            allow_patterns=list(FILES),
            commit_message="Upload a ViT exported by vit.export",
        )
    except Exception as err:  # noqa: BLE001  (huggingface_hub raises many kinds: offline, HTTP, auth)
        print(
            f"error: --push_to_hub {repo}: {out} is written, but it could not be uploaded: "
            f"{type(err).__name__}: {first_line(err)}",
            file=sys.stderr,
        )
        return 1
    print(f"pushed to https://huggingface.co/{repo}")
    return 0


def hub_license(text: str) -> str:
    """`--license` as the Hub spells its license ids (`apache-2.0`), else an error naming the form."""
    if not _LICENSE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Hub license id: lowercase letters, digits, '.', '+' "
            "and '-', like apache-2.0, mit, cc-by-4.0 or other"
        )
    return text


def prepare(args: argparse.Namespace) -> tuple[VisionTransformer, dict, list[str], dict]:
    """`--out` checked, then the checkpoint opened and what timm cannot compute refused (`load`)."""
    check_out(args.out, args.overwrite)
    return load(args.ckpt_path)  # a PretrainedError (a ValueError) for weights of another layout


def write(args: argparse.Namespace, prepared: tuple[VisionTransformer, dict, list[str], dict]) -> int:
    """Write the export into `--out`; 1 when it cannot be written."""
    from safetensors import SafetensorError

    backbone, data_config, names, training = prepared
    try:
        export(backbone, args.out, data_config, names, training, args.license)
    except (OSError, SafetensorError) as err:  # a full disk: the temporary folder is gone, --out is untouched
        return write_failed(
            "--out", args.out / "model.safetensors" if isinstance(err, SafetensorError) else args.out, err
        )
    print(
        f"wrote {args.out / 'model.safetensors'}, config.json and README.md ({len(names)} classes); "
        f"load with timm.create_model('local-dir:{args.out}', pretrained=True)"
    )
    return push(args.out, args.push_to_hub, args.private) if args.push_to_hub else 0


if __name__ == "__main__":
    sys.exit(main())
