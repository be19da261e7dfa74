"""The community population of the coverage sweep: model libraries and research code.

Two kinds of source, none of them diffusers, timm or transformers:

- **packages** from the package index that install without changing the installed torch,
  torchvision, transformers, diffusers or timm (the ``community`` extra of pyproject.toml,
  which ``scripts/setup.sh`` installs): lucidrains' ``vit-pytorch``, ``x-transformers``,
  ``mmdit``, ``perceiver-pytorch`` and ``denoising-diffusion-pytorch``, MONAI, OpenCLIP, and
  torchvision's own models;
- **research repositories**: the model files researchers train (DiT, SiT, U-ViT, MDT,
  LightningDiT, REPA, TREAD), brought in at run time from a snapshot (``--snapshots DIR``,
  one folder per repository holding its model files and a ``COMMIT`` file; never committed,
  see ``SNAPSHOT_FILES`` and docs/support.md) and imported by path.

Every case is built at a tiny size (depth 4-6, width 32-64, 16-64 tokens) and carries the
verdict expected where it is known (``expected``: ``route``, or ``refuse: <why>``).

Example:
    >>> from benchmarks.coverage_community import SOURCES, SNAPSHOT_FILES
    >>> len(SOURCES) >= 8 and "dit" in SNAPSHOT_FILES
    True
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from benchmarks.coverage_checks import Case
from benchmarks.coverage_community_cases import PACKAGE_CASES
from benchmarks.coverage_community_repos import REPO_CASES, SNAPSHOT_FILES, import_snapshot

__all__ = [
    "PACKAGES",
    "SNAPSHOT_FILES",
    "SOURCES",
    "community_cases",
    "import_snapshot",
    "package_versions",
    "snapshot_commits",
]

# source -> distribution names whose versions the JSON records
PACKAGES = {
    "vit-pytorch": ["vit-pytorch"],
    "x-transformers": ["x-transformers"],
    "mmdit": ["mmdit", "hyper-connections"],
    "perceiver-pytorch": ["perceiver-pytorch"],
    "denoising-diffusion-pytorch": ["denoising-diffusion-pytorch"],
    "torchvision": ["torchvision"],
    "monai": ["monai"],
    "open-clip": ["open_clip_torch"],
}
SOURCES = [*PACKAGES, *SNAPSHOT_FILES]


def package_versions() -> dict[str, str]:
    """Installed version of every community package (``not installed`` where absent)."""
    out = {}
    for dists in PACKAGES.values():
        for dist in dists:
            try:
                out[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                out[dist] = "not installed"
    return out


def snapshot_commits(snapshots: Path | None) -> dict[str, str]:
    """``repository@commit`` of every snapshot folder (its ``COMMIT`` file)."""
    out = {}
    for name, (repo, _files) in SNAPSHOT_FILES.items():
        commit_file = Path(snapshots or "/nonexistent") / name / "COMMIT"
        commit = commit_file.read_text().strip() if commit_file.exists() else "no snapshot"
        out[name] = f"{repo}@{commit}"
    return out


def community_cases(source: str, snapshots: Path | None = None) -> Iterator[Case | tuple]:
    """The cases of one source (their ``family`` is ``source``); ``(source, reason)`` where
    they cannot be made here.

    Args:
        source: A name in :data:`SOURCES`.
        snapshots: The folder holding one snapshot folder per research repository.
    """
    warnings.filterwarnings("ignore")
    if source in PACKAGE_CASES:
        make, where = PACKAGE_CASES[source], None
    else:
        make, where = REPO_CASES[source], Path(snapshots or "/nonexistent") / source
        if not where.is_dir():
            yield source, f"no snapshot: --snapshots DIR must hold {source}/ (docs/support.md)"
            return
    try:
        for case in make() if where is None else make(where):
            yield dataclasses.replace(case, family=source)  # rows say their source
    except Exception as err:  # noqa: BLE001 - an import failure is "not buildable here"
        yield source, f"import: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
