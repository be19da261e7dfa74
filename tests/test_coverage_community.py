"""The community population of the coverage sweep (benchmarks/coverage_community.py).

The package-index part runs here (the ``community`` extra, installed by scripts/setup.sh):
representative cases keep the verdicts of the committed table. The research-repository part
needs snapshots and runs only when ``TREAD_FX_COMMUNITY_SNAPSHOTS`` names their folder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks.coverage import main as coverage_main
from benchmarks.coverage_checks import VERDICTS, judge
from benchmarks.coverage_community import (
    PACKAGES,
    SNAPSHOT_FILES,
    SOURCES,
    community_cases,
    import_snapshot,
)
from benchmarks.coverage_community_cases import REFUSE_LATENTS

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "results" / "coverage.json"
SNAPSHOTS = os.environ.get("TREAD_FX_COMMUNITY_SNAPSHOTS", "")
SWEEP = "python -m benchmarks.coverage community --snapshots DIR"


def _case(source: str, name: str):
    cases = {c.name: c for c in community_cases(source) if not isinstance(c, tuple)}
    return cases[f"{source}: {name}"]


def test_the_population_spans_enough_sources():
    outside = {"diffusers", "timm", "transformers"}
    assert len(SOURCES) >= 8 and not outside & set(SOURCES)
    package_cases = [c for s in PACKAGES for c in community_cases(s)]
    assert all(not isinstance(c, tuple) for c in package_cases), package_cases
    assert len(package_cases) + len(SNAPSHOT_FILES) >= 20
    assert all(c.expected == "route" or c.expected.startswith("refuse: ") for c in package_cases)


@pytest.mark.parametrize(
    ("source", "name", "verdict", "reason"),
    [
        ("torchvision", "VisionTransformer", "routes", ""),
        ("x-transformers", "ContinuousTransformerWrapper(Encoder)", "routes", ""),
        ("x-transformers", "ContinuousTransformerWrapper(Encoder, rotary)", "routes", ""),
        ("vit-pytorch", "SimpleViT (4 registers)", "routes", ""),
        ("denoising-diffusion-pytorch", "Unet", "refused", "no token sequence flows through"),
        ("perceiver-pytorch", "Perceiver", "refused", "carry no token of the model's input"),
    ],
)
def test_representative_cases_keep_their_verdict(source, name, verdict, reason):
    got = judge(_case(source, name))
    assert got.verdict == verdict, got
    assert reason in got.reason, got


def test_the_committed_table_is_the_current_population():
    """The committed rows are those of the current cases, at least 20 from 8 sources."""
    rows = json.loads(COMMITTED.read_text())["community"]["rows"]
    assert len({r["name"].split(":")[0] for r in rows}) >= 8 and len(rows) >= 20
    names = {r["name"] for r in rows}
    assert {c.name for s in PACKAGES for c in community_cases(s)} <= names
    assert all(r["verdict"] in VERDICTS for r in rows)
    assert all(r["expected"] for r in rows if r["verdict"] != "not buildable")


def test_a_community_run_replaces_only_its_own_rows(tmp_path):
    """Another population's section stays; ``--only`` keeps the other sources' rows."""
    other = {"meta": {"source": "x"}, "rows": [{"name": "a", "verdict": "routes"}], "date": "d",
             "seconds": 1}  # fmt: skip
    kept = {"name": "DiT: DiT", "family": "dit", "verdict": "routes", "expected": "route"}
    stale = {"name": "perceiver-pytorch: Perceiver", "family": "perceiver-pytorch",
             "verdict": "broken", "expected": REFUSE_LATENTS}  # fmt: skip
    community = {**other, "rows": [kept, stale]}
    (tmp_path / "c.json").write_text(json.dumps({"timm": other, "community": community}))
    coverage_main(["community", "--only", "perceiver-pytorch", "--out", str(tmp_path / "c")])
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["timm"] == other
    rows = {r["name"]: r["verdict"] for r in data["community"]["rows"]}
    assert rows == {"DiT: DiT": "routes", "perceiver-pytorch: Perceiver": "refused"}
    text = (tmp_path / "c.md").read_text()
    assert (
        "Expected to route: 1, routing cleanly: 1 (100%). Expected to be refused: 1, "
        "refused: 1." in text
    )


def test_a_snapshot_module_wins_over_a_package_of_the_same_name(tmp_path, monkeypatch):
    """Research repositories call their model folder ``models`` (often without
    ``__init__.py``), as this project does: the snapshot's must be the one imported."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net.py").write_text("WHERE = 'snapshot'\n")
    shadow = tmp_path / "shadow"
    (shadow / "models").mkdir(parents=True)
    (shadow / "models" / "__init__.py").write_text("")
    (shadow / "models" / "net.py").write_text("WHERE = 'shadow'\n")
    monkeypatch.syspath_prepend(str(shadow))
    monkeypatch.delitem(sys.modules, "models", raising=False)
    (net,) = import_snapshot(tmp_path, "models.net")
    assert net.WHERE == "snapshot"
    assert str(tmp_path) not in sys.path


def test_a_missing_snapshot_is_not_buildable_with_the_command_to_run():
    (row,) = community_cases("dit", None)
    assert row[0] == "dit" and "--snapshots DIR" in row[1]


@pytest.mark.skipif(not SNAPSHOTS, reason=f"needs repository snapshots: {SWEEP} runs them")
@pytest.mark.parametrize("source", sorted(SNAPSHOT_FILES))
def test_research_repositories_keep_their_verdicts(source):
    rows = json.loads(COMMITTED.read_text())["community"]["rows"]
    committed = {r["name"]: r["verdict"] for r in rows}
    for case in community_cases(source, Path(SNAPSHOTS)):
        if isinstance(case, tuple):
            assert committed.get(case[0]) == "not buildable", case
            continue
        assert judge(case).verdict == committed[case.name], case.name
