"""Write a stand-in for MNIST where Horovod's example scripts look for it, made from
scikit-learn's digits (8x8, 1797 images) upscaled to 28x28, so that those scripts run unmodified
on a machine without network access (tests/test_elastic.py runs them; they would download MNIST).

    python scripts/mnist_standin.py --keras-dir ~/.keras/datasets --ranks 8 --torch-dir DATA

* ``--keras-dir``: ``mnist.npz`` and ``mnist-0.npz`` ... ``mnist-<ranks-1>.npz`` (Horovod's TF2
  examples load ``mnist-%d.npz % hvd.rank()``), each with x_train, y_train, x_test, y_test as
  ``keras.datasets.mnist.load_data`` returns them (uint8). Keras checks the file's sha256
  against the real MNIST and would download it again; tests/horovod_alias.py accepts these
  files instead (HVD_SGP_TEST_MNIST_STANDIN=1).
* ``--torch-dir``: ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` in the IDX format
  torchvision's ``datasets.MNIST(root)`` reads (it checks only that the files exist).

Images: each digit pixel (0-16) becomes a 3x3 block scaled to 0-255, centred with a 2-pixel
border; the first 1437 digits are the training set, the other 360 the test set.
"""
from __future__ import annotations

import argparse
import os
import struct

import numpy as np

TRAIN = 1437  # 80% of the 1797 digits


def digits_28x28() -> tuple[np.ndarray, np.ndarray]:
    """All of scikit-learn's digits as (N, 28, 28) uint8 images and (N,) uint8 labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    big = np.kron(digits.images, np.ones((3, 3)))  # 24x24
    images = np.zeros((len(big), 28, 28))
    images[:, 2:26, 2:26] = big * (255.0 / 16.0)
    return np.rint(images).astype(np.uint8), digits.target.astype(np.uint8)


def write_keras(folder: str, ranks: int, images: np.ndarray, labels: np.ndarray) -> None:
    os.makedirs(folder, exist_ok=True)
    arrays = {"x_train": images[:TRAIN], "y_train": labels[:TRAIN],
              "x_test": images[TRAIN:], "y_test": labels[TRAIN:]}
    for name in ["mnist.npz"] + [f"mnist-{rank}.npz" for rank in range(ranks)]:
        np.savez(os.path.join(folder, name), **arrays)


def _idx(path: str, array: np.ndarray) -> None:
    """IDX: magic (0, 0, type 0x08 = ubyte, number of dimensions), sizes big-endian, data."""
    with open(path, "wb") as handle:
        handle.write(struct.pack(">BBBB", 0, 0, 0x08, array.ndim))
        handle.write(struct.pack(f">{array.ndim}I", *array.shape))
        handle.write(np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_torchvision(root: str, images: np.ndarray, labels: np.ndarray) -> None:
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for prefix, part in (("train", slice(None, TRAIN)), ("t10k", slice(TRAIN, None))):
        _idx(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), images[part])
        _idx(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels[part])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keras-dir", help="e.g. ~/.keras/datasets")
    parser.add_argument("--ranks", type=int, default=8, help="mnist-<rank>.npz files to write")
    parser.add_argument("--torch-dir", help="the root torchvision's MNIST is given")
    args = parser.parse_args()
    if not (args.keras_dir or args.torch_dir):
        parser.error("give --keras-dir and/or --torch-dir")
    images, labels = digits_28x28()
    if args.keras_dir:
        write_keras(os.path.expanduser(args.keras_dir), args.ranks, images, labels)
    if args.torch_dir:
        write_torchvision(os.path.expanduser(args.torch_dir), images, labels)


if __name__ == "__main__":
    main()
