"""Issue 58's research population list: at least 100 repositories, at least 8 per domain,
every entry complete (listed before any case is run; the runner comes later)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

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
