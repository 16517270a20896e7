"""The attention mechanism softmax(f(Q, K) + M) V: score functions against their formulas, masks,
fast vs explicit paths, cross-attention, pooling heads."""

import re

import pytest
import torch
import torch.nn.functional as F

from vit.models import VisionTransformer, record_attention
from vit.models.attention import Attention
from vit.models.masks import mask_attention
from vit.models.scores import SCORES

B, M, N, D, H = 2, 5, 7, 12, 3
d = D // H


def explicit(attn, *args, **kwargs):
    """`(out, weights)` from the explicit path, which `record_attention` makes every attention take."""
    with record_attention(attn) as maps:
        out = attn(*args, **kwargs)
    [weights] = maps
    return out, weights


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def heads(t):  # (B, L, D) -> (B, H, L, d), written out independently of the module
    return t.reshape(t.shape[0], t.shape[1], H, d).permute(0, 2, 1, 3)


def project(attn, x, context):
    w_q, w_k, w_v = attn.qkv.weight.chunk(3)
    b_q, b_k, b_v = attn.qkv.bias.chunk(3)
    return heads(x @ w_q.T + b_q), heads(context @ w_k.T + b_k), heads(context @ w_v.T + b_v)


def reference_scores(attn, q, k):
    """Each score written from its formula, pair by pair where the formula is per pair."""
    s = attn.attn_score
    if s == "scaled_dot":
        return torch.einsum("bhmd,bhnd->bhmn", q, k) / d**0.5
    if s == "dot":
        return torch.einsum("bhmd,bhnd->bhmn", q, k)
    if s == "general":  # q^T W k
        return torch.einsum("bhmd,hde,bhne->bhmn", q, attn.score.weight, k)
    if s == "additive":  # w_a^T tanh(W_b [q ; k]), the concatenation built for every pair
        pairs = torch.cat(
            [
                q[:, :, :, None, :].expand(-1, -1, -1, k.shape[2], -1),
                k[:, :, None, :, :].expand(-1, -1, q.shape[2], -1, -1),
            ],
            dim=-1,
        )  # (B,H,M,N,2d)
        hidden = torch.tanh(torch.einsum("hae,bhmne->bhmna", attn.score.w_b, pairs))
        return torch.einsum("ha,bhmna->bhmn", attn.score.w_a, hidden)
    if s == "concat":  # w_a^T tanh(W_q q + W_k k)
        hq = torch.einsum("had,bhmd->bhma", attn.score.w_q, q)
        hk = torch.einsum("had,bhnd->bhna", attn.score.w_k, k)
        hidden = torch.tanh(hq[:, :, :, None] + hk[:, :, None])
        return torch.einsum("ha,bhmna->bhmn", attn.score.w_a, hidden)
    raise AssertionError(s)


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("cross", [False, True])
def test_each_score_matches_its_formula(score, cross):
    attn = Attention(D, num_heads=H, attn_score=score, score_dim=4).eval()
    x = torch.randn(B, M, D)
    context = torch.randn(B, N, D) if cross else x
    out, weights = explicit(attn, x, context if cross else None)
    q, k, v = project(attn, x, context)
    expected_w = reference_scores(attn, q, k).softmax(-1)
    torch.testing.assert_close(weights, expected_w, atol=1e-6, rtol=1e-5)
    expected_out = (expected_w @ v).permute(0, 2, 1, 3).reshape(B, -1, D) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


def masks():
    key_mask = torch.ones(B, N, dtype=torch.bool)
    key_mask[0, 3:] = False
    bool_mask = torch.rand(B, 1, M, N) > 0.3
    float_mask = torch.zeros(B, H, M, N).masked_fill(torch.rand(B, H, M, N) > 0.6, float("-inf"))
    float_mask += 0.5 * torch.randn(B, H, M, N)  # finite biases are added as they are
    return {
        "none": {},
        "bool": {"mask": bool_mask},
        "float": {"mask": float_mask},
        "key_mask": {"key_mask": key_mask},
        "causal": {"causal": True},
        "all": {"mask": bool_mask, "key_mask": key_mask, "causal": True},
    }


def allowed_of(kwargs):
    allowed = torch.ones(B, H, M, N, dtype=torch.bool)
    if "mask" in kwargs:
        m = kwargs["mask"]
        allowed = allowed & (m if m.dtype == torch.bool else m > float("-inf"))
    if "key_mask" in kwargs:
        allowed = allowed & kwargs["key_mask"][:, None, None, :]
    if kwargs.get("causal"):
        allowed = allowed & (torch.arange(N)[None, :] <= torch.arange(M)[:, None])
    return allowed


