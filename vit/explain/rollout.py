"""Attention rollout and its relatives, as functions of tensors: which input tokens an output reads.
Nothing here runs a model: from one softmax map `(B, H, N, N)` per block (and the gradients w.r.t. each), the chains
make one token-to-token map `R` `(B, N, N)`, and `rollout_to_patch_map` reads the row(s) the pooling uses. References:
Abnar & Zuidema, ACL 2020 (rollout); Chefer, Gur & Wolf, ICCV 2021 (gradient-weighted maps)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from vit.checks import check_choice, check_float, check_int
from vit.models.vision_transformer import Pool

HeadFusion = Literal["mean", "max", "min"]
Scale = Literal["minmax", "sum"]
HEAD_FUSIONS = get_args(HeadFusion)


def fuse_heads(attn: Tensor, head_fusion: HeadFusion = "mean") -> Tensor:
    """Collapse the head dimension of `(B, H, ...)` attention into `(B, ...)`, in at least float32: rollout multiplies
    many near-identity matrices, and half precision loses too much in such a product."""
    check_choice("head_fusion", head_fusion, HeadFusion)
    attn = attn.to(torch.promote_types(attn.dtype, torch.float32))
    return {"mean": attn.mean, "max": attn.amax, "min": attn.amin}[head_fusion](dim=1)


def gradient_weighted(attn: Tensor, grad: Tensor) -> Tensor:
    """Chefer et al.'s head-averaged positive part of gradient x attention: `(B, H, ...)` -> `(B, ...)`."""
    return fuse_heads((grad * attn).clamp(min=0), "mean")


def discard_lowest(fused: Tensor, discard_ratio: float, keep_cls_self: bool = True) -> Tensor:
    """Zero the lowest `int(discard_ratio * N * N)` entries of each `(B, N, N)` map, but [0, 0] with `keep_cls_self`:
    discarding it could cut the CLS token off from its own path, and rollout reads the CLS token's row."""
    check_float("discard_ratio", discard_ratio, 0.0, 1.0, high_open=True)
    B, N, _ = fused.shape
    num_discard = int(discard_ratio * N * N)
    if num_discard == 0:
        return fused
    flat = fused.flatten(1)  # (B, N*N)
    ranking = flat.detach().clone()
    if keep_cls_self:
        ranking[:, 0] = float("inf")  # flat index 0 is [0, 0]; discard_ratio < 1 never reaches it
    lowest = ranking.topk(num_discard, dim=1, largest=False).indices  # (B, num_discard)
    return flat.scatter(1, lowest, 0.0).view(B, N, N)


def residual(fused: Tensor) -> Tensor:
    """`0.5 * A + 0.5 * I` with every row re-normalised to sum to 1, for `(B, N, N)` maps: the residual connection
    passes each token on as much as attention mixes it (Abnar & Zuidema's weighting)."""
    eye = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    with_residual = 0.5 * fused + 0.5 * eye  # (B, N, N); every row sums to at least 0.5
    return with_residual / with_residual.sum(dim=-1, keepdim=True)


def chain(steps: Sequence[Tensor]) -> Tensor:
    """`M_L ... M_2 M_1` for per-block `(B, N, N)` maps given first block first (later blocks act on the left)."""
    B, N, _ = steps[0].shape
    product = torch.eye(N, dtype=steps[0].dtype, device=steps[0].device).expand(B, N, N)
    for step in steps:
        product = step @ product
    return product


