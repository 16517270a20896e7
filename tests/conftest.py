"""Fixtures shared by the test files."""

import os
from pathlib import Path

import pytest
import torch
from notebook_helpers import NOTEBOOKS

from vit.data.cifar import DATASETS
from vit.data.fake_cifar import write_fake_cifar

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2`: the workers share the cores, so each (and the train.py processes it starts)
    # computes on one thread instead of oversubscribing them.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def trust_written_files(monkeypatch, dataset_cls, checksums: dict[str, str]) -> None:
    """Make torchvision expect the MD5s of the generated files instead of the official ones.

    Only the expected values change: torchvision still hashes every file and compares.
    """
    monkeypatch.setattr(dataset_cls, "train_list", [[n, checksums[n]] for n, _ in dataset_cls.train_list])
    monkeypatch.setattr(dataset_cls, "test_list", [[n, checksums[n]] for n, _ in dataset_cls.test_list])
    monkeypatch.setattr(dataset_cls, "meta", {**dataset_cls.meta, "md5": checksums[dataset_cls.meta["filename"]]})


@pytest.fixture(scope="session")
def _fake_cifar_folders(tmp_path_factory):
    """Generated folders written so far in this session: {(dataset, num_train, num_test, seed): (root, md5s)}."""
    return {"base": tmp_path_factory.mktemp("fake_cifar"), "written": {}}


@pytest.fixture
def fake_cifar(_fake_cifar_folders, monkeypatch):
    """`fake_cifar(dataset, num_train=60, num_test=20, seed=0) -> data_dir` of a generated CIFAR folder.

    Each folder is written once per session (`write_fake_cifar`) and torchvision is made to accept
    it for the current test. Use one size per dataset within a test: the last call's MD5s win.
    """
    written = _fake_cifar_folders["written"]

    def make(dataset: str = "cifar10", *, num_train: int = 60, num_test: int = 20, seed: int = 0) -> Path:
        key = (dataset, num_train, num_test, seed)
        if key not in written:
            root = _fake_cifar_folders["base"] / "-".join(map(str, key))
            written[key] = (root, write_fake_cifar(root, dataset, num_train=num_train, num_test=num_test, seed=seed))
        root, checksums = written[key]
        trust_written_files(monkeypatch, DATASETS[dataset], checksums)
        return root

    return make


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """Run kernels with this interpreter and this checkout, small settings, and no real data."""
    from ipykernel.kernelspec import write_kernel_spec

    # A `python3` kernel spec pointing at sys.executable, found first through JUPYTER_PATH, so a
    # user-wide spec for another Python cannot take over.
    write_kernel_spec(path=str(tmp_path / "jupyter/kernels/python3"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    root = str(NOTEBOOKS.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("VIT_NB_FAST", "1")
    monkeypatch.setenv("VIT_NB_CHECKPOINT", "")
    monkeypatch.setenv("VIT_NB_DATA_DIR", str(tmp_path / "no-cifar-here"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models: threads only add overhead
