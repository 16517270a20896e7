"""Relevance maps behind one interface: which parts of the image a prediction draws on.

    maps = relevance(model, images, method="chefer")   # (B, gh, gw), each map summing to 1
    pixels = to_pixels(maps, images.shape[-2:])         # (B, H, W), the same mass spread over pixels

Methods (`Method`), each a published rule:
- "attention": the last block's attention of the pooled token (the CLS row, the MAP query, or the
  mean over rows for mean pooling) over the patches, heads averaged.
- "rollout": Abnar & Zuidema 2020, attention rollout (`vit.explain.rollout`).
- "flow": Abnar & Zuidema 2020, attention flow: the maximum flow from each input patch to the
  pooled output through the layer graph whose capacities are the residual-mixed attention
  `0.5 A + 0.5 I`, heads averaged (scipy's max-flow on integer capacities).
- "chefer": Chefer, Gur & Wolf 2021, "Generic Attention-model Explainability": `R = I`, then for
  each block `R <- R + mean_h((dy/dA * A)^+) R`, read at the pooled token; class-specific.
- "gradcam": Selvaraju et al. 2017, Grad-CAM: `ReLU(sum_k alpha_k A^k)` with `alpha_k` the mean
  gradient of the target logit over the positions of feature map `k`; on the ViT's tokens before the
  last block's attention (`blocks[-1].norm1`, CLS dropped, as pytorch-grad-cam does for ViTs) and on
  the ResNet's last stage, so the CNN gets maps too. Tested against pytorch-grad-cam.
- "random": a seeded uniform map, the baseline every table needs.

Every map is returned normalised to sum 1 over its grid (all zeros stays zeros), so that shares of
relevance compare across methods. The class explained is `target` (default: the prediction).
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit.checks import check_choice
from vit.explain.rollout import _eval_mode, _gradient_weighted_maps, _model_pool, fuse_heads, patch_relevance
from vit.models.record import record_attention

Method = Literal["attention", "rollout", "flow", "chefer", "gradcam", "random"]
METHODS = get_args(Method)
ATTENTION_METHODS = ("attention", "rollout", "flow", "chefer")


def relevance(model: nn.Module, images: Tensor, method: Method = "rollout", target: Tensor | int | None = None,
              seed: int = 0) -> Tensor:
    """Relevance `(B, gh, gw)` of `images` for `model`'s prediction (or `target`), each map summing to 1."""
    check_choice("method", method, Method)
    if method in ATTENTION_METHODS and not hasattr(model, "patch_embed"):
        raise ValueError(f"method={method!r} needs a model with attention layers (a ViT); "
                         f"{type(model).__name__} has none: use 'gradcam' or 'random'")
    if method == "random":
        grid = _grid(model, images)
        generator = torch.Generator().manual_seed(seed)
        return normalise(torch.rand(images.shape[0], *grid, generator=generator))
    if method == "rollout":
        if target is not None:
            raise ValueError("method='rollout' is class-agnostic: it takes no target")
        return normalise(patch_relevance(model, images, method="rollout", scale="sum"))
    if method == "gradcam":
        return normalise(grad_cam(model, images, target))
    grid = tuple(model.patch_embed.grid_size)
    if method == "chefer":
        layers, pool_map = _gradient_weighted_maps(model, images, target)
        return normalise(_read_pooled(model, chefer_chain(layers), pool_map, grid))
    if target is not None:
        raise ValueError(f"method={method!r} is class-agnostic: it takes no target")
    with torch.no_grad(), _eval_mode(model), record_attention(model) as maps:
        model(images)
    pool = _model_pool(model)
    blocks, pool_query = (maps[:-1], maps[-1]) if pool == "map" else (maps, None)
    pool_map = fuse_heads(pool_query) if pool_query is not None else None  # (B, 1, N)
    if method == "attention":
        last = fuse_heads(blocks[-1])  # (B, N, N)
        return normalise(_read_pooled(model, last, pool_map, grid))
    return normalise(attention_flow(blocks, model.num_prefix_tokens, pool_map, grid))


def chefer_chain(layers: list[Tensor]) -> Tensor:
    """Chefer et al.'s rule for self-attention: `R = I`, then `R <- R + A_l R` per block, first block first.

    `layers` are the per-block `mean_h((dy/dA * A)^+)` maps `(B, N, N)`.
    """
    B, N, _ = layers[0].shape
    R = torch.eye(N, dtype=layers[0].dtype, device=layers[0].device).expand(B, N, N)
    for A in layers:
        R = R + A @ R
    return R


