"""The Vision Transformer (Dosovitskiy et al. 2021): patches -> tokens -> Transformer -> CLS -> class."""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.init import trunc_normal_

from vit.checks import check_choice, check_float, check_int
from vit.models.block import Block
from vit.models.heads import MAPHead
from vit.models.patch_embed import PatchEmbed
from vit.models.pos_embed import sincos_1d, sincos_2d
from vit.models.pretrained import load_pretrained
from vit.models.scores import Score

PosEmbed = Literal["learned", "sincos1d", "sincos2d", "none"]
MAX_WIDTH, MAX_DEPTH, MAX_MLP_RATIO = 65536, 1024, 64.0
Pool = Literal["cls", "mean", "map"]
Stem = Literal["patch", "conv"]
QKInit = Literal["normal", "mimetic"]
MIMETIC_ALPHA, MIMETIC_BETA = 0.7, 0.7  # W_q^T W_k = alpha Z + beta I at init (qk_init="mimetic")


class VisionTransformer(nn.Module):
    """A plain ViT whose parameter names match `timm.models.VisionTransformer`.

    For the same configuration (`pool="cls"`, `attn_score="scaled_dot"`, `pos_embed="learned"`;
    timm's `global_pool="token"`), `VisionTransformer(...).load_state_dict(timm_vit.state_dict())`
    loads strictly and gives the same logits, so timm checkpoints can be brought in.

    Pooling (`pool`), how the token sequence becomes one vector for the head:
      - `"cls"`: a learned CLS token is prepended (token 0) and read out after the last block.
      - `"mean"`: no CLS token; the average of the patch tokens.
      - `"map"`: no CLS token; a learned query cross-attends to the patch tokens (`MAPHead`).

    Position encodings (`pos_embed`), added to the tokens after the CLS token (if any) is prepended:
      - `"learned"`: a parameter `(1, N, D)`, N tokens; the CLS token has its own learned position.
      - `"sincos1d"`: the fixed sin/cos encoding over the token index; the CLS token is token 0 and
        gets position 0, the patches (row-major) positions 1..N (0..N-1 without a CLS token).
      - `"sincos2d"`: the fixed 2-D encoding over (patch row, patch column); the CLS token sits
        outside the grid and gets the zero vector, i.e. no position.
      - `"none"`: no position information at all (an ablation: the encoder is then permutation
        equivariant over patches).
    Fixed encodings are non-persistent buffers: they are not learned and not in the state dict.

    Args use timm's names. `drop_rate` is dropout before the head (as in timm),
    `proj_drop_rate` dropout after the attention projection and in the MLP, `attn_drop_rate`
    dropout on the attention weights, `drop_path_rate` the stochastic-depth rate of the last
    block (rising linearly from 0 in the first). `attn_score` picks the score function `f(q, k)`
    of every attention layer (`vit.models.scores`), `score_dim` the hidden width d_a of the
    additive forms. `pretrained`: weights to start from, a timm model name, a hub id or a local file,
    adapted to this config (`vit.models.pretrained`).

    timm's model API is there too: `forward_intermediates`, `get_classifier`, `reset_classifier`,
    `set_grad_checkpointing`, `num_features`. Non-square images: `img_size=(H, W)`; the patch grid is
    then `(H / P, W / P)` and every position encoding follows it.
    """

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 32,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 10,
        embed_dim: int = 192,
        depth: int = 6,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        qk_init_std: float = 0.02,
        qk_init: QKInit = "normal",
        patch_kernel: int | None = None,
        stem: Stem = "patch",
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        pos_embed: PosEmbed = "learned",
        pool: Pool = "cls",
        attn_score: Score = "scaled_dot",
        score_dim: int = 16,
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        check_choice("pos_embed", pos_embed, PosEmbed)
        check_choice("pool", pool, Pool)
        check_choice("stem", stem, Stem)
        # Upper bounds far above any published ViT (ViT-22B: width 6144, depth 48), so that a typo
        # fails here instead of allocating for hours.
        check_int("embed_dim", embed_dim, 1, MAX_WIDTH)
        check_int("num_heads", num_heads, 1, embed_dim)
        check_int("depth", depth, 1, MAX_DEPTH)
        check_float("mlp_ratio", mlp_ratio, 0.0, MAX_MLP_RATIO, low_open=True)
        check_int("score_dim", score_dim, 1, MAX_WIDTH)
        check_float("qk_init_std", qk_init_std, 0.0, 10.0, low_open=True)
        check_choice("qk_init", qk_init, QKInit)
        self.qk_init_std, self.qk_init = qk_init_std, qk_init
        for name, value in (("num_classes", num_classes), ("in_chans", in_chans)):
            check_int(name, value, 1)
        for name, value in (("drop_rate", drop_rate), ("proj_drop_rate", proj_drop_rate),
                            ("attn_drop_rate", attn_drop_rate), ("drop_path_rate", drop_path_rate)):
            check_float(name, value, 0.0, 1.0, high_open=True)
        self.num_classes = num_classes
        self.embed_dim = self.num_features = embed_dim  # timm's name for the width the head reads
        self.pos_embed_type = pos_embed
        self.pool = pool
        self.num_prefix_tokens = 1 if pool == "cls" else 0  # the CLS token, when there is one

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                                      kernel_size=patch_kernel, stem=stem)
        num_patches = self.patch_embed.num_patches
        num_tokens = self.num_prefix_tokens + num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pool == "cls" else None
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
        elif pos_embed == "sincos1d":
            self.register_buffer("pos_embed", sincos_1d(torch.arange(num_tokens), embed_dim)[None], persistent=False)
        elif pos_embed == "sincos2d":
            grid = sincos_2d(*self.patch_embed.grid_size, embed_dim)  # (N, D)
            cls_pos = torch.zeros(self.num_prefix_tokens, embed_dim)
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
                qk_norm=qk_norm,
                attn_score=attn_score,
                score_dim=score_dim,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=dpr[i],
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        if pool == "map":
            self.attn_pool = MAPHead(
                embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, attn_score=attn_score, score_dim=score_dim
            )
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes)
        self.grad_checkpointing = False
        self.init_weights()
        if pretrained:
            load_pretrained(self, pretrained)

    def init_weights(self) -> None:
        """timm's scheme: truncated normal (std 0.02) for linear layers and learned positions.

        The query and key rows of every `qkv` get std `qk_init_std` instead. At timm's 0.02 the
        attention logits start with a std of about 0.02 at width 64: every row is near uniform, and
        each token reads the average of all the others. At `1 / sqrt(embed_dim)` a query's entries
        have unit variance (its input is layer-normalised), so the scaled logits start with a std of
        about 1: attention depends on content from the first step. `qk_init="mimetic"` (after
        Trockman & Kolter 2023, "Mimetic initialization of self-attention layers") sets the query
        and key projections so that `W_q^T W_k = alpha Z + beta I` (Z Gaussian with std
        1/sqrt(D), alpha = beta = 0.7): each token's query then matches keys of tokens like
        itself, so from the first step tokens read similar tokens (ink reads ink) rather than the
        average of all.
        """
        if isinstance(self.pos_embed, nn.Parameter):
            trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.qk_init == "mimetic":
            width = self.embed_dim
            for block in self.blocks:
                z = torch.randn(width, width) / math.sqrt(width)
                u, s, vh = torch.linalg.svd(MIMETIC_ALPHA * z + MIMETIC_BETA * torch.eye(width))
                qkv = block.attn.qkv.weight.data  # (3 * D, D): rows of W_q, then W_k, then W_v
                qkv[:width] = (u * s.sqrt()).T  # W_q = sqrt(S) U^T
                qkv[width:2 * width] = s.sqrt()[:, None] * vh  # W_k = sqrt(S) V^T, so W_q^T W_k = U S V^T
        elif self.qk_init_std != 0.02:
            for block in self.blocks:
                qkv = block.attn.qkv.weight  # (3 * D, D): the q rows, then k, then v
                trunc_normal_(qkv.data[: 2 * qkv.shape[0] // 3], std=self.qk_init_std)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names that are not weight matrices but still have ndim > 1 (timm's convention)."""
        return {"cls_token", "pos_embed", "attn_pool.probe"}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C, H, W) -> (B, N, D)`: the normalised tokens after the last block, the CLS token first if any."""
        x = self.embed(x)  # (B, N, D)
        for block in self.blocks:
            x = self._run_block(block, x)  # x + attn(norm1(x)), then x + mlp(norm2(x))
        return self.norm(x)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C, H, W) -> (B, N, D)`: the image as tokens, the CLS token first if any, positions added."""
        x = self.patch_embed(x)  # (B, num_patches, D)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, N = 1 + num_patches, D)
        if self.pos_embed is not None:
            x = x + self.pos_embed  # learned or fixed, (1, N, D)
        return x

    def _run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled():
            # Activation checkpointing: the block's activations are recomputed in the backward pass.
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        *,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ):
        """The token maps after chosen blocks, for dense tasks and probing (timm's signature, in part).

        `indices`: the last n blocks for an int, block numbers for a list (negative from the end), all
        by default. `output_fmt`: "NCHW" gives `(B, D, gh, gw)` patch maps, "NLC" `(B, num_patches, D)`.
        Returns the list, or `(final normalised tokens (B, N, D), list)` unless `intermediates_only`;
        with `return_prefix_tokens`, each entry is `(patch map, prefix tokens (B, num_prefix, D))`.
        """
        check_choice("output_fmt", output_fmt, ("NCHW", "NLC"))
        depth = len(self.blocks)
        if indices is None:
            wanted = list(range(depth))
        elif isinstance(indices, int):
            check_int("indices", indices, 1, depth)
            wanted = list(range(depth - indices, depth))
        else:
            wanted = [i % depth for i in indices]
        gh, gw = self.patch_embed.grid_size
        prefix = self.num_prefix_tokens
        x = self.embed(x)
        intermediates = []
        for i, block in enumerate(self.blocks):
            x = self._run_block(block, x)
            if i in wanted:
                y = self.norm(x) if norm else x
                patches = y[:, prefix:]  # (B, num_patches, D)
                if output_fmt == "NCHW":
                    patches = patches.transpose(1, 2).reshape(x.shape[0], -1, gh, gw)  # (B, D, gh, gw)
                intermediates.append((patches, y[:, :prefix]) if return_prefix_tokens else patches)
        return intermediates if intermediates_only else (self.norm(x), intermediates)

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """A new, freshly initialised head for `num_classes` classes (0: no head, `forward` returns features)."""
        check_int("num_classes", num_classes, 0)
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Trade compute for memory: recompute each block's activations in the backward pass."""
        self.grad_checkpointing = enable

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, N, D) -> (B, num_classes)`: pool the tokens as `self.pool` says, then the linear head."""
        if self.pool == "cls":
            x = x[:, 0]  # (B, D)
        elif self.pool == "mean":
            x = x.mean(dim=1)  # (B, D)
        else:
            x = self.attn_pool(x)  # (B, D)
        return self.head(self.head_drop(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits `(B, num_classes)`. Attention maps: `with vit.models.record_attention(model) as maps`."""
        return self.forward_head(self.forward_features(x))
