"""Training augmentations of photographs (per image; Mixup/CutMix per batch), `MEAN_STD`, CIFAR's eval transform."""

from typing import Literal, get_args

import torch
from timm.data import Mixup, constants
from torchvision.transforms import v2

from vit.checks import check_choice, check_float, check_int

DatasetName = Literal["cifar10", "cifar100"]
AutoAugmentName = Literal["none", "randaugment", "trivialaugment", "autoaugment"]
AUTO_AUGMENTS = get_args(AutoAugmentName)

# Per-channel (R, G, B) mean and std of the pixels scaled to [0, 1]: a data set's own (CIFAR's over its 50,000
# training images, std over every pixel), or what pretrained weights expect (timm's).
MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagenet": (tuple(constants.IMAGENET_DEFAULT_MEAN), tuple(constants.IMAGENET_DEFAULT_STD)),  # most timm weights
    "inception": (tuple(constants.IMAGENET_INCEPTION_MEAN), tuple(constants.IMAGENET_INCEPTION_STD)),  # augreg ViTs
}
CIFAR_MEAN_STD = {name: MEAN_STD[name] for name in get_args(DatasetName)}  # each CIFAR's own


def train_transform(
    crop: list,
    to_tensor: list,
    *,
    policy: v2.AutoAugmentPolicy,
    horizontal_flip: bool,
    auto_augment: AutoAugmentName,
    randaugment_num_ops: int,
    randaugment_magnitude: int,
    random_erasing: float,
) -> v2.Compose:
    """The per-image training transform: `crop`, flip, `auto_augment` (with `policy`), `to_tensor`, `random_erasing`."""
    check_choice("auto_augment", auto_augment, AutoAugmentName)
    check_int("randaugment_num_ops", randaugment_num_ops, 0)
    check_int("randaugment_magnitude", randaugment_magnitude, 0, 30)  # one of RandAugment's 31 bins
    check_float("random_erasing", random_erasing, 0.0, 1.0)
    steps = [*crop, *([v2.RandomHorizontalFlip()] if horizontal_flip else [])]
    if auto_augment == "randaugment":
        steps.append(v2.RandAugment(num_ops=randaugment_num_ops, magnitude=randaugment_magnitude))
    elif auto_augment == "trivialaugment":
        steps.append(v2.TrivialAugmentWide())
    elif auto_augment == "autoaugment":
        steps.append(v2.AutoAugment(policy))
    steps += to_tensor
    if random_erasing > 0:
        steps.append(v2.RandomErasing(p=random_erasing, value=0))
    return v2.Compose(steps)


def batch_mixup(
    num_classes: int,
    *,
    batch_size: int,
    mixup_alpha: float,
    cutmix_alpha: float,
    mixup_prob: float,
    mixup_switch_prob: float,
) -> Mixup | None:
    """timm's batch `Mixup` for these options, or None when both alphas are 0 (mixing off); `mixup_switch_prob`
    is the probability of CutMix instead of Mixup. No label smoothing: the LightningModule smooths the targets."""
    for name, value, high in [
        ("mixup_prob", mixup_prob, 1.0),
        ("mixup_switch_prob", mixup_switch_prob, 1.0),
        ("mixup_alpha", mixup_alpha, None),
        ("cutmix_alpha", cutmix_alpha, None),
    ]:
        check_float(name, value, 0.0, high)
    if mixup_alpha == 0 and cutmix_alpha == 0:
        return None
    if batch_size % 2 != 0:
        raise ValueError(
            f"batch_size={batch_size} must be even when Mixup/CutMix is on (timm mixes a batch with its flip)"
        )
    return Mixup(
        mixup_alpha=mixup_alpha,
        cutmix_alpha=cutmix_alpha,
        prob=mixup_prob,
        switch_prob=mixup_switch_prob,
        mode="batch",
        label_smoothing=0.0,
        num_classes=num_classes,
    )


def build_eval_transform(
    dataset: DatasetName, size: tuple[int, int] = (32, 32), mean_std: tuple | None = None
) -> v2.Compose:
    """CIFAR's eval transform: bicubic upsampling to `size` (when not 32x32), normalised with `mean_std` or CIFAR's."""
    mean, std = mean_std or CIFAR_MEAN_STD[dataset]
    resize = [v2.Resize(size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True)] if size != (32, 32) else []
    return v2.Compose(
        [*resize, v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
    )
