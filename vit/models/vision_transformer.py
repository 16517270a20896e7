"""The Vision Transformer (Dosovitskiy et al. 2021): patches -> tokens -> Transformer -> CLS -> class."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from timm.layers import trunc_normal_
from torch import nn

from vit.models.block import Block
from vit.models.patch_embed import PatchEmbed
from vit.models.pos_embed import sincos_1d, sincos_2d

PosEmbed = Literal["learned", "sincos1d", "sincos2d", "none"]


class VisionTransformer(nn.Module):
    """A plain ViT whose parameter names match `timm.models.VisionTransformer`.

    For the same configuration (`global_pool="token"`, `pos_embed="learned"`),
    `VisionTransformer(...).load_state_dict(timm_vit.state_dict())` loads strictly and gives the
    same logits, so timm checkpoints can be brought in.

    Position encodings (`pos_embed`), added to the tokens after the CLS token is prepended:
      - `"learned"`: a parameter `(1, 1 + N, D)`; the CLS token has its own learned position.
      - `"sincos1d"`: the fixed sin/cos encoding over the token index; the CLS token is token 0 and
        gets position 0, the patches (row-major) positions 1..N.
      - `"sincos2d"`: the fixed 2-D encoding over (patch row, patch column); the CLS token sits
        outside the grid and gets the zero vector, i.e. no position.
      - `"none"`: no position information at all (an ablation: the encoder is then permutation
        equivariant over patches).
    Fixed encodings are non-persistent buffers: they are not learned and not in the state dict.

    Args use timm's names. `drop_rate` is dropout before the head (as in timm),
    `proj_drop_rate` dropout after the attention projection and in the MLP, `attn_drop_rate`
    dropout on the attention weights, `drop_path_rate` the stochastic-depth rate of the last
    block (rising linearly from 0 in the first).
    """

    def __init__(
        self,
        *,
        img_size: int = 32,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 10,
        embed_dim: int = 192,
        depth: int = 6,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        pos_embed: PosEmbed = "learned",
    ) -> None:
        super().__init__()
        if pos_embed not in get_args(PosEmbed):
            raise ValueError(f"pos_embed={pos_embed!r} is not one of {get_args(PosEmbed)}")
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; "
                f"allowed num_heads for this width: {[h for h in range(1, embed_dim + 1) if embed_dim % h == 0]}"
            )
        for name, value in (("depth", depth), ("num_classes", num_classes), ("in_chans", in_chans)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        for name, value in (("drop_rate", drop_rate), ("proj_drop_rate", proj_drop_rate),
                            ("attn_drop_rate", attn_drop_rate), ("drop_path_rate", drop_path_rate)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1)")
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.pos_embed_type = pos_embed
        self.num_prefix_tokens = 1  # the CLS token

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, embed_dim))
        elif pos_embed == "sincos1d":
            self.register_buffer("pos_embed", sincos_1d(torch.arange(1 + num_patches), embed_dim)[None], persistent=False)
        elif pos_embed == "sincos2d":
            grid = sincos_2d(*self.patch_embed.grid_size, embed_dim)  # (N, D)
            cls_pos = torch.zeros(1, embed_dim)
            self.register_buffer("pos_embed", torch.cat([cls_pos, grid])[None], persistent=False)
        else:
            self.pos_embed = None

        # Stochastic depth grows linearly with depth: early blocks are kept almost always.
        dpr = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList(
            Block(
                embed_dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=dpr[i],
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        """timm's scheme: truncated normal (std 0.02) for linear layers and learned positions."""
        if isinstance(self.pos_embed, nn.Parameter):
            trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names that are not weight matrices but still have ndim > 1 (timm's convention)."""
        return {"cls_token", "pos_embed"}

    def forward_features(self, x: torch.Tensor, return_attn: bool = False):
        """`(B, C, H, W) -> (B, 1 + N, D)` normalised tokens, CLS first (and the attention maps)."""
        x = self.patch_embed(x)  # (B, N, D)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, D)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        attns = []
        for block in self.blocks:
            if return_attn:
                x, attn = block(x, return_attn=True)
                attns.append(attn)  # (B, H, 1 + N, 1 + N)
            else:
                x = block(x)
        x = self.norm(x)
        return (x, attns) if return_attn else x

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, 1 + N, D) -> (B, num_classes)` from the CLS token."""
        return self.head(self.head_drop(x[:, 0]))

    def forward(self, x: torch.Tensor, return_attn: bool = False):
        """Logits `(B, num_classes)`; with `return_attn`, `(logits, [attn (B, H, N, N) per block])`."""
        if return_attn:
            x, attns = self.forward_features(x, return_attn=True)
            return self.forward_head(x), attns
        return self.forward_head(self.forward_features(x))
