"""Rotary positions (`pos_embed="rope"` axial, `"rope_mixed"` learned mixed frequencies) and the relative position
bias (`"relative"`): timm's RoPE ViTs (its `Eva` class) and its relative-position ViT (`RelPosBias` table) load
strictly and give the same logits and attention maps, at their native size and another; the rotation makes a
query-key product depend on the offset alone, as does the bias; the fused and explicit paths agree for every score
function; the explanations, the model folder and the export work."""

from __future__ import annotations

import json

import pytest
import timm
import torch

import vit
import vit.artifact as artifact
import vit.models.timm_compat as timm_compat
from vit.explain.relevance import relevance, usable_methods
from vit.models import VisionTransformer, record_attention
from vit.models.rope import RotaryEmbedding, axial_angles, grid_coords, mixed_freqs, rotate

TIMM = {
    "rope": "vit_small_patch16_rope_224",
    "rope_mixed": "vit_small_patch16_rope_mixed_224",
    "relative": "vit_relpos_medium_patch16_cls_224",
}
ROPES = ("rope", "rope_mixed")
# timm's relative-position ViT with its `RelPosBias` table (its registered ones learn an MLP of log offsets instead)
RELPOS = dict(rel_pos_type="bias", qkv_bias=True, fc_norm=False)
SMALL = dict(patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)


def timm_pair(pos_embed: str, img_size, **options) -> tuple[torch.nn.Module, VisionTransformer]:
    """timm's model with random weights (not its init: every parameter moved), and ours with its state dict;
    `options`: timm's (`num_reg_tokens` for RoPE, `class_token` for the relative bias)."""
    torch.manual_seed(0)
    extra = RELPOS if pos_embed == "relative" else {}
    if options.get("class_token") is False:
        extra = {**extra, "global_pool": "avg"}
    reference = timm.create_model(
        TIMM[pos_embed], pretrained=False, img_size=img_size, **SMALL, **extra, **options
    ).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = VisionTransformer(
        img_size=img_size,
        in_chans=3,
        pos_embed=pos_embed,
        init_values=1e-5,
        **SMALL,
        reg_tokens=options.get("num_reg_tokens", 0),
        pool="cls" if options.get("class_token", True) else "mean",
        fc_norm=False if pos_embed == "relative" else None,
    )
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours.eval()


