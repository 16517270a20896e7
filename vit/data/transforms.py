"""Training augmentations the data modules of photographs share (per image, and Mixup/CutMix per batch), the
normalisation constants (`MEAN_STD`), and CIFAR's eval transform."""

from typing import Literal, get_args

import torch
from timm.data import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    IMAGENET_INCEPTION_MEAN,
    IMAGENET_INCEPTION_STD,
    Mixup,
)
from torchvision.transforms import v2

from vit.checks import check_choice, check_float, check_int

DatasetName = Literal["cifar10", "cifar100"]
AutoAugmentName = Literal["none", "randaugment", "trivialaugment", "autoaugment"]
AUTO_AUGMENTS = get_args(AutoAugmentName)

# Per-channel (R, G, B) mean and standard deviation of the pixel values scaled to [0, 1], by name: a data set's
# own (CIFAR's over all 50,000 official training images, std over every pixel, not the mean of per-image stds),
# or those pretrained weights expect (timm's). Normalising with a data set's own gives inputs of roughly zero mean
# and unit variance.
MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagenet": (tuple(IMAGENET_DEFAULT_MEAN), tuple(IMAGENET_DEFAULT_STD)),  # most timm ImageNet weights
    "inception": (tuple(IMAGENET_INCEPTION_MEAN), tuple(IMAGENET_INCEPTION_STD)),  # (0.5, 0.5): the augreg ViTs
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
    """The per-image training transform of the data modules of photographs (CIFAR, image folders), in this order:

    `crop` (the data set's own: CIFAR's padded crop, an image folder's `RandomResizedCrop`), `horizontal_flip`,
    `auto_augment` ("randaugment" with `randaugment_num_ops` / `randaugment_magnitude`, "trivialaugment",
    or "autoaugment" with `policy`: torchvision's CIFAR-10 policy, or ImageNet's for photographs), then
    `to_tensor` (the PIL image to a normalised float tensor), then `random_erasing` (the probability of
    erasing one rectangle to 0, the data set's mean after normalising, as in the paper).
    """
    check_choice("auto_augment", auto_augment, AutoAugmentName)
    check_int("randaugment_num_ops", randaugment_num_ops, 0)
    # RandAugment splits its strength range into 31 bins; the magnitude picks one of them.
    check_int("randaugment_magnitude", randaugment_magnitude, 0, 30)
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
    """timm's batch `Mixup` for these options, or None when both alphas are 0 (mixing off).

    `mixup_prob` is the probability of mixing a batch at all, `mixup_switch_prob` the probability of CutMix instead
    of Mixup when both alphas are positive. The targets come out without label smoothing: the LightningModule
    smooths hard and soft targets alike, and smoothing twice would compound. timm mixes a batch with its flip, so
    `batch_size` must be even when mixing is on (and the training loader drops its last incomplete batch).
    `SplitDataModule.on_after_batch_transfer` applies it.
    """
    for name, value in [("mixup_prob", mixup_prob), ("mixup_switch_prob", mixup_switch_prob)]:
        check_float(name, value, 0.0, 1.0)  # probabilities
    for name, value in [("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)]:
        check_float(name, value, 0.0)  # 0 turns it off
    if mixup_alpha == 0 and cutmix_alpha == 0:
        return None
    if batch_size % 2 != 0:
        raise ValueError(f"batch_size={batch_size} must be even when Mixup/CutMix is on "
                         "(timm mixes a batch with its flip)")
    return Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, prob=mixup_prob, switch_prob=mixup_switch_prob,
                 mode="batch", label_smoothing=0.0, num_classes=num_classes)


def build_eval_transform(dataset: DatasetName, size: tuple[int, int] = (32, 32),
                         mean_std: tuple | None = None) -> v2.Compose:
    """Deterministic transform for validation, test and predict: resizing (if asked) and normalisation only."""
    return v2.Compose(to_normalised_tensor(dataset, size, mean_std))


def to_normalised_tensor(dataset: DatasetName, size: tuple[int, int] = (32, 32), mean_std: tuple | None = None) -> list:
    """Upsampling to a pretrained model's resolution `size` `(H, W)` (bicubic, after the 32x32 augmentations),
    then the tensor normalised with `mean_std` (default: the dataset's own statistics)."""
    mean, std = mean_std or CIFAR_MEAN_STD[dataset]
    resize = [v2.Resize(size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True)] if size != (32, 32) else []
    return [*resize, v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