@pytest.mark.parametrize("score", ["scaled_dot", "dot", "general"])
@pytest.mark.parametrize("mask_name", list(masks()))
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fast_path_equals_explicit_path(score, mask_name, qk_norm):
    attn = Attention(D, num_heads=H, attn_score=score, qk_norm=qk_norm).eval()
    kwargs = masks()[mask_name]
    x, context = torch.randn(B, M, D), torch.randn(B, N, D)
    fast = attn(x, context, **kwargs)
    slow, _ = explicit(attn, x, context, **kwargs)
    assert (fast - slow).abs().max() < 1e-5
    if not kwargs:  # self-attention too
        assert (attn(x) - explicit(attn, x)[0]).abs().max() < 1e-5


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("mask_name", ["bool", "float", "key_mask", "causal", "all"])
def test_masked_weights_are_exactly_zero_and_rows_sum_to_one(score, mask_name):
    attn = Attention(D, num_heads=H, attn_score=score, score_dim=4)
    kwargs = masks()[mask_name]
    _, w = explicit(attn, torch.randn(B, M, D), torch.randn(B, N, D), **kwargs)
    allowed = allowed_of(kwargs).expand_as(w)
    assert torch.all(w[~allowed] == 0)
    has_key = allowed.any(-1)
    torch.testing.assert_close(w.sum(-1)[has_key], torch.ones(int(has_key.sum())))


def test_causal_mask_is_lower_triangular():
    attn = Attention(D, num_heads=H)
    _, w = explicit(attn, torch.randn(B, 6, D), causal=True)
    assert torch.all(w.triu(diagonal=1) == 0)
    torch.testing.assert_close(w[..., 0, 0], torch.ones(B, H))  # the first query sees only itself


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("recorded", [False, True])
def test_a_query_with_every_key_masked_gets_zeros_not_nan(score, recorded):
    attn = Attention(D, num_heads=H, attn_score=score, score_dim=4)
    mask = torch.ones(B, 1, M, N, dtype=torch.bool)
    mask[:, :, 2] = False  # query 2 may look nowhere
    x, context = torch.randn(B, M, D, requires_grad=True), torch.randn(B, N, D)
    res = explicit(attn, x, context, mask=mask) if recorded else attn(x, context, mask=mask)
    out = res[0] if recorded else res
    assert not torch.isnan(out).any()
    # the row's attention output is zero, so the block output is the projection's bias alone
    torch.testing.assert_close(out[:, 2], attn.proj.bias.expand(B, -1))
    if recorded:
        assert torch.all(res[1][:, :, 2] == 0)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in attn.parameters() if p.grad is not None)


def test_cross_attention_with_three_different_widths():
    attn = Attention(8, num_heads=2, kdim=5, vdim=3, attn_dim=6, out_dim=4)
    x, ctx, val = torch.randn(B, M, 8), torch.randn(B, N, 5), torch.randn(B, N, 3)
    out, w = explicit(attn, x, ctx, value=val)
    assert out.shape == (B, M, 4) and w.shape == (B, 2, M, N)
    # the formula with the module's separate projections
    q = (x @ attn.q.weight.T + attn.q.bias).reshape(B, M, 2, 3).transpose(1, 2)
    k = (ctx @ attn.k.weight.T + attn.k.bias).reshape(B, N, 2, 3).transpose(1, 2)
    v = (val @ attn.v.weight.T + attn.v.bias).reshape(B, N, 2, 3).transpose(1, 2)
    expected_w = (q @ k.transpose(-1, -2) / 3**0.5).softmax(-1)
    torch.testing.assert_close(w, expected_w)
    expected = (expected_w @ v).transpose(1, 2).reshape(B, M, 6) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(attn(x, ctx, value=val), out, atol=1e-5, rtol=1e-5)  # fast path agrees


