"""The optimizer the classifier builds: which parameters train and decay, and the learning rate at every step."""

import math
from types import SimpleNamespace

import pytest
import torch

from vit.models import ResNet, VisionTransformer
from vit.training.classifier import ImageClassifier

CIFAR_CFG = dict(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=48, depth=2, num_heads=3)


def optimizer_and_schedule(model: ImageClassifier, total_steps: int, max_epochs: int, per_epoch: int | None = None):
    """What Lightning gets from `configure_optimizers`, for a run of `total_steps` optimizer steps of `per_epoch`
    an epoch (by default the run's steps over its epochs; fewer steps: `max_steps` ends the run first)."""
    model.trainer = SimpleNamespace(
        estimated_stepping_batches=total_steps,
        max_epochs=max_epochs,
        num_training_batches=per_epoch or total_steps // max_epochs,
        accumulate_grad_batches=1,
    )
    config = model.configure_optimizers()
    return config["optimizer"], config["lr_scheduler"]["scheduler"]


@pytest.mark.parametrize("pool", ["cls", "map"])
def test_weight_decay_only_on_weight_matrices(pool):
    model = ImageClassifier(VisionTransformer(**CIFAR_CFG, pool=pool, reg_tokens=2), weight_decay=0.05)
    optimizer, _ = optimizer_and_schedule(model, total_steps=10, max_epochs=1)
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    named = list(model.backbone.named_parameters())
    assert len(decay_of) == len(named)  # every parameter once
    for name, p in named:
        # Norm gains, biases, the CLS token, the registers, the position embedding and the MAP query are not weights.
        is_weight = p.ndim >= 2 and name not in ("cls_token", "reg_token", "pos_embed", "attn_pool.latent")
        assert decay_of[id(p)] == (0.05 if is_weight else 0.0), name
    assert any(name == "attn_pool.latent" for name, _ in named) == (pool == "map")


def test_frozen_parameters_are_not_given_to_the_optimizer():
    model = ImageClassifier(ResNet(img_size=32, in_chans=1, num_classes=2), trainable="head")
    optimizer, _ = optimizer_and_schedule(model, total_steps=10, max_epochs=1)
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert given == {id(p) for p in model.backbone.head.parameters()}


