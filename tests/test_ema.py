"""EMA of the weights (`ImageClassifier(ema_decay=...)`): the average is the formula, it is what evaluation and
every command that opens the checkpoint run, and a resumed `fit` continues it exactly."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from robust_helpers import main_in_process, tiny_config
from torch.utils.data import DataLoader, TensorDataset

from vit.models import VisionTransformer
from vit.training.classifier import ImageClassifier

CFG = {"img_size": 16, "patch_size": 8, "num_classes": 3, "embed_dim": 16, "depth": 2, "num_heads": 2}


def test_the_average_after_k_steps_is_the_formula():
    torch.manual_seed(0)
    decay, k = 0.8, 5
    model = ImageClassifier(VisionTransformer(**CFG), ema_decay=decay)
    optimizer = torch.optim.SGD(model.backbone.parameters(), lr=0.5)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    weights = [{n: p.detach().clone() for n, p in model.backbone.named_parameters()}]  # w_0: where training starts
    for step in range(k):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.optimizer_step(0, step, optimizer)  # as Lightning calls it: the step, then the average
        weights.append({n: p.detach().clone() for n, p in model.backbone.named_parameters()})
    averaged = dict(model.ema.module.named_parameters())
    for name in weights[0]:
        # e_k = d^k w_0 + sum_{i=1..k} (1 - d) d^(k - i) w_i
        expected = decay**k * weights[0][name] + sum(
            (1 - decay) * decay ** (k - i) * weights[i][name] for i in range(1, k + 1)
        )
        torch.testing.assert_close(averaged[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(averaged["head.weight"], weights[-1]["head.weight"])  # the average is not the weights
    assert not any(p.requires_grad for p in model.ema.parameters())


def test_evaluation_runs_the_average():
    torch.manual_seed(0)
    model = ImageClassifier(VisionTransformer(**CFG), ema_decay=0.5).eval()
    with torch.no_grad():
        for p in model.ema.module.parameters():
            p.add_(0.1)
        x = torch.randn(2, 3, 16, 16)
        assert torch.equal(model.predict_step(x, 0), model.ema.module(x).softmax(dim=-1))
        assert not torch.allclose(model.predict_step(x, 0), model(x).softmax(dim=-1))


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5])
def test_ema_decay_names_what_is_allowed(bad):
    with pytest.raises(ValueError, match=f"ema_decay={bad}"):
        ImageClassifier(VisionTransformer(**CFG), ema_decay=bad)


def _fit(root, ckpt_path=None) -> ImageClassifier:
    """6 steps (2 epochs of 3 batches, in order) of a tiny ViT with EMA, a checkpoint at every epoch end."""
    L.seed_everything(0)
    data = TensorDataset(torch.randn(12, 3, 16, 16), torch.randint(0, 3, (12,)))
    model = ImageClassifier(VisionTransformer(**CFG), lr=0.01, warmup_epochs=0.5, ema_decay=0.7)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1)],
    )
    trainer.fit(model, DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return model


def test_a_resumed_fit_continues_the_weights_and_the_average_exactly(tmp_path):
    whole = _fit(tmp_path / "whole")
    resumed = _fit(tmp_path / "resumed", ckpt_path=tmp_path / "whole" / "epoch=0-step=3.ckpt")
    first = torch.load(tmp_path / "whole" / "epoch=0-step=3.ckpt", weights_only=True)["state_dict"]
    assert any(key.startswith("ema.module.") for key in first)
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0, msg=name)
    assert not torch.equal(whole.ema.module.head.weight, whole.backbone.head.weight)


@pytest.mark.slow
def test_a_checkpoint_with_ema_gives_the_predictions_of_the_average_in_every_command(tmp_path, monkeypatch):
    """train.py with `--model.ema_decay`: vit.artifact.load (vit.predict, vit.explain, vit.load), and vit.export, run
    the averaged weights: equal to a forward of the backbone loaded by hand with `ema.module.*`."""
    import vit
    import vit.artifact
    from vit.export import load as export_load

    config = tiny_config(tmp_path, max_epochs=1)
    main_in_process(
        ["fit", "--config", str(config), "--test_after_fit", "false", "--model.ema_decay", "0.9"], monkeypatch
    )
    path = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["state_dict"]
    averaged = {k.removeprefix("ema.module."): v for k, v in state.items() if k.startswith("ema.module.")}
    trained = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
    assert averaged.keys() == trained.keys()
    by_hand, raw = vit.artifact.load(path).model, vit.artifact.load(path).model
    by_hand.load_state_dict(averaged)
    raw.load_state_dict(trained)
    opened = vit.artifact.load(path)
    model = opened.model
    x = torch.randn(3, opened.inputs["in_chans"], *opened.inputs["img_size"])
    with torch.no_grad():
        expected = by_hand.eval()(x)
        assert not torch.allclose(raw.eval()(x), expected, atol=1e-4)  # the average differs from the weights
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # what vit.explain records
        torch.testing.assert_close(vit.load(path).model(x), expected, rtol=0, atol=0)
        torch.testing.assert_close(export_load(path)[0](x), expected, rtol=0, atol=0)
