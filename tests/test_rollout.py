"""Attention rollout: each test writes the expected formula out rather than calling back into it."""

import importlib
import io
import sys

import pytest
import torch
from torch import nn

from vit.explain.plot import overlay, rollout_grid
from vit.explain.relevance import attention_gradients, relevance
from vit.explain.rollout import (
    attention_rollout,
    discard_lowest,
    gradient_rollout,
    minmax,
    rollout_to_patch_map,
)
from vit.models import contract, record_attention


def random_attentions(layers=3, B=2, H=4, N=5, seed=0):
    """Softmax maps (B, H, N, N), one per layer, rows summing to 1."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, H, N, N)
    return [torch.randn(shape, generator=g, dtype=torch.float64).softmax(-1) for _ in range(layers)]


def residual_normalise(a):
    """norm(0.5 A + 0.5 I) along rows, written out for the tests."""
    a = 0.5 * a + 0.5 * torch.eye(a.shape[-1], dtype=a.dtype)
    return a / a.sum(-1, keepdim=True)


class PatchEmbed(nn.Module):
    def __init__(self, dim, patch, grid_size):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)
        self.grid_size = grid_size


class Recorded(contract.Recorded):
    """A layer `vit.models.record_attention` records (`vit.models.contract.Recorded`): it appends the weights."""

    def forward(self, attn):
        if self.recorder is not None:
            self.recorder.append(attn)
        return attn


class TinyViT(contract.Backbone):
    """Stand-in ViT whose attention maps are set by hand, recorded through `record_attention`'s contract.

    `readout_depth` blocks feed the logits; blocks after that still run and return attention,
    but nothing downstream of them reaches the logits, so their attention gets no gradient.
    """

    def __init__(self, pool="cls", depth=2, heads=2, dim=8, readout_depth=None, grid_size=(2, 3)):
        super().__init__()
        self.pool, self.heads, self.num_classes = pool, heads, 3
        self.num_prefix_tokens, self.num_reg_tokens = (1 if pool == "cls" else 0), 0
        self.readout_depth = depth if readout_depth is None else readout_depth
        self.patch_embed = PatchEmbed(dim, 4, grid_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(depth))
        self.pool_query = nn.Parameter(torch.randn(1, 1, dim))
        self.pool_kv = nn.Linear(dim, 2 * dim)
        self.head = nn.Linear(dim, 3)
        self.record = nn.ModuleList(Recorded() for _ in range(depth + 1))
        self.training_in_forward = None

    has_attention = True

    def gradcam_target(self):
        return self.patch_embed.proj, lambda fmap: fmap  # (B, D, gh, gw): the patch grid

    def split(self, t):  # (B, N, D) -> (B, H, N, D/H)
        B, N, D = t.shape
        return t.view(B, N, self.heads, D // self.heads).transpose(1, 2)

    def forward(self, x):
        self.training_in_forward = self.training
        pool = self.pool
        tokens = self.patch_embed.proj(x).flatten(2).transpose(1, 2)  # (B, N, D)
        if pool == "cls":
            tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1)
        readout = tokens
        for i, qkv in enumerate(self.qkv):
            q, k, v = (self.split(t) for t in qkv(tokens).chunk(3, dim=-1))
            attn = self.record[i]((q @ k.transpose(-2, -1)).softmax(-1))  # (B, H, N, N)
            tokens = tokens + (attn @ v).transpose(1, 2).flatten(2)
            if i + 1 == self.readout_depth:
                readout = tokens
        if pool == "cls":
            pooled = readout[:, 0]
        elif pool == "mean":
            pooled = readout.mean(1)
        else:
            k, v = (self.split(t) for t in self.pool_kv(readout).chunk(2, dim=-1))
            q = self.split(self.pool_query.expand(len(x), -1, -1))
            attn = self.record[-1]((q @ k.transpose(-2, -1)).softmax(-1))  # (B, H, 1, N)
            pooled = (attn @ v).transpose(1, 2).flatten(1)
        return self.head(pooled)


def logits_and_maps(model, x):
    """`(logits, attentions)`: one forward pass under `record_attention`."""
    with record_attention(model) as attentions:
        logits = model(x)
    return logits, attentions


def images(B=2, seed=0):
    return torch.randn(B, 3, 8, 12, generator=torch.Generator().manual_seed(seed))


def tiny_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return TinyViT(**kwargs).double()


# --- attention_rollout ----------------------------------------------------------------------


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
def test_identity_attention_gives_identity_rollout(head_fusion):
    eye = torch.eye(4).expand(2, 3, 4, 4)
    rollout = attention_rollout([eye] * 5, head_fusion=head_fusion)
    torch.testing.assert_close(rollout, torch.eye(4).expand(2, 4, 4))


def test_two_layer_example_worked_by_hand():
    a1 = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
    a2 = torch.tensor([[0.5, 0.5], [0.1, 0.9]])
    # 0.5 A + 0.5 I:  Â1 = [[0.9, 0.1], [0.2, 0.8]],  Â2 = [[0.75, 0.25], [0.05, 0.95]]
    # R = Â2 @ Â1 (first layer rightmost):
    expected = torch.tensor(
        [[0.75 * 0.9 + 0.25 * 0.2, 0.75 * 0.1 + 0.25 * 0.8], [0.05 * 0.9 + 0.95 * 0.2, 0.05 * 0.1 + 0.95 * 0.8]]
    )
    torch.testing.assert_close(expected, torch.tensor([[0.725, 0.275], [0.235, 0.765]]))
    rollout = attention_rollout([a1[None, None], a2[None, None]])
    torch.testing.assert_close(rollout[0], expected)
    # The reverse order, Â1 @ Â2 = [[0.68, 0.32], [0.19, 0.81]], must not come out.
    assert not torch.allclose(rollout[0], torch.tensor([[0.68, 0.32], [0.19, 0.81]]))


def test_rows_are_normalised_not_columns():
    # Max over two heads leaves rows that do not sum to 1, so the normalisation axis matters.
    heads = torch.tensor([[[0.8, 0.2], [0.4, 0.6]], [[0.6, 0.4], [0.1, 0.9]]])
    # max = [[0.8, 0.4], [0.4, 0.9]];  0.5 max + 0.5 I = [[0.9, 0.2], [0.2, 0.95]]
    expected = torch.tensor([[0.9 / 1.1, 0.2 / 1.1], [0.2 / 1.15, 0.95 / 1.15]])
    rollout = attention_rollout([heads[None]], head_fusion="max")
    torch.testing.assert_close(rollout[0], expected)


def test_random_rollout_matches_written_out_product():
    attentions = random_attentions(layers=3)
    fused = [a.amin(1) for a in attentions]
    a1, a2, a3 = (residual_normalise(f) for f in fused)
    expected = a3 @ a2 @ a1
    torch.testing.assert_close(attention_rollout(attentions, head_fusion="min"), expected)


@pytest.mark.parametrize("discard_ratio", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
def test_rows_sum_to_one(head_fusion, discard_ratio):
    rollout = attention_rollout(random_attentions(), head_fusion=head_fusion, discard_ratio=discard_ratio)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    assert (rollout >= 0).all()


@pytest.mark.parametrize("discard_ratio", [0.25, 0.5, 0.9])
def test_discard_zeroes_the_asked_fraction_and_keeps_cls_self(discard_ratio):
    B, N = 3, 6
    fused = torch.rand(B, N, N, generator=torch.Generator().manual_seed(1)) + 0.1  # no zeros yet
    fused[:, 0, 0] = 0.01  # the weakest entry, yet it must survive
    out = discard_lowest(fused, discard_ratio)
    num_zero = int(discard_ratio * N * N)
    assert ((out == 0).flatten(1).sum(1) == num_zero).all()
    torch.testing.assert_close(out[:, 0, 0], fused[:, 0, 0])
    for b in range(B):
        zeroed, kept = fused[b][out[b] == 0], fused[b][out[b] != 0]  # row-major: kept[0] is [0, 0]
        torch.testing.assert_close(out[b][out[b] != 0], kept)  # survivors untouched
        assert zeroed.max() <= kept[1:].min()  # the lowest went, the protected entry aside
    # Without protection the CLS self entry, being the smallest, is the first to go.
    assert (discard_lowest(fused, discard_ratio, keep_cls_self=False)[:, 0, 0] == 0).all()


def test_discard_in_rollout_by_hand():
    a = torch.tensor([[0.1, 0.9], [0.3, 0.7]])[None, None]
    # ratio 0.5 of 4 entries -> 2 zeroed. [0, 0] is protected, so 0.3 and 0.7 go:
    # D = [[0.1, 0.9], [0, 0]];  0.5 D + 0.5 I = [[0.55, 0.45], [0, 0.5]]
    kept = torch.tensor([[0.55, 0.45], [0.0, 1.0]])
    torch.testing.assert_close(attention_rollout([a], discard_ratio=0.5)[0], kept)
    # Unprotected, 0.1 and 0.3 go: D = [[0, 0.9], [0, 0.7]];
    # 0.5 D + 0.5 I = [[0.5, 0.45], [0, 0.85]]
    dropped = torch.tensor([[0.5 / 0.95, 0.45 / 0.95], [0.0, 1.0]])
    rollout = attention_rollout([a], discard_ratio=0.5, keep_cls_self=False)
    torch.testing.assert_close(rollout[0], dropped)


def test_start_layer_equals_rollout_of_sliced_list():
    attentions = random_attentions(layers=4)
    for start in range(4):
        torch.testing.assert_close(
            attention_rollout(attentions, head_fusion="max", discard_ratio=0.3, start_layer=start),
            attention_rollout(attentions[start:], head_fusion="max", discard_ratio=0.3),
        )


def test_errors_name_the_offending_value():
    attentions = random_attentions(layers=2)
    with pytest.raises(ValueError, match="'median'.*mean.*max.*min|mean.*max.*min.*'median'"):
        attention_rollout(attentions, head_fusion="median")
    for ratio in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=f"discard_ratio.*{ratio}"):
            attention_rollout(attentions, discard_ratio=ratio)
    with pytest.raises(ValueError, match="empty"):
        attention_rollout([])
    with pytest.raises(ValueError, match=r"attentions\[0\].*\(2, 4, 5, 3\)"):
        attention_rollout([torch.rand(2, 4, 5, 3)])
    with pytest.raises(ValueError, match=r"attentions\[1\].*\(2, 4, 6, 6\)"):
        attention_rollout([attentions[0], torch.rand(2, 4, 6, 6)])
    with pytest.raises(ValueError, match="start_layer.*7"):
        attention_rollout(attentions, start_layer=7)


# --- rollout_to_patch_map --------------------------------------------------------------------


def min_max(v):  # per sample, over the last dimension
    lo, hi = v.min(-1, keepdim=True).values, v.max(-1, keepdim=True).values
    return (v - lo) / (hi - lo)


def pooled_rollout(pool, *, seed, gh=2, gw=3, B=2):
    """A rollout for a 2x3 grid read by `pool`, its pooling weights (map), and the patch relevance
    written out: the CLS row for cls, the mean over queries for mean, a_pool @ R for map."""
    N = gh * gw + (pool == "cls")
    rollout = attention_rollout(random_attentions(B=B, N=N, seed=seed))
    pool_attn = torch.rand(B, 1, N, dtype=torch.float64).softmax(-1) if pool == "map" else None
    if pool == "cls":
        relevance = rollout[:, 0, 1:]
    elif pool == "mean":
        relevance = rollout.sum(1) / N
    else:  # a_pool @ R, written as a sum over the tokens the query attends to
        relevance = (pool_attn[:, 0, :, None] * rollout).sum(1)
    return rollout, pool_attn, relevance


@pytest.mark.parametrize("pool", ["cls", "mean", "map"])
def test_patch_map_shape_range_and_formula(pool):
    gh, gw, B = 2, 3, 2
    rollout, pool_attn, relevance = pooled_rollout(pool, seed=3)
    patch_map = rollout_to_patch_map(rollout, (gh, gw), pool=pool, pool_attn=pool_attn)
    assert patch_map.shape == (B, gh, gw)
    assert patch_map.min() >= 0 and patch_map.max() <= 1
    torch.testing.assert_close(patch_map, min_max(relevance).view(B, gh, gw))


def test_patch_map_errors():
    rollout = attention_rollout(random_attentions(N=7))
    with pytest.raises(ValueError, match="'avg'"):
        rollout_to_patch_map(rollout, (2, 3), pool="avg")
    with pytest.raises(ValueError, match="N=7"):
        rollout_to_patch_map(rollout, (2, 3), pool="mean")
    with pytest.raises(ValueError, match="pool_attn"):
        rollout_to_patch_map(rollout[:, 1:, 1:], (2, 3), pool="map")


# --- gradient rollout --------------------------------------------------------------------------


def test_grad_rollout_is_identity_where_the_gradient_is_zero():
    # One block, logit read from the CLS token only: rows 1.. of the attention get zero gradient,
    # so after the residual and normalisation those rows are identity rows.
    model, x = tiny_model(depth=1), images().double()
    grad = gradient_rollout(*attention_gradients(model, x))
    plain = attention_rollout(logits_and_maps(model, x)[1])
    eye = torch.eye(7, dtype=torch.float64)
    torch.testing.assert_close(grad[:, 1:], eye[1:].expand(2, 6, 7))
    assert not torch.allclose(grad, plain)
    assert not torch.allclose(grad[:, 0], eye[0])  # the CLS row does receive gradient
    torch.testing.assert_close(grad.sum(-1), torch.ones(2, 7, dtype=torch.float64))


def test_grad_rollout_matches_written_out_formula_and_unused_layer_is_identity():
    # Three blocks, logits read after the second: block 3's attention gets no gradient at all.
    model, x = tiny_model(depth=3, readout_depth=2), images().double()
    target = torch.tensor([2, 0])
    logits, attentions = logits_and_maps(model, x)
    score = logits[torch.arange(2), target].sum()
    grads = torch.autograd.grad(score, attentions, allow_unused=True)
    assert grads[2] is None or (grads[2] == 0).all()
    weighted = [(g * a).clamp(min=0).mean(1) for g, a in zip(grads[:2], attentions[:2])]
    expected = residual_normalise(weighted[1]) @ residual_normalise(weighted[0])  # block 3: I
    torch.testing.assert_close(gradient_rollout(*attention_gradients(model, x, target)), expected.detach())
    from_second = gradient_rollout(*attention_gradients(model, x, target), start_layer=1)
    torch.testing.assert_close(from_second, residual_normalise(weighted[1]).detach())


def test_grad_rollout_target_defaults_to_prediction_and_accepts_int():
    model, x = tiny_model(), images().double()
    predicted = model(x).argmax(-1)
    by_default = gradient_rollout(*attention_gradients(model, x))
    torch.testing.assert_close(by_default, gradient_rollout(*attention_gradients(model, x, predicted)))
    as_int = gradient_rollout(*attention_gradients(model, x, 1))
    torch.testing.assert_close(as_int, gradient_rollout(*attention_gradients(model, x, torch.tensor([1, 1]))))
    assert not torch.allclose(as_int, gradient_rollout(*attention_gradients(model, x, 2)))


@pytest.mark.parametrize("training", [True, False])
def test_grad_rollout_leaves_grads_and_modes_alone(training):
    model, x = tiny_model(pool="map"), images().double()
    model.train(training)
    model.head.eval()  # a mixed state must come back as it was, module by module
    before = {m: m.training for m in model.modules()}
    model.head.weight.grad = torch.full_like(model.head.weight, 3.0)
    attention_gradients(model, x)
    relevance(model, x, "grad_rollout")
    relevance(model, x, "rollout")
    assert model.training_in_forward is False  # explained in eval mode
    assert {m: m.training for m in model.modules()} == before
    assert (model.head.weight.grad == 3.0).all()
    assert all(p.grad is None for name, p in model.named_parameters() if name != "head.weight")


def test_grad_rollout_works_under_inference_mode_and_frozen_params():
    model = tiny_model()
    model.requires_grad_(False)
    with torch.inference_mode():
        x = images().double()
        expected_shape = (2, 7, 7)
        assert gradient_rollout(*attention_gradients(model, x)).shape == expected_shape
        assert relevance(model, x, "grad_rollout").shape == (2, 2, 3)


# --- relevance(model, x, "rollout" | "grad_rollout"), drawn min-max scaled ----------------------


@pytest.mark.parametrize("method", ["rollout", "grad_rollout"])
@pytest.mark.parametrize("pool", ["cls", "mean", "map"])
def test_rollout_relevance_per_pool(pool, method):
    model, x = tiny_model(pool=pool, grid_size=(2, 3)), images().double()
    maps = minmax(relevance(model, x, method))
    assert maps.shape == (2, 2, 3)
    assert maps.min() >= 0 and maps.max() <= 1
    peak = maps.flatten(1).max(1).values
    torch.testing.assert_close(peak, torch.ones(2, dtype=torch.float64))


def test_rollout_relevance_map_pool_rollout_formula():
    model, x = tiny_model(pool="map"), images().double()
    with torch.no_grad():
        _, attentions = logits_and_maps(model, x)
    rollout = attention_rollout(attentions[:-1], head_fusion="max", keep_cls_self=False)
    a_pool = attentions[-1].amax(1)  # (B, 1, N)
    expected = min_max((a_pool[:, 0, :, None] * rollout).sum(1)).view(2, 2, 3)
    torch.testing.assert_close(minmax(relevance(model, x, "rollout", head_fusion="max")), expected)


def test_rollout_relevance_map_pool_grad_rollout_formula():
    model, x = tiny_model(pool="map"), images().double()
    logits, attentions = logits_and_maps(model, x)
    score = logits.max(-1).values.sum()  # predicted class
    grads = torch.autograd.grad(score, attentions)
    weighted = [(g * a).clamp(min=0).mean(1).detach() for g, a in zip(grads, attentions)]
    rollout = residual_normalise(weighted[1]) @ residual_normalise(weighted[0])
    expected = min_max((weighted[2][:, 0, :, None] * rollout).sum(1)).view(2, 2, 3)
    torch.testing.assert_close(minmax(relevance(model, x, "grad_rollout")), expected)


def test_rollout_relevance_rejects_options_that_do_not_apply():
    model, x = tiny_model(), images().double()
    with pytest.raises(ValueError, match="'saliency'"):
        relevance(model, x, "saliency")
    with pytest.raises(ValueError, match="head_fusion='max'"):
        relevance(model, x, "grad_rollout", head_fusion="max")
    with pytest.raises(ValueError, match="target=3"):
        relevance(model, x, "rollout", target=3)
    model.pool = "avg"
    with pytest.raises(ValueError, match="'avg'"):
        relevance(model, x)


# --- overlays ---------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 3])
def test_overlay_is_rgb_in_unit_range(channels):
    image = torch.randn(channels, 16, 24) * 2  # normalised-looking input, outside [0, 1]
    out = overlay(image, torch.rand(2, 3), alpha=0.4)
    assert out.shape == (16, 24, 3)
    assert out.dtype.kind == "f"
    assert out.min() >= 0 and out.max() <= 1


def test_rollout_grid_renders_rows_by_columns():
    from matplotlib.figure import Figure

    maps = {"rollout": torch.rand(3, 2, 3), "grad rollout": torch.rand(3, 2, 3)}
    fig = rollout_grid(torch.randn(3, 3, 16, 24), maps, titles=["a", "b", "c"])
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 3 * 3 + 3  # and a colour bar per row (the default scale)
    assert [ax.get_title() for ax in fig.axes[:3]] == ["a", "rollout", "grad rollout"]
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    assert buffer.getvalue().startswith(b"\x89PNG")


def test_import_does_not_load_matplotlib(monkeypatch):
    # Forget matplotlib and vit.explain's modules (monkeypatch puts them back), then import afresh.
    import vit.explain

    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib" or m.startswith("vit.explain.")]:
        monkeypatch.delitem(sys.modules, name)
    for attr in ("rollout", "plot"):
        monkeypatch.delattr(vit.explain, attr, raising=False)
    importlib.import_module("vit.explain.rollout")
    importlib.import_module("vit.explain.plot")
    assert "matplotlib" not in sys.modules


# --- patch shares (scale="sum") and models without a `pool` attribute -------------------------


@pytest.mark.parametrize("pool", ["cls", "mean", "map"])
def test_patch_map_sum_scale_is_the_share_of_relevance(pool):
    gh, gw, B = 2, 3, 2
    rollout, pool_attn, relevance = pooled_rollout(pool, seed=4)
    shares = rollout_to_patch_map(rollout, (gh, gw), pool=pool, pool_attn=pool_attn, scale="sum")
    torch.testing.assert_close(shares, (relevance / relevance.sum(-1, keepdim=True)).view(B, gh, gw))
    torch.testing.assert_close(shares.sum((1, 2)), torch.ones(B, dtype=torch.float64))


def test_patch_map_sum_scale_leaves_a_map_without_relevance_at_zero():
    rollout = torch.eye(7).expand(2, 7, 7)  # the CLS token reads only itself: no patch relevance
    shares = rollout_to_patch_map(rollout, (2, 3), scale="sum")
    assert (shares == 0).all()
    with pytest.raises(ValueError, match="scale.*'softmax'"):
        rollout_to_patch_map(rollout, (2, 3), scale="softmax")


# --- gradient rollout on a trained ViT --------------------------------------------------------


@pytest.fixture(scope="module")
def trained_vit():
    """A real VisionTransformer trained for a few seconds on two-circles `diagonal`, and test images."""
    import torch.nn.functional as F

    from vit.data import TwoCirclesDataset
    from vit.models import VisionTransformer

    torch.manual_seed(0)
    train = TwoCirclesDataset(num_samples=2048, seed=1)
    test = TwoCirclesDataset(num_samples=256, seed=2)
    model = VisionTransformer(
        img_size=32, patch_size=8, in_chans=1, num_classes=2, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only add synchronisation (5x slower on a busy CPU)
    try:
        for _ in range(4):
            for idx in torch.randperm(len(train)).split(64):
                loss = F.cross_entropy(model(train.images[idx]), train.labels[idx])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    with torch.no_grad():
        accuracy = (model(test.images).argmax(-1) == test.labels).float().mean().item()
    assert accuracy >= 0.9, f"the fixture did not train: test accuracy {accuracy}"
    return model, test.images[:16], test.labels[:16]


@pytest.mark.slow
def test_grad_rollout_of_trained_vit_differs_from_rollout_and_between_targets(trained_vit):
    model, x, _ = trained_vit
    grid = model.patch_embed.grid_size
    with torch.no_grad():
        plain = rollout_to_patch_map(attention_rollout(logits_and_maps(model, x)[1]), grid, scale="sum")
    for_neg, for_pos = (
        rollout_to_patch_map(gradient_rollout(*attention_gradients(model, x, t)), grid, scale="sum") for t in (0, 1)
    )

    def total_variation(p, q):  # per image, between two distributions over the patches
        return 0.5 * (p - q).abs().sum((1, 2))

    # Seeded, the three pairs differ by a total variation of 0.11-0.98 per image (0.2-0.8 on average).
    for p, q in ((for_pos, plain), (for_neg, plain), (for_pos, for_neg)):
        distance = total_variation(p, q)
        assert (distance > 0.05).all() and distance.mean() > 0.2, distance


@pytest.mark.slow
def test_grad_rollout_of_trained_vit_is_identity_where_the_gradient_is_zero(trained_vit):
    model, x, labels = trained_vit
    logits, attentions = logits_and_maps(model, x)
    score = logits.gather(1, labels[:, None]).sum()
    grads = torch.autograd.grad(score, attentions)
    # The head reads the CLS token only, so in the last block no other token's attention row matters.
    last_grad, last_attn = grads[-1], attentions[-1].detach()
    assert (last_grad[:, :, 1:] == 0).all() and (last_grad[:, :, 0] != 0).any()
    weighted = (last_grad * last_attn).clamp(min=0).mean(1)  # (B, N, N)
    assert (weighted[:, 1:] == 0).all()
    last_only = gradient_rollout(*attention_gradients(model, x, labels), start_layer=len(attentions) - 1)
    torch.testing.assert_close(last_only, residual_normalise(weighted))
    N = last_attn.shape[-1]
    torch.testing.assert_close(last_only[:, 1:], torch.eye(N)[1:].expand(len(x), N - 1, N))
    # Every block, chained: the written-out product of the gradient-weighted maps.
    per_block = [residual_normalise((g * a.detach()).clamp(min=0).mean(1)) for g, a in zip(grads, attentions)]
    torch.testing.assert_close(gradient_rollout(*attention_gradients(model, x, labels)), per_block[1] @ per_block[0])
