"""The ViT's recipe options (overlapping patches, the init std of queries and keys; QK-norm's parity with timm is in
test_timm_parity.py), the attention-blocking mask, and checkpoints that record the options the model no longer has."""

import pytest
import torch
import torch.nn.functional as F

from vit.models import VisionTransformer, record_attention
from vit.models.masks import mask_attention
from vit.models.patch_embed import PatchEmbed

CFG = dict(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=48, depth=2, num_heads=3)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_overlapping_patches_are_a_linear_map_of_each_padded_window():
    embed = PatchEmbed(img_size=(16, 16), patch_size=4, in_chans=2, embed_dim=5, kernel_size=8)
    x = torch.randn(3, 2, 16, 16)
    windows = F.unfold(x, kernel_size=8, stride=4, padding=2).transpose(1, 2)  # (B, N, C * 8 * 8)
    expected = windows @ embed.proj.weight.flatten(1).T + embed.proj.bias
    torch.testing.assert_close(embed(x), expected, rtol=0, atol=1e-5)
    assert embed.grid_size == (4, 4)


def _input_window(embed: PatchEmbed, token: tuple[int, int], img: int = 32) -> torch.Tensor:
    """The pixels whose value changes the token (by its gradient), as a bool (H, W) map."""
    x = torch.randn(1, embed.in_chans, img, img, requires_grad=True)
    gw = embed.grid_size[1]
    embed(x)[0, token[0] * gw + token[1]].sum().backward()
    return x.grad[0].abs().sum(0) > 0


def test_a_token_sees_exactly_its_receptive_field():
    plain = PatchEmbed(img_size=(32, 32), patch_size=4, in_chans=1, embed_dim=8).eval()
    assert _input_window(plain, (2, 3)).nonzero().tolist() == [[r, c] for r in range(8, 12) for c in range(12, 16)]
    overlap = PatchEmbed(img_size=(32, 32), patch_size=4, in_chans=1, embed_dim=8, kernel_size=8).eval()
    assert _input_window(overlap, (2, 3)).nonzero().tolist() == [[r, c] for r in range(6, 14) for c in range(10, 18)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kernel_size=5), "expected patch_size=4 plus an even number"),
        (dict(kernel_size=2), "kernel_size=2 is not allowed"),
    ],
)
def test_bad_patch_options_name_the_value(kwargs, message):
    args = dict(img_size=(32, 32), patch_size=4, in_chans=1, embed_dim=8) | kwargs
    with pytest.raises(ValueError, match=message):
        PatchEmbed(**args)


def test_a_mask_that_blocks_nothing_leaves_the_logits_unchanged():
    model = VisionTransformer(**CFG, pool="mean").eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        plain = model(x)
        with mask_attention(model, torch.ones(4, 1, 64, 64, dtype=torch.bool)):
            masked = model(x)
    torch.testing.assert_close(masked, plain, rtol=0, atol=0)


def test_blocked_pairs_get_zero_weight_and_the_fused_path_agrees():
    model = VisionTransformer(**CFG, pool="mean").eval()
    x = torch.randn(2, 3, 32, 32)
    allowed = torch.rand(2, 1, 64, 64) > 0.3
    allowed |= torch.eye(64, dtype=torch.bool)  # every query keeps itself
    with torch.no_grad(), mask_attention(model, allowed):
        fused = model(x)
        with record_attention(model) as maps:
            explicit = model(x)
    torch.testing.assert_close(fused, explicit, rtol=0, atol=1e-5)
    for weights in maps:  # (B, H, N, N)
        assert (weights.masked_select(~allowed.expand_as(weights)) == 0).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    with torch.no_grad():
        assert (fused - model(x)).abs().max() > 1e-5  # the mask did change the output (float noise is ~1e-7)


def test_masks_do_not_nest_and_are_removed_on_exit():
    model = VisionTransformer(**CFG)
    with mask_attention(model, torch.ones(1, 1, 65, 65, dtype=torch.bool)):
        with pytest.raises(RuntimeError, match="the model already applies a mask"):
            with mask_attention(model, torch.ones(1, 1, 65, 65, dtype=torch.bool)):
                pass
    assert model.attn_mask is None


@pytest.mark.parametrize("std", [0.02, 0.125])
def test_qk_init_std_sets_the_attention_logits_std_to_width_times_its_square(std):
    """q = W_q x with x layer-normalised (unit variance): var(q_i) = D std^2; q.k / sqrt(d) then has std D std^2."""
    model = VisionTransformer(
        img_size=32, patch_size=4, in_chans=3, num_classes=2, embed_dim=64, depth=1, num_heads=4, qk_init_std=std
    )
    w = model.blocks[0].attn.qkv.weight
    assert w[:128].std().item() == pytest.approx(std, rel=0.05)  # q and k rows
    assert w[128:].std().item() == pytest.approx(0.02, rel=0.05)  # v rows keep timm's std
    tokens = torch.nn.functional.layer_norm(torch.randn(16, 65, 64), (64,))
    q, k, _ = torch.nn.functional.linear(tokens, w).reshape(16, 65, 3, 4, 16).permute(2, 0, 3, 1, 4)
    logits = q @ k.transpose(-1, -2) / 4.0
    assert logits.std().item() == pytest.approx(64 * std**2, rel=0.2)


@pytest.mark.slow
def test_a_checkpoint_recording_an_option_the_model_does_not_have_is_refused_naming_it(
    tmp_path_factory, monkeypatch, capsys
):
    # Checkpoints written while the model had `stem` and `qk_init` (the recipe screen tried them) record them:
    # the schema takes only the arguments VisionTransformer has, so each door refuses them in one line.
    from PIL import Image
    from robust_helpers import cli, error_line, run_dirs, shared_run, tiny_config

    from vit.predict import main as predict_main

    [run_dir] = run_dirs(shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch))
    folder = tmp_path_factory.mktemp("retired")
    (folder / "images").mkdir()
    Image.new("L", (32, 32), 200).save(folder / "images" / "a.png")
    config = tiny_config(folder / "cfg")
    content = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    content["hyper_parameters"]["backbone"]["init_args"].update({"stem": "patch", "qk_init": "normal"})
    ckpt = folder / "old.ckpt"
    torch.save(content, ckpt)
    # It has no model folder (written before them): every door says so, and the command that writes one refuses it.
    assert (
        predict_main(
            ["--ckpt_path", str(ckpt), "--input_dir", str(folder / "images"), "--output", str(folder / "p.csv")]
        )
        == 2
    )
    assert "has no model folder beside it" in error_line(capsys.readouterr().err)
    code, stderr = cli(["test", "--config", str(config), "--ckpt_path", str(ckpt)], monkeypatch, capsys)
    assert code == 2 and "has no model folder beside it" in error_line(stderr)
    from vit.upgrade import main as write_folder

    assert write_folder(["--ckpt_path", str(ckpt)]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"error: checkpoint {ckpt}: hyper_parameters.backbone.init_args.stem: VisionTransformer has no argument "
        "'stem'; refused"
    )
    assert not (folder / "p.csv").exists() and not (folder / "cfg" / "runs").exists()