def test_attention_input_errors_name_the_problem():
    attn = Attention(D, num_heads=H, kdim=5)
    with pytest.raises(ValueError, match="value has 3 tokens but context has 7"):
        attn(torch.randn(B, M, D), torch.randn(B, N, 5), value=torch.randn(B, 3, 5))
    with pytest.raises(ValueError, match="value was given without context"):
        attn(torch.randn(B, M, D), value=torch.randn(B, N, D))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 3\) does not broadcast"):
        Attention(D, num_heads=H)(torch.randn(B, M, D), mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_mask must be a bool tensor of shape"):
        Attention(D, num_heads=H)(torch.randn(B, M, D), key_mask=torch.ones(B, M))
    with pytest.raises(ValueError, match="attn_score='bilinear' is not allowed: expected one of"):
        Attention(D, num_heads=H, attn_score="bilinear")


TINY = dict(img_size=16, patch_size=4, in_chans=1, num_classes=3, embed_dim=12, depth=2, num_heads=3)


@pytest.mark.parametrize("pool", ["cls", "mean", "map"])
@pytest.mark.parametrize("score", SCORES)
def test_gradients_reach_every_parameter(pool, score):
    model = VisionTransformer(**TINY, pool=pool, attn_score=score, score_dim=4)
    F.cross_entropy(model(torch.randn(4, 1, 16, 16)), torch.tensor([0, 1, 2, 0])).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


@pytest.mark.parametrize("pool, tokens, extra", [("cls", 17, 0), ("mean", 16, 0), ("map", 16, 1)])
def test_record_attention_for_every_pool(pool, tokens, extra):
    model = VisionTransformer(**TINY, pool=pool).eval()
    x = torch.randn(2, 1, 16, 16)
    with record_attention(model) as attns:
        logits = model(x)
    assert len(attns) == TINY["depth"] + extra
    for a in attns[: TINY["depth"]]:
        assert a.shape == (2, 3, tokens, tokens)
    if pool == "map":
        assert attns[-1].shape == (2, 3, 1, tokens)  # the pooling query over the patch tokens
    for a in attns:
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]))
    assert (model(x) - logits).abs().max() < 1e-5
    assert model.num_prefix_tokens == (1 if pool == "cls" else 0)
    assert ("cls_token" in dict(model.named_parameters())) == (pool == "cls")


def test_record_attention_restores_the_fast_path_and_refuses_nesting():
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(2, 1, 16, 16)
    with record_attention(model) as maps:
        model(x)
        with pytest.raises(RuntimeError, match="already recording"):
            with record_attention(model):
                pass
    assert len(maps) == TINY["depth"]
    model(x)  # after the context, nothing more is recorded
    assert len(maps) == TINY["depth"]
    assert all(block.attn.recorder is None for block in model.blocks)
    with pytest.raises(RuntimeError, match="inside the context"), record_attention(model):
        assert all(block.attn.recorder is not None for block in model.blocks)  # recording when the error comes
        raise RuntimeError("an error inside the context")
    assert all(block.attn.recorder is None for block in model.blocks)  # restored after an error too


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_an_integer_mask_is_refused_rather_than_read_as_a_bias(dtype):
    # Read as a bias, a 0/1 mask would add 0 or 1 to the scores: nothing would be blocked.
    model = VisionTransformer(**TINY).eval()
    allowed = torch.eye(17, dtype=dtype)[None, None]  # (1, 1, N, N): each token may see only itself
    message = re.escape(
        f"a mask of dtype {dtype} is not allowed: pass a bool mask (True = may attend; "
        "`mask.bool()` for a 0/1 mask) or a float additive bias (0 = may attend, -inf = blocked)"
    )
    with pytest.raises(ValueError, match=message), mask_attention(model, allowed):
        pass
    assert model.attn_mask is None
    with pytest.raises(ValueError, match=message):  # the layer's own mask argument too
        Attention(D, num_heads=H)(torch.randn(B, M, D), mask=torch.ones(M, M, dtype=dtype))
    with torch.no_grad(), mask_attention(model, allowed.bool()), record_attention(model) as maps:
        model(torch.randn(2, 1, 16, 16))
    torch.testing.assert_close(maps[0], torch.eye(17).expand(2, 3, 17, 17))  # as a bool mask, it blocks


@pytest.mark.parametrize("value, name", [(float("nan"), "NaN"), (float("inf"), "+inf")])
def test_a_bias_holding_nan_or_plus_inf_is_refused_naming_it(value, name):
    model = VisionTransformer(**TINY).eval()
    bias = torch.zeros(1, 1, 17, 17)
    bias[0, 0, 3, 5] = value
    message = (
        f"the mask holds {name} (1 of 289 values): an additive bias must be finite (0 = may attend) or -inf (blocked)"
    )
    with pytest.raises(ValueError, match=re.escape(message)), mask_attention(model, bias):
        pass
    bias[0, 0, 3, 5] = float("-inf")  # -inf blocks: allowed
    with torch.no_grad(), mask_attention(model, bias):
        assert torch.isfinite(model(torch.randn(2, 1, 16, 16))).all()


def test_local_mask_against_a_brute_force():
    from vit.models.masks import local_mask

    gh, gw, prefix = 4, 5, 1
    for radius in (0, 1, 2):
        mask = local_mask((gh, gw), radius, prefix)
        for i in range(prefix + gh * gw):
            for j in range(prefix + gh * gw):
                if i < prefix or j < prefix:
                    expected = True
                else:
                    (ri, ci), (rj, cj) = divmod(i - prefix, gw), divmod(j - prefix, gw)
                    expected = max(abs(ri - rj), abs(ci - cj)) <= radius
                assert bool(mask[i, j]) == expected, (radius, i, j)
