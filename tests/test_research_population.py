"""Issue 58's research population: the list (at least 100 repositories, at least 8 per domain,
every entry complete, listed before any case ran) and the runner that builds a listed
repository from its snapshot and judges it (here on a self-written repository: CI has no
snapshots)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch

LIST = Path(__file__).resolve().parents[1] / "benchmarks" / "research" / "population.json"
DOMAINS = {
    "image-dit", "uvit-hourglass", "mmdit", "video", "audio", "3d", "motion-robot", "ssm-linear",
}  # fmt: skip
FIELDS = ["domain", "repo", "commit", "file", "class", "config", "inputs", "expected", "reason",
          "edits", "imports", "prediction"]  # fmt: skip


def _entries() -> list[dict]:
    return json.loads(LIST.read_text())["entries"]


def test_the_list_has_a_hundred_repositories_and_eight_per_domain() -> None:
    entries = _entries()
    repos = [e["repo"].lower() for e in entries]
    assert len(set(repos)) == len(repos) >= 100
    per_domain = Counter(e["domain"] for e in entries)
    assert set(per_domain) == DOMAINS and min(per_domain.values()) >= 8, per_domain


def test_every_entry_says_what_to_build_and_what_to_expect() -> None:
    for e in _entries():
        assert list(e) == FIELDS, e["repo"]
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", e["repo"]) and re.fullmatch(
            r"[0-9a-f]{40}", e["commit"]
        )
        assert e["file"].endswith(".py") and e["class"].isidentifier(), e["repo"]
        assert e["expected"] == "route" or e["expected"].startswith("refuse: "), e["repo"]
        assert e["reason"] and e["inputs"] and e["config"] not in (None, ""), e["repo"]


# -- the runner: snapshot at the listed commit, builder, judged like the other sweeps ----------

MODEL_FILE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, c):
        h = self.norm(x) + c[:, None]
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class TinyDiT(nn.Module):
    def __init__(self, dim=32, depth=4):
        super().__init__()
        self.embed = nn.Conv2d(4, dim, 2, 2)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 16)

    def forward(self, x, t):
        h = self.embed(x).flatten(2).transpose(1, 2)
        c = self.time(t[:, None])
        for block in self.blocks:
            h = block(h, c)
        return self.out(h)
"""


def _mirror(tmp_path: Path) -> tuple[Path, str]:
    import subprocess

    work = tmp_path / "work"
    (work / "tiny").mkdir(parents=True)
    (work / "tiny" / "model.py").write_text(MODEL_FILE)
    (work / "tiny" / "weights.bin").write_bytes(b"\0" * 64)  # not a source file: left out
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "tiny"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, check=True)
    mirror = tmp_path / "mirrors" / "someone+tiny" / "repo"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(mirror)], check=True)
    return tmp_path / "mirrors", commit.stdout.decode().strip()


def test_a_listed_repository_is_built_from_its_commit_and_judged(tmp_path: Path) -> None:
    from benchmarks.coverage_checks import judge
    from benchmarks.coverage_community_repos import import_snapshot
    from benchmarks.research.population import Build, make_snapshot, research_cases

    mirrors, commit = _mirror(tmp_path)
    entry = {"domain": "image-dit", "repo": "someone/tiny", "commit": commit,
             "class": "TinyDiT", "edits": "", "expected": "route"}  # fmt: skip
    root = make_snapshot(entry, mirrors, tmp_path / "snapshots")
    assert (root / "tiny" / "model.py").exists() and not (root / "tiny" / "weights.bin").exists()
    assert (root / "COMMIT").read_text().strip() == commit

    def build(root: Path) -> Build:
        (mod,) = import_snapshot(root, "tiny.model")
        inputs = (torch.randn(2, 4, 8, 8), torch.tensor([0.1, 0.7]))
        return Build(lambda: mod.TinyDiT(), lambda: (inputs, {}))

    listed, known = [entry], {"someone/tiny": build}
    (case,) = research_cases(tmp_path / "snapshots", "someone/tiny", listed, known)
    verdict = judge(case)
    assert (verdict.verdict, verdict.expected, verdict.family) == ("routes", "route", "image-dit")
    assert verdict.flop_ratio is not None and verdict.flop_ratio < 1.0


def test_a_repository_without_a_builder_or_with_a_failing_one_is_not_buildable(
    tmp_path: Path,
) -> None:
    from benchmarks.research.population import research_cases

    entry = {"domain": "3d", "repo": "someone/none", "commit": "0" * 40, "class": "M",
             "edits": "", "expected": "route"}  # fmt: skip
    (row,) = research_cases(tmp_path, "someone/none", [entry], {})
    assert row == ("someone/none: M", "no builder written for this repository yet", "route")

    def missing(root: Path):
        raise FileNotFoundError(f"{root / 'model.py'} is not in the snapshot")

    (row,) = research_cases(tmp_path, "someone/none", [entry], {"someone/none": missing})
    assert row[1].startswith("FileNotFoundError: ") and "model.py" in row[1]


def test_every_listed_repository_has_a_builder() -> None:
    from benchmarks.research.population import builders

    assert set(builders()) == {e["repo"] for e in _entries()}
