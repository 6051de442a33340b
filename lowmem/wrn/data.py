"""Image datasets for the WRN track, all read through torchvision's own dataset classes.

- ``cifar10``: the paper's benchmark, ``torchvision.datasets.CIFAR10`` (downloaded where there is internet).
- ``fashion-mnist``: real images that work offline: Debian's ``dataset-fashion-mnist`` package when installed,
  else torchvision's download. Its 28x28 grayscale images are zero-padded by 2 pixels to the 32x32 that WRN's
  CIFAR layout expects (padding, not resizing, keeps every pixel as it was).
- ``synthetic``: small, learnable, class-dependent images written in CIFAR-10's on-disk format (the python pickle
  batches) and read back through the same ``CIFAR10`` class, so the real loading code is what the smoke profile
  and the tests exercise.

Augmentation follows the recipe (paper notes): reflect-pad 4, random 32x32 crop, horizontal flip; normalization
is per channel, with mean and std computed from the training split rather than typed in.
"""

from __future__ import annotations

import gzip
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset
from torchvision import datasets, transforms

DATASETS = ("cifar10", "fashion-mnist", "synthetic")
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class DatasetMissing(RuntimeError):
    """The dataset is not on disk and could not be fetched; the message says how to get it."""


@dataclass
class ImageData:
    train: Dataset
    test: Dataset
    in_channels: int
    num_classes: int
    source: str  # where the images came from, for captions


class _LocalCIFAR10(datasets.CIFAR10):
    # torchvision checks each file's md5 against the published archive; generated files in the same format cannot
    # match it. With no md5 given, torchvision's own check_integrity only checks that the file exists; the parsing
    # is torchvision's own either way.
    train_list = [[name, None] for name, _ in datasets.CIFAR10.train_list]
    test_list = [[name, None] for name, _ in datasets.CIFAR10.test_list]
    meta = {**datasets.CIFAR10.meta, "md5": None}


