"""examples/data.py: the offline datasets, the IDX reader and the latent shards."""

from __future__ import annotations

import gzip
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
data = importlib.import_module("data")


def test_digits_shape_range_and_labels():
    images, labels, num_classes = data.load_dataset("digits")
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.float32
    assert images.min() == -1.0 and images.max() == 1.0
    assert labels.dtype == torch.int64 and labels.shape == (1797,)
    assert num_classes == 10 and set(labels.tolist()) == set(range(10))


def test_mnist_shape_and_range():
    images, labels, num_classes = data.load_dataset("mnist")
    assert images.shape == (5000, 1, 28, 28) and num_classes == 10
    assert -1.0 <= images.min() < images.max() <= 1.0
    assert labels.dtype == torch.int64


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip(tmp_path, compress, dtype):
    array = (np.arange(2 * 3 * 5) - 7).reshape(2, 3, 5).astype(dtype)
    if dtype == np.uint8:
        array = np.arange(30, dtype=np.uint8).reshape(2, 3, 5)
    path = tmp_path / ("a.idx.gz" if compress else "a.idx")
    data.write_idx(path, array)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == compress
    back = data.read_idx(path)
    assert back.dtype == np.dtype(dtype) and np.array_equal(back, array)


def test_idx_reader_parses_the_header_itself(tmp_path):
    # Written by hand: magic 0x00000803 (uint8, 3 dims), sizes 2x2x3 big-endian, 12 values.
    raw = bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 3]) + bytes(range(12))
    (tmp_path / "x").write_bytes(raw)
    assert data.read_idx(tmp_path / "x").tolist() == np.arange(12).reshape(2, 2, 3).tolist()


def _fashion_dir(tmp_path: Path, compress: bool, n: int = 6) -> Path:
    d = tmp_path / "fmnist"
    d.mkdir()
    ext = ".gz" if compress else ""
    rng = np.random.default_rng(0)
    for prefix, count in (("train", n), ("t10k", 2)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        data.write_idx(d / f"{prefix}-images-idx3-ubyte{ext}", images)
        data.write_idx(d / f"{prefix}-labels-idx1-ubyte{ext}", np.arange(count, dtype=np.uint8))
    return d


@pytest.mark.parametrize("compress", [False, True])
def test_fashion_mnist_from_tiny_idx_files(tmp_path, compress):
    d = _fashion_dir(tmp_path, compress)
    images, labels, num_classes = data.load_dataset("fashion-mnist", d)
    assert images.shape == (6, 1, 28, 28) and num_classes == 10
    assert labels.tolist() == list(range(6))
    assert images.min() >= -1.0 and images.max() <= 1.0
    raw = data.read_idx(d / f"train-images-idx3-ubyte{'.gz' if compress else ''}")
    assert torch.allclose(images[:, 0], torch.from_numpy(raw).float() / 127.5 - 1)
    assert data.load_fashion_mnist(d, split="test").images.shape == (2, 1, 28, 28)


def test_idx_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad-magic"
    bad.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(data.DataError, match="(?s)bad-magic.*not an IDX"):
        data.read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 9]) + bytes(3))
    with pytest.raises(data.DataError, match="(?s)short.*9"):
        data.read_idx(short)
    gz = tmp_path / "broken.gz"
    gz.write_bytes(gzip.compress(b"\x00" * 100)[:20])
    with pytest.raises(data.DataError, match="broken.gz"):
        data.read_idx(gz)


