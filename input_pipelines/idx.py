"""LeCun's IDX files (MNIST, Fashion-MNIST) as NumPy arrays.

    images, labels = load_fashion_mnist("/usr/share/datasets/fashion-mnist",
                                        "train")

Debian's `dataset-fashion-mnist` installs the four gzip'ed IDX files under
/usr/share/datasets/fashion-mnist; plain (not gzip'ed) files read too.
"""

import gzip
import os
from typing import Tuple

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# IDX type codes -> NumPy dtypes (big-endian, as the format stores them).
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4",
           0x0D: ">f4", 0x0E: ">f8"}


class IdxError(ValueError):
    """A file is not an IDX file; the message names it."""


def read_idx(path: str) -> np.ndarray:
    """One IDX file (gzip'ed or not) as an array of its shape.

    Raises:
        IdxError: The header or the size does not fit the format.
        OSError: The file does not read.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise IdxError(f"{path}: not an IDX file (magic {data[:4]!r})")
    dims = data[3]
    header = 4 + 4 * dims
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big")
             for i in range(dims)]
    dtype = np.dtype(_DTYPES[data[2]])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(data) != expected:
        raise IdxError(f"{path}: {len(data)} bytes, but its header says "
                       f"{shape} of {dtype} ({expected} bytes)")
    return np.frombuffer(data, dtype, offset=header).reshape(shape)


def load_fashion_mnist(directory: str = FASHION_MNIST_DIR,
                       split: str = "train") -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 28, 28], labels int64 [N]) of "train" or "test".

    Raises:
        IdxError: A file is malformed, or images and labels disagree.
        FileNotFoundError: Naming the file (and the package that has it).
    """
    prefix = {"train": "train", "test": "t10k"}[split]
    arrays = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        name = os.path.join(directory, f"{prefix}-{kind}")
        path = next((p for p in (name + ".gz", name) if os.path.exists(p)),
                    None)
        if path is None:
            raise FileNotFoundError(
                f"{name}.gz not found (Debian/Ubuntu: apt-get install "
                "dataset-fashion-mnist)")
        arrays.append(read_idx(path))
    images, labels = arrays
    if len(images) != len(labels):
        raise IdxError(f"{directory}: {len(images)} {split} images but "
                       f"{len(labels)} labels")
    return images, labels.astype(np.int64)
