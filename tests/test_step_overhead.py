"""The overhead benchmark's floor runs the bare step: the same updates through Lightning's loop as by hand."""

import lightning as L
import torch
import torch.nn.functional as F

from benchmarks.step_overhead import BareStep, SlicedBatches
from vit.models import VisionTransformer


def tiny_model(seed: int) -> VisionTransformer:
    torch.manual_seed(seed)
    return VisionTransformer(img_size=16, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=1, num_heads=2)


class Replay:
    """The same batches again, as one iterable (a list would be taken by Lightning for a list of loaders)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def test_the_floor_makes_the_bare_loops_updates_through_lightning():
    torch.manual_seed(1)
    x, y = torch.randn(20, 1, 16, 16), torch.randint(0, 2, (20,))
    batches = list(SlicedBatches(x, y, batch=4, steps=3))
    assert len(batches) == 3 and all(b[0].shape == (4, 1, 16, 16) for b in batches)

    by_hand = tiny_model(0)
    optimizer = torch.optim.AdamW(by_hand.parameters(), lr=0.01)
    losses = []
    for bx, by in batches:
        loss = F.cross_entropy(by_hand(bx), by)
        losses.append(float(loss))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    floored = tiny_model(0)
    module = BareStep(floored, torch.optim.AdamW(floored.parameters(), lr=0.01), logged=True)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, Replay(batches))
    assert trainer.global_step == 3
    for (name, a), b in zip(by_hand.state_dict().items(), floored.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    # what the one `self.log` logged: the step's loss, its epoch mean in `callback_metrics` after the epoch
    assert abs(float(trainer.callback_metrics["train/loss"]) - sum(losses) / 3) < 1e-6
