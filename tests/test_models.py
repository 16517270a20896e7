"""The ViT and the CNN baseline: timm's state-dict names, recorded attention, encodings, errors."""

import math

import pytest
import torch

from vit.models import ResNet, VisionTransformer, record_attention
from vit.models.pos_embed import sincos_1d, sincos_2d
from vit.training.classifier import ImageClassifier

CIFAR_CFG = dict(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=48, depth=2, num_heads=3)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_state_dict_names_are_timms():
    keys = set(VisionTransformer(**CIFAR_CFG).state_dict())
    for name in [
        "cls_token",
        "pos_embed",
        "patch_embed.proj.weight",
        "blocks.0.norm1.weight",
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc1.weight",
        "blocks.1.mlp.fc2.bias",
        "norm.weight",
        "head.weight",
    ]:
        assert name in keys


def test_record_attention_gives_one_row_stochastic_map_per_block_cls_first():
    model = VisionTransformer(**CIFAR_CFG).eval()
    with record_attention(model) as attns:
        logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10)
    assert len(attns) == CIFAR_CFG["depth"]
    for a in attns:
        assert a.shape == (2, 3, 65, 65)  # 64 patches + CLS
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 3, 65))
    assert attns[0].requires_grad  # kept in the autograd graph for gradient rollout


def test_sincos_1d_matches_the_transformer_formula():
    D = 16
    pe = sincos_1d(torch.arange(10), D)
    for pos in range(10):
        for i in range(D // 2):
            angle = pos / 10000 ** (2 * i / D)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_sincos_2d_encodes_row_in_first_half_and_column_in_second():
    gh, gw, D = 3, 4, 16
    pe = sincos_2d(gh, gw, D)
    assert pe.shape == (gh * gw, D)
    for r in range(gh):
        for c in range(gw):
            for i in range(D // 4):
                w = 1 / 10000 ** (2 * i / (D // 2))
                token = r * gw + c  # row-major, as the patch embedding emits patches
                assert pe[token, 2 * i].item() == pytest.approx(math.sin(r * w), abs=1e-6)
                assert pe[token, 2 * i + 1].item() == pytest.approx(math.cos(r * w), abs=1e-6)
                assert pe[token, D // 2 + 2 * i].item() == pytest.approx(math.sin(c * w), abs=1e-6)
                assert pe[token, D // 2 + 2 * i + 1].item() == pytest.approx(math.cos(c * w), abs=1e-6)


@pytest.mark.parametrize("kind", ["sincos1d", "sincos2d"])
def test_fixed_encodings_are_non_persistent_buffers(kind):
    model = VisionTransformer(**CIFAR_CFG, pos_embed=kind)
    assert "pos_embed" not in dict(model.named_parameters())
    assert "pos_embed" not in model.state_dict()
    assert model.pos_embed.shape == (1, 65, 48)
    if kind == "sincos2d":
        assert torch.all(model.pos_embed[0, 0] == 0)  # the CLS token has no grid position
        torch.testing.assert_close(model.pos_embed[0, 1:], sincos_2d(8, 8, 48))
    else:
        torch.testing.assert_close(model.pos_embed[0], sincos_1d(torch.arange(65), 48))


def test_no_pos_embed_makes_the_encoder_permutation_equivariant_over_patches():
    model = VisionTransformer(**CIFAR_CFG, pos_embed="none").eval()
    tokens = model.patch_embed(torch.randn(2, 3, 32, 32))
    perm = torch.randperm(64)
    assert model.pos_embed is None
    with torch.no_grad():
        # feed the blocks directly so the permutation is of tokens, not of pixels
        def run(t):
            t = torch.cat([model.cls_token.expand(2, -1, -1), t], dim=1)
            for b in model.blocks:
                t = b(t)
            return t

        out, out_perm = run(tokens), run(tokens[:, perm])
    torch.testing.assert_close(out_perm[:, 1:], out[:, 1:][:, perm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_perm[:, 0], out[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(img_size=30, patch_size=4), "img_size=30 is not divisible by patch_size=4"),
        (dict(patch_size=64), "patch_size=64"),
        (dict(embed_dim=50, num_heads=3), "embed_dim=50 is not divisible by num_heads=3"),
        (dict(pos_embed="alibi"), "pos_embed='alibi' is not allowed: expected one of"),
        (dict(pool="max"), "pool='max' is not allowed: expected one of"),
        (dict(attn_score="cosine"), "attn_score='cosine' is not allowed: expected one of"),
        (dict(drop_path_rate=1.5), "drop_path_rate=1.5"),
        (dict(depth=0), "depth=0"),
    ],
)
def test_bad_configuration_names_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        VisionTransformer(**{**CIFAR_CFG, **kwargs})


@pytest.mark.parametrize("model_cls", [VisionTransformer, ResNet])
@pytest.mark.parametrize("shape", [(2, 1, 32, 32), (2, 3, 28, 28), (3, 32, 32)])
def test_wrong_input_shape_names_expected_and_actual(model_cls, shape):
    model = model_cls(**({**CIFAR_CFG} if model_cls is VisionTransformer else dict(img_size=32, in_chans=3)))
    with pytest.raises(ValueError, match=r"expected input of shape \(B, 3, 32, 32\), got"):
        model(torch.randn(*shape))


def test_resnet_contract_and_size():
    model = ResNet(img_size=32, in_chans=1, num_classes=2)
    assert model(torch.randn(5, 1, 32, 32)).shape == (5, 2)

    def conv_bn(c_in, c_out, k):  # a bias-free k x k convolution and its batch norm's gain and shift
        return c_in * c_out * k * k + 2 * c_out

    def block(c_in, c_out):  # two 3x3 convolutions, and a 1x1 projection where the width changes
        return conv_bn(c_in, c_out, 3) + conv_bn(c_out, c_out, 3) + (conv_bn(c_in, c_out, 1) if c_in != c_out else 0)

    # The default widths (32, 64, 128), one block per stage: stem, three stages, a linear head.
    expected = conv_bn(1, 32, 3) + block(32, 32) + block(32, 64) + block(64, 128) + (128 * 2 + 2)
    assert sum(p.numel() for p in model.parameters()) == expected == 307_042
    with pytest.raises(ValueError, match="widths=()"):
        ResNet(widths=())


def test_classifier_rejects_bad_hyperparameters():
    backbone = ResNet(img_size=32, in_chans=1, num_classes=2)
    with pytest.raises(ValueError, match=r"lr=-0.1 is not allowed: expected a finite number in \(0, inf\)"):
        ImageClassifier(backbone, lr=-0.1)
    with pytest.raises(ValueError, match="label_smoothing=1.0"):
        ImageClassifier(backbone, label_smoothing=1.0)


def test_soft_targets_equal_hard_targets_when_one_hot():
    clf = ImageClassifier(ResNet(img_size=32, in_chans=1, num_classes=3), label_smoothing=0.1)
    logits = torch.randn(4, 3)
    y = torch.tensor([0, 2, 1, 2])
    torch.testing.assert_close(clf._loss(logits, y), clf._loss(logits, torch.nn.functional.one_hot(y, 3).float()))
