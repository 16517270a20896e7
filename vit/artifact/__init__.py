"""The trained model as a folder of its own, in the Hugging Face Hub / timm layout: `model.safetensors` and
`config.json`. Each checkpoint a run saves gets one beside it (`last.ckpt` -> `last/`); timm
(`create_model("local-dir:<folder>", pretrained=True)`), transformers (`pipeline("image-classification", model=...)`)
and `vit.load` open it.

    artifact = vit.artifact.read("runs/two_circles/vit/version_0/checkpoints/last")
    artifact.model, artifact.inputs, artifact.class_names

Neither file can carry code. `config.json` holds timm's keys where timm can compute the model (`architecture`,
`num_classes`, `num_features`, `global_pool`, `model_args`, `pretrained_cfg`, `label_names`) and this project's under
`"vit"`: the backbone by its registry name and arguments, `inputs` (size, channels, normalisation, interpolation),
`class_names`, the data module by name and arguments, `format_version`. Reading looks the backbone up in this
project's registry, checks its arguments against the constructor (`schema.check_backbone`, which reads the model's
own bounds), compares every tensor's name and shape on the meta device from the safetensors header before memory is
spent, and checks the weights finite in the model's dtype. `model.safetensors` holds the weights the commands run: the
EMA average when the run kept one.
"""

from vit.artifact.config import (
    CONFIG,
    FORMAT_VERSION,
    GENERIC_ARCHITECTURE,
    MAX_CONFIG_BYTES,
    WEIGHTS,
    ArtifactError,
    architecture,
    data_config,
    describe,
    from_checkpoint,
    hub_base_model,
    hub_dataset,
    is_hub_id,
    timm_args,
    training_record,
    weights,
)
from vit.artifact.files import folder_of, is_artifact, locate, read_config, remove, write
from vit.artifact.reader import Artifact, load, read, test_data

__all__ = [
    "CONFIG",
    "FORMAT_VERSION",
    "GENERIC_ARCHITECTURE",
    "MAX_CONFIG_BYTES",
    "WEIGHTS",
    "Artifact",
    "ArtifactError",
    "architecture",
    "data_config",
    "describe",
    "folder_of",
    "from_checkpoint",
    "hub_base_model",
    "hub_dataset",
    "is_artifact",
    "is_hub_id",
    "load",
    "locate",
    "read",
    "read_config",
    "remove",
    "test_data",
    "timm_args",
    "training_record",
    "weights",
    "write",
]
