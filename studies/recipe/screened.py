"""The screen's ViT: the library's `VisionTransformer`, plus the two options the screen tried and dropped.

The recipe screen (``studies/recipe/results/screen/summary.md``) tried a convolutional stem (``stem: conv``) and a
mimetic initialisation of the queries and keys (``qk_init: mimetic``); neither helped (0/1 each),
so neither is an option of the library's model. They live here, where the screen that tried them
can still build them, weight for weight: with the same seed, ``build`` makes the same initial
weights (and leaves the random generator in the same state) as ``VisionTransformer(stem="conv")``
and ``VisionTransformer(qk_init="mimetic")`` did when the library had them, which
``tests/test_study_recipe.py`` checks against values recorded then.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal

import torch
from torch import nn

from vit.checks import check_choice
from vit.models import VisionTransformer

Stem = Literal["patch", "conv"]
QKInit = Literal["normal", "mimetic"]
MIMETIC_ALPHA, MIMETIC_BETA = 0.7, 0.7  # W_q^T W_k = alpha Z + beta I at init (qk_init="mimetic")
_VIT_DEFAULTS = {name: p.default for name, p in inspect.signature(VisionTransformer).parameters.items()}


class ConvStem(nn.Sequential):
    """The convolutional stem of Xiao et al. 2021 ("Early convolutions help transformers see better"):
    `(B, C, H, W) -> (B, D, H/P, W/P)`.

    3x3 convolutions of stride 2 with BatchNorm and ReLU until the total stride is the patch size
    `P` (a power of 2), then a 1x1 convolution to the width `D`. It takes the place of the patch
    embedding's single strided convolution (``patch_embed.proj``).
    """

    def __init__(self, *, patch_size: int, in_chans: int, embed_dim: int) -> None:
        if patch_size < 2 or patch_size & (patch_size - 1):
            raise ValueError(
                f"stem='conv' needs patch_size a power of 2 >= 2 (stride-2 convolutions), got {patch_size}"
            )
        layers, width = [], in_chans
        for i in range(patch_size.bit_length() - 1):  # log2(P) stride-2 convolutions
            out = max(embed_dim // 2 ** (patch_size.bit_length() - 2 - i), 8)
            layers += [
                nn.Conv2d(width, out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
            ]
            width = out
        super().__init__(*layers, nn.Conv2d(width, embed_dim, kernel_size=1))  # (B, D, H/P, W/P)

    @property
    def weight(self) -> torch.Tensor:
        """The weights that read the pixels: the patch embedding checks an input's dtype against ``proj.weight``."""
        return self[0].weight


def mimetic_init(model: VisionTransformer, alpha: float = MIMETIC_ALPHA, beta: float = MIMETIC_BETA) -> None:
    """Set every block's query and key projections so that `W_q^T W_k = alpha Z + beta I`.

    After Trockman & Kolter 2023 ("Mimetic initialization of self-attention layers"): Z is Gaussian
    with std 1/sqrt(D), so each token's query matches the keys of tokens like itself, and from the
    first step tokens read similar tokens (ink reads ink) rather than the average of all. The
    product is split by its SVD, `U S V^T`: `W_q = sqrt(S) U^T`, `W_k = sqrt(S) V^T`.
    """
    width = model.embed_dim
    for block in model.blocks:
        z = torch.randn(width, width) / math.sqrt(width)
        u, s, vh = torch.linalg.svd(alpha * z + beta * torch.eye(width))
        qkv = block.attn.qkv.weight.data  # (3 * D, D): rows of W_q, then W_k, then W_v
        qkv[:width] = (u * s.sqrt()).T  # W_q = sqrt(S) U^T
        qkv[width : 2 * width] = s.sqrt()[:, None] * vh  # W_k = sqrt(S) V^T, so W_q^T W_k = U S V^T


def build(*, stem: Stem = "patch", qk_init: QKInit = "normal", **vit_args) -> VisionTransformer:
    """A ``VisionTransformer(**vit_args)`` with the screen's ``stem`` and ``qk_init``.

    The random draws come in the order the library's model made them when it had the two options:
    the stem first (it was built inside the patch embedding, the model's first module), then the
    rest of the model, then its ``init_weights``, then the mimetic draws. The model is built with
    its own patch embedding, whose draws are not the stem's, so for ``stem="conv"`` the generator
    is set back to where the stem left it and the draws after it are made again: the default
    initialisation of every ``nn.Linear`` (the only modules after the patch embedding that draw at
    construction, for the models allowed here), then ``init_weights``.
    """
    check_choice("stem", stem, Stem)
    check_choice("qk_init", qk_init, QKInit)
    arg = lambda name: vit_args.get(name, _VIT_DEFAULTS[name])  # noqa: E731
    if (stem, qk_init) != ("patch", "normal") and vit_args.get("pretrained"):
        raise ValueError(f"stem={stem!r} and qk_init={qk_init!r} set initial weights: they do not go with pretrained")
    if qk_init == "mimetic" and arg("qk_init_std") != 0.02:
        raise ValueError(
            f"qk_init='mimetic' sets the query and key rows itself: qk_init_std={arg('qk_init_std')!r} "
            "is not allowed with it (leave it at 0.02)"
        )
    if stem == "conv":
        if arg("patch_kernel") is not None:
            raise ValueError(
                f"patch_kernel={arg('patch_kernel')} applies to stem='patch' only; stem='conv' has its own 3x3 kernels"
            )
        if arg("pool") == "map" or arg("attn_score") in ("additive", "concat"):
            raise ValueError(
                f"stem='conv' is screened with the default head and score: pool={arg('pool')!r}, "
                f"attn_score={arg('attn_score')!r} draw weights at construction that it does not replay"
            )
        conv = ConvStem(patch_size=arg("patch_size"), in_chans=arg("in_chans"), embed_dim=arg("embed_dim"))
        after_stem = torch.get_rng_state()
    model = VisionTransformer(**vit_args)
    if stem == "conv":
        model.patch_embed.proj = conv
        torch.set_rng_state(after_stem)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()  # the draws of its construction, in the order it was built
        model.init_weights()
    if qk_init == "mimetic":
        mimetic_init(model)
    return model
