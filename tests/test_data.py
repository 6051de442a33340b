"""Loaders against small files written in the datasets' real on-disk formats."""

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from lowmem.wrn import data


def test_synthetic_cifar_is_read_by_torchvisions_cifar10_parser(tmp_path: Path) -> None:
    d = data.load("synthetic", tmp_path, synthetic_size=(50, 20), seed=3)
    assert (len(d.train), len(d.test)) == (50, 20)
    assert (d.in_channels, d.num_classes) == (3, 10)
    # The pickle batches hold what was written, in CIFAR-10's row layout, parsed by torchvision into HWC uint8.
    raw = pickle.load(open(tmp_path / "synthetic/cifar-10-batches-py/test_batch", "rb"))
    assert d.test.targets == list(raw["labels"])
    assert np.array_equal(d.test.data, raw["data"].reshape(20, 3, 32, 32).transpose(0, 2, 3, 1))
    x, y = d.test[0]
    assert x.shape == (3, 32, 32) and y == raw["labels"][0]
    # Normalization uses the training split's own per-channel statistics: the training images come out centred.
    xs = torch.stack([d.train.transform.transforms[-1](torch.tensor(img).permute(2, 0, 1).float() / 255) for img in d.train.data])
    assert torch.allclose(xs.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)


def test_real_cifar10_class_rejects_files_that_do_not_match_the_published_archive(tmp_path: Path) -> None:
    data.write_synthetic_cifar(tmp_path, 10, 10)
    with pytest.raises(data.DatasetMissing, match="cs.toronto.edu"):
        data.load("cifar10", tmp_path, download=False)


def _idx(path: Path, arr: np.ndarray) -> None:
    # idx format: 2 zero bytes, dtype code 0x08 (ubyte), number of dims, big-endian sizes, then the data.
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes())


def test_fashion_mnist_from_debian_layout_is_padded_to_32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    debian = tmp_path / "debian"
    debian.mkdir()
    rng = np.random.default_rng(0)
    sizes = {"train": 30, "t10k": 12}
    labels = {}
    for split, n in sizes.items():
        labels[split] = rng.integers(0, 10, n).astype(np.uint8)
        _idx(debian / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)).astype(np.uint8))
        _idx(debian / f"{split}-labels-idx1-ubyte.gz", labels[split])
    monkeypatch.setattr(data, "DEBIAN_FASHION_MNIST", debian)
    d = data.load("fashion-mnist", tmp_path / "root", download=False)
    assert (len(d.train), len(d.test), d.in_channels) == (30, 12, 1)
    assert d.test.targets.tolist() == labels["t10k"].tolist()
    x, _ = d.test[0]
    assert x.shape == (1, 32, 32)
    # Zero padding: the 2-pixel border is the normalized value of a black pixel everywhere.
    border = torch.cat([x[0, :2].flatten(), x[0, -2:].flatten(), x[0, :, :2].flatten(), x[0, :, -2:].flatten()])
    assert torch.allclose(border, border[0].expand_as(border))


def test_missing_fashion_mnist_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "DEBIAN_FASHION_MNIST", tmp_path / "nowhere")
    with pytest.raises(data.DatasetMissing, match="apt-get install dataset-fashion-mnist"):
        data.load("fashion-mnist", tmp_path, download=False)


def test_unknown_dataset_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cifar10, fashion-mnist, synthetic"):
        data.load("imagenet", tmp_path)
