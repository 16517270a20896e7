"""Attention rollout: which input patches a ViT's prediction draws on.

Everything here is a function of tensors, except the two entry points that run a model
(`gradient_rollout`, `patch_relevance`). They get the attention maps the one way the models give
them:

    with record_attention(model) as attentions:
        logits = model(x)

where `attentions` holds one softmax map `(B, H, N, N)` per block, still in the autograd graph.
With `model.pool == "map"` the list ends with one extra `(B, H, 1, N)` entry: the pooling query's
attention over the tokens. The model also exposes `pool` ("cls" | "mean" | "map"; a model without
the attribute is read as "cls", the classic ViT),
`patch_embed.grid_size` (gh, gw) and `num_prefix_tokens` (1 for a CLS token, else 0).

References:
    Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020 (attention rollout).
    Chefer, Gur & Wolf, "Generic Attention-model Explainability for Interpreting Bi-Modal and
    Encoder-Decoder Transformers", ICCV 2021 (gradient-weighted rollout).

The overlays that draw these maps are in `vit.explain.plot`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from vit.checks import check_choice
from vit.models.record import record_attention
from vit.models.vision_transformer import Pool

HeadFusion = Literal["mean", "max", "min"]
Method = Literal["rollout", "grad_rollout"]
Scale = Literal["minmax", "sum"]

HEAD_FUSIONS = get_args(HeadFusion)
METHODS = get_args(Method)


# ---------------------------------------------------------------------------------------------
# Pure functions of attention tensors
# ---------------------------------------------------------------------------------------------


def fuse_heads(attn: Tensor, head_fusion: HeadFusion = "mean") -> Tensor:
    """Collapse the head dimension of `(B, H, ...)` attention into `(B, ...)`."""
    check_choice("head_fusion", head_fusion, HeadFusion)
    # Half precision loses too much in a product of many near-identity matrices.
    attn = attn.to(torch.promote_types(attn.dtype, torch.float32))
    if head_fusion == "mean":
        return attn.mean(dim=1)
    if head_fusion == "max":
        return attn.amax(dim=1)
    return attn.amin(dim=1)


def discard_lowest(fused: Tensor, discard_ratio: float, keep_cls_self: bool = True) -> Tensor:
    """Zero the lowest `discard_ratio` fraction of each sample's entries of a `(B, N, N)` map.

    Exactly `int(discard_ratio * N * N)` entries per sample become zero. With `keep_cls_self`, the
    entry [0, 0] (the CLS token attending to itself) is never among them: without it, aggressive
    discarding can cut the CLS token off from its own path through the network.
    """
    _check_discard_ratio(discard_ratio)
    B, N, _ = fused.shape
    num_discard = int(discard_ratio * N * N)
    if num_discard == 0:
        return fused
    flat = fused.flatten(1)  # (B, N*N)
    ranking = flat.detach().clone()
    if keep_cls_self:
        ranking[:, 0] = float("inf")  # flat index 0 is [0, 0]
    # discard_ratio < 1 keeps num_discard <= N*N - 1, so the protected entry is never reached.
    lowest = ranking.topk(num_discard, dim=1, largest=False).indices  # (B, num_discard)
    return flat.scatter(1, lowest, 0.0).view(B, N, N)


def attention_rollout(
    attentions: Sequence[Tensor],
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    keep_cls_self: bool = True,
) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020) of per-block maps `(B, H, N, N)` -> `(B, N, N)`.

    Per block: fuse heads, optionally discard the weakest entries, account for the residual
    connection as `0.5 * A + 0.5 * I`, and re-normalise every row to sum to 1 (row i is the
    distribution token i reads from). Blocks are then chained with the first block rightmost,
    `R = Â_L ... Â_2 Â_1`, so row i of R says how much output token i draws on each input token.

    Args:
        attentions: one softmax map `(B, H, N, N)` per block, first block first.
        head_fusion: how heads are combined, "mean" | "max" | "min".
        discard_ratio: fraction in [0, 1) of each sample's fused entries set to zero per block.
        start_layer: index of the first block to include; earlier blocks are skipped.
        keep_cls_self: never discard entry [0, 0]. Leave True when token 0 is a CLS token; pass
            False for models without one (`num_prefix_tokens == 0`).
    """
    _check_attentions(attentions)
    _check_discard_ratio(discard_ratio)
    _check_start_layer(start_layer, len(attentions))
    fused = [
        discard_lowest(fuse_heads(attn, head_fusion), discard_ratio, keep_cls_self)  # (B, N, N)
        for attn in attentions[start_layer:]
    ]
    return _chain(fused)


