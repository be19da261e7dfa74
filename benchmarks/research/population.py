"""From a listed entry and its repository snapshot to a coverage case.

Each entry of ``population.json`` names a repository, a commit, a model file and class, a tiny
config and the expected verdict. :func:`make_snapshot` exports that commit from a bare mirror
(what ``fetch`` brings, ``MIRRORS/owner+name/repo``) into ``SNAPSHOTS/owner+name``; a builder
in one of the ``cases_*`` modules imports the model file from there, applies the listed edits
(CUDA-only kernels replaced by plain PyTorch of the same math) and says how to call the model.
A repository without a builder is *not buildable* with that reason: the table counts it.

Example:
    >>> from benchmarks.research.population import entries
    >>> len(entries()) >= 100
    True
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.coverage_checks import Case

__all__ = ["LIST", "Build", "builders", "entries", "make_snapshot", "research_cases"]

LIST = Path(__file__).with_name("population.json")
DOMAIN_MODULES = ("image", "uvit", "mmdit", "video", "audio", "threed", "motion", "ssm")


@dataclass
class Build:
    """How to build and call one listed model.

    Attributes:
        make: Builds the model (called under ``torch.manual_seed(0)``).
        inputs: Builds ``(args, kwargs)`` of one forward call (deterministic).
        noisy: The argument holding the noisy input (see :class:`Case`).
        batch_dim: The noisy input's sample dim (1 for ``[T, B, C]``).
        note: How the case was built, shown in the table (edits included).
        routes: Routes given to ``route()``.
    """

    make: Callable[[], Any]
    inputs: Callable[[], tuple[tuple, dict]]
    noisy: str | int | None = None
    batch_dim: int = 0
    note: str = ""
    routes: list = field(default_factory=lambda: [(1, -1)])


def entries(path: Path = LIST) -> list[dict]:
    """The listed entries, in list order."""
    return json.loads(Path(path).read_text())["entries"]


def folder_name(repo: str) -> str:
    """The snapshot (and mirror) folder of ``owner/name``: ``owner+name``."""
    return repo.replace("/", "+")


SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".txt", ".cfg", ".toml", ".ini")


def _source_paths(git_dir: Path, commit: str) -> list[str]:
    """The commit's source and config files whose objects the mirror holds (a mirror may
    leave its largest files out)."""
    git = ["git", f"--git-dir={git_dir}"]
    tree = subprocess.run([*git, "ls-tree", "-r", "-z", commit], check=True, capture_output=True)
    listed = [line.split("\t", 1) for line in tree.stdout.decode().split("\0") if line]
    wanted = [(meta.split()[2], path) for meta, path in listed
              if meta.split()[1] == "blob" and path.endswith(SOURCE_SUFFIXES)]  # fmt: skip
    check = subprocess.run([*git, "cat-file", "--batch-check"], capture_output=True, check=True,
                           input="".join(f"{sha}\n" for sha, _ in wanted).encode())  # fmt: skip
    present = check.stdout.decode().splitlines()
    return [path for (_, path), line in zip(wanted, present) if not line.endswith("missing")]


def make_snapshot(entry: dict, mirrors: Path, snapshots: Path) -> Path:
    """Export the entry's commit (its source and config files) from
    ``mirrors/owner+name/repo`` into ``snapshots/owner+name``, once: a folder whose ``COMMIT``
    file holds that commit is kept as it is."""
    folder = Path(snapshots) / folder_name(entry["repo"])
    stamp = folder / "COMMIT"
    if stamp.exists() and stamp.read_text().strip() == entry["commit"]:
        return folder
    git_dir = Path(mirrors) / folder_name(entry["repo"]) / "repo"
    if not git_dir.exists():
        raise FileNotFoundError(f"no mirror of {entry['repo']} at {git_dir}: fetch it first")
    folder.mkdir(parents=True, exist_ok=True)
    paths = _source_paths(git_dir, entry["commit"])
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", entry["commit"], "--",
                              *paths], check=True, capture_output=True)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    stamp.write_text(entry["commit"] + "\n")
    return folder


def builders() -> dict[str, Callable[[Path], Build]]:
    """Every repository's builder, from the ``cases_*`` modules' ``BUILDERS``."""
    import importlib

    found: dict[str, Callable[[Path], Build]] = {}
    for name in DOMAIN_MODULES:
        try:
            module = importlib.import_module(f"benchmarks.research.cases_{name}")
        except ModuleNotFoundError as err:
            if err.name != f"benchmarks.research.cases_{name}":
                raise
            continue
        found.update(module.BUILDERS)
    return found


def research_cases(
    snapshots: Path, repo: str, listed: list[dict] | None = None, known: dict | None = None
) -> Iterator[Case | tuple]:
    """The case of listed repository ``repo``, built from its snapshot, or ``(name, reason,
    expected)`` where it cannot be built (no builder yet, an import or build error)."""
    entry = next(e for e in (listed or entries()) if e["repo"] == repo)
    name = f"{repo}: {entry['class']}"
    builder = (builders() if known is None else known).get(repo)
    if builder is None:
        yield name, "no builder written for this repository yet", entry["expected"]
        return
    try:
        build = builder(Path(snapshots) / folder_name(repo))
    except Exception as err:  # an import or a missing file: the row says which
        yield name, f"{type(err).__name__}: {err}".splitlines()[0][:300], entry["expected"]
        return
    edits = f"edits: {entry['edits']}" if entry["edits"] else ""
    yield Case(
        name,
        entry["domain"],
        build.make,
        build.inputs,
        routes=build.routes,
        note="; ".join(s for s in (build.note, edits) if s),
        noisy=build.noisy,
        expected=entry["expected"],
        batch_dim=build.batch_dim,
    )
