"""The partial-view (visibility) model of the runner's report: exact unit windows, visibility against a brute-force
count, the re-binning of per-image predictions."""

import numpy as np
import pytest
import torch

from studies.runner import visibility
from vit.data.same_different import SameDifferentDataset, make_shapes, render
from vit.models import ConvNet


def _gradient_windows(model: ConvNet) -> torch.Tensor:
    """`(U, H, W)`: each last-layer unit's input support, by autograd through the real network (positive weights
    and inputs keep every ReLU open, so no path is cut by an activation)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                m.weight.fill_(0.1)
    model.eval()
    x = torch.ones(1, 1, *model.img_size, requires_grad=True)
    fmap = model.forward_features(x)[0].sum(0).flatten()  # (U,)
    return torch.stack([torch.autograd.grad(unit, x, retain_graph=True)[0][0, 0] != 0 for unit in fmap])


@pytest.mark.parametrize("strides,padding", [((2, 1, 1), "zero"), ((1, 2, 1), "valid"), ((1, 2, 1), "circular")])
def test_unit_windows_are_the_gradient_support_of_every_unit(strides, padding):
    model = ConvNet(
        img_size=20, in_chans=1, num_classes=2, widths=(2,) * len(strides), strides=strides, padding=padding
    )
    assert torch.equal(visibility.unit_windows(model), _gradient_windows(model))


def test_unit_windows_of_cnn_rf11_are_squares_on_a_stride_2_grid():
    # cnn-rf11: strides (2, 1, 1), zero padding 1 per layer; unit i starts at 2 i - (1 + 2 + 2) (the padding
    # seen through the strides so far) and spans 11 px, cut at the border.
    windows = visibility.unit_windows(ConvNet(img_size=32, in_chans=1, widths=(4, 4, 4), strides=(2, 1, 1)))
    assert windows.shape == (16 * 16, 32, 32)
    for i, j in [(0, 0), (3, 7), (15, 15), (8, 2)]:
        expected = torch.zeros(32, 32, dtype=torch.bool)
        expected[max(0, 2 * i - 5) : 2 * i + 6, max(0, 2 * j - 5) : 2 * j + 6] = True
        assert torch.equal(windows[16 * i + j], expected)


def _brute_force_visible(windows: torch.Tensor, positions, shape_ids) -> list[bool]:
    """The definition counted one unit, one stroke, one pixel pair at a time."""
    shapes = make_shapes()
    out = []
    for pos, ids in zip(positions.numpy(), shape_ids.numpy()):
        inks = [
            np.argwhere(render(pos[None, [k, k]], ids[None, [k, k]], shapes, windows.shape[-1])[0] > 0)
            for k in range(2)
        ]  # each stroke's ink pixels, drawn alone

        def holds_adjacent(window, ink):
            inside = [p for p in ink if window[p[0], p[1]]]
            return any(max(abs(p[0] - q[0]), abs(p[1] - q[1])) == 1 for p in inside for q in inside)

        out.append(any(holds_adjacent(w, inks[0]) and holds_adjacent(w, inks[1]) for w in windows.numpy()))
    return out


@pytest.mark.parametrize("strides,padding", [((2, 1), "zero"), ((1, 2, 1), "circular")])
def test_visibility_equals_a_brute_force_count_of_adjacent_ink_pixels(strides, padding):
    model = ConvNet(img_size=20, in_chans=1, widths=(2,) * len(strides), strides=strides, padding=padding)
    windows = _gradient_windows(model)  # independent of unit_windows
    data = SameDifferentDataset(num_samples=60, img_size=20, seed=3)
    fast = visibility.visible(visibility.unit_windows(model), data.positions, data.shape_ids, chunk=7)
    brute = _brute_force_visible(windows, data.positions, data.shape_ids)
    assert fast.tolist() == brute
    assert 0 < sum(brute) < len(brute)  # both kinds of pair occur: the case can fail


def test_rebin_pools_the_per_image_predictions_by_visibility(tmp_path):
    model = ConvNet(img_size=32, in_chans=1, widths=(2, 2, 2), strides=(2, 1, 1))
    windows = visibility.unit_windows(model)
    data = SameDifferentDataset(num_samples=50, seed=1)
    seen = visibility.visible(windows, data.positions, data.shape_ids).numpy()
    pred = np.where(seen, data.labels.numpy(), 1 - data.labels.numpy())  # right exactly on the visible pairs
    np.savez(
        tmp_path / "a.npz",
        test_positions=data.positions.numpy(),
        test_shape_ids=data.shape_ids.numpy(),
        test_label=data.labels.numpy(),
        test_pred=pred,
        test_distance=data.span.numpy(),
    )
    got = visibility.rebin(windows, [tmp_path / "a.npz"] * 2)
    assert got["visible"] == [2 * int(seen.sum())] * 2 and got["hidden"] == [0, 2 * int((~seen).sum())]
    assert sum(n for _, n, _ in got["span"].values()) == 100