def rollout_to_patch_map(
    rollout: Tensor,
    grid_size: tuple[int, int],
    pool: Pool = "cls",
    pool_attn: Tensor | None = None,
    scale: Scale = "minmax",
) -> Tensor:
    """Turn a rollout `(B, N, N)` into one relevance value per patch, `(B, gh, gw)`, in [0, 1].

    What the prediction reads depends on how the tokens are pooled:
        "cls":  the CLS row of the rollout over the patch tokens (column 0, the CLS token, dropped).
        "mean": the mean of all rows; the pooled vector is the average of the output tokens, so
                its relevance is the average of their rollout rows.
        "map":  the pooling query's head-fused attention `pool_attn` `(B, 1, N)` (or `(B, N)`)
                pushed through the rollout, `pool_attn @ R`. No residual is added: the query is
                a learned vector, not one of the tokens.

    `scale` sets how each sample's values are scaled:
        "minmax": to [0, 1] by min-max (a constant map becomes all zeros), for display: the map
                  shows where relevance is relative to the rest of that image.
        "sum":    divided by their sum over the patches, so the map is a distribution over the
                  patches and the sum over any set of patches is that set's share of the relevance
                  (for "cls" the CLS token's own column is left out before dividing). A sample
                  with no relevance on any patch stays all zeros.
    Patches are laid out row-major, as a conv patch embedding's `flatten(2)` orders them.
    """
    check_choice("pool", pool, Pool)
    check_choice("scale", scale, Scale)
    if rollout.ndim != 3 or rollout.shape[1] != rollout.shape[2]:
        raise ValueError(f"rollout must have shape (B, N, N), got {tuple(rollout.shape)}")
    if (pool == "map") != (pool_attn is not None):
        raise ValueError(f"pool_attn is required for pool='map' and only then; got pool={pool!r}")
    gh, gw = grid_size
    B, N, _ = rollout.shape
    num_prefix = 1 if pool == "cls" else 0
    if N != num_prefix + gh * gw:
        raise ValueError(
            f"rollout has N={N} tokens but pool={pool!r} with grid_size={tuple(grid_size)} "
            f"needs {num_prefix + gh * gw}"
        )

    if pool == "cls":
        relevance = rollout[:, 0, 1:]  # (B, gh*gw)
    elif pool == "mean":
        relevance = rollout.mean(dim=1)  # (B, N)
    else:
        if pool_attn.ndim == 3:
            pool_attn = pool_attn.squeeze(1)
        if pool_attn.shape != (B, N):
            raise ValueError(
                f"pool_attn must have shape (B, 1, N) = ({B}, 1, {N}) after fusing heads, "
                f"got {tuple(pool_attn.shape)}"
            )
        relevance = (pool_attn.unsqueeze(1).to(rollout.dtype) @ rollout).squeeze(1)  # (B, N)

    if scale == "sum":
        total = relevance.sum(dim=1, keepdim=True)
        relevance = relevance / torch.where(total > 0, total, torch.ones_like(total))
    else:
        lo = relevance.amin(dim=1, keepdim=True)
        span = relevance.amax(dim=1, keepdim=True) - lo
        relevance = (relevance - lo) / torch.where(span > 0, span, torch.ones_like(span))
    return relevance.reshape(B, gh, gw)


