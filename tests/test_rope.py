"""Rotary positions (`pos_embed="rope"` axial, `"rope_mixed"` learned mixed frequencies): timm's RoPE ViTs (its `Eva`
class) load strictly and give the same logits and attention maps, at their native size and another; the rotation
makes a query-key product depend on the offset alone; the fused and explicit paths agree for every score function;
the explanations, the model folder and the export work."""

from __future__ import annotations

import json

import pytest
import timm
import torch

import vit
import vit.artifact as artifact
from vit.explain.relevance import relevance, usable_methods
from vit.models import VisionTransformer, record_attention
from vit.models.rope import RotaryEmbedding, axial_angles, grid_coords, mixed_freqs, rotate

TIMM = {"rope": "vit_small_patch16_rope_224", "rope_mixed": "vit_small_patch16_rope_mixed_224"}
SMALL = dict(patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)


def timm_pair(pos_embed: str, img_size, **options) -> tuple[torch.nn.Module, VisionTransformer]:
    """timm's RoPE ViT with random weights (not its init: every parameter moved), and ours with its state dict."""
    torch.manual_seed(0)
    reference = timm.create_model(TIMM[pos_embed], pretrained=False, img_size=img_size, **SMALL, **options).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = VisionTransformer(img_size=img_size, in_chans=3, pos_embed=pos_embed, init_values=1e-5, **SMALL,
                             **{"reg_tokens": options["num_reg_tokens"]} if "num_reg_tokens" in options else {})
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


@pytest.mark.parametrize("pos_embed", list(TIMM))
@pytest.mark.parametrize("img_size", [(32, 32), (24, 40)], ids=["square", "another size"])
@pytest.mark.parametrize("options", [{}, {"num_reg_tokens": 2}], ids=["cls", "cls+registers"])
def test_timms_rope_vit_loads_strictly_with_equal_logits_and_attention_maps(pos_embed, img_size, options):
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
    return torch.tensor([x * temperature ** (-k / bands) for k in range(bands)]
                        + [y * temperature ** (-k / bands) for k in range(bands)])


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
def test_every_score_function_takes_rotary_positions_and_the_fused_and_explicit_paths_agree(pos_embed, score):
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, in_chans=1, num_classes=2, embed_dim=16, depth=2,
                              num_heads=2, pos_embed=pos_embed, attn_score=score, score_dim=4).eval()
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        fused = model(x)
        with record_attention(model) as maps:
            explicit = model(x)
    torch.testing.assert_close(fused, explicit, rtol=0, atol=1e-5)
    assert len(maps) == 2 and all(torch.isfinite(m).all() for m in maps)


@pytest.mark.parametrize("pos_embed", list(TIMM))
def test_the_explanations_of_a_rope_vit_are_maps_summing_to_one(pos_embed):
    torch.manual_seed(0)
    model = VisionTransformer(img_size=16, patch_size=4, in_chans=1, num_classes=2, embed_dim=16, depth=2,
                              num_heads=2, pos_embed=pos_embed).eval()
    x = torch.randn(2, 1, 16, 16)
    for method in usable_methods(model, ["all"]):
        shares = relevance(model, x, method)
        assert shares.shape == (2, 4, 4) and torch.isfinite(shares).all(), method
        torch.testing.assert_close(shares.sum(dim=(1, 2)), torch.ones(2), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos_embed", list(TIMM))
def test_a_rope_vits_model_folder_opens_in_timm_as_its_eva_and_in_vit_load(pos_embed, tmp_path):
    _, model = timm_pair(pos_embed, (32, 32))
    args = dict(img_size=32, in_chans=3, pos_embed=pos_embed, init_values=1e-5, **SMALL)
    inputs = {"img_size": [32, 32], "in_chans": 3, "mean": None, "std": None, "interpolation": "bilinear"}
    config = artifact.describe(model, {"class_path": "vit.models.VisionTransformer", "init_args": args}, inputs,
                               ["a", "b", "c"])
    folder = artifact.write(tmp_path / "model", config, artifact.weights(model))
    written = json.loads((folder / "config.json").read_text())
    assert written["architecture"] == TIMM[pos_embed] and written["model_args"]["use_rot_pos_emb"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()(x)
        torch.testing.assert_close(theirs, model(x), rtol=0, atol=1e-4)
        torch.testing.assert_close(vit.load(folder).model(x), model(x), rtol=0, atol=0)


def test_what_rotary_positions_cannot_do_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"pos_embed='rope': the head width 6 \(embed_dim / num_heads\) must be a "
                                         r"multiple of 4"):
        VisionTransformer(img_size=16, patch_size=4, embed_dim=12, depth=1, num_heads=2, pos_embed="rope")
    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, pos_embed="rope",
                              pool="map")
    with pytest.raises(artifact.ArtifactError, match=r"pool='map' with rotary positions cannot be exported"):
        artifact.timm_args(model)
    layer_scale = VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, init_values=0.1)
    with pytest.raises(artifact.ArtifactError, match=r"init_values \(layer scale\) without rotary positions cannot "
                                                     r"be exported"):
        artifact.timm_args(layer_scale)
    attn = model.blocks[0].attn
    with pytest.raises(ValueError, match="rope is for self-attention"):
        attn(torch.randn(1, 17, 16), torch.randn(1, 3, 16), rope=model.rope.angles(0))
