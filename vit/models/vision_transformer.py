"""The Vision Transformer (Dosovitskiy et al. 2021): patches -> tokens -> Transformer -> class; its `Block`."""

from __future__ import annotations

from typing import Literal

import torch
import torch.utils.checkpoint
from timm.layers import DropPath, LayerScale, Mlp
from torch import nn
from torch.nn.init import trunc_normal_

from vit.checks import check_arguments, check_choice, check_int, check_size
from vit.models.attention import Attention, check_heads
from vit.models.contract import Backbone, ToMaps
from vit.models.heads import MAPHead
from vit.models.patch_embed import PatchEmbed
from vit.models.pos_embed import sincos_1d, sincos_2d
from vit.models.rope import RotaryEmbedding
from vit.models.scores import Score

PosEmbed = Literal["learned", "sincos1d", "sincos2d", "rope", "rope_mixed", "relative", "none"]
ROPE = {"rope": "axial", "rope_mixed": "mixed"}  # pos_embed -> the rotary variant (`vit.models.rope`)
Pool = Literal["cls", "mean", "map"]
DEFAULT_SHAPE = {"embed_dim": 192, "depth": 6, "num_heads": 3}  # a ViT-Ti width at half depth, for 32 px images
# Far above any published ViT (ViT-22B: width 6144, depth 48), so that a typo fails here instead of allocating.
BOUNDS = {
    "in_chans": (1, 1024),
    "num_classes": (1, 10**7),
    "embed_dim": (1, 65536),
    "depth": (1, 1024),
    "reg_tokens": (0, 1024),
    "score_dim": (1, 65536),
    "mlp_ratio": (0, 64, True, False),
    "drop_path_rate": (0, 1, False, True),
    "qk_init_std": (0, 10, True, False),
    "init_values": (0, 10, True, False),
    "rope_temperature": (1, 1e9, False, False),
}


