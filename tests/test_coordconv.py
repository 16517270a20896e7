"""CoordConv (Liu et al. 2018): the coordinate channels, and a ResNet that reads them."""

import pytest
import torch

from vit.models import CoordConvResNet, ResNet
from vit.models.coordconv import coord_channels


def test_coord_channels_are_normalised_pixel_centres():
    c = coord_channels(4)
    assert c.shape == (2, 4, 4)
    centres = torch.tensor([-0.75, -0.25, 0.25, 0.75])  # (i + 0.5) / 4 * 2 - 1
    assert torch.equal(c[0], centres[:, None].expand(4, 4))  # row (y) varies down the image
    assert torch.equal(c[1], centres[None, :].expand(4, 4))  # column (x) varies across


def test_coordconv_appends_coordinates_and_reuses_resnet():
    torch.manual_seed(0)
    model = CoordConvResNet(img_size=16, in_chans=3, num_classes=5, widths=(4, 8)).eval()
    x = torch.randn(2, 3, 16, 16)
    with_coords = model.add_coords(x)
    assert with_coords.shape == (2, 5, 16, 16)
    assert torch.equal(with_coords[:, :3], x)
    assert torch.equal(with_coords[:, 3:], coord_channels(16).expand(2, -1, -1, -1))
    assert model(x).shape == (2, 5)
    assert torch.equal(model(x), model.resnet(with_coords))
    # Same parameters as a ResNet with two more input channels; the coordinates are not state.
    plain = ResNet(img_size=16, in_chans=5, num_classes=5, widths=(4, 8))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    assert not any("coords" in k for k in model.state_dict())
    with pytest.raises(ValueError, match=r"expected input of shape \(B, 3, 16, 16\), got \(2, 1, 16, 16\)"):
        model(torch.randn(2, 1, 16, 16))
