"""The Vision Transformer (Dosovitskiy et al. 2021): patches -> tokens -> Transformer -> CLS -> class."""

from __future__ import annotations

from typing import Literal

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.init import trunc_normal_

from vit.checks import check_choice, check_float, check_int, check_size
from vit.models.block import Block
from vit.models.heads import MAPHead
from vit.models.masks import local_mask
from vit.models.patch_embed import PatchEmbed
from vit.models.pos_embed import sincos_1d, sincos_2d
from vit.models.pretrained import check_layout, load_pretrained, resolve_shape
from vit.models.scores import Score

PosEmbed = Literal["learned", "sincos1d", "sincos2d", "none"]
Pool = Literal["cls", "mean", "map"]
MAX_WIDTH, MAX_DEPTH, MAX_MLP_RATIO, MAX_REG_TOKENS = 65536, 1024, 64.0, 1024


class VisionTransformer(nn.Module):
    """A plain ViT whose parameter names match `timm.models.VisionTransformer`.

    For the same configuration (`attn_score="scaled_dot"`, `pos_embed="learned"`, and timm's
    `global_pool` for `pool`: "token" for "cls", "avg" for "mean", "map" for "map", with the same
    `reg_tokens`, `no_embed_class` and `fc_norm`), `VisionTransformer(...).load_state_dict(timm_vit.state_dict())`
    loads strictly and gives the same features and logits, so timm checkpoints can be brought in.

    Tokens: `[CLS] [registers] [patches]`, `num_prefix_tokens` = (1 with a CLS token) + `reg_tokens`.
    timm's model API is there too: `forward_intermediates`, `get_classifier`, `reset_classifier`,
    `set_grad_checkpointing`, `num_features`.

    The options, by what they are (timm's names wherever timm has the option):

    Shape. `img_size` is the side of a square image or `(H, W)`; the patch grid is then
    `(H / P, W / P)` for `patch_size` P, and every position encoding follows it. `embed_dim`, `depth`,
    `num_heads` and `mlp_ratio` (the MLP's hidden width over `embed_dim`) size the encoder. Left
    unset (None), `embed_dim`, `depth` and `num_heads` are the `pretrained` weights' (a timm name's
    architecture, or a file's shapes: `vit.models.pretrained.resolve_shape`), and 192, 6 and 3 without them.

    timm's layout.
      - `pool`, how the token sequence becomes one vector for the head: `"cls"`, a learned CLS token
        prepended (token 0) and read out after the last block; `"mean"`, no CLS token, the average of
        the patch tokens (registers left out); `"map"`, no CLS token, a learned query cross-attending
        to the patch tokens (`MAPHead`, timm's `AttentionPoolLatent`).
      - `fc_norm`: the final LayerNorm sits before the pooling (`norm`, on every token) or after it
        (`fc_norm`, on the pooled vector); by default after for "mean" (timm's `global_pool="avg"`),
        before for "cls" and "map". The unused one is an `nn.Identity` without parameters, as in timm.
        `pool="mean", fc_norm=False` normalises every token, then averages (timm's
        `global_pool="avg", fc_norm=False`): the only mean pooling before `fc_norm` existed, kept by
        the relation study's configs.
      - `reg_tokens` (Darcet et al. 2024, "Vision Transformers Need Registers"): learned tokens after
        the CLS token that every token may attend to and that nothing reads out: extra room for
        global computation, so that patch tokens are not taken over for it.
      - `no_embed_class`: positions for the patches only, the CLS token and registers having none
        (timm's register models use it); otherwise every token has one.
      - `qkv_bias`, `qk_norm` (a LayerNorm on each head's queries and keys).
      - `pos_embed="learned"`: a parameter `(1, N, D)`, timm's position table.

    Regularisation. `drop_rate` is dropout before the head (as in timm), `proj_drop_rate` dropout after
    the attention projection and in the MLP, `attn_drop_rate` dropout on the attention weights,
    `drop_path_rate` the stochastic-depth rate of the last block (rising linearly from 0 in the first).

    This project's.
      - `attn_score`: the score function `f(q, k)` of every attention layer (`vit.models.scores`);
        `score_dim` the hidden width d_a of the additive forms.
      - `pos_embed`'s fixed encodings, non-persistent buffers (not learned, not in the state dict):
        `"sincos1d"`, the sin/cos encoding over the token index (position 0 is the first token that
        has a position, the patches follow row-major); `"sincos2d"`, the 2-D encoding over (patch row,
        patch column), the prefix tokens sitting outside the grid with the zero vector; `"none"`, no
        position information at all (an ablation: the encoder is then permutation equivariant over
        patches). `pos_scale` multiplies a fixed table (1: as published, entries of RMS 0.71; the
        patch embedding's output starts near 0.1, so at init the tokens are then mostly position).
      - `qk_init_std`: the init std of the query and key projections (`init_weights`).
      - `patch_kernel`: overlapping patches, a window wider than the patch (`PatchEmbed`).
      - `attn_radius`: local attention, in training and at test time: a patch attends only to the
        patches within this many grid steps (`vit.models.masks.local_mask`; 1: its 3x3 neighbourhood);
        the CLS token and registers still see and are seen by all. Stacked, `depth` layers reach
        `depth * attn_radius` patches, as a CNN's receptive field grows. None (default): global.

    Weights. `pretrained`: weights to start from, a timm model name, a hub id or a local file, adapted
    to this config (`vit.models.pretrained`).
    """

    def __init__(
        self,
        *,
        # Shape.
        img_size: int | tuple[int, int] = 32,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 10,
        embed_dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: float = 4.0,
        # timm's layout.
        pool: Pool = "cls",
        fc_norm: bool | None = None,
        reg_tokens: int = 0,
        no_embed_class: bool = False,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        pos_embed: PosEmbed = "learned",
        # Regularisation.
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        # This project's.
        attn_score: Score = "scaled_dot",
        score_dim: int = 16,
        pos_scale: float = 1.0,
        qk_init_std: float = 0.02,
        patch_kernel: int | None = None,
        attn_radius: int | None = None,
        # Weights.
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        shape = resolve_shape(pretrained, embed_dim=embed_dim, depth=depth, num_heads=num_heads)
        embed_dim, depth, num_heads = shape["embed_dim"], shape["depth"], shape["num_heads"]
        _check_args(embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, in_chans=in_chans,
                    num_classes=num_classes, pool=pool, fc_norm=fc_norm, reg_tokens=reg_tokens,
                    no_embed_class=no_embed_class, pos_embed=pos_embed, pos_scale=pos_scale, score_dim=score_dim,
                    qk_init_std=qk_init_std, drop_rate=drop_rate, proj_drop_rate=proj_drop_rate,
                    attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate)
        if attn_radius is not None:
            check_int("attn_radius", attn_radius, 0, MAX_WIDTH)
        self.num_classes = num_classes
        self.embed_dim = self.num_features = embed_dim  # timm's name for the width the head reads
        self.pos_embed_type = pos_embed
        self.pool = pool
        self.use_fc_norm = pool == "mean" if fc_norm is None else fc_norm
        self.num_reg_tokens, self.no_embed_class = reg_tokens, no_embed_class
        self.num_prefix_tokens = (1 if pool == "cls" else 0) + reg_tokens  # the CLS token if any, then the registers
        self.qk_init_std = qk_init_std

        self.patch_embed = PatchEmbed(img_size=check_size("img_size", img_size), patch_size=patch_size,
                                      in_chans=in_chans, embed_dim=embed_dim, kernel_size=patch_kernel)
        num_patches = self.patch_embed.num_patches
        unplaced = self.num_prefix_tokens if no_embed_class else 0  # prefix tokens without a position
        num_placed = self.num_prefix_tokens + num_patches - unplaced  # the tokens that have one
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pool == "cls" else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, num_placed, embed_dim))
        elif pos_embed == "sincos1d":
            table = pos_scale * sincos_1d(torch.arange(num_placed), embed_dim)
            self.register_buffer("pos_embed", table[None], persistent=False)
        elif pos_embed == "sincos2d":
            grid = pos_scale * sincos_2d(*self.patch_embed.grid_size, embed_dim)  # (num_patches, D)
            prefix_pos = torch.zeros(num_placed - num_patches, embed_dim)
            self.register_buffer("pos_embed", torch.cat([prefix_pos, grid])[None], persistent=False)
        else:
            self.pos_embed = None

        # Local attention: a fixed mask, in training as at test time (None: every token sees every token).
        self.attn_radius = attn_radius
        mask = None if attn_radius is None else local_mask(self.patch_embed.grid_size, attn_radius,
                                                           self.num_prefix_tokens)
        self.register_buffer("attn_mask", mask, persistent=False)

        # Stochastic depth grows linearly with depth: early blocks are kept almost always.
        dpr = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()  # numbers, also under a meta-device build
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
        # As in timm: one final LayerNorm, before the pooling (`norm`) or after it (`fc_norm`).
        self.norm = nn.Identity() if self.use_fc_norm else nn.LayerNorm(embed_dim, eps=1e-6)
        if pool == "map":
            self.attn_pool = MAPHead(
                embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, attn_score=attn_score, score_dim=score_dim
            )
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6) if self.use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes)
        self.grad_checkpointing = False
        self.init_weights()
        # A state dict of another layout (the MAP head before it took timm's names, a norm on the other
        # side of the pooling) is converted where that is exact and refused in one line where it is not.
        self.register_load_state_dict_pre_hook(_check_layout_hook)
        if pretrained:
            load_pretrained(self, pretrained)

    def init_weights(self) -> None:
        """timm's scheme: truncated normal (std 0.02) for linear layers and learned positions.

        The query and key rows of every `qkv` get std `qk_init_std` instead. At timm's 0.02 the
        attention logits start with a std of about 0.02 at width 64: every row is near uniform, and
        each token reads the average of all the others. At `1 / sqrt(embed_dim)` a query's entries
        have unit variance (its input is layer-normalised), so the scaled logits start with a std of
        about 1: attention depends on content from the first step.
        """
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

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameter names that are not weight matrices but still have ndim > 1 (timm's convention)."""
        return {"cls_token", "reg_token", "pos_embed", "attn_pool.latent"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, str | list]:
        """timm's layer groups, read by `timm.optim.param_groups_layer_decay`: the stem (patch embedding, CLS,
        registers, positions), then `blocks.N` one group each, then `norm`; the rest (`fc_norm`, the MAP head,
        `head`) is the last group."""
        return {"stem": r"^cls_token|reg_token|pos_embed|patch_embed",
                "blocks": [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))]}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C, H, W) -> (B, N, D)`: the tokens after the last block, `[CLS] [registers] [patches]`, normalised
        by `norm` (with `fc_norm`, an Identity: the pooled vector is normalised instead, as in timm)."""
        x = self.embed(x)  # (B, N, D)
        for block in self.blocks:
            x = self._run_block(block, x)  # x + attn(norm1(x)), then x + mlp(norm2(x))
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

    def _run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and torch.is_grad_enabled():
            # Activation checkpointing: the block's activations are recomputed in the backward pass.
            return torch.utils.checkpoint.checkpoint(block, x, self.attn_mask, use_reentrant=False)
        return block(x, self.attn_mask)

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

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """`(B, N, D) -> (B, num_classes)`: pool the tokens as `self.pool` says, `fc_norm`, then the
        linear head; with `pre_logits`, the pooled features `(B, D)` the head reads."""
        if self.pool == "cls":
            x = x[:, 0]  # (B, D)
        elif self.pool == "mean":
            x = x[:, self.num_prefix_tokens:].mean(dim=1)  # the patches: (B, D)
        else:
            x = self.attn_pool(x[:, self.num_prefix_tokens:])  # the query reads the patches: (B, D)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits `(B, num_classes)`. Attention maps: `with vit.models.record_attention(model) as maps`."""
        return self.forward_head(self.forward_features(x))


def _check_args(*, embed_dim, depth, num_heads, mlp_ratio, in_chans, num_classes, pool, fc_norm, reg_tokens,
                no_embed_class, pos_embed, pos_scale, score_dim, qk_init_std, drop_rate, proj_drop_rate,
                attn_drop_rate, drop_path_rate) -> None:
    """Raise `ValueError` naming the first of `VisionTransformer`'s options that is not allowed, and what is.

    Upper bounds far above any published ViT (ViT-22B: width 6144, depth 48), so that a typo fails here
    instead of allocating for hours. `img_size` and the patch options are checked where they are used
    (`check_size`, `PatchEmbed`).
    """
    check_choice("pos_embed", pos_embed, PosEmbed)
    check_float("pos_scale", pos_scale, 0.0, 100.0, low_open=True)
    if pos_scale != 1.0 and not pos_embed.startswith("sincos"):
        raise ValueError(f"pos_scale={pos_scale!r} is not allowed with pos_embed={pos_embed!r}: it scales the "
                         "fixed tables only (sincos1d, sincos2d)")
    check_choice("pool", pool, Pool)
    check_int("embed_dim", embed_dim, 1, MAX_WIDTH)
    check_int("num_heads", num_heads, 1, embed_dim)
    check_int("depth", depth, 1, MAX_DEPTH)
    check_float("mlp_ratio", mlp_ratio, 0.0, MAX_MLP_RATIO, low_open=True)
    check_int("score_dim", score_dim, 1, MAX_WIDTH)
    check_int("reg_tokens", reg_tokens, 0, MAX_REG_TOKENS)
    for name, value in (("fc_norm", fc_norm), ("no_embed_class", no_embed_class)):
        if not isinstance(value, bool) and not (name == "fc_norm" and value is None):
            raise ValueError(f"{name}={value!r} is not allowed: expected true or false")
    check_float("qk_init_std", qk_init_std, 0.0, 10.0, low_open=True)
    for name, value in (("num_classes", num_classes), ("in_chans", in_chans)):
        check_int(name, value, 1)
    for name, value in (("drop_rate", drop_rate), ("proj_drop_rate", proj_drop_rate),
                        ("attn_drop_rate", attn_drop_rate), ("drop_path_rate", drop_path_rate)):
        check_float(name, value, 0.0, 1.0, high_open=True)


def _check_layout_hook(module: VisionTransformer, state_dict: dict, prefix: str, *args) -> None:
    """`load_state_dict` pre-hook: bring `state_dict`'s keys under `prefix` to this model's layout (`check_layout`)."""
    own = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    fixed = check_layout(own, module)
    if fixed is not own:
        for key in own:
            del state_dict[prefix + key]
        state_dict.update({prefix + k: v for k, v in fixed.items()})
