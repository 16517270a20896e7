"""Pretrained weights: ours loads a timm file exactly as timm itself does at a new image size; timm's model API."""

import logging

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file

from vit.models import VisionTransformer
from vit.models.pretrained import PretrainedError

TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)  # vit_tiny_patch16_224


@pytest.fixture(scope="module")
def timm_file(tmp_path_factory):
    """A vit_tiny_patch16_224 with random weights (no download here), saved as timm would ship it."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    path = tmp_path_factory.mktemp("weights") / "vit_tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.mark.parametrize("img_size, num_classes", [(224, 1000), (96, 10), (64, 5)])
def test_loading_equals_timms_own_pretrained_loading(timm_file, img_size, num_classes):
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=img_size, num_classes=num_classes,
                                  pretrained_cfg_overlay=dict(file=str(timm_file))).eval()
    ours = VisionTransformer(img_size=img_size, num_classes=num_classes, pretrained=str(timm_file), **TINY).eval()
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        diff = (ours.forward_features(x) - reference.forward_features(x)).abs().max().item()
    assert diff < 1e-5
    if num_classes == 1000:  # same head: the logits agree too
        with torch.no_grad():
            assert (ours(x) - reference(x)).abs().max() < 1e-5


def test_another_patch_size_and_channel_count_are_resampled_as_timm_does(timm_file):
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=64, patch_size=8, in_chans=1,
                                  num_classes=3, pretrained_cfg_overlay=dict(file=str(timm_file))).eval()
    ours = VisionTransformer(img_size=64, in_chans=1, num_classes=3, pretrained=str(timm_file),
                             **{**TINY, "patch_size": 8}).eval()
    x = torch.randn(2, 1, 64, 64)
    with torch.no_grad():
        assert (ours.forward_features(x) - reference.forward_features(x)).abs().max() < 1e-5


def test_a_new_head_is_logged_and_left_fresh(timm_file, caplog):
    with caplog.at_level(logging.WARNING):
        model = VisionTransformer(img_size=32, num_classes=7, pretrained=str(timm_file), **TINY)
    assert "head.weight and head.bias re-initialised" in caplog.text
    assert model.head.weight.shape == (7, 192) and model.head.bias.abs().max() == 0


def test_a_learned_table_into_a_sincos_config_is_an_error(timm_file):
    with pytest.raises(PretrainedError, match="learned position table, and this config has pos_embed='sincos2d'"):
        VisionTransformer(img_size=32, pos_embed="sincos2d", pretrained=str(timm_file), **TINY)


def test_weights_that_do_not_fit_name_the_tensors(timm_file):
    with pytest.raises(PretrainedError, match=r"blocks\.0\.attn\.qkv\.weight: \(576, 192\) in the weights, \(288, 96\) here"):
        VisionTransformer(img_size=32, pretrained=str(timm_file), **{**TINY, "embed_dim": 96})


def test_a_name_that_cannot_be_downloaded_says_how_to_pass_a_file(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PretrainedError) as err:
        VisionTransformer(img_size=32, pretrained="vit_tiny_patch16_224.augreg_in21k", **TINY)
    message = str(err.value)
    assert "the weights of 'vit_tiny_patch16_224.augreg_in21k' could not be downloaded" in message
    assert "pretrained=/path/to/model.safetensors" in message
    with pytest.raises(PretrainedError, match="there is no such file"):
        VisionTransformer(img_size=32, pretrained="missing/model.safetensors", **TINY)


def test_forward_intermediates_are_the_blocks_outputs():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=32, depth=3, num_heads=2).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        tokens, expected = model.embed(x), []
        for block in model.blocks:
            tokens = block(tokens)
            expected.append(tokens[:, 1:].transpose(1, 2).reshape(2, 32, 8, 8))
    torch.testing.assert_close(final, model.forward_features(x))
    assert len(maps) == 3
    for got, want in zip(maps, expected):
        torch.testing.assert_close(got, want)
    last = model.forward_intermediates(x, indices=1, output_fmt="NLC", intermediates_only=True)
    assert len(last) == 1 and last[0].shape == (2, 64, 32)


def test_grad_checkpointing_gives_the_same_outputs_and_gradients():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=32, depth=3, num_heads=2,
                              drop_path_rate=0.0)
    x = torch.randn(4, 3, 32, 32)
    plain = model(x)
    plain.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    checkpointed = model(x)
    checkpointed.sum().backward()
    torch.testing.assert_close(checkpointed, plain)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def test_classifier_api_as_in_timm():
    model = VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=32, depth=1, num_heads=2)
    assert model.get_classifier() is model.head and model.num_features == 32
    model.reset_classifier(4)
    assert model.num_classes == 4 and model(torch.randn(1, 3, 32, 32)).shape == (1, 4)


def test_pytorch_grad_cam_works_on_our_vit_as_on_timms():
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    def reshape(tokens, grid=8):  # (B, 1 + 64, D) -> (B, D, 8, 8), the CLS token dropped
        return tokens[:, 1:].reshape(tokens.shape[0], grid, grid, -1).permute(0, 3, 1, 2)

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=4, num_classes=10, embed_dim=32, depth=2, num_heads=2).eval()
    x = torch.randn(2, 3, 32, 32)
    with GradCAM(model=model, target_layers=[model.blocks[-1].norm1], reshape_transform=reshape) as cam:
        maps = cam(input_tensor=x, targets=[ClassifierOutputTarget(3)] * 2)
    assert maps.shape == (2, 32, 32) and np.isfinite(maps).all() and maps.max() > 0


@pytest.mark.parametrize("trainable, trained", [
    ("head", {"head"}),
    (1, {"head", "norm", "blocks.1"}),
    ("all", {"head", "norm", "blocks.1", "blocks.0", "patch_embed", "cls_token", "pos_embed"}),
])
def test_freezing_trains_only_what_it_names(trainable, trained):
    from vit.training.classifier import ImageClassifier

    torch.manual_seed(0)
    backbone = VisionTransformer(img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2)
    model = ImageClassifier(backbone, trainable=trainable, lr=0.1, weight_decay=0.0)
    before = {n: p.detach().clone() for n, p in backbone.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()
    for name, p in backbone.named_parameters():
        moved = not torch.equal(p, before[name])
        expected = any(name == t or name.startswith(t + ".") for t in trained)
        assert moved == expected, name
        assert p.requires_grad == expected and (p.grad is not None) == expected, name


def test_freezing_options_name_what_is_allowed():
    from vit.models import ResNet
    from vit.training.classifier import ImageClassifier

    vit = VisionTransformer(img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2)
    with pytest.raises(ValueError, match=r"trainable=3 is not allowed: expected an int in \[0, 2\]"):
        ImageClassifier(vit, trainable=3)
    with pytest.raises(ValueError, match="trainable=1 counts Transformer blocks; ResNet has no `blocks`"):
        ImageClassifier(ResNet(img_size=16, in_chans=3, num_classes=3, widths=(4,)), trainable=1)


def test_non_square_images_load_pretrained_weights_as_timm_does(timm_file):
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=True, img_size=(96, 128), num_classes=4,
                                  pretrained_cfg_overlay=dict(file=str(timm_file))).eval()
    ours = VisionTransformer(img_size=(96, 128), num_classes=4, pretrained=str(timm_file), **TINY).eval()
    assert ours.patch_embed.grid_size == (6, 8)
    x = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        assert (ours.forward_features(x) - reference.forward_features(x)).abs().max() < 1e-5


@pytest.mark.parametrize("pos_embed", ["learned", "sincos1d", "sincos2d", "none"])
def test_non_square_images_work_with_every_position_encoding_and_rollout(pos_embed):
    from vit.explain.relevance import relevance

    model = VisionTransformer(img_size=(16, 24), patch_size=8, in_chans=1, num_classes=3, embed_dim=16, depth=2,
                              num_heads=2, pos_embed=pos_embed).eval()
    x = torch.randn(2, 1, 16, 24)
    assert model(x).shape == (2, 3)
    assert relevance(model, x, "rollout").shape == (2, 2, 3)
    maps = model.forward_intermediates(x, indices=1, intermediates_only=True)
    assert maps[0].shape == (2, 16, 2, 3)
    with pytest.raises(ValueError, match=r"expected input of shape \(B, 1, 16, 24\), got \(2, 1, 24, 16\)"):
        model(torch.randn(2, 1, 24, 16))
    with pytest.raises(ValueError, match=r"img_size=\(16, 0\) is not allowed"):
        VisionTransformer(img_size=(16, 0), patch_size=8)
