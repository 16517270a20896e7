"""Attention masks, combined into one additive bias `M`: 0 where a query may look, -inf where not.
As `F.scaled_dot_product_attention`: a boolean mask is True where attention is allowed; a float mask is added to the
scores. Shapes broadcast to `(B, H, M, N)`. An integer mask is refused: read as a bias, 0/1 would block nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from vit.models.contract import Backbone


def causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None) -> torch.Tensor:
    """`(M, N)` bool, True where key `j <= i` for query `i` (top-left aligned, as SDPA's `is_causal`)."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril()


def local_mask(
    grid_size: tuple[int, int], radius: int, num_prefix: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """`(N, N)` bool, `N = num_prefix + gh * gw`: patches see patches within `radius` (Chebyshev); prefix tokens see
    and are seen by every token."""
    gh, gw = grid_size
    rows = torch.arange(gh, device=device).repeat_interleave(gw)  # (gh * gw,)
    cols = torch.arange(gw, device=device).repeat(gh)
    near = ((rows[:, None] - rows[None]).abs() <= radius) & ((cols[:, None] - cols[None]).abs() <= radius)
    n = num_prefix + gh * gw
    mask = torch.ones(n, n, dtype=torch.bool, device=device)
    mask[num_prefix:, num_prefix:] = near
    return mask


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean mask becomes 0 / -inf; a float mask is returned as it is (in `dtype`); any other dtype is refused."""
    _check_dtype(mask)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def check_mask(mask: torch.Tensor) -> None:
    """Raise `ValueError` unless `mask` is a bool mask, or a float bias whose values are finite or -inf (reads the
    whole mask: a device sync on a GPU, so done once where a mask is handed over)."""
    _check_dtype(mask)
    if mask.dtype == torch.bool:
        return
    for name, bad in (("NaN", mask.isnan()), ("+inf", mask == float("inf"))):
        count = int(bad.sum())
        if count:
            raise ValueError(
                f"the mask holds {name} ({count} of {mask.numel()} values): an additive bias must be "
                "finite (0 = may attend) or -inf (blocked)"
            )


def _check_dtype(mask: torch.Tensor) -> None:
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(
            f"a mask of dtype {mask.dtype} is not allowed: pass a bool mask (True = may attend; "
            "`mask.bool()` for a 0/1 mask) or a float additive bias (0 = may attend, -inf = blocked)"
        )


def attention_bias(
    *,
    batch: int,
    heads: int,
    num_queries: int,
    num_keys: int,
    mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    causal: bool = False,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor | None:
    """Combine the three mask forms into one additive bias broadcastable to `(B, H, M, N)`, or None. `mask` is bool or
    float; `key_mask` `(B, N)` bool, False for padding keys; `causal`: query `i` sees keys `0..i`."""
    target, parts = (batch, heads, num_queries, num_keys), []
    if mask is not None:
        try:
            torch.broadcast_shapes(mask.shape, target)
        except RuntimeError:
            shape = tuple(mask.shape)
            raise ValueError(f"mask of shape {shape} does not broadcast to (B, H, M, N) = {target}") from None
        parts.append(to_additive(mask, dtype))
    if key_mask is not None:
        if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, num_keys):
            raise ValueError(
                f"key_mask must be a bool tensor of shape (B, N) = {(batch, num_keys)}, "
                f"got {key_mask.dtype} {tuple(key_mask.shape)}"
            )
        parts.append(to_additive(key_mask[:, None, None, :], dtype))  # (B, 1, 1, N)
    if causal:
        parts.append(to_additive(causal_mask(num_queries, num_keys, device), dtype))  # (M, N)
    return sum(parts[1:], parts[0]) if parts else None


@contextlib.contextmanager
def mask_attention(model: nn.Module, mask: torch.Tensor) -> Iterator[None]:
    """While open, every block of a `VisionTransformer` applies `mask` (bool or additive) as its `attn_mask`."""
    check_mask(mask)
    if not (isinstance(model, Backbone) and model.has_attention):
        raise TypeError(f"mask_attention needs a ViT (a backbone with attention layers); {type(model).__name__} is not")
    if model.attn_mask is not None:
        raise RuntimeError("the model already applies a mask (attn_mask); combine the two into one mask")
    model.attn_mask = mask
    try:
        yield
    finally:
        model.attn_mask = None
