"""examples/metrics.py: feature-space FID/KID behave like distances on real digits."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
data = importlib.import_module("data")
metrics = importlib.import_module("metrics")


@pytest.fixture(scope="module")
def digits_net(tmp_path_factory):
    images, labels, num_classes = data.load_dataset("digits")
    cache = tmp_path_factory.mktemp("cache")
    lines: list[str] = []
    net, acc = metrics.train_feature_net(images, labels, num_classes, name="digits",
                                         steps=300, cache_dir=cache, log=lines.append)  # fmt: skip
    return images, labels, net, acc, cache, lines


def test_feature_net_is_accurate(digits_net):
    _, _, _, acc, cache, lines = digits_net
    assert acc > 0.9, acc
    assert "trained on digits" in lines[-1] and f"{acc:.3f}" in lines[-1]
    assert len(list(cache.glob("featnet-digits-*.safetensors"))) == 1


def test_feature_net_cache(tmp_path):
    images, labels, _ = data.load_dataset("digits")
    images, labels = images[:256], labels[:256]
    lines: list[str] = []
    kwargs = dict(name="tiny", steps=20, batch_size=32, cache_dir=tmp_path, log=lines.append)
    net, acc = metrics.train_feature_net(images, labels, 10, **kwargs)
    state = torch.get_rng_state()
    again, acc2 = metrics.train_feature_net(images, labels, 10, **kwargs)
    assert acc2 == acc and "loaded" in lines[-1]
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is left alone
    for a, b in zip(net.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    (path,) = tmp_path.glob("featnet-tiny-*.safetensors")
    path.write_bytes(b"corrupt")  # a broken cache entry is rebuilt, identically
    rebuilt, acc3 = metrics.train_feature_net(images, labels, 10, **kwargs)
    assert "unreadable cache file" in lines[-2] and acc3 == acc
    for a, b in zip(net.state_dict().values(), rebuilt.state_dict().values()):
        assert torch.equal(a, b)
    other, _ = metrics.train_feature_net(images[:128], labels[:128], 10, **kwargs)
    assert len(list(tmp_path.glob("featnet-tiny-*.safetensors"))) == 2  # new data, new entry


def test_fid_small_for_real_and_monotone_under_noise(digits_net):
    images, _, net, _, _, _ = digits_net
    extractor = metrics.FeatureExtractor(net)
    perm = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(0))
    real_a, real_b = images[perm[:300]], images[perm[300:600]]
    noise = torch.randn(real_b.shape, generator=torch.Generator().manual_seed(1))
    scores = [metrics.fid_kid(real_a, real_b + s * noise, extractor) for s in (0, 0.3, 0.6, 1.0)]
    fids = [s["fid"] for s in scores]
    kids = [s["kid_mean"] for s in scores]
    assert all(a < b for a, b in zip(fids, fids[1:])), fids
    assert kids[0] < kids[2] < kids[3], kids  # KID is noisier at barely visible noise
    # Real vs real (only the sample-size floor) is small next to visible noise ...
    assert fids[0] < 0.5 * fids[2] and fids[0] < 0.25 * fids[3], fids
    assert abs(kids[0]) < 0.02 and kids[-1] > 0.03, kids
    # ... and next to dropping half of the classes.
    labels = digits_net[1]
    half = real_b[labels[perm[300:600]] < 5]
    assert metrics.fid_kid(real_a, half, extractor)["fid"] > 3 * fids[0]
    # Identical sets: FID ~ 0.
    assert metrics.fid_kid(real_a, real_a, extractor)["fid"] < 1e-3


def test_inception_fid_is_optional(capsys):
    real = torch.zeros(2, 1, 8, 8)
    assert metrics.inception_fid(real, real, path="/no/such/default_1.pt") is None
    assert "Inception FID skipped" in capsys.readouterr().out
    assert metrics.inception_fid(torch.zeros(2, 4, 8, 8), torch.zeros(2, 4, 8, 8)) is None
    assert "4 channels" in capsys.readouterr().out