def attention_flow(blocks: list[Tensor], num_prefix: int, pool_map: Tensor | None, grid: tuple[int, int]) -> Tensor:
    """Attention flow `(B, gh, gw)`: for each input patch, the max flow from it to the pooled output.

    Nodes: every token at every layer (layer 0 the input). An edge from token j at layer l to token i
    at layer l + 1 has the capacity `0.5 A_l[i, j] + 0.5 [i == j]` (rows re-normalised), as for
    rollout. The sink is the CLS token at the top; for mean pooling every top token, for MAP pooling
    the query, each joined to a super-sink with the weight the pooling gives it.
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    fused = [_residual(fuse_heads(a)) for a in blocks]  # (B, N, N) each
    B, N, _ = fused[0].shape
    L = len(fused)
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
        sink = (L + 1) * N  # a super-sink fed by the top tokens the pooling reads
        if pool_map is None and num_prefix > 0:
            readout = np.zeros(N)
            readout[0] = 1.0
        elif pool_map is None:
            readout = np.full(N, 1.0 / N)
        else:
            readout = pool_map[b].reshape(-1).double().cpu().numpy()
        top = np.nonzero(readout > 0)[0]
        rows.append(L * N + top)
        cols.append(np.full(len(top), sink))
        caps.append(np.round(readout[top] * scale).astype(np.int64))
        graph = csr_matrix((np.concatenate(caps), (np.concatenate(rows), np.concatenate(cols))),
                           shape=(sink + 1, sink + 1))
        for p in range(grid[0] * grid[1]):
            out[b, p] = maximum_flow(graph, num_prefix + p, sink).flow_value / scale
    return out.reshape(B, *grid).float()


def grad_cam(model: nn.Module, images: Tensor, target: Tensor | int | None = None) -> Tensor:
    """Grad-CAM `(B, gh, gw)` at the target layer's resolution: `ReLU(sum_k mean_ij(dy/dA^k) A^k)`."""
    layer, to_map = gradcam_layer(model)
    store = {}

    def keep(module, inputs, output) -> None:
        store["activation"] = output

    handle = layer.register_forward_hook(keep)
    try:
        # As in a validation loop: inference mode off, gradients on; only d(logit)/d(activation) is
        # taken, so the parameters' .grad (and so training) are left alone.
        with torch.inference_mode(False), torch.enable_grad(), _eval_mode(model):
            x = images.detach().clone().requires_grad_(True)
            logits = model(x)
            chosen = logits.argmax(-1) if target is None else torch.as_tensor(target, device=logits.device).expand(len(x))
            [gradient] = torch.autograd.grad(logits.gather(1, chosen[:, None].long()).sum(), store["activation"])
    finally:
        handle.remove()
    activation, gradient = to_map(store["activation"].detach()), to_map(gradient)  # (B, K, gh, gw)
    weights = gradient.mean(dim=(2, 3), keepdim=True)  # alpha_k: (B, K, 1, 1)
    return F.relu((weights * activation).sum(1))  # (B, gh, gw)


def gradcam_layer(model: nn.Module):
    """The layer Grad-CAM reads, and the function turning its output into `(B, K, gh, gw)` maps."""
    if hasattr(model, "blocks") and hasattr(model, "patch_embed"):
        gh, gw = model.patch_embed.grid_size
        prefix = model.num_prefix_tokens

        def tokens_to_map(t: Tensor) -> Tensor:  # (B, N, D) -> (B, D, gh, gw), prefix tokens dropped
            return t[:, prefix:].transpose(1, 2).reshape(t.shape[0], -1, gh, gw)

        return model.blocks[-1].norm1, tokens_to_map
    stages = getattr(model, "stages", None) or getattr(getattr(model, "resnet", None), "stages", None)
    if stages is None:
        raise ValueError(f"{type(model).__name__}: no Grad-CAM layer known (a ViT's blocks or a ResNet's stages)")
    return stages[-1], lambda t: t


def to_pixels(maps: Tensor, size: tuple[int, int]) -> Tensor:
    """`(B, gh, gw)` -> `(B, H, W)`: each cell's relevance spread evenly over its pixels (sums are kept)."""
    H, W = size
    gh, gw = maps.shape[-2:]
    pixels = F.interpolate(maps[:, None].float(), size=(H, W), mode="nearest")[:, 0]
    return pixels * (gh * gw) / (H * W)


def normalise(maps: Tensor) -> Tensor:
    """Clamp at 0 and divide each map by its sum (an all-zero map stays all zeros)."""
    maps = maps.detach().float().clamp(min=0)
    total = maps.flatten(1).sum(1).view(-1, *([1] * (maps.ndim - 1)))
    return maps / torch.where(total > 0, total, torch.ones_like(total))


def _residual(fused: Tensor) -> Tensor:
    eye = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
    mixed = 0.5 * fused + 0.5 * eye
    return mixed / mixed.sum(-1, keepdim=True)


def _read_pooled(model: nn.Module, R: Tensor, pool_map: Tensor | None, grid: tuple[int, int]) -> Tensor:
    """Row(s) of an `(B, N, N)` token-to-token map that the pooling reads, over the patches: `(B, gh, gw)`."""
    pool = _model_pool(model)
    if pool == "cls":
        rel = R[:, 0, 1:]
    elif pool == "mean":
        rel = R.mean(1)
    else:
        rel = (pool_map.reshape(R.shape[0], 1, -1).to(R.dtype) @ R)[:, 0]
    return rel.reshape(R.shape[0], *grid)


def _grid(model: nn.Module, images: Tensor) -> tuple[int, int]:
    if hasattr(model, "patch_embed"):
        return tuple(model.patch_embed.grid_size)
    layer, to_map = gradcam_layer(model)
    shape = {}

    def note(module, inputs, output) -> None:  # a hook that returns something replaces the output
        shape["s"] = to_map(output).shape[-2:]

    handle = layer.register_forward_hook(note)
    try:
        with torch.no_grad():
            model(images[:1])
    finally:
        handle.remove()
    return tuple(shape["s"])
