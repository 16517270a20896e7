"""The model's API beyond `forward`, as timm's users know it, and the inputs `forward` takes.

forward_intermediates, gradient checkpointing, get_classifier / reset_classifier / num_features, the layers
pytorch-grad-cam hooks, and an error naming an input of the wrong dtype.
"""

import numpy as np
import pytest
import torch

from vit.models import ResNet, VisionTransformer


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
    model = VisionTransformer(
        img_size=32, patch_size=4, num_classes=10, embed_dim=32, depth=3, num_heads=2, drop_path_rate=0.0
    )
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


@pytest.mark.parametrize(
    "model",
    [
        VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=2, embed_dim=8, depth=1, num_heads=2),
        ResNet(img_size=8, in_chans=1, num_classes=2, widths=(4,)),
    ],
    ids=["vit", "resnet"],
)
def test_inputs_of_the_wrong_dtype_are_named(model):
    with pytest.raises(ValueError, match=r"expected a floating-point input, got torch\.uint8: .*x\.float\(\) / 255"):
        model(torch.zeros(2, 1, 8, 8, dtype=torch.uint8))
    for dtype in (torch.float64, torch.float16):
        with pytest.raises(
            ValueError, match=rf"input dtype {dtype} does not match the model's weights \(torch\.float32\)"
        ):
            model(torch.zeros(2, 1, 8, 8, dtype=dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision keeps float32 inputs: allowed
        assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 2)
