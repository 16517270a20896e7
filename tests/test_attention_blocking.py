"""The attention-blocking experiment: which tokens see which stroke, and which pairs each condition blocks."""

import pytest
import torch

from vit.data.same_different import SameDifferentDataset
from vit.experiments.attention_blocking import CONDITIONS, allowed_pairs, receptive_windows, stroke_tokens
from vit.models import VisionTransformer


def test_windows_of_plain_and_overlapping_patches():
    plain = VisionTransformer(img_size=16, patch_size=4, in_chans=1, num_classes=2, embed_dim=8, depth=1, num_heads=2)
    windows = receptive_windows(plain, 16, 1)  # (16, 16, 16)
    for t in range(16):
        r, c = divmod(t, 4)
        expected = torch.zeros(16, 16, dtype=torch.bool)
        expected[4 * r:4 * r + 4, 4 * c:4 * c + 4] = True
        assert torch.equal(windows[t], expected)
    overlap = VisionTransformer(img_size=16, patch_size=4, patch_kernel=8, in_chans=1, num_classes=2, embed_dim=8,
                                depth=1, num_heads=2)
    window = receptive_windows(overlap, 16, 1)[5]  # token (1, 1): rows and columns 2..9
    assert window.nonzero().min(0).values.tolist() == [2, 2] and window.nonzero().max(0).values.tolist() == [9, 9]


def test_a_stroke_is_seen_by_the_tokens_whose_window_holds_one_of_its_pixels():
    data = SameDifferentDataset(num_samples=30, img_size=32, noise=0.0, seed=1)
    model = VisionTransformer(img_size=32, patch_size=4, in_chans=1, num_classes=2, embed_dim=8, depth=1, num_heads=2)
    sees = stroke_tokens(receptive_windows(model, 32, 1), data.positions, data.shape_ids, 32)  # (30, 2, 64)
    for n in range(30):
        image = data.images[n, 0]
        # brute force: both strokes together are the image's ink; each token of either set holds ink
        ink_tokens = {(r // 4) * 8 + c // 4 for r, c in (image > 0.5).nonzero().tolist()}
        assert set((sees[n, 0] | sees[n, 1]).nonzero().squeeze(1).tolist()) == ink_tokens


def test_each_condition_blocks_the_pairs_it_names():
    sees = torch.zeros(1, 2, 6, dtype=torch.bool)
    sees[0, 0, [0, 1]] = True  # stroke A: tokens 0, 1
    sees[0, 1, [4]] = True  # stroke B: token 4
    g = torch.Generator().manual_seed(0)
    blocked = {c: (~allowed_pairs(c, sees, prefix=1, generator=g)[0, 0]).nonzero().tolist() for c in CONDITIONS}
    shift = lambda pairs: sorted([q + 1, k + 1] for q, k in pairs)  # noqa: E731  (token 0 is the CLS token)
    assert blocked["none"] == []
    assert sorted(blocked["cross"]) == shift([(0, 4), (1, 4), (4, 0), (4, 1)])
    assert sorted(blocked["within"]) == shift([(0, 1), (1, 0)])
    assert len(blocked["random"]) == 4 and all(q != k and q > 0 and k > 0 for q, k in blocked["random"])
    assert sorted(blocked["isolate"]) == shift([(4, k) for k in (0, 1, 2, 3, 5)] + [(q, 4) for q in (0, 1, 2, 3, 5)])
    [isolated] = set.intersection(*(set(pair) for pair in blocked["isolate_random"]))  # in every blocked pair
    assert len(blocked["isolate_random"]) == 10 and isolated - 1 in (2, 3, 5)  # a token that sees no stroke
    assert len(blocked["self_only"]) == 6 * 5  # every pair of distinct patches; the CLS token is left alone
    with pytest.raises(ValueError, match="condition='all' is not allowed"):
        allowed_pairs("all", sees, prefix=0, generator=g)
