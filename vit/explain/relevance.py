"""Relevance maps, every method behind one call: which parts of the image a prediction draws on.

    maps = relevance(model, images, method="chefer")   # (B, gh, gw), each map summing to 1
    pixels = to_pixels(maps, images.shape[-2:])         # (B, H, W), the same mass spread over pixels

Methods (`Method`; docs/explain.md has their formulas and papers): "attention" (the last block's), "rollout",
"flow", "grad_rollout", "chefer", "gradcam" (at the layer the backbone names, `Backbone.gradcam_target`: the ViT's
tokens at `blocks[-1].norm1` without the prefix tokens, as pytorch-grad-cam, or a CNN's last feature map) and "random"
(a seeded baseline on that layer's grid). Each method's facts are one row of `vit.explain.methods.FACTS`; the model
is a `vit.models.contract.Backbone`. It runs in eval mode, each module's train/eval flag restored after, parameters'
`.grad` untouched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit.checks import check_choice, check_float, check_int
from vit.explain.methods import ATTENTION_METHODS, CLASS_METHODS, FACTS, METHODS, Method  # noqa: F401  (importable here)
from vit.explain.rollout import (
    HeadFusion,
    attention_rollout,
    chefer_rollout,
    fuse_heads,
    gradient_rollout,
    gradient_weighted,
    normalise,
    readout_weights,
    residual,
    rollout_to_patch_map,
)
from vit.models.contract import Backbone
from vit.models.record import record_attention
from vit.models.vision_transformer import Pool


def relevance(
    model: nn.Module,
    images: Tensor,
    method: Method = "rollout",
    target: Tensor | int | None = None,
    *,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    seed: int = 0,
) -> Tensor:
    """Relevance `(B, gh, gw)` of `images` for `model`'s prediction (or `target`), each map summing to 1, or all zeros
    where the method finds no positive evidence (Chefer's rule and Grad-CAM clamp at 0).
    `head_fusion` and `discard_ratio` apply to "rollout", `start_layer` to "rollout" and "grad_rollout", `target` to
    `CLASS_METHODS`, `seed` to "random"; given to another method (but `seed`), they are refused."""
    _check_method(
        model, method, target=target, head_fusion=head_fusion, discard_ratio=discard_ratio, start_layer=start_layer
    )
    if method == "random":  # on the grid Grad-CAM's layer has: a ViT's patches, a CNN's last feature map
        grid = map_grid(model, images[:1])
        return normalise(torch.rand(images.shape[0], *grid, generator=torch.Generator().manual_seed(seed)))
    if method == "gradcam":
        return normalise(grad_cam(model, images, target))
    # An attention method: `usable_methods` let only a backbone with attention through, which has a ViT's tokens.
    pool, grid, regs = model.pool, tuple(model.patch_embed.grid_size), model.num_reg_tokens
    check_choice("model.pool", pool, Pool)
    if method in CLASS_METHODS:  # grad_rollout, chefer
        maps, grads = attention_gradients(model, images, target)
        (blocks, pool_query), (block_grads, pool_grad) = _split_pool(maps, pool), _split_pool(grads, pool)
        pool_attn = None if pool_query is None else gradient_weighted(pool_query, pool_grad)  # (B, 1, P)
        tokens = (
            gradient_rollout(blocks, block_grads, start_layer)
            if method == "grad_rollout"
            else chefer_rollout(blocks, block_grads)
        )  # (B, N, N)
    else:
        with torch.no_grad(), _eval_mode(model), record_attention(model) as maps:
            model(images)
        _check_recorded(model, maps)
        blocks, pool_query = _split_pool(maps, pool)
        pool_attn = None if pool_query is None else fuse_heads(pool_query, head_fusion)  # (B, 1, P)
        if method == "flow":
            return normalise(attention_flow(blocks, pool, pool_attn, grid, regs))
        tokens = (
            fuse_heads(blocks[-1])
            if method == "attention"  # (B, N, N)
            else attention_rollout(blocks, head_fusion, discard_ratio, start_layer, keep_cls_self=pool == "cls")
        )
    return rollout_to_patch_map(tokens, grid, pool, pool_attn, scale="sum", reg_tokens=regs)


def usable_methods(
    model: nn.Module, requested: Sequence[str], *, skip: bool = False, option: str = "method="
) -> list[str]:
    """The methods of `requested` (`["all"]`: all) that `model` can run, in order: an attention method on a model
    without attention layers (the CNN) is left out with `skip`, else a `ValueError` naming it after `option`."""
    if not isinstance(model, Backbone):
        raise TypeError(
            f"{type(model).__name__} is not a vit.models.contract.Backbone: the relevance methods read what a "
            "backbone declares (its Grad-CAM layer, whether it has attention layers)"
        )
    if list(requested) == ["all"]:
        requested, skip = METHODS, True
    usable = [m for m in requested if m not in FACTS or not FACTS[m].attention or model.has_attention]
    unusable = [m for m in requested if m not in usable]
    if unusable and not skip:
        raise ValueError(
            f"{option}{','.join(unusable)!r} needs a model with attention layers (a ViT); "
            f"{type(model).__name__} has none: use 'gradcam' or 'random'"
        )
    return usable


def attention_gradients(
    model: nn.Module, images: Tensor, target: Tensor | int | None = None
) -> tuple[list[Tensor], list[Tensor]]:
    """The attention maps of one forward pass (`(B, H, N, N)` per block, then for `pool="map"` the query's
    `(B, H, 1, P)`) and the gradient of the `target` logit (default: the prediction) w.r.t. each (zero if unused),
    detached; parameters' `.grad` untouched, also under `torch.no_grad()` and with frozen parameters."""
    # A non-inference copy of the input that requires grad: a graph exists even with every parameter frozen.
    with torch.inference_mode(False), torch.enable_grad(), _eval_mode(model):
        x = images.detach().clone().requires_grad_(True)
        with record_attention(model) as maps:
            logits = model(x)  # (B, num_classes); maps [(B, H, N, N), ...]
        _check_recorded(model, maps)
        if not all(attn.requires_grad for attn in maps):
            raise ValueError(
                "the model's attention maps are not in the autograd graph; "
                "its attention layers must record the softmax maps that multiply the values"
            )
        grads = torch.autograd.grad(_target_score(logits, target), maps, allow_unused=True)
    grads = [torch.zeros_like(a) if g is None else g for a, g in zip(maps, grads)]
    return [a.detach() for a in maps], grads


def attention_flow(
    blocks: list[Tensor], pool: Pool, pool_attn: Tensor | None, grid: tuple[int, int], reg_tokens: int = 0
) -> Tensor:
    """Attention flow `(B, gh, gw)` of per-block maps `(B, H, N, N)`: for each input patch, the max flow from it to
    the pooled output through every token of every layer, with capacities `residual(A)` as for rollout, into a
    super-sink fed by the top tokens with the weight the pooling gives them (`readout_weights`)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    fused = [residual(fuse_heads(a)) for a in blocks]  # (B, N, N) each
    B, N, _ = fused[0].shape
    L, num_prefix = len(fused), (1 if pool == "cls" else 0) + reg_tokens
    readout = readout_weights(pool, N, pool_attn, reg_tokens).expand(B, N).double().cpu().numpy()
    scale = 10**6  # scipy's max-flow takes integer capacities
    out = torch.zeros(B, grid[0] * grid[1], dtype=torch.float64)
    for b in range(B):
        rows, cols, caps = [], [], []
        for layer, a in enumerate(fused):
            a = a[b].double().cpu().numpy()  # a[i, j]: token i at layer + 1 reads token j at layer
            i, j = np.nonzero(a > 0)
            rows.append(layer * N + j)
            cols.append((layer + 1) * N + i)
            caps.append(np.round(a[i, j] * scale).astype(np.int64))
        sink, top = (L + 1) * N, np.nonzero(readout[b] > 0)[0]  # a super-sink fed by the top tokens the pooling reads
        rows.append(L * N + top)
        cols.append(np.full(len(top), sink))
        caps.append(np.round(readout[b, top] * scale).astype(np.int64))
        graph = csr_matrix(
            (np.concatenate(caps), (np.concatenate(rows), np.concatenate(cols))), shape=(sink + 1, sink + 1)
        )
        for p in range(grid[0] * grid[1]):
            out[b, p] = maximum_flow(graph, num_prefix + p, sink).flow_value / scale
    return out.reshape(B, *grid).float()


def map_grid(model: Backbone, images: Tensor) -> tuple[int, int]:
    """`(gh, gw)` of the maps `model`'s Grad-CAM layer gives for `images` (one forward pass, no gradient)."""
    (layer, to_map), store = model.gradcam_target(), {}
    handle = layer.register_forward_hook(lambda module, inputs, output: store.setdefault("output", output))
    try:
        with torch.no_grad(), _eval_mode(model):
            model(images)
    finally:
        handle.remove()
    return tuple(to_map(store["output"]).shape[-2:])


def grad_cam(model: Backbone, images: Tensor, target: Tensor | int | None = None) -> Tensor:
    """Grad-CAM `(B, gh, gw)` at the target layer's resolution: `ReLU(sum_k mean_ij(dy/dA^k) A^k)`."""
    (layer, to_map), store = model.gradcam_target(), {}

    def keep(module, inputs, output) -> None:  # the forward pass's; a checkpointed layer runs again in backward
        store.setdefault("activation", output)

    handle = layer.register_forward_hook(keep)
    try:
        # As in `attention_gradients`: only d(logit)/d(activation) is taken, parameters' .grad are untouched.
        with torch.inference_mode(False), torch.enable_grad(), _eval_mode(model):
            logits = model(images.detach().clone().requires_grad_(True))
            [gradient] = torch.autograd.grad(_target_score(logits, target), store["activation"])
    finally:
        handle.remove()
    activation, gradient = to_map(store["activation"].detach()), to_map(gradient)  # (B, K, gh, gw)
    weights = gradient.mean(dim=(2, 3), keepdim=True)  # alpha_k: (B, K, 1, 1)
    return F.relu((weights * activation).sum(1))  # (B, gh, gw)


def to_pixels(maps: Tensor, size: tuple[int, int]) -> Tensor:
    """`(B, gh, gw)` -> `(B, H, W)`: each cell's relevance spread evenly over its pixels (sums are kept)."""
    (H, W), (gh, gw) = size, maps.shape[-2:]
    pixels = F.interpolate(maps[:, None].float(), size=(H, W), mode="nearest")[:, 0]
    return pixels * (gh * gw) / (H * W)


def _check_method(
    model: nn.Module,
    method: str,
    *,
    target: Tensor | int | None,
    head_fusion: str,
    discard_ratio: float,
    start_layer: int,
) -> None:
    """Raise `ValueError` unless `relevance` can run `method` with these options on `model`; nothing runs."""
    check_choice("method", method, Method)
    check_choice("head_fusion", head_fusion, HeadFusion)
    check_float("discard_ratio", discard_ratio, 0.0, 1.0, high_open=True)
    check_int("start_layer", start_layer, 0)
    if method != "rollout" and (head_fusion != "mean" or discard_ratio != 0.0):
        raise ValueError(
            "head_fusion and discard_ratio apply to method='rollout' only; got "
            f"method={method!r}, head_fusion={head_fusion!r}, discard_ratio={discard_ratio}"
        )
    if method not in ("rollout", "grad_rollout") and start_layer != 0:
        raise ValueError(
            f"start_layer applies to method='rollout' and 'grad_rollout' only; got method={method!r}, "
            f"start_layer={start_layer}"
        )
    if method not in CLASS_METHODS and target is not None:
        raise ValueError(
            f"target={target!r} applies to the class-specific methods {list(CLASS_METHODS)} only; "
            f"method={method!r} is class-agnostic"
        )
    usable_methods(model, [method])


def _target_score(logits: Tensor, target: Tensor | int | None) -> Tensor:
    """The batch's sum of each sample's target logit (default: its prediction): its gradient is each sample's own."""
    target = logits.argmax(dim=-1) if target is None else target
    target = torch.as_tensor(target, device=logits.device).long().expand(logits.shape[0])  # (B,)
    return logits.gather(1, target[:, None]).sum()


def _split_pool(maps: list[Tensor], pool: str) -> tuple[list[Tensor], Tensor | None]:
    """`(block maps, the pooling query's map)`: for `pool="map"` the last recorded map is the query's."""
    if pool != "map":
        return maps, None
    *blocks, query = maps
    if query.shape[-2] != 1:
        raise ValueError(f"pool='map' needs a last attention entry of shape (B, H, 1, N), got {tuple(query.shape)}")
    return blocks, query


def _check_recorded(model: nn.Module, attentions: list[Tensor]) -> None:
    if not attentions:
        raise ValueError(
            f"{type(model).__name__} recorded no attention maps: rollout needs a model with attention "
            "layers (a ViT); for a CNN use a gradient method such as Grad-CAM"
        )


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
