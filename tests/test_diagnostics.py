"""The recipe study's plateau diagnostics (studies/recipe/diagnostics.py) against hand computations, and the callback
in a real (tiny) fit."""

import csv
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from studies.recipe.diagnostics import PlateauDiagnostics, attention_stats, grad_norms, token_probe
from vit.data.same_different import SHAPE_SIZE, SameDifferentDataModule, SameDifferentDataset, make_shapes
from vit.models import VisionTransformer
from vit.training.classifier import ImageClassifier

TINY = dict(img_size=16, patch_size=4, in_chans=1, num_classes=2, embed_dim=8, depth=2, num_heads=2, pool="mean")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_zero_queries_give_uniform_attention_entropy_ln_n_and_max_weight_1_over_n():
    model = VisionTransformer(**TINY).eval()
    for block in model.blocks:  # q = 0 for every token: every score is 0, every row uniform over 16 keys
        block.attn.qkv.weight.data[:8] = 0
        block.attn.qkv.bias.data[:8] = 0
    stats = attention_stats(model, torch.randn(3, 1, 16, 16))
    for i in range(2):
        assert stats[f"attn/block{i}_entropy"] == pytest.approx(math.log(16), abs=1e-5)
        assert stats[f"attn/block{i}_max_weight"] == pytest.approx(1 / 16, abs=1e-7)


def test_attention_stats_equal_the_formula_on_each_row():
    model = VisionTransformer(**TINY).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)  # sharp, uneven attention
    x = torch.randn(2, 1, 16, 16)
    stats = attention_stats(model, x)
    # by hand: block 0's input is the embedded image; its attention is softmax(q k^T / sqrt(d)) per head
    tokens = model.blocks[0].norm1(model.embed(x))
    q, k, _ = model.blocks[0].attn.qkv(tokens).reshape(2, 16, 3, 2, 4).permute(2, 0, 3, 1, 4)
    rows = (q @ k.transpose(-1, -2) / 2.0).softmax(-1).reshape(-1, 16).tolist()  # sqrt(head_dim 4) = 2
    entropy = sum(-sum(p * math.log(p) for p in row) for row in rows) / len(rows)
    assert stats["attn/block0_entropy"] == pytest.approx(entropy, rel=1e-5)
    assert stats["attn/block0_max_weight"] == pytest.approx(sum(max(r) for r in rows) / len(rows), rel=1e-5)


def test_qk_gradient_norm_covers_the_query_and_key_rows_only():
    model = VisionTransformer(**TINY)
    F.cross_entropy(model(torch.randn(4, 1, 16, 16)), torch.tensor([0, 1, 0, 1])).backward()
    squares = 0.0
    for block in model.blocks:
        w_q, w_k, _ = block.attn.qkv.weight.grad.chunk(3)
        b_q, b_k, _ = block.attn.qkv.bias.grad.chunk(3)
        squares += sum(t.pow(2).sum().item() for t in (w_q, w_k, b_q, b_k))
    norms = grad_norms(model)
    assert norms["grad/qk"] == pytest.approx(math.sqrt(squares), rel=1e-6)
    assert norms["grad/pos_embed"] == pytest.approx(model.pos_embed.grad.norm().item(), rel=1e-6)


class _Features(torch.nn.Module):
    """A stand-in whose tokens after every block are given features."""

    def __init__(self, features):
        super().__init__()
        self.features = features

    def forward_intermediates(self, x, indices, output_fmt, intermediates_only):
        return [self.features]


def test_token_probe_reads_a_linear_code_and_not_noise():
    labels = torch.randint(0, 4, (40, 6))
    labels[:, ::2] = -1  # half the tokens carry no label
    code = torch.randn(4, 8)
    informative = code[labels.clamp(min=0)] + 0.01 * torch.randn(40, 6, 8)
    x = torch.zeros(40, 1)
    assert token_probe(_Features(informative), x, labels) == 1.0
    noise = torch.randn(40, 6, 8)
    assert token_probe(_Features(noise), x, labels) < 0.6
    # the ridge solution is least squares onto one-hot targets with a bias, fitted on images 0..19
    keep = labels[:20] >= 0
    fit = torch.cat([noise[:20][keep], torch.ones(int(keep.sum()), 1)], 1).double()
    solution = torch.linalg.lstsq(fit, F.one_hot(labels[:20][keep], 4).double()).solution
    test_keep = labels[20:] >= 0
    test = torch.cat([noise[20:][test_keep], torch.ones(int(test_keep.sum()), 1)], 1).double()
    expected = ((test @ solution).argmax(1) == labels[20:][test_keep]).double().mean().item()
    assert token_probe(_Features(noise), x, labels, ridge=1e-9) == pytest.approx(expected)


def test_token_labels_mark_the_patch_of_each_strokes_centre_pixel():
    data = SameDifferentDataset(num_samples=20, img_size=32, noise=0.0, seed=3)
    labels = data.token_labels(4)
    shapes = make_shapes()
    for n in range(20):
        expected = torch.full((64,), -1)
        for k in range(2):
            r, c = data.positions[n, k].tolist()
            ink = [
                (r + i, c + j)
                for i in range(SHAPE_SIZE)
                for j in range(SHAPE_SIZE)
                if shapes[data.shape_ids[n, k]][i, j]
            ]
            row, col = sorted(ink)[len(ink) // 2]  # every stroke's middle pixel is its box's centre
            expected[(row // 4) * 8 + col // 4] = data.shape_ids[n, k]
        assert torch.equal(labels[n], expected)


def test_the_callback_logs_every_diagnostic_during_a_fit(tmp_path):
    data = SameDifferentDataModule(num_train=64, num_val=32, num_test=16, batch_size=16, seed=0)
    model = ImageClassifier(
        VisionTransformer(
            img_size=32, patch_size=4, in_chans=1, num_classes=2, embed_dim=16, depth=2, num_heads=2, pool="mean"
        ),
        lr=1e-3,
    )
    trainer = L.Trainer(
        max_steps=4,
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
        log_every_n_steps=1,
        callbacks=[PlateauDiagnostics(every_n_steps=2, num_images=32)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = {k for row in rows for k, v in row.items() if v}
    for key in ("attn/block0_entropy", "attn/block1_max_weight", "probe/block1_acc", "grad/qk", "grad/pos_embed"):
        assert key in logged
    entropies = [float(r["attn/block0_entropy"]) for r in rows if r.get("attn/block0_entropy")]
    assert all(0 < e <= math.log(64) + 1e-6 for e in entropies)
