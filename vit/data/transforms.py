"""Per-image transforms for CIFAR: the training augmentations and the deterministic eval transform."""

from typing import Literal, get_args

import torch
from torchvision.transforms import v2

from vit.checks import check_choice, check_size

DatasetName = Literal["cifar10", "cifar100"]
AutoAugmentName = Literal["none", "randaugment", "trivialaugment", "autoaugment"]
AUTO_AUGMENTS = get_args(AutoAugmentName)

# Per-channel (R, G, B) mean and standard deviation of the pixel values, scaled to [0, 1], over all
# 50,000 official training images (std over every pixel, not the mean of per-image stds).
# Normalising with them gives inputs of roughly zero mean and unit variance.
CIFAR_MEAN_STD = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def build_train_transform(
    dataset: DatasetName,
    *,
    img_size: int | tuple[int, int] = 32,
    mean_std: tuple | None = None,
    random_crop: bool = True,
    horizontal_flip: bool = True,
    auto_augment: AutoAugmentName = "none",
    randaugment_num_ops: int = 2,
    randaugment_magnitude: int = 9,
    random_erasing: float = 0.0,
) -> v2.Compose:
    """Per-image training transform: PIL image -> normalised float32 tensor (3, 32, 32)."""
    # Crop, flip and the policies run on the PIL image: for 32x32 images that is faster than on
    # uint8 tensors, where every op pays the dispatch overhead of a tiny tensor.
    steps: list = []
    if random_crop:
        steps.append(v2.RandomCrop(32, padding=4))
    if horizontal_flip:
        steps.append(v2.RandomHorizontalFlip())
    steps += auto_augment_step(auto_augment, randaugment_num_ops, randaugment_magnitude)
    steps += _to_normalised_tensor(dataset, img_size, mean_std)
    if random_erasing > 0:
        # After normalising, so the erased rectangle is 0 = the dataset mean, as in the paper.
        steps.append(v2.RandomErasing(p=random_erasing, value=0))
    return v2.Compose(steps)


def auto_augment_step(
    name: AutoAugmentName, num_ops: int = 2, magnitude: int = 9, policy: v2.AutoAugmentPolicy = v2.AutoAugmentPolicy.CIFAR10
) -> list:
    """The augmentation policy `name` as a list of at most one transform ("none": empty).

    "randaugment" with `num_ops` / `magnitude`, "trivialaugment", or "autoaugment" with `policy`
    (torchvision's CIFAR-10 policy by default; ImageNet's for photographs).
    """
    check_choice("auto_augment", name, AutoAugmentName)
    if name == "randaugment":
        return [v2.RandAugment(num_ops=num_ops, magnitude=magnitude)]
    if name == "trivialaugment":
        return [v2.TrivialAugmentWide()]
    if name == "autoaugment":
        return [v2.AutoAugment(policy)]
    return []


def build_eval_transform(dataset: DatasetName, img_size: int | tuple[int, int] = 32, mean_std: tuple | None = None) -> v2.Compose:
    """Deterministic transform for validation, test and predict: resizing (if asked) and normalisation only."""
    return v2.Compose(_to_normalised_tensor(dataset, img_size, mean_std))


def _to_normalised_tensor(dataset: DatasetName, img_size: int | tuple[int, int] = 32, mean_std: tuple | None = None) -> list:
    """Upsampling for a pretrained model's resolution, a side or `(H, W)` (bicubic, after the 32x32
    augmentations), then the tensor normalised with `mean_std` (default: the dataset's own statistics)."""
    mean, std = mean_std or CIFAR_MEAN_STD[dataset]
    size = check_size("img_size", img_size)
    resize = [v2.Resize(size, interpolation=v2.InterpolationMode.BICUBIC, antialias=True)] if size != (32, 32) else []
    return [*resize, v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))]