def test_fashion_mnist_missing_directory_and_files(tmp_path):
    with pytest.raises(data.DataError, match="(?s)nowhere.*not found"):
        data.load_dataset("fashion-mnist", tmp_path / "nowhere")
    d = _fashion_dir(tmp_path, compress=False)
    (d / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(data.DataError, match="train-labels-idx1-ubyte"):
        data.load_dataset("fashion-mnist", d)
    data.write_idx(d / "train-labels-idx1-ubyte", np.arange(5, dtype=np.uint8))
    with pytest.raises(data.DataError, match="(?s)train-labels-idx1-ubyte.*do not match 6 images"):
        data.load_dataset("fashion-mnist", d)


def _write_shard(path: Path, latents: np.ndarray, labels: np.ndarray) -> None:
    if path.suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file({"latents": latents, "labels": labels}, str(path))
    elif path.suffix == ".npz":
        np.savez(path, latents=latents, labels=labels)
    else:  # NAME.latents.npy + NAME.labels.npy
        np.save(path, latents)
        np.save(path.with_name(path.name.replace(".latents.npy", ".labels.npy")), labels)


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".latents.npy"])
def test_latent_shards(tmp_path, suffix):
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((n, 4, 4, 4)).astype(np.float32) for n in (3, 5)]
    _write_shard(tmp_path / f"a{suffix}", parts[0], np.array([0, 1, 2]))
    _write_shard(tmp_path / f"b{suffix}", parts[1], np.array([3, 4, 5, 6, 0]))
    images, labels, num_classes = data.load_dataset("latents", tmp_path)
    assert images.shape == (8, 4, 4, 4) and images.dtype == torch.float32
    assert torch.equal(images, torch.from_numpy(np.concatenate(parts)))  # stored values, as is
    assert labels.tolist() == [0, 1, 2, 3, 4, 5, 6, 0] and num_classes == 7
    (tmp_path / "meta.json").write_text('{"num_classes": 1000}')
    assert data.load_latents(tmp_path).num_classes == 1000


def test_latent_errors_name_the_file(tmp_path):
    ok = np.zeros((2, 4, 4, 4), np.float32)
    with pytest.raises(data.DataError, match="(?s)missing.*not found"):
        data.load_latents(tmp_path / "missing")
    with pytest.raises(data.DataError, match="no latent shards"):
        data.load_latents(tmp_path)
    _write_shard(tmp_path / "a.safetensors", ok, np.array([0, 1]))
    _write_shard(tmp_path / "b.safetensors", np.zeros((2, 4, 8, 8), np.float32), np.array([0, 1]))
    with pytest.raises(data.DataError, match=r"(?s)b.safetensors.*do not match.*a.safetensors"):
        data.load_latents(tmp_path)
    _write_shard(tmp_path / "b.safetensors", ok, np.array([0, 1, 1]))
    with pytest.raises(data.DataError, match=r"b.safetensors:\s2 latents but 'labels'"):
        data.load_latents(tmp_path)
    nan = ok.copy()
    nan[1, 2, 3, 0] = np.nan
    _write_shard(tmp_path / "b.safetensors", nan, np.array([0, 1]))
    with pytest.raises(data.DataError, match="(?s)b.safetensors.*NaN"):
        data.load_latents(tmp_path)
    (tmp_path / "b.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(data.DataError, match=r"b.safetensors:\scannot read"):
        data.load_latents(tmp_path)
    (tmp_path / "b.safetensors").unlink()
    np.save(tmp_path / "c.latents.npy", ok)
    with pytest.raises(data.DataError, match=r"c.latents.npy:\sno matching labels"):
        data.load_latents(tmp_path)


def test_unknown_dataset():
    with pytest.raises(data.DataError, match="unknown dataset 'cifar'"):
        data.load_dataset("cifar")


def test_pad_images_centres_the_digit_on_its_background():
    images, labels, num_classes = data.load_dataset("mnist")
    padded = data.pad_images(data.ImageData(images[:4], labels[:4], num_classes), 32)
    assert padded.images.shape == (4, 1, 32, 32)
    assert torch.equal(padded.images[:, :, 2:30, 2:30], images[:4])
    border = torch.ones(32, 32, dtype=torch.bool)
    border[2:30, 2:30] = False
    assert (padded.images[:, :, border] == images.min()).all()
    assert torch.equal(padded.labels, labels[:4]) and padded.num_classes == num_classes
    assert data.pad_images(padded, None) is padded


def test_pad_images_refuses_a_smaller_side():
    images = torch.zeros(1, 1, 28, 28)
    with pytest.raises(data.DataError, match="--pad-to 16 is smaller than the images"):
        data.pad_images(data.ImageData(images, torch.zeros(1, dtype=torch.int64), 1), 16)
