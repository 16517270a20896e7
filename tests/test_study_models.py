"""The studies' ViT options (`studies.runner.models.StudyViT`): local attention, the size of a fixed position table."""

import re
import typing

import pytest
import torch

from studies.runner.models import StudyViT
from vit.models import VisionTransformer, record_attention
from vit.models.pos_embed import sincos_1d, sincos_2d
from vit.registry import BACKBONES, meta_backbone
from vit.registry import signature as _signature

CIFAR_CFG = dict(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=48, depth=2, num_heads=3)


def test_a_local_vit_attends_within_its_radius_and_a_wide_radius_is_the_global_model():
    torch.manual_seed(0)
    kwargs = dict(img_size=16, in_chans=1, num_classes=2, embed_dim=16, depth=2, num_heads=2, pool="mean")
    local = StudyViT(attn_radius=1, **kwargs).eval()
    x = torch.randn(2, 1, 16, 16)
    with record_attention(local) as maps:
        local(x)
    grid = torch.arange(16)
    far = ((grid[:, None] // 4 - grid[None] // 4).abs() > 1) | ((grid[:, None] % 4 - grid[None] % 4).abs() > 1)
    for weights in maps:  # (B, H, N, N): zero beyond one grid step, rows still sum to one
        assert weights[..., far].abs().max() == 0
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    wide = StudyViT(attn_radius=4, **kwargs).eval()
    plain = VisionTransformer(**kwargs).eval()
    plain.load_state_dict(wide.state_dict())  # the mask is a buffer, not in the state dict: the same weights
    torch.testing.assert_close(wide(x), plain(x))
    plain.load_state_dict(local.state_dict())  # the same weights, attending globally: another output
    assert not torch.allclose(local(x), plain(x))
    with pytest.raises(ValueError, match="attn_radius=-1"):
        StudyViT(attn_radius=-1, **kwargs)


@pytest.mark.parametrize("kind", ["sincos1d", "sincos2d"])
def test_pos_scale_multiplies_the_fixed_table(kind):
    model = StudyViT(**CIFAR_CFG, pos_embed=kind, pos_scale=0.03)
    assert "pos_embed" not in model.state_dict()
    if kind == "sincos2d":
        torch.testing.assert_close(model.pos_embed[0, 1:], 0.03 * sincos_2d(8, 8, 48))
    else:
        torch.testing.assert_close(model.pos_embed[0], 0.03 * sincos_1d(torch.arange(65), 48))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(pos_embed="learned", pos_scale=0.5),
            "pos_scale=0.5 is not allowed with pos_embed='learned': it scales the fixed tables only",
        ),
        (dict(pos_embed="sincos2d", pos_scale=0.0), "pos_scale=0.0 is not allowed"),
    ],
)
def test_pos_scale_is_for_the_fixed_tables_and_positive(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StudyViT(**CIFAR_CFG, **kwargs)


@pytest.mark.parametrize("std", [0.1, 0.7])
def test_pos_init_std_sizes_the_learned_table_and_nothing_else(std):
    torch.manual_seed(0)
    model = StudyViT(**CIFAR_CFG, pos_embed="learned", pos_init_std=std)
    table = model.pos_embed.detach()
    assert table.numel() == 65 * 48
    assert abs(table.std().item() - std) < 0.05 * std  # 3,120 normal draws: the sample std within 5%
    assert table.abs().max() > 2 * std  # not truncated at 2 std, as the library's initialisation is
    torch.manual_seed(0)
    library = VisionTransformer(**CIFAR_CFG, pos_embed="learned")
    assert library.pos_embed.std().item() < 0.021
    for (name, a), (_, b) in zip(model.named_parameters(), library.named_parameters(), strict=True):
        if name != "pos_embed":
            torch.testing.assert_close(a, b, msg=name)  # the same seed draws every other weight alike


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(pos_embed="sincos2d", pos_init_std=0.7),
            "pos_init_std=0.7 is not allowed with pos_embed='sincos2d': it sizes the learned table only",
        ),
        (dict(pos_embed="learned", pos_init_std=0.0), "pos_init_std=0.0 is not allowed"),
    ],
)
def test_pos_init_std_is_for_the_learned_table_and_positive(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StudyViT(**CIFAR_CFG, **kwargs)


def test_the_checkpoint_schema_knows_the_study_model_and_all_its_arguments_once_it_is_imported():
    assert BACKBONES["studies.runner.models.StudyViT"] is StudyViT
    parameters, hints = _signature(StudyViT)  # its own and, through **kwargs, VisionTransformer's
    assert {"attn_radius", "pos_scale", "embed_dim", "pool", "patch_kernel"} <= set(parameters)
    assert hints["attn_radius"] == int | None
    assert hints["pool"] == typing.get_type_hints(VisionTransformer.__init__)["pool"]
    meta = meta_backbone(StudyViT, {**CIFAR_CFG, "attn_radius": 1})
    assert meta.state_dict().keys() == VisionTransformer(**CIFAR_CFG).state_dict().keys()  # the mask is no weight


def test_a_learned_table_started_at_the_sincos_values_is_the_fixed_table_then_trains():
    args = dict(img_size=32, in_chans=1, num_classes=2, patch_size=4, embed_dim=32, depth=2, num_heads=2)
    for pool in ("mean", "cls"):
        started = StudyViT(**args, pool=pool, pos_embed="learned", pos_init="sincos2d")
        fixed = VisionTransformer(**args, pool=pool, pos_embed="sincos2d")
        assert torch.equal(started.pos_embed.detach(), fixed.pos_embed) and started.pos_embed.requires_grad
    with pytest.raises(ValueError, match=r"pos_init='sincos2d' is not allowed with pos_embed='sincos2d'"):
        StudyViT(**args, pos_embed="sincos2d", pos_init="sincos2d")