@pytest.mark.parametrize(
    "trainable, trained, pool",
    [
        ("head", {"head"}, "cls"),
        (1, {"head", "norm", "blocks.1"}, "cls"),
        (1, {"head", "fc_norm", "blocks.1"}, "mean"),  # timm's average pooling normalises after the mean
        ("all", {"head", "norm", "blocks.1", "blocks.0", "patch_embed", "cls_token", "pos_embed"}, "cls"),
    ],
)
def test_freezing_trains_only_what_it_names(trainable, trained, pool):
    torch.manual_seed(0)
    backbone = VisionTransformer(
        img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2, pool=pool
    )
    model = ImageClassifier(backbone, trainable=trainable, lr=0.1, weight_decay=0.0)
    before = {n: p.detach().clone() for n, p in backbone.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()
    for name, p in backbone.named_parameters():
        moved = not torch.equal(p, before[name])
        expected = any(name == t or name.startswith(t + ".") for t in trained)
        assert moved == expected, name
        assert p.requires_grad == expected and (p.grad is not None) == expected, name


def test_freezing_options_name_what_is_allowed():
    vit = VisionTransformer(img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2)
    with pytest.raises(ValueError, match=r"trainable=3 is not allowed: expected an int in \[0, 2\]"):
        ImageClassifier(vit, trainable=3)
    with pytest.raises(ValueError, match="trainable=1 counts Transformer blocks; ResNet has no `blocks`"):
        ImageClassifier(ResNet(img_size=16, in_chans=3, num_classes=3, widths=(4,)), trainable=1)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The schedule written out: linear warmup, update t at (t + 1) / W, reaching 1 at update W - 1, then a cosine
    from there to `min_lr_ratio` at `total_steps`."""
    peak = max(0, warmup_steps - 1)
    if step < peak:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - peak) / max(1, total_steps - peak))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_step(step: int, warmup_steps: int, decay_steps: int, decay_rate: float) -> float:
    """The step schedule written out: the same warmup, then times `decay_rate` every `decay_steps` updates."""
    peak = max(0, warmup_steps - 1)
    return (step + 1) / warmup_steps if step < peak else decay_rate ** ((step - peak) // decay_steps)


@pytest.mark.parametrize(
    "warmup_epochs, min_lr_ratio, warmup_steps",
    [(1.0, 0.1, 10), (0.0, 0.0, 0), (0.0, 0.25, 0), (0.1, 0.0, 1), (0.2, 0.5, 2), (11.0, 0.0, 110), (1.0, 1.0, 10)],
)
def test_learning_rate_at_every_step_follows_warmup_then_cosine_also_after_a_resume(
    warmup_epochs, min_lr_ratio, warmup_steps
):
    lr, total_steps = 0.01, 110  # 11 epochs of 10 steps
    backbone = ResNet(img_size=32, in_chans=1, num_classes=2)

    def build():
        model = ImageClassifier(backbone, lr=lr, warmup_epochs=warmup_epochs, min_lr_ratio=min_lr_ratio)
        return optimizer_and_schedule(model, total_steps=total_steps, max_epochs=11)

    optimizer, schedule = build()
    resume_at = 37
    for step in range(total_steps + 1):  # Lightning steps the schedule after each optimizer step
        if step == resume_at:  # as Lightning resumes: new objects from configure_optimizers, then the saved states
            states = optimizer.state_dict(), schedule.state_dict()
            optimizer, schedule = build()
            optimizer.load_state_dict(states[0])
            schedule.load_state_dict(states[1])
        expected = lr * warmup_cosine(step, warmup_steps, total_steps, min_lr_ratio)
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(expected, rel=0, abs=lr * 1e-12), step
        optimizer.step()
        schedule.step_update(step + 1)  # as `ImageClassifier.lr_scheduler_step`: the update count after the step


def layer_of(name: str, depth: int) -> int:
    """BEiT's layer of a ViT parameter, written out: the stem 0, block N at N + 1 (the final norm with the last
    block), the head after them at depth + 1."""
    if name.startswith(("patch_embed.", "cls_token", "reg_token", "pos_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    if name.startswith("norm."):
        return depth
    return depth + 1  # fc_norm, attn_pool, head


@pytest.mark.parametrize("pool, min_lr_ratio", [("cls", 0.0), ("map", 0.1)])
def test_layer_decay_gives_each_layer_lr_times_decay_to_the_depth_above_it_at_every_step(pool, min_lr_ratio):
    depth, decay, lr, total_steps, warmup_steps = 3, 0.75, 0.01, 20, 10
    backbone = VisionTransformer(
        img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=depth, num_heads=2, pool=pool, reg_tokens=1
    )
    model = ImageClassifier(
        backbone, lr=lr, weight_decay=0.05, warmup_epochs=1.0, layer_decay=decay, min_lr_ratio=min_lr_ratio
    )
    optimizer, schedule = optimizer_and_schedule(model, total_steps=total_steps, max_epochs=2)
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    named = list(backbone.named_parameters())
    assert len(group_of) == len(named)
    num_layers = depth + 2
    scale = {name: decay ** (num_layers - 1 - layer_of(name, depth)) for name, _ in named}
    assert scale["head.weight"] == 1.0 and scale["patch_embed.proj.weight"] == decay ** (depth + 1)
    for name, p in named:
        assert group_of[id(p)]["lr_scale"] == pytest.approx(scale[name], rel=1e-12), name
        is_weight = p.ndim >= 2 and name not in ("cls_token", "reg_token", "pos_embed", "attn_pool.latent")
        assert group_of[id(p)]["weight_decay"] == (0.05 if is_weight else 0.0), name
    # timm's schedules give each group `value * lr_scale`: its warmup, peak and floor, scaled at every step.
    for step in range(total_steps + 1):
        factor = warmup_cosine(step, warmup_steps, total_steps, min_lr_ratio)
        for name, p in named:
            assert group_of[id(p)]["lr"] == pytest.approx(lr * scale[name] * factor, rel=1e-9, abs=1e-15), (step, name)
        optimizer.step()
        schedule.step_update(step + 1)


def test_layer_decay_groups_are_those_timm_gives_its_own_vision_transformer():
    import timm
    from timm.optim import param_groups_layer_decay

    cfg = {
        "img_size": 16,
        "patch_size": 8,
        "num_classes": 3,
        "embed_dim": 16,
        "depth": 2,
        "num_heads": 2,
        "reg_tokens": 1,
    }
    ours, theirs = VisionTransformer(**cfg), timm.create_model("vit_tiny_patch16_224", pretrained=False, **cfg)

    def scales(model):
        return {
            name: group["lr_scale"]
            for group in param_groups_layer_decay(model, layer_decay=0.5)
            for name, p in model.named_parameters()
            if any(p is q for q in group["params"])
        }

    assert scales(ours) == scales(theirs)
    assert len(set(scales(ours).values())) == 4  # stem, 2 blocks, head: the matcher is used, not timm's fallback


def test_layer_decay_options_name_what_is_allowed():
    vit = VisionTransformer(img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2)
    for bad in (0.0, 1.5, -0.5):
        with pytest.raises(ValueError, match=f"layer_decay={bad}"):
            ImageClassifier(vit, layer_decay=bad)
    ImageClassifier(vit, layer_decay=1.0)  # every layer at lr: allowed
    with pytest.raises(ValueError, match="layer_decay=0.75 needs a backbone with timm's `group_matcher`.*ResNet"):
        ImageClassifier(ResNet(img_size=16, in_chans=3, num_classes=3, widths=(4,)), layer_decay=0.75)
    ImageClassifier(vit, layer_decay=0.75, min_lr_ratio=0.01)  # each group's floor is its own (timm's lr_scale)


def test_with_layer_decay_each_groups_learning_rate_is_logged_beside_the_heads():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    backbone = VisionTransformer(img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2)
    model = ImageClassifier(backbone, lr=0.01, warmup_epochs=0.0, layer_decay=0.5)
    data = DataLoader(TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 3, (8,))), batch_size=4)
    trainer = L.Trainer(
        max_steps=2,
        log_every_n_steps=1,  # the rates are logged on the steps the loggers write
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/lr")}
    # The last step's rates (the schedule has since stepped to its end): the head's, times each group's layer scale.
    scales = [group["lr_scale"] for group in trainer.optimizers[0].param_groups]
    assert {k: v for k, v in logged.items() if k != "train/lr"} == {
        f"train/lr/group_{i}": pytest.approx(logged["train/lr"] * scale) for i, scale in enumerate(scales)
    }
    assert max(scales) == 1.0 and len(set(scales)) > 2 and logged["train/lr"] > 0


@pytest.mark.parametrize("opt, cls", [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD), ("lamb", None)])
def test_the_optimizer_is_timms_by_name_over_the_same_parameter_groups(opt, cls):
    import timm.optim

    backbone = VisionTransformer(**CIFAR_CFG)
    model = ImageClassifier(backbone, opt=opt, lr=0.01, weight_decay=0.05, betas=(0.8, 0.9), layer_decay=0.5)
    optimizer, _ = optimizer_and_schedule(model, total_steps=10, max_epochs=1)
    reference = timm.optim.create_optimizer_v2(backbone, opt=opt, lr=0.01, weight_decay=0.05, layer_decay=0.5)
    assert type(optimizer) is (cls or type(reference))
    ours = sorted((g["lr_scale"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups)
    theirs = sorted((g["lr_scale"], g["weight_decay"], len(g["params"])) for g in reference.param_groups)
    assert ours == theirs  # timm's own layer-decay groups for its factory
    if "betas" in optimizer.defaults:
        assert optimizer.defaults["betas"] == (0.8, 0.9)
    else:
        assert optimizer.defaults["momentum"] == 0.9 and optimizer.defaults["nesterov"]  # timm's sgd


def test_an_optimizer_timm_does_not_have_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"opt='adamx' is not allowed: expected one of timm's optimizers"):
        ImageClassifier(VisionTransformer(**CIFAR_CFG), opt="adamx")


@pytest.mark.parametrize("opt, total_steps", [("sgd", 60), ("adamw", 60), ("sgd", 40)])
def test_a_step_schedule_multiplies_the_rate_by_decay_rate_every_decay_epochs_also_after_a_resume(opt, total_steps):
    lr, max_epochs = 0.1, 6  # 10 updates an epoch: warmup 5, a decay every 15 updates; 40: max_steps ends the run
    backbone = ResNet(img_size=32, in_chans=1, num_classes=2)

    def build():
        model = ImageClassifier(
            backbone, opt=opt, lr=lr, warmup_epochs=0.5, sched="step", decay_epochs=1.5, decay_rate=0.5
        )
        return optimizer_and_schedule(model, total_steps=total_steps, max_epochs=max_epochs, per_epoch=10)

    optimizer, schedule = build()
    for step in range(total_steps):
        if step == 23:  # as Lightning resumes: new objects, then the saved states
            states = optimizer.state_dict(), schedule.state_dict()
            optimizer, schedule = build()
            optimizer.load_state_dict(states[0])
            schedule.load_state_dict(states[1])
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(lr * warmup_step(step, 5, 15, 0.5), rel=1e-12), step
        optimizer.step()
        schedule.step_update(step + 1)


def test_schedule_options_name_what_is_allowed():
    backbone = ResNet(img_size=32, in_chans=1, num_classes=2)
    with pytest.raises(ValueError, match=r"^sched='linear' is not allowed: expected one of \['cosine', 'tanh', 'step'"):
        ImageClassifier(backbone, sched="linear")
    with pytest.raises(ValueError, match=r"^decay_epochs=0.0 is not allowed"):
        ImageClassifier(backbone, sched="step", decay_epochs=0.0)
    with pytest.raises(ValueError, match=r"^decay_rate=1.5 is not allowed"):
        ImageClassifier(backbone, sched="step", decay_rate=1.5)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"param_group_field": "weight_decay"}, "the schedule's param_group_field='weight_decay' is not of the kind"),
        (
            {"base_values": [0.1]},
            r"the schedule's base_values=\[0.1\] is not of the kind this run's has \(\[0.1, 0.1\]\)",
        ),
        ({"lr_min": float("nan")}, "the schedule's lr_min=nan is not of the kind"),
        ({"t_initial": 0}, "the schedule's state cannot give the rate of update 3: "),
        (
            {"optimizer": {}},
            r"^the schedule's state is not a CosineLRScheduler's .*: it has optimizer and lacks nothing$",
        ),
    ],
)
def test_a_restored_schedule_state_is_refused_unless_it_holds_what_this_runs_holds(change, message):
    from vit.training.optim import check_restored, warmup_schedule

    def schedule():
        optimizer = torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)]}], lr=0.1)
        return warmup_schedule(optimizer, warmup_steps=4, total_steps=20)

    check_restored(schedule(), schedule().state_dict(), 0, 20)  # its own state goes on to the end
    with pytest.raises(ValueError, match=message):
        check_restored(schedule(), {**schedule().state_dict(), **change}, 0, 20)


def recorder():
    """Test aid: a Lightning callback recording each update's rate, and each epoch's correct predictions counted by
    hand with the weights the step sees (no dropout: the training step's own logits)."""
    import lightning as L

    class Recorder(L.Callback):
        def __init__(self):
            self.rates, self.correct, self.seen = {}, [], []

        def on_train_epoch_start(self, trainer, pl_module):
            self.correct.append(0), self.seen.append(0)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.rates[trainer.global_step] = max(group["lr"] for group in trainer.optimizers[0].param_groups)
            with torch.no_grad():
                self.correct[-1] += int((pl_module(batch[0]).argmax(1) == batch[1]).sum())
            self.seen[-1] += len(batch[1])

    return Recorder()


def test_train_acc_is_each_epochs_own_accuracy_and_the_rate_is_logged_on_every_written_step(tmp_path):
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    backbone = VisionTransformer(img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=1, num_heads=2)
    model = ImageClassifier(backbone, lr=0.05, warmup_epochs=1.0)
    data = DataLoader(TensorDataset(torch.randn(24, 3, 16, 16), torch.randint(0, 3, (24,))), batch_size=4)
    seen = recorder()
    trainer = L.Trainer(
        max_epochs=3,
        log_every_n_steps=4,
        logger=CSVLogger(tmp_path, name="", version=""),
        callbacks=[seen],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    accs = [float(r["train/acc"]) for r in rows if r["train/acc"]]
    assert accs == [pytest.approx(c / n) for c, n in zip(seen.correct, seen.seen)]
    assert len(set(accs)) > 1  # the weights changed: an accuracy summed over epochs would differ
    rates = {int(r["step"]): float(r["train/lr"]) for r in rows if r["train/lr"]}
    # Lightning writes after every 4th update (the CSV's step: the updates before it); each rate is its update's.
    assert rates == {step: pytest.approx(seen.rates[step]) for step in (3, 7, 11, 15)}