# ---------------------------------------------------------------------------------------------
# Entry points that run a model
# ---------------------------------------------------------------------------------------------


def gradient_rollout(
    model: nn.Module, x: Tensor, target: int | Tensor | None = None, start_layer: int = 0
) -> Tensor:
    """Gradient-weighted rollout (Chefer et al. 2021 style) for images `x` -> `(B, N, N)`.

    Per block the attention is weighted by the gradient of the target logit,
    `mean_heads((dy/dA * A).clamp(min=0))`, then chained exactly like `attention_rollout`
    (residual `0.5 * A + 0.5 * I`, row normalisation, first block rightmost). A block whose
    attention gets no gradient therefore contributes the identity.

    `target` is a class index or a `(B,)` tensor of them; by default the predicted class. The model
    runs in eval mode (dropout off) and every module's train/eval flag is restored afterwards.
    Gradients are taken with `torch.autograd.grad` w.r.t. the attention maps only, so parameter
    `.grad`s are left as they were. Works under `torch.no_grad()` / `torch.inference_mode()`, as in
    a Lightning validation loop. For `pool="map"` the pooling query's map is not part of the
    result; `patch_relevance` uses it.
    """
    layers, _ = _gradient_weighted_maps(model, x, target)
    _check_start_layer(start_layer, len(layers))
    return _chain(layers[start_layer:])


def patch_relevance(
    model: nn.Module,
    x: Tensor,
    method: Method = "rollout",
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    target: int | Tensor | None = None,
    start_layer: int = 0,
    scale: Scale = "minmax",
) -> Tensor:
    """Per-patch relevance `(B, gh, gw)` in [0, 1] for images `x`, whatever `model.pool` is.

    method="rollout" is class-agnostic and uses `head_fusion` and `discard_ratio`;
    method="grad_rollout" explains `target` (default: the predicted class) and always averages
    heads. Options that do not apply to the chosen method raise instead of being ignored.
    For `pool="map"` the pooling query's attention is pushed through the rollout: head-fused (never
    discarded) for "rollout", weighted by its gradient like the blocks for "grad_rollout".
    `scale` is "minmax" (for display) or "sum" (shares of the relevance), as in
    `rollout_to_patch_map`.
    """
    check_choice("method", method, Method)  # `scale` is checked by rollout_to_patch_map
    pool = _model_pool(model)
    grid_size = tuple(model.patch_embed.grid_size)

    if method == "grad_rollout":
        if head_fusion != "mean" or discard_ratio != 0.0:
            raise ValueError(
                "head_fusion and discard_ratio apply to method='rollout' only; got "
                f"head_fusion={head_fusion!r}, discard_ratio={discard_ratio}"
            )
        layers, pool_map = _gradient_weighted_maps(model, x, target)
        _check_start_layer(start_layer, len(layers))
        rollout = _chain(layers[start_layer:])  # (B, N, N)
        return rollout_to_patch_map(rollout, grid_size, pool, pool_map, scale=scale)

    if target is not None:
        raise ValueError(f"target applies to method='grad_rollout' only; got target={target!r}")
    with torch.no_grad(), _eval_mode(model), record_attention(model) as attentions:
        model(x)
    _check_recorded(model, attentions)
    pool_attn = None
    if pool == "map":
        *attentions, pool_query = attentions
        pool_attn = fuse_heads(pool_query, head_fusion)  # (B, 1, N)
    rollout = attention_rollout(
        attentions,
        head_fusion=head_fusion,
        discard_ratio=discard_ratio,
        start_layer=start_layer,
        keep_cls_self=model.num_prefix_tokens > 0,
    )  # (B, N, N)
    return rollout_to_patch_map(rollout, grid_size, pool, pool_attn, scale=scale)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _check_discard_ratio(discard_ratio: float) -> None:
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")