def attention_rollout(
    attentions: Sequence[Tensor],
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    keep_cls_self: bool = True,
) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020) of per-block maps `(B, H, N, N)` from block `start_layer` on ->
    `(B, N, N)`: per block fuse heads, `discard_lowest`, add the `residual`; then `R = Â_L ... Â_2 Â_1`.
    `head_fusion`: how the heads become one map; `discard_ratio`: the share of the weakest entries dropped (Gildenblat's
    variant; 0 is the paper's rollout); `start_layer`: the first block chained; `keep_cls_self`: never discard the CLS
    token's attention to itself (False for a model without a CLS token, where token 0 is a patch)."""
    _check_attentions(attentions)
    check_int("start_layer", start_layer, 0, len(attentions) - 1)  # discard_lowest checks discard_ratio
    return chain(
        [
            residual(discard_lowest(fuse_heads(attn, head_fusion), discard_ratio, keep_cls_self))
            for attn in attentions[start_layer:]
        ]
    )


def gradient_rollout(attentions: Sequence[Tensor], grads: Sequence[Tensor], start_layer: int = 0) -> Tensor:
    """Gradient-weighted rollout (Chefer et al. 2021 style) of per-block maps `(B, H, N, N)` -> `(B, N, N)`: each
    block's `mean_heads((dy/dA * A).clamp(min=0))`, with `grads` = dy/dA, chained as in `attention_rollout`."""
    _check_attentions(attentions)
    check_int("start_layer", start_layer, 0, len(attentions) - 1)
    return chain([residual(gradient_weighted(a, g)) for a, g in zip(attentions[start_layer:], grads[start_layer:])])


def chefer_rollout(attentions: Sequence[Tensor], grads: Sequence[Tensor]) -> Tensor:
    """Chefer et al.'s rule for self-attention: `R = I`, then `R <- R + Ā R` per block, first block first,
    with `Ā = mean_heads((dy/dA * A).clamp(min=0))`. Written as the chain of `I + Ā`; no row normalisation."""
    _check_attentions(attentions)
    weighted = [gradient_weighted(a, g) for a, g in zip(attentions, grads)]  # (B, N, N) each
    eye = torch.eye(weighted[0].shape[-1], dtype=weighted[0].dtype, device=weighted[0].device)
    return chain([eye + w for w in weighted])


def readout_weights(pool: Pool, num_tokens: int, pool_attn: Tensor | None = None, reg_tokens: int = 0) -> Tensor:
    """How much the pooled vector takes from each output token `[CLS] [registers] [patches]`, `(1, N)` or `(B, N)`:
    "cls" all from CLS, "mean" 1/P from each patch, "map" the query's head-fused `pool_attn` `(B, 1, P)`."""
    if pool == "cls":
        return torch.eye(1, num_tokens)
    num_patches = num_tokens - reg_tokens
    per_patch = torch.full((1, num_patches), 1.0 / num_patches) if pool == "mean" else pool_attn.flatten(1)
    return F.pad(per_patch, (reg_tokens, 0))  # (1 or B, N)


def rollout_to_patch_map(
    rollout: Tensor,
    grid_size: tuple[int, int],
    pool: Pool = "cls",
    pool_attn: Tensor | None = None,
    scale: Scale = "minmax",
    reg_tokens: int = 0,
) -> Tensor:
    """A token-to-token map `R` `(B, N, N)` as one relevance value per patch, `(B, gh, gw)`: the pooled output's
    row `readout_weights @ R` without the prefix columns, scaled by `minmax` (for display) or `normalise` ("sum")."""
    check_choice("pool", pool, Pool)
    check_choice("scale", scale, Scale)
    if rollout.ndim != 3 or rollout.shape[1] != rollout.shape[2]:
        raise ValueError(f"rollout must have shape (B, N, N), got {tuple(rollout.shape)}")
    if (pool == "map") != (pool_attn is not None):
        raise ValueError(f"pool_attn is required for pool='map' and only then; got pool={pool!r}")
    (gh, gw), (B, N, _) = grid_size, rollout.shape
    num_prefix = (1 if pool == "cls" else 0) + reg_tokens
    if N != num_prefix + gh * gw:
        raise ValueError(
            f"rollout has N={N} tokens but pool={pool!r} with reg_tokens={reg_tokens} and grid_size="
            f"{tuple(grid_size)} needs {num_prefix + gh * gw}"
        )
    if pool == "map" and pool_attn.flatten(1).shape != (B, gh * gw):
        raise ValueError(
            f"pool_attn must have shape (B, 1, P) = ({B}, 1, {gh * gw}) (the patches) after fusing "
            f"heads, got {tuple(pool_attn.shape)}"
        )
    weights = readout_weights(pool, N, pool_attn, reg_tokens).to(rollout)  # (1, N) or (B, N)
    relevance = (weights.unsqueeze(1) @ rollout).squeeze(1)[:, num_prefix:]  # (B, gh*gw)
    relevance = normalise(relevance) if scale == "sum" else minmax(relevance)
    return relevance.reshape(B, gh, gw)


def normalise(maps: Tensor) -> Tensor:
    """Clamp at 0 and divide each map `(B, ...)` by its sum (an all-zero map stays all zeros); at least float32."""
    maps = maps.clamp(min=0)
    maps = maps.to(torch.promote_types(maps.dtype, torch.float32))
    total = maps.flatten(1).sum(1).view(-1, *([1] * (maps.ndim - 1)))
    return maps / torch.where(total > 0, total, torch.ones_like(total))


def minmax(maps: Tensor) -> Tensor:
    """Each map `(B, ...)` scaled to [0, 1] by its own min and max, for display (a constant map becomes zeros)."""
    flat, shape = maps.flatten(1), (-1, *([1] * (maps.ndim - 1)))
    lo = flat.amin(1).view(shape)
    span = flat.amax(1).view(shape) - lo
    return (maps - lo) / torch.where(span > 0, span, torch.ones_like(span))


def _check_attentions(attentions: Sequence[Tensor]) -> None:
    if len(attentions) == 0:
        raise ValueError("attentions is empty; expected one (B, H, N, N) map per block")
    first = tuple(attentions[0].shape)
    for i, attn in enumerate(attentions):
        shape = tuple(attn.shape)
        if attn.ndim != 4 or shape[-1] != shape[-2]:
            raise ValueError(f"attentions[{i}] must be square (B, H, N, N), got shape {shape}")
        if shape != first:
            raise ValueError(f"attentions[{i}] has shape {shape} but attentions[0] has {first}")
