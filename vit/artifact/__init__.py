"""The trained model as a folder of its own, in the Hugging Face Hub / timm layout (`model.safetensors`,
`config.json`), and the one way Lightning reads and writes a run's checkpoints (`vit.artifact.io`).

Each checkpoint a run saves gets its model folder beside it (`last.ckpt` -> `last/`); timm
(`create_model("local-dir:<folder>", pretrained=True)`), transformers (`pipeline("image-classification", model=...)`)
and `vit.load` open it. Neither file can carry code: `config.json` holds timm's keys where a timm model computes the
same function and this project's under "vit" (the backbone by registered class path and arguments, inputs, class
names, the data module, what the run records of itself); reading checks them (`vit.registry`) and compares every
tensor's name and shape with the header of `model.safetensors` before memory is spent.

    model = vit.artifact.load("runs/two_circles/vit/version_0/checkpoints/last")
    model.model, model.inputs, model.class_names
"""

from vit.artifact.config import CONFIG, WEIGHTS, ArtifactError, describe, from_checkpoint, read_config, weights
from vit.artifact.files import folder_of, is_artifact, locate, remove, write
from vit.artifact.reader import Artifact, load, read, test_data

__all__ = [
    "CONFIG",
    "WEIGHTS",
    "Artifact",
    "ArtifactError",
    "describe",
    "folder_of",
    "from_checkpoint",
    "is_artifact",
    "load",
    "locate",
    "read",
    "read_config",
    "remove",
    "test_data",
    "weights",
    "write",
]
