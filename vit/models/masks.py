"""Attention masks, combined into one additive bias `M`: 0 where a query may look, -inf where not.

Conventions (as `F.scaled_dot_product_attention`): a boolean mask is True where attention is allowed; a float mask
is added to the scores (0 / -inf, or any finite bias). Shapes broadcast to `(B, H, M, N)` (batch, heads, queries,
keys). An integer mask is refused: a 0/1 tensor read as a bias would add 0 or 1 to the scores and block nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None) -> torch.Tensor:
    """`(M, N)` bool, True where key `j <= i` for query `i` (top-left aligned, as SDPA's `is_causal`)."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril()


def local_mask(grid_size: tuple[int, int], radius: int, num_prefix: int = 0,
               device: torch.device | None = None) -> torch.Tensor:
    """`(N, N)` bool, `N = num_prefix + gh * gw`: patch tokens attend to the patches within `radius` grid
    steps (Chebyshev distance, so a `(2 radius + 1)^2` square, cut at the border); prefix tokens (CLS,
    registers) attend to every token and every token to them. Patches are row-major after the prefix."""
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
    """Raise `ValueError` unless `mask` is a bool mask, or a float bias whose values are finite or -inf.

    NaN or +inf in a bias make every weight of their query's row NaN. Reads the whole mask (a
    device sync on a GPU), so it is checked once where a mask is handed over, not at every forward.
    """
    _check_dtype(mask)
    if mask.dtype == torch.bool:
        return
    for name, bad in (("NaN", mask.isnan()), ("+inf", mask == float("inf"))):
        count = int(bad.sum())
        if count:
            raise ValueError(f"the mask holds {name} ({count} of {mask.numel()} values): an additive bias must be "
                             "finite (0 = may attend) or -inf (blocked)")


def _check_dtype(mask: torch.Tensor) -> None:
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(
            f"a mask of dtype {mask.dtype} is not allowed: pass a bool mask (True = may attend; `mask.bool()` "
            "for a 0/1 mask) or a float additive bias (0 = may attend, -inf = blocked)"
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
    """Combine the three mask forms into one additive bias broadcastable to `(B, H, M, N)`, or None.

    `mask` is bool or float; `key_mask` `(B, N)` bool, False for padding keys; `causal`: query `i` sees keys
    `0..i` only.
    """
    target = (batch, heads, num_queries, num_keys)
    bias = None
    if mask is not None:
        try:
            torch.broadcast_shapes(mask.shape, target)
        except RuntimeError:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, M, N) = {target}"
            ) from None
        bias = to_additive(mask, dtype)
    if key_mask is not None:
        if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, num_keys):
            raise ValueError(
                f"key_mask must be a bool tensor of shape (B, N) = {(batch, num_keys)}, "
                f"got {key_mask.dtype} {tuple(key_mask.shape)}"
            )
        kb = to_additive(key_mask[:, None, None, :], dtype)  # (B, 1, 1, N)
        bias = kb if bias is None else bias + kb
    if causal:
        cb = to_additive(causal_mask(num_queries, num_keys, device), dtype)  # (M, N)
        bias = cb if bias is None else bias + cb
    return bias


@contextlib.contextmanager
def mask_attention(model: nn.Module, mask: torch.Tensor) -> Iterator[None]:
    """While open, every block of a `VisionTransformer` applies `mask` (bool or additive, as above) as its `attn_mask`.

    For experiments on a trained model without changing it: e.g. forbid the tokens of one object to attend to those
    of another, in every layer, and see what the logits lose. `mask` must broadcast to each layer's `(B, H, N, N)`.
    """
    check_mask(mask)
    if getattr(model, "attn_mask", None) is not None:
        raise RuntimeError("the model already applies a mask (attn_mask); combine the two into one mask")
    model.attn_mask = mask
    try:
        yield
    finally:
        model.attn_mask = None