class Block(nn.Module):
    """`x + attn(norm1(x))`, then `x + mlp(norm2(x))`, each branch with stochastic depth; timm's parameter names."""

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        attn_score: Score = "scaled_dot",
        score_dim: int = 16,
        drop_path: float = 0.0,
        init_values: float | None = None,
        eva_names: bool = False,
        relative: tuple[tuple[int, int], int] | None = None,
    ) -> None:
        super().__init__()
        # eps=1e-6 as in timm and the original ViT, so timm checkpoints give identical outputs.
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(
            dim,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            attn_score=attn_score,
            score_dim=score_dim,
            relative=relative,
        )
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))  # fc1, act (GELU), drop1, norm (Identity), fc2, drop2
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        # Layer scale (Touvron et al. 2021): each branch scaled per channel, started at `init_values` so that a deep
        # model starts near the identity; None: none, and no parameters. Named as timm names it: `ls1.gamma` in its
        # VisionTransformer (and relative-position ViT), `gamma_1` in its Eva (the RoPE ViTs), by `eva_names`.
        scaled, eva = init_values is not None, init_values is not None and eva_names
        self.ls1 = LayerScale(dim, init_values) if scaled and not eva else nn.Identity()
        self.ls2 = LayerScale(dim, init_values) if scaled and not eva else nn.Identity()
        self.gamma_1 = nn.Parameter(torch.full((dim,), float(init_values))) if eva else None
        self.gamma_2 = nn.Parameter(torch.full((dim,), float(init_values))) if eva else None

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, rope: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`(B, N, D) -> (B, N, D)`; `mask` (bool or additive, `vit.models.masks`) limits the attention, `rope` (its
        rotary angles) turns its queries and keys."""
        attended = self.ls1(self.attn(self.norm1(x), mask=mask, rope=rope))
        x = x + self.drop_path1(attended if self.gamma_1 is None else self.gamma_1 * attended)
        mixed = self.ls2(self.mlp(self.norm2(x)))
        return x + self.drop_path2(mixed if self.gamma_2 is None else self.gamma_2 * mixed)


class VisionTransformer(Backbone):
    """A plain ViT whose parameter names match `timm.models.VisionTransformer`; built from numbers alone.
    For the same configuration (scaled-dot scores, learned positions, `pool` "cls", "mean" or "map" for timm's
    `global_pool` "token", "avg" or "map"), a timm ViT's state dict loads strictly and gives the same logits;
    pretrained weights come through `vit.models.pretrained.create_vit`. Tokens: `[CLS] [registers] [patches]`.

    Args:
        img_size: a side, or `(H, W)`; the patch grid is `(H / P, W / P)`, P the `patch_size`.
        embed_dim, depth, num_heads: `DEFAULT_SHAPE`'s when None (`train.py` fills in a pretrained source's).
        pool: "cls" (a learned CLS token, read out), "mean" (the patch tokens' average) or "map" (`MAPHead`).
        fc_norm: the final LayerNorm after the pooling (`fc_norm`) instead of on every token (`norm`); by default
            after for "mean" (timm's `global_pool="avg"`), before for "cls" and "map".
        reg_tokens: learned register tokens after the CLS token (Darcet et al. 2024), never read out.
        no_embed_class: positions for the patches only (timm's register models), not the prefix tokens.
        pos_embed: "learned" (a parameter), "sincos1d" (over the token index), "sincos2d" (over the patch grid,
            prefix tokens at zero), both non-persistent buffers, added to the tokens; "rope" / "rope_mixed" (rotary,
            `vit.models.rope`: queries and keys turned by the patch's column and row, axial or with learned mixed
            frequencies; prefix tokens unturned; no table added); "relative" (`vit.models.relpos`: every block's
            heads learn a bias per offset between two patches, and three for a CLS token, added to the scores; at
            most a CLS token as prefix); or "none" (permutation equivariant over patches).
        rope_temperature: the rotary frequencies' base (timm's 100 for "rope", 10 for "rope_mixed" when None).
        init_values: layer scale, each block's two branches scaled per channel from this value (timm's
            `init_values`: `ls1.gamma`, or Eva's `gamma_1` with rotary positions); None: none.
        drop_path_rate: stochastic depth of the last block, rising linearly from 0 in the first.
        attn_score: every attention layer's score function (`vit.models.scores`); `score_dim`: the additive ones' width.
        qk_init_std: the init std of the query and key projections (`init_weights`).
        patch_kernel: a patch window wider than the patch: overlapping patches (`PatchEmbed`).

    `attn_mask`, None here, is a fixed mask every block applies (`vit.models.masks`); a subclass may set it."""

    has_attention = True

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 32,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 10,
        embed_dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: float = 4.0,
        pool: Pool = "cls",
        fc_norm: bool | None = None,
        reg_tokens: int = 0,
        no_embed_class: bool = False,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        pos_embed: PosEmbed = "learned",
        drop_path_rate: float = 0.0,
        attn_score: Score = "scaled_dot",
        score_dim: int = 16,
        qk_init_std: float = 0.02,
        patch_kernel: int | None = None,
        init_values: float | None = None,
        rope_temperature: float | None = None,
    ) -> None:
        super().__init__()
        embed_dim, depth, num_heads = (
            DEFAULT_SHAPE[k] if v is None else v
            for k, v in (("embed_dim", embed_dim), ("depth", depth), ("num_heads", num_heads))
        )
        check_arguments(VisionTransformer, locals(), BOUNDS)
        check_int("num_heads", num_heads, 1, embed_dim)
        check_heads(embed_dim, num_heads)
        self.num_classes, self.qk_init_std = num_classes, qk_init_std
        self.embed_dim = self.num_features = embed_dim  # timm's name for the width the head reads
        self.pos_embed_type, self.pool = pos_embed, pool
        self.use_fc_norm = pool == "mean" if fc_norm is None else fc_norm
        self.num_reg_tokens, self.no_embed_class = reg_tokens, no_embed_class
        self.num_prefix_tokens = (1 if pool == "cls" else 0) + reg_tokens  # the CLS token if any, then the registers

        self._build_embedding(img_size=img_size, patch_size=patch_size, in_chans=in_chans, patch_kernel=patch_kernel)
        self.rope = self._build_rope(depth=depth, num_heads=num_heads, rope_temperature=rope_temperature)
        self.register_buffer("attn_mask", None, persistent=False)  # None: every token sees every token

        self.blocks = self._build_blocks(
            depth, num_heads, mlp_ratio, qkv_bias, qk_norm, attn_score, score_dim, drop_path_rate, init_values
        )
        self._build_head(num_heads=num_heads, mlp_ratio=mlp_ratio, attn_score=attn_score, score_dim=score_dim)
        self.grad_checkpointing = False
        self.init_weights()

    def _build_embedding(
        self, *, img_size: int | tuple[int, int], patch_size: int, in_chans: int, patch_kernel: int | None
    ) -> None:
        """Set `patch_embed`, the CLS and register tokens and the position table `pos_embed` (None if it has none)."""
        embed_dim = self.embed_dim
        self.patch_embed = PatchEmbed(
            img_size=check_size("img_size", img_size),
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            kernel_size=patch_kernel,
        )
        num_patches = self.patch_embed.num_patches
        num_placed = num_patches + (0 if self.no_embed_class else self.num_prefix_tokens)  # the tokens with a position
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if self.pool == "cls" else None
        self.reg_token = nn.Parameter(torch.zeros(1, self.num_reg_tokens, embed_dim)) if self.num_reg_tokens else None
        if self.pos_embed_type == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, num_placed, embed_dim))
        elif self.pos_embed_type == "sincos1d":
            self.register_buffer("pos_embed", sincos_1d(torch.arange(num_placed), embed_dim)[None], persistent=False)
        elif self.pos_embed_type == "sincos2d":
            grid = sincos_2d(*self.patch_embed.grid_size, embed_dim)  # (num_patches, D); prefix tokens at 0
            self.register_buffer(
                "pos_embed", torch.cat([torch.zeros(num_placed - num_patches, embed_dim), grid])[None], persistent=False
            )
        else:
            self.pos_embed = None

    def _build_rope(self, *, depth: int, num_heads: int, rope_temperature: float | None) -> RotaryEmbedding | None:
        """The rotary embedding for "rope" / "rope_mixed" positions, else None."""
        if self.pos_embed_type not in ROPE:
            return None
        return RotaryEmbedding(
            ROPE[self.pos_embed_type],
            grid_size=self.patch_embed.grid_size,
            head_dim=self.embed_dim // num_heads,
            depth=depth,
            num_heads=num_heads,
            num_prefix_tokens=self.num_prefix_tokens,
            temperature=rope_temperature,
        )

    def _build_blocks(
        self,
        depth: int,
        num_heads: int,
        mlp_ratio: float,
        qkv_bias: bool,
        qk_norm: bool,
        attn_score: Score,
        score_dim: int,
        drop_path_rate: float,
        init_values: float | None,
    ) -> nn.ModuleList:
        """The `depth` Transformer blocks, their stochastic depth rising linearly to `drop_path_rate`."""
        pos_embed = self.pos_embed_type
        relative = (self.patch_embed.grid_size, self.num_prefix_tokens) if pos_embed == "relative" else None
        dpr = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()  # numbers, also under a meta-device build
        return nn.ModuleList(
            Block(
                self.embed_dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                qk_norm=qk_norm,
                attn_score=attn_score,
                score_dim=score_dim,
                drop_path=p,
                init_values=init_values,
                eva_names=pos_embed in ROPE,
                relative=relative,
            )
            for p in dpr
        )

    def _build_head(self, *, num_heads: int, mlp_ratio: float, attn_score: Score, score_dim: int) -> None:
        """Set the final `norm`, the pooling's `attn_pool` ("map" only), `fc_norm`, `head_drop` and the `head`."""
        embed_dim = self.embed_dim
        self.norm = nn.Identity() if self.use_fc_norm else nn.LayerNorm(embed_dim, eps=1e-6)
        if self.pool == "map":
            self.attn_pool = MAPHead(
                embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, attn_score=attn_score, score_dim=score_dim
            )
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6) if self.use_fc_norm else nn.Identity()
        self.head_drop = nn.Identity()  # timm's name; this model has no dropout before the head
        self.head = nn.Linear(embed_dim, self.num_classes)

    def init_weights(self) -> None:
        """timm's scheme (truncated normal, std 0.02), but std `qk_init_std` for the query and key rows of every `qkv`:
        at `1 / sqrt(embed_dim)` the attention logits start with a std of about 1 instead of near 0."""
        if isinstance(self.pos_embed, nn.Parameter):
            trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.qk_init_std != 0.02:
            for block in self.blocks:
                qkv = block.attn.qkv.weight  # (3 * D, D): the q rows, then k, then v
                trunc_normal_(qkv.data[: 2 * qkv.shape[0] // 3], std=self.qk_init_std)

    def gradcam_target(self) -> tuple[nn.Module, ToMaps]:
        # The last block's input norm: its patch tokens, laid out on the patch grid (the prefix tokens have no place).
        (gh, gw), prefix = self.patch_embed.grid_size, self.num_prefix_tokens
        return self.blocks[-1].norm1, lambda t: t[:, prefix:].transpose(1, 2).reshape(t.shape[0], -1, gh, gw)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names that are not weight matrices but still have ndim > 1 (timm's convention)."""
        return {"cls_token", "reg_token", "pos_embed", "attn_pool.latent", "rope.freqs"}  # rope: timm's too

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, str | list]:
        """timm's layer groups (`param_groups_layer_decay`): the stem, `blocks.N` one each, `norm`; the rest last."""
        return {
            "stem": r"^cls_token|reg_token|pos_embed|patch_embed",
            "blocks": [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        }

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C, H, W) -> (B, N, D)`: the tokens after the last block, normalised by `norm`."""
        x = self.embed(x)  # (B, N, D)
        for i, block in enumerate(self.blocks):
            x = self._run_block(block, x, i)  # x + attn(norm1(x)), then x + mlp(norm2(x))
        return self.norm(x)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C, H, W) -> (B, N, D)`: the image as tokens, `[CLS] [registers] [patches]`, positions added."""
        x = self.patch_embed(x)  # (B, num_patches, D)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if self.pos_embed is not None and self.no_embed_class:
            x = x + self.pos_embed  # the patches' positions only, (1, num_patches, D)
        x = torch.cat([*prefix, x], dim=1)  # (B, N = num_prefix_tokens + num_patches, D)
        if self.pos_embed is not None and not self.no_embed_class:
            x = x + self.pos_embed  # learned or fixed, (1, N, D)
        return x

    def _run_block(self, block: nn.Module, x: torch.Tensor, index: int) -> torch.Tensor:
        rope = None if self.rope is None else self.rope.angles(index)  # block `index`'s rotary angles
        if self.grad_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(block, x, self.attn_mask, rope, use_reentrant=False)
        return block(x, self.attn_mask, rope)

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
        """The patch maps after the chosen blocks (`indices`: the last n, or block numbers), as timm's method: "NCHW"
        `(B, D, gh, gw)` or "NLC"; the final normalised tokens first unless `intermediates_only`."""
        check_choice("output_fmt", output_fmt, ("NCHW", "NLC"))
        depth = len(self.blocks)
        if indices is None:
            wanted = list(range(depth))
        elif isinstance(indices, int):
            check_int("indices", indices, 1, depth)
            wanted = list(range(depth - indices, depth))
        else:
            wanted = [i % depth for i in indices]
        (gh, gw), prefix = self.patch_embed.grid_size, self.num_prefix_tokens
        x, intermediates = self.embed(x), []
        for i, block in enumerate(self.blocks):
            x = self._run_block(block, x, i)
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

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """`(B, N, D) -> (B, num_classes)`: pool the tokens, `fc_norm`, the head; `pre_logits`: the pooled `(B, D)`."""
        if self.pool == "cls":
            x = x[:, 0]  # (B, D)
        elif self.pool == "mean":
            x = x[:, self.num_prefix_tokens :].mean(dim=1)  # the patches: (B, D)
        else:
            x = self.attn_pool(x[:, self.num_prefix_tokens :])  # the query reads the patches: (B, D)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits `(B, num_classes)`. Attention maps: `with vit.models.record_attention(model) as maps`."""
        return self.forward_head(self.forward_features(x))