def _check_start_layer(start_layer: int, num_layers: int) -> None:
    if not 0 <= start_layer < num_layers:
        raise ValueError(
            f"start_layer must be in [0, {num_layers}) for {num_layers} layers, got {start_layer}"
        )


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


def _residual_and_normalise(fused: Tensor) -> Tensor:
    """`0.5 * A + 0.5 * I` with every row re-normalised to sum to 1, for `(B, N, N)` maps."""
    eye = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    with_residual = 0.5 * fused + 0.5 * eye  # (B, N, N); every row sums to at least 0.5
    return with_residual / with_residual.sum(dim=-1, keepdim=True)


def _chain(fused_layers: Sequence[Tensor]) -> Tensor:
    """`Â_L ... Â_1` for head-fused maps `(B, N, N)` given first block first."""
    B, N, _ = fused_layers[0].shape
    rollout = torch.eye(N, dtype=fused_layers[0].dtype, device=fused_layers[0].device)
    rollout = rollout.expand(B, N, N)
    for fused in fused_layers:
        rollout = _residual_and_normalise(fused) @ rollout  # later blocks act on the left
    return rollout


def _check_recorded(model: nn.Module, attentions: Sequence[Tensor]) -> None:
    if not attentions:
        raise ValueError(
            f"{type(model).__name__} recorded no attention maps: rollout needs a model with attention layers "
            "(a ViT); for a CNN use a gradient method such as Grad-CAM"
        )


def _model_pool(model: nn.Module) -> str:
    """`model.pool`, checked; a model without the attribute pools its CLS token (the classic ViT)."""
    pool = getattr(model, "pool", "cls")
    check_choice("model.pool", pool, Pool)
    return pool


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Run in eval mode, then give every submodule back its own train/eval flag."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _gradient_weighted_maps(
    model: nn.Module, x: Tensor, target: int | Tensor | None
) -> tuple[list[Tensor], Tensor | None]:
    """Per-block `mean_heads((dy/dA * A).clamp(min=0))` maps `(B, N, N)`, and for `pool="map"` the
    pooling query's map weighted the same way `(B, 1, N)` (else None)."""
    pool = _model_pool(model)
    # Lightning validation runs under inference_mode; autograd needs it off and an ordinary
    # (non-inference) copy of the input. The input requires grad so the graph exists even when
    # every parameter is frozen.
    with torch.inference_mode(False), torch.enable_grad(), _eval_mode(model):
        x = x.detach().clone().requires_grad_(True)
        with record_attention(model) as attentions:
            logits = model(x)  # (B, num_classes); attentions [(B, H, N, N), ...]
        _check_recorded(model, attentions)
        B = logits.shape[0]
        if target is None:
            target = logits.argmax(dim=-1)
        target = torch.as_tensor(target, device=logits.device).long().expand(B)  # (B,)
        # Samples are independent, so the gradient of the sum gives each sample its own gradient.
        score = logits.gather(1, target[:, None]).sum()
        _check_attentions(attentions[:-1] if pool == "map" else attentions)
        if not all(attn.requires_grad for attn in attentions):
            raise ValueError(
                "the model's attention maps are not in the autograd graph; "
                "its attention layers must record the softmax maps that multiply the values"
            )
        grads = torch.autograd.grad(score, attentions, allow_unused=True)

    weighted = []
    for attn, grad in zip(attentions, grads):
        attn = attn.detach()
        if grad is None:  # the attention does not reach the logit at all
            grad = torch.zeros_like(attn)
        relevance = (grad * attn).clamp(min=0)  # (B, H, N, N) or (B, H, 1, N)
        weighted.append(relevance.to(torch.promote_types(relevance.dtype, torch.float32)).mean(1))
    if pool == "map":
        *layers, pool_map = weighted
        if pool_map.shape[1] != 1:
            raise ValueError(
                f"pool='map' needs a last attention entry of shape (B, H, 1, N), "
                f"got {tuple(attentions[-1].shape)}"
            )
        return layers, pool_map
    return weighted, None