def write_synthetic_cifar(root: Path, n_train: int, n_test: int, seed: int = 0, num_classes: int = 10) -> Path:
    """Writes ``root/cifar-10-batches-py`` in CIFAR-10's format: each class is a noisy copy of its own random
    low-frequency pattern, so a model can learn it in a few steps. Returns the folder."""
    rng = np.random.default_rng(seed)
    folder = root / datasets.CIFAR10.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    patterns = rng.uniform(40, 215, size=(num_classes, 3, 4, 4)).repeat(8, axis=2).repeat(8, axis=3)

    def batch(n: int) -> dict:
        labels = rng.integers(0, num_classes, size=n)
        imgs = patterns[labels] + rng.normal(0, 30, size=(n, 3, 32, 32))
        data = np.clip(imgs, 0, 255).astype(np.uint8).reshape(n, 3072)  # CIFAR rows: 1024 R, 1024 G, 1024 B
        # The published batches are Python 2 pickles whose str keys torchvision reads back as str (latin1).
        return {"data": data, "labels": labels.tolist(), "batch_label": "synthetic"}

    per_file = -(-n_train // 5)
    for i in range(5):
        with open(folder / f"data_batch_{i + 1}", "wb") as f:
            pickle.dump(batch(min(per_file, n_train - i * per_file)), f, protocol=2)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch(n_test), f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{c}" for c in range(num_classes)], "num_vis": 3072}, f, protocol=2)
    return folder


def _stats(images: np.ndarray) -> tuple[list[float], list[float]]:
    x = images.astype(np.float64) / 255.0  # (N, H, W, C)
    return x.mean(axis=(0, 1, 2)).tolist(), x.std(axis=(0, 1, 2)).tolist()


def _transforms(mean: list[float], std: list[float], pad_to_32: int, augment: bool) -> transforms.Compose:
    t: list = [transforms.ToTensor()]
    if pad_to_32:
        t.append(transforms.Pad(pad_to_32))
    if augment:
        t += [transforms.RandomCrop(32, padding=4, padding_mode="reflect"), transforms.RandomHorizontalFlip()]
    t.append(transforms.Normalize(mean, std))
    return transforms.Compose(t)


def _cifar(root: Path, cls: type[datasets.CIFAR10], download: bool, augment: bool) -> tuple[Dataset, Dataset]:
    train = cls(str(root), train=True, download=download)
    mean, std = _stats(train.data)
    train.transform = _transforms(mean, std, 0, augment=augment)
    test = cls(str(root), train=False, transform=_transforms(mean, std, 0, augment=False))
    return train, test


def _fashion_raw(root: Path) -> bool:
    """Makes ``root/FashionMNIST/raw`` hold the four idx files; True if it does."""
    raw = root / "FashionMNIST" / "raw"
    if all((raw / f).is_file() for f in FASHION_FILES):
        return True
    if not all((DEBIAN_FASHION_MNIST / f"{f}.gz").is_file() for f in FASHION_FILES):
        return False
    # Debian recompressed the archives, so torchvision's md5 check of the .gz files fails; decompressed, they are
    # the standard idx files it reads with download=False.
    raw.mkdir(parents=True, exist_ok=True)
    for f in FASHION_FILES:
        with gzip.open(DEBIAN_FASHION_MNIST / f"{f}.gz") as src, open(raw / f, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return True


def load(
    name: str, root: str | Path, download: bool = True, augment: bool = True, synthetic_size: tuple[int, int] = (512, 256), seed: int = 0
) -> ImageData:
    """Loads a dataset by name; ``augment`` applies the recipe's crop and flip to the training split. A dataset that
    is missing and cannot be fetched raises ``DatasetMissing``."""
    root = Path(root)
    if name == "synthetic":
        write_synthetic_cifar(root / "synthetic", *synthetic_size, seed=seed)
        train, test = _cifar(root / "synthetic", _LocalCIFAR10, download=False, augment=augment)
        return ImageData(train, test, 3, 10, f"synthetic CIFAR-format images ({synthetic_size[0]} train / {synthetic_size[1]} test)")
    if name == "cifar10":
        try:
            train, test = _cifar(root, datasets.CIFAR10, download=download, augment=augment)
        except (RuntimeError, OSError) as e:
            raise DatasetMissing(
                f"CIFAR-10 is not in {root / 'cifar-10-batches-py'} and could not be downloaded ({e}). On a machine with "
                f"internet it downloads by itself; otherwise copy cifar-10-python.tar.gz from "
                f"https://www.cs.toronto.edu/~kriz/cifar.html into {root} and extract it there."
            ) from e
        return ImageData(train, test, 3, 10, "CIFAR-10 (torchvision)")
    if name == "fashion-mnist":
        local = _fashion_raw(root)
        try:
            train = datasets.FashionMNIST(str(root), train=True, download=download and not local)
        except (RuntimeError, OSError) as e:
            raise DatasetMissing(
                f"Fashion-MNIST is not in {root / 'FashionMNIST/raw'} and could not be downloaded ({e}). Offline, install "
                f"Debian's package: `sudo apt-get install dataset-fashion-mnist` (make setup does this as root)."
            ) from e
        mean, std = _stats(train.data.numpy()[..., None])
        train.transform = _transforms(mean, std, 2, augment=augment)
        test = datasets.FashionMNIST(str(root), train=False, transform=_transforms(mean, std, 2, augment=False))
        return ImageData(train, test, 1, 10, "Fashion-MNIST (real images, 28x28 zero-padded to 32x32)")
    raise ValueError(f"unknown dataset {name!r}; use one of: {', '.join(DATASETS)}")


def subset(ds: Dataset, n: int, seed: int) -> Dataset:
    """A fixed random subset of ``n`` examples (all of them if n <= 0 or n >= len)."""
    if n <= 0 or n >= len(ds):  # type: ignore[arg-type]
        return ds
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]  # type: ignore[arg-type]
    return Subset(ds, idx.tolist())
