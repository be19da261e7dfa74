"""examples/compare_report.py: convergence speed-ups and equal-time/equal-step FID from curves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import compare_report as cr  # noqa: E402


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _arm(out: Path, seed: int, arm: str, times, vals, fids, steps_per_s: float) -> None:
    steps = [round(t * steps_per_s) for t in times]
    metrics = [
        {"step": s, "time_s": t, "val_loss_ema": v, "train_loss": v}
        for s, t, v in zip(steps, times, vals)
    ]
    _write(out / f"seed{seed}" / arm / "metrics.jsonl", metrics)
    curve = [
        {"step": s, "time_s": t, "fid": f, "kid_mean": f / 100, "class_accuracy": 0.9}
        for s, t, f in zip(steps, times, fids)
    ]
    _write(out / f"seed{seed}" / arm / "fid_curve.jsonl", curve)


@pytest.fixture
def finished(tmp_path):
    """Two seeds: the baseline (1 step/s) ends at val 1.0, FID 4.0 after 100 s; TREAD (1.5
    steps/s) reaches val 1.0 at 50 s and FID 4.0 at 87.5 s."""
    times = [0.0, 25.0, 50.0, 75.0, 100.0]
    for seed in (0, 1):
        _arm(tmp_path, seed, "baseline", times, [4, 3, 2, 1.5, 1.0], [40, 20, 10, 6, 4], 1.0)
        _arm(tmp_path, seed, "tread", times, [3, 2, 1.0, 0.8, 0.7], [30, 15, 8, 5, 3], 1.5)
    return tmp_path


def test_first_reach_interpolates_and_reports_never():
    times = np.array([0.0, 10.0, 20.0])
    assert cr.first_reach(times, np.array([3.0, 2.0, 1.0]), 1.5) == 15.0
    assert cr.first_reach(times, np.array([3.0, 2.0, 1.0]), 3.5) == 0.0
    assert cr.first_reach(times, np.array([3.0, 2.0, 1.0]), 0.5) is None


def test_convergence_speedups_and_equal_time_and_step_fid(finished):
    runs = cr.load_runs(finished)
    row = cr.convergence(runs["baseline"][0], runs["tread"][0])
    assert row["val reach time"] == pytest.approx(50.0)
    assert row["val speed-up"] == pytest.approx(2.0)
    assert row["fid reach time"] == pytest.approx(87.5)  # 5 at 75 s, 3 at 100 s
    assert row["fid speed-up"] == pytest.approx(100 / 87.5)
    assert row["fid @ time"] == (4.0, 3.0)
    # the baseline's last step is 100: on TREAD's curve between step 75 (FID 8) and 112 (FID 5)
    assert row["fid @ steps"][1] == pytest.approx(np.interp(100, [75, 112], [8, 5]), abs=0.1)
    assert row["steps"] == (100, 150)


def test_report_has_the_convergence_table_plots_and_notes(finished):
    (finished / "notes.md").write_text("Notes: a hand-written remark.\n")
    report = cr.write_report(finished, ["--out", "x"], ["--data", "digits"], "limit").read_text()
    assert "## Convergence" in report and "| mean ± std |" in report
    assert "2 ± 0" in report  # val-loss speed-up over the two seeds
    assert "Notes: a hand-written remark." in report
    for name in ("val_loss_vs_time", "fid_vs_time", "fid_vs_step"):
        assert (finished / f"{name}.png").stat().st_size > 1000
    summary = json.loads((finished / "summary.json").read_text())
    assert len(summary["convergence"]) == 2


def test_a_speedup_never_reached_is_said(finished):
    _arm(finished, 1, "tread", [0.0, 50.0, 100.0], [5, 4, 3], [50, 45, 41], 1.5)
    runs = cr.load_runs(finished)
    row = cr.convergence(runs["baseline"][1], runs["tread"][1])
    assert row["val speed-up"] is None and row["fid speed-up"] is None
    report = cr.write_report(finished, [], [], "limit").read_text()
    assert "not reached" in report and "reached in 1 of 2 seeds: 2" in report


def test_a_seed_without_fid_curves_is_reported_beside_seeds_with_them(finished):
    times = [0.0, 25.0, 50.0, 75.0, 100.0]
    _arm(finished, 2, "baseline", times, [4, 3, 2, 1.5, 1.0], [40, 20, 10, 6, 4], 1.0)
    _arm(finished, 2, "tread", times, [3, 2, 1.0, 0.8, 0.7], [30, 15, 8, 5, 3], 1.5)
    for arm in ("baseline", "tread"):
        (finished / "seed2" / arm / "fid_curve.jsonl").unlink()
    report = cr.write_report(finished, [], [], "limit").read_text()
    assert "reached in 2 of 3 seeds: 4 / 3, 4 / 3" in report  # FID at equal time, per seed