def timm_attention(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """timm's attention weights `(B, H, N, N)` per block, from its explicit path (the input of `attn_drop`)."""
    maps, hooks = [], []
    for block in model.blocks:
        block.attn.fused_attn = False
        hooks.append(block.attn.attn_drop.register_forward_hook(lambda m, inputs, out: maps.append(inputs[0])))
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return maps


PAIRS = [(p, o) for p in ROPES for o in ({}, {"num_reg_tokens": 2})] + [
    ("relative", {}),
    ("relative", {"class_token": False}),
]


@pytest.mark.parametrize("pos_embed, options", PAIRS, ids=lambda v: str(v) if isinstance(v, dict) else v)
@pytest.mark.parametrize("img_size", [(32, 32), (24, 40)], ids=["square", "another size"])
def test_timms_model_loads_strictly_with_equal_logits_and_attention_maps(pos_embed, img_size, options):
    reference, ours = timm_pair(pos_embed, img_size, **options)
    x = torch.randn(2, 3, *img_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=1e-4)
    with record_attention(ours) as maps, torch.no_grad():
        ours(x)
    theirs = timm_attention(reference, x)
    assert len(maps) == len(theirs) == SMALL["depth"]
    for mine, timms in zip(maps, theirs):
        torch.testing.assert_close(mine, timms, rtol=0, atol=1e-5)


def brute_force_angles(x: float, y: float, head_dim: int, temperature: float) -> torch.Tensor:
    """The axial angles of one patch, written out: the first quarter of the planes turn with x, the second with y."""
    bands = head_dim // 4
    return torch.tensor(
        [x * temperature ** (-k / bands) for k in range(bands)]
        + [y * temperature ** (-k / bands) for k in range(bands)]
    )


def test_axial_angles_are_the_formula_and_a_product_depends_on_the_offset_alone():
    grid, head_dim = (3, 5), 16
    angles = axial_angles(grid, head_dim, temperature=100.0)
    xs, ys = grid_coords(grid)
    for i in range(angles.shape[0]):
        torch.testing.assert_close(angles[i], brute_force_angles(float(xs[i]), float(ys[i]), head_dim, 100.0))
    torch.manual_seed(0)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def product(p: int, r: int) -> torch.Tensor:  # q at patch p with k at patch r
        return rotate(q[None], angles[p][None])[0] @ rotate(k[None], angles[r][None])[0]

    # (row 0, col 0) with (row 1, col 2) and (row 1, col 1) with (row 2, col 3): the same offset (1, 2)
    torch.testing.assert_close(product(0, 7), product(6, 13), rtol=0, atol=1e-5)
    assert not torch.allclose(product(0, 7), product(0, 8))
    torch.testing.assert_close(rotate(q[None], torch.zeros(1, head_dim // 2))[0], q, rtol=0, atol=0)  # angle 0


def test_the_prefix_tokens_are_not_rotated_and_mixed_frequencies_start_at_the_axial_magnitudes():
    torch.manual_seed(0)
    rope = RotaryEmbedding("mixed", grid_size=(2, 2), head_dim=8, depth=3, num_heads=2, num_prefix_tokens=2)
    angles = rope.angles(1)  # (H, N, d / 2)
    assert angles.shape == (2, 2 + 4, 4) and (angles[:, :2] == 0).all()
    freqs = mixed_freqs(16, 2, 3)
    magnitudes = freqs.pow(2).sum(0).sqrt()  # (depth, heads, d / 2): |(f_x, f_y)| per plane
    expected = 10.0 ** (-torch.arange(0, 16, 4) / 16)
    torch.testing.assert_close(magnitudes, torch.cat([expected, expected]).expand(2, 3, 8), rtol=1e-5, atol=1e-6)
    assert list(dict(rope.named_parameters())) == ["freqs"] and not rope.state_dict().keys() - {"freqs"}


@pytest.mark.parametrize("pos_embed", list(TIMM))
@pytest.mark.parametrize("score", ["scaled_dot", "dot", "general", "additive", "concat"])
def test_every_score_function_takes_these_positions_and_the_fused_and_explicit_paths_agree(pos_embed, score):
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=16,
        patch_size=4,
        in_chans=1,
        num_classes=2,
        embed_dim=16,
        depth=2,
        num_heads=2,
        pos_embed=pos_embed,
        attn_score=score,
        score_dim=4,
    ).eval()
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        fused = model(x)
        with record_attention(model) as maps:
            explicit = model(x)
    torch.testing.assert_close(fused, explicit, rtol=0, atol=1e-5)
    assert len(maps) == 2 and all(torch.isfinite(m).all() for m in maps)


@pytest.mark.parametrize("pos_embed", list(TIMM))
def test_the_explanations_of_these_vits_are_maps_summing_to_one(pos_embed):
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=16, patch_size=4, in_chans=1, num_classes=2, embed_dim=16, depth=2, num_heads=2, pos_embed=pos_embed
    ).eval()
    x = torch.randn(2, 1, 16, 16)
    for method in usable_methods(model, ["all"]):
        shares = relevance(model, x, method)
        assert shares.shape == (2, 4, 4) and torch.isfinite(shares).all(), method
        torch.testing.assert_close(shares.sum(dim=(1, 2)), torch.ones(2), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos_embed", list(TIMM))
def test_the_model_folder_opens_in_timm_as_its_own_model_and_in_vit_load(pos_embed, tmp_path):
    _, model = timm_pair(pos_embed, (32, 32))
    args = dict(
        img_size=32,
        in_chans=3,
        pos_embed=pos_embed,
        init_values=1e-5,
        **SMALL,
        **({"fc_norm": False} if pos_embed == "relative" else {}),
    )
    inputs = {"img_size": [32, 32], "in_chans": 3, "mean": None, "std": None, "interpolation": "bilinear"}
    config = artifact.describe(
        model, {"class_path": "vit.models.VisionTransformer", "init_args": args}, inputs, ["a", "b", "c"]
    )
    folder = artifact.write(tmp_path / "model", config, timm_compat.timm_state_dict(model))
    written = json.loads((folder / "config.json").read_text())
    assert written["architecture"] == TIMM[pos_embed]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()(x)
        torch.testing.assert_close(theirs, model(x), rtol=0, atol=1e-4)
        torch.testing.assert_close(vit.load(folder).model(x), model(x), rtol=0, atol=0)


def test_the_relative_bias_is_the_table_at_each_pairs_offset():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=(8, 12), patch_size=4, embed_dim=16, depth=1, num_heads=2, pos_embed="relative")
    rel = model.blocks[0].attn.rel_pos
    bias = rel()[0]  # (H, N, N): CLS, then the 2 x 3 patches
    table, (gh, gw) = rel.relative_position_bias_table, (2, 3)
    offsets = (2 * gh - 1) * (2 * gw - 1)
    for i in range(gh * gw):
        for j in range(gh * gw):
            dy, dx = i // gw - j // gw, i % gw - j % gw
            torch.testing.assert_close(bias[:, 1 + i, 1 + j], table[(dy + gh - 1) * (2 * gw - 1) + dx + gw - 1])
        torch.testing.assert_close(bias[:, 0, 1 + i], table[offsets])  # CLS to a patch
        torch.testing.assert_close(bias[:, 1 + i, 0], table[offsets + 1])  # a patch to CLS
    torch.testing.assert_close(bias[:, 0, 0], table[offsets + 2])
    assert table.shape == (offsets + 3, 2)


def test_what_these_positions_cannot_do_is_refused_in_one_line():
    with pytest.raises(
        ValueError,
        match=r"pos_embed='relative' takes at most one prefix token \(a CLS token\), got "
        r"3: register tokens have no offset to the patches",
    ):
        VisionTransformer(
            img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, pos_embed="relative", reg_tokens=2
        )
    relative = VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, pos_embed="relative")
    with pytest.raises(timm_compat.NotInTimm, match=r"pos_embed='relative' without init_values cannot be exported"):
        timm_compat.timm_args(relative)
    with pytest.raises(
        ValueError,
        match=r"pos_embed='rope': the head width 6 \(embed_dim / num_heads\) must be a "
        r"multiple of 4",
    ):
        VisionTransformer(img_size=16, patch_size=4, embed_dim=12, depth=1, num_heads=2, pos_embed="rope")
    model = VisionTransformer(
        img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, pos_embed="rope", pool="map"
    )
    with pytest.raises(timm_compat.NotInTimm, match=r"pool='map' with rotary positions cannot be exported"):
        timm_compat.timm_args(model)
    attn = model.blocks[0].attn
    with pytest.raises(ValueError, match="rope is for self-attention"):
        attn(torch.randn(1, 17, 16), torch.randn(1, 3, 16), rope=model.rope.angles(0))


def test_timms_layer_scale_loads_as_ls1_gamma_with_equal_logits_and_exports_back():
    torch.manual_seed(0)
    reference = timm.create_model(
        "vit_small_patch16_224", pretrained=False, img_size=32, init_values=1e-5, **SMALL
    ).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = VisionTransformer(img_size=32, in_chans=3, init_values=0.5, **SMALL).eval()  # the value is the weights'
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), rtol=0, atol=1e-5)
        exported = timm.create_model(
            timm_compat.architecture(args := timm_compat.timm_args(ours)), pretrained=False, **args
        ).eval()
        exported.load_state_dict(ours.state_dict(), strict=True)
        torch.testing.assert_close(exported(x), reference(x), rtol=0, atol=1e-5)
