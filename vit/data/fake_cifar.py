"""A small generated folder in CIFAR's on-disk format, so tests and demos run the real loading code offline."""

import hashlib
import os
import pickle
from pathlib import Path

import numpy as np

from vit.checks import check_choice
from vit.data.cifar import EXPECTED_FILES, NUM_CLASSES, DatasetName


def write_fake_cifar(
    root: str | os.PathLike, dataset: DatasetName = "cifar10", num_train: int = 500, num_test: int = 100, seed: int = 0
) -> dict[str, str]:
    """Write a small CIFAR folder in the official format under `root`, each class its own colour and stripes plus
    noise; returns the MD5 of every file written, by name (to substitute for the official ones)."""
    check_choice("dataset", dataset, DatasetName)
    folder = Path(root) / EXPECTED_FILES[dataset][0]
    folder.mkdir(parents=True, exist_ok=True)
    num_classes, rng = NUM_CLASSES[dataset], np.random.default_rng(seed)
    colours, periods = rng.uniform(40, 215, size=(num_classes, 3, 1, 1)), rng.integers(3, 12, size=num_classes)
    rows = np.arange(32).reshape(1, 32, 1)

    def images(n: int) -> tuple[np.ndarray, list[int]]:
        labels = rng.integers(0, num_classes, size=n)
        stripes = 30.0 * np.sin(2 * np.pi * rows / periods[labels].reshape(n, 1, 1, 1))  # (N, 1, 32, 1)
        pixels = colours[labels] + stripes + rng.normal(0, 20, size=(n, 3, 32, 32))  # (N, 3, 32, 32)
        data = np.clip(pixels, 0, 255).astype(np.uint8).reshape(n, 3 * 32 * 32)  # (N, 3072)
        return data, labels.tolist()

    class_names, files = [f"fake_class_{i:02d}" for i in range(num_classes)], {}
    if dataset == "cifar10":
        train_chunks = np.array_split(np.arange(num_train), 5)
        for i, chunk in enumerate(train_chunks, start=1):
            data, labels = images(len(chunk))
            files[f"data_batch_{i}"] = {"batch_label": f"training batch {i} of 5", "data": data, "labels": labels}
        data, labels = images(num_test)
        files["test_batch"] = {"batch_label": "testing batch 1 of 1", "data": data, "labels": labels}
        files["batches.meta"] = {
            "label_names": class_names,
            "num_cases_per_batch": len(train_chunks[0]),
            "num_vis": 3072,
        }
    else:
        for name, n in [("train", num_train), ("test", num_test)]:
            data, labels = images(n)  # and 20 superclasses of 5 classes each, as in CIFAR-100
            files[name] = {"data": data, "fine_labels": labels, "coarse_labels": [c // 5 for c in labels]}
        files["meta"] = {
            "fine_label_names": class_names,
            "coarse_label_names": [f"fake_superclass_{i:02d}" for i in range(20)],
        }
    for name, content in files.items():
        (folder / name).write_bytes(pickle.dumps(content))
    return {name: hashlib.md5((folder / name).read_bytes()).hexdigest() for name in files}
