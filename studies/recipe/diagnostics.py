"""What tells a ViT run stuck on the loss plateau from one that leaves it, logged while it trains: the recipe
study's diagnostics (its screen, ``screen.py``, and the recipe's own config, ``configs/same_different/vit.yaml``).

Three measurements, each a function of the model and a fixed probe batch, and `PlateauDiagnostics`,
the callback that logs them every `every_n_steps` optimizer steps:

* attention sharpness per block: the mean entropy of the attention rows (nats; uniform over N
  keys is ln N) and the mean of each row's largest weight (uniform: 1/N);
* gradient norms of the query/key projections (the rows of every `qkv` that make q and k) and of
  a learned position table: is anything pushing attention to change?
* a linear probe of the tokens after a block: when the data say which token holds which object
  (`token_labels`), a least-squares probe fitted on half the probe images and scored on the other
  half tells whether each token already encodes its object (for `same_different`: the stroke's
  orientation, chance 25%).
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import nn

from vit.checks import check_int
from vit.models import record_attention


def attention_stats(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """`attn/block{i}_entropy` and `attn/block{i}_max_weight` of every block, averaged over images, heads and
    queries."""
    with torch.no_grad(), record_attention(model) as maps:
        model(x)
    stats = {}
    for i, weights in enumerate(maps[: len(model.blocks)]):  # (B, H, N, N); a MAP head's map comes last
        stats[f"attn/block{i}_entropy"] = -(weights * weights.clamp_min(1e-30).log()).sum(-1).mean().item()
        stats[f"attn/block{i}_max_weight"] = weights.amax(-1).mean().item()
    return stats


def grad_norms(model: nn.Module) -> dict[str, float]:
    """`grad/qk`: the L2 norm of the gradient of every block's query and key projections together;
    `grad/pos_embed`: that of a learned position table. Read after `backward`, before the step."""
    squares = []
    for block in model.blocks:
        qkv = block.attn.qkv
        if qkv.weight.grad is None:
            continue
        qk_rows = 2 * qkv.weight.shape[0] // 3  # q and k rows; v is the last third
        squares.append(qkv.weight.grad[:qk_rows].pow(2).sum())
        if qkv.bias is not None and qkv.bias.grad is not None:
            squares.append(qkv.bias.grad[:qk_rows].pow(2).sum())
    norms = {"grad/qk": torch.stack(squares).sum().sqrt().item()} if squares else {}
    pos = getattr(model, "pos_embed", None)
    if isinstance(pos, nn.Parameter) and pos.grad is not None:
        norms["grad/pos_embed"] = pos.grad.norm().item()
    return norms


def token_probe(
    model: nn.Module, x: torch.Tensor, token_labels: torch.Tensor, block: int = 0, ridge: float = 1e-3
) -> float:
    """Accuracy of a linear probe from the patch tokens after `block` to `token_labels` `(B, num_patches)`.

    Labels are class indices, -1 for tokens without one. The probe is ridge regression onto
    one-hot targets (with a bias), fitted on the labelled tokens of the first half of the images
    and scored (argmax) on those of the second half.
    """
    with torch.no_grad():
        features = model.forward_intermediates(x, indices=[block], output_fmt="NLC", intermediates_only=True)[0]
    half = len(x) // 2
    num_classes = int(token_labels.max()) + 1

    def labelled(part: slice) -> tuple[torch.Tensor, torch.Tensor]:
        keep = token_labels[part] >= 0
        f = features[part][keep].double()  # (n, D)
        return torch.cat([f, torch.ones(len(f), 1, dtype=f.dtype)], 1), token_labels[part][keep]

    f_fit, y_fit = labelled(slice(0, half))
    f_test, y_test = labelled(slice(half, None))
    targets = nn.functional.one_hot(y_fit, num_classes).double()
    gram = f_fit.T @ f_fit + ridge * torch.eye(f_fit.shape[1], dtype=f_fit.dtype)
    weights = torch.linalg.solve(gram, f_fit.T @ targets)  # (D + 1, classes)
    return ((f_test @ weights).argmax(1) == y_test).double().mean().item()


class PlateauDiagnostics(L.Callback):
    """Log attention sharpness, query/key and position gradient norms, and a token probe while a ViT trains.

    Works with any `VisionTransformer` backbone (`model.backbone`); the probe batch is the first
    `num_images` of the validation split. The token probe runs when the validation dataset has a
    `token_labels(patch_size)` method (`SameDifferentDataset` has: the orientation of the stroke
    whose centre lies in the token's patch), after every block. Add it to a config's `trainer.callbacks` as
    `studies.recipe.diagnostics.PlateauDiagnostics` (as `configs/same_different/vit.yaml` does), and run
    `python train.py` from the repository root, where `studies` is importable.
    """

    def __init__(self, every_n_steps: int = 50, num_images: int = 256) -> None:
        check_int("every_n_steps", every_n_steps, 1)
        check_int("num_images", num_images, 2)
        self.every_n_steps, self.num_images = every_n_steps, num_images
        self._batch: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _probe_batch(self, trainer: L.Trainer, device: torch.device):
        if self._batch is None:
            dataset = trainer.datamodule.val_set
            n = min(self.num_images, len(dataset))
            x = torch.stack([dataset[i][0] for i in range(n)])
            labels = None
            if callable(getattr(dataset, "token_labels", None)):
                labels = dataset.token_labels(trainer.lightning_module.backbone.patch_embed.patch_size)[:n]
            self._batch = (x, labels)
        x, labels = self._batch
        return x.to(device), labels

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            pl_module.log_dict(grad_norms(pl_module.backbone), on_step=True, on_epoch=False)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps != 0 or trainer.sanity_checking:
            return
        model = pl_module.backbone
        x, labels = self._probe_batch(trainer, pl_module.device)
        was_training = model.training
        model.eval()
        try:
            stats = attention_stats(model, x)
            stats["attn/uniform_entropy"] = math.log(model.patch_embed.num_patches + model.num_prefix_tokens)
            if labels is not None:
                for i in range(len(model.blocks)):
                    stats[f"probe/block{i}_acc"] = token_probe(model, x, labels.to(x.device), block=i)
        finally:
            model.train(was_training)
        pl_module.log_dict(stats, on_step=True, on_epoch=False)
