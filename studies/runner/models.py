"""The ViT options only the studies use, as a subclass of the library's `VisionTransformer`.

`StudyViT` adds local attention (`attn_radius`, the arrangement study's `local1` cells), the size of
a fixed position table (`pos_scale`, the recipe screen's sin/cos candidate) and the initial size of a
learned one (`pos_init_std`, the arrangement study's learned-table cells). Configs name it as
`class_path: studies.runner.models.StudyViT`; importing this module lets checkpoints name it too
(`vit.registry.allow_backbone`), so `vit.load`, attention blocking and `train.py`
open a study's checkpoints once the study's code is imported.
"""

from __future__ import annotations

from typing import Literal

import torch

from vit.checks import check_float, check_int
from vit.models import VisionTransformer
from vit.models.masks import local_mask
from vit.models.pos_embed import sincos_2d
from vit.registry import allow_backbone


class StudyViT(VisionTransformer):
    """`VisionTransformer(**kwargs)` with three options of the studies.

    Args:
        attn_radius: local attention, in training and at test time: a patch attends only to the patches
            within this many grid steps (`vit.models.masks.local_mask`; 1: its 3x3 neighbourhood); the CLS
            token and registers still see and are seen by all. None: global, the library's model.
        pos_scale: a factor on a fixed position table (`sincos1d`, `sincos2d`): 1 is the table as
            published, entries of RMS 0.71, while the patch embedding's output starts near 0.1.
        pos_init_std: the standard deviation of a learned table's initial entries (normal, not truncated);
            None: the library's 0.02 (truncated normal). 0.7 starts it at the size of the sin/cos table.
        pos_init: "sincos2d" starts a learned table at the sin/cos 2-D table's values (its size and its structure),
            then trains it; None: random (`pos_init_std`).
    """

    def __init__(
        self,
        *,
        attn_radius: int | None = None,
        pos_scale: float = 1.0,
        pos_init_std: float | None = None,
        pos_init: Literal["sincos2d"] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if pos_init is not None:
            if self.pos_embed_type != "learned" or pos_init_std is not None:
                raise ValueError(
                    f"pos_init={pos_init!r} is not allowed with pos_embed={self.pos_embed_type!r} and "
                    f"pos_init_std={pos_init_std!r}: it starts a learned table, in place of a random one"
                )
            grid = sincos_2d(*self.patch_embed.grid_size, self.embed_dim)  # (num_patches, D), as the fixed table
            with torch.no_grad():
                self.pos_embed.zero_()  # the prefix tokens' rows at 0, as the fixed table has them
                self.pos_embed[0, -grid.shape[0] :] = grid
        check_float("pos_scale", pos_scale, 0.0, 100.0, low_open=True)
        if pos_init_std is not None:
            check_float("pos_init_std", pos_init_std, 0.0, 100.0, low_open=True)
            if self.pos_embed_type != "learned":
                raise ValueError(
                    f"pos_init_std={pos_init_std!r} is not allowed with "
                    f"pos_embed={self.pos_embed_type!r}: it sizes the learned table only"
                )
            with torch.no_grad():
                self.pos_embed.normal_(0.0, pos_init_std)
        if pos_scale != 1.0:
            if not self.pos_embed_type.startswith("sincos"):
                raise ValueError(
                    f"pos_scale={pos_scale!r} is not allowed with pos_embed={self.pos_embed_type!r}: it "
                    "scales the fixed tables only (sincos1d, sincos2d)"
                )
            with torch.no_grad():
                self.pos_embed.mul_(pos_scale)
        if attn_radius is not None:
            check_int("attn_radius", attn_radius, 0, 65536)
            self.attn_mask = local_mask(self.patch_embed.grid_size, attn_radius, self.num_prefix_tokens)


allow_backbone(StudyViT)
