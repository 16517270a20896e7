"""A readable Vision Transformer: the model (`vit.models`), its data, training and explanations.

`vit.load(model)` gives a trained model ready for inference; torch is imported when it is called.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vit.api import Predictor


def load(path_or_url: str | os.PathLike, device: str = "cpu", precision: str = "32") -> Predictor:
    """The trained model of a model folder, a `train.py` checkpoint, a URL or an `hf-hub:` id, ready for inference:
    `vit.api.load`."""
    from vit.api import load as load_checkpoint

    return load_checkpoint(path_or_url, device, precision)
