"""examples/compare.py: both arms run, the report and plots are written (tiny budget)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def test_compare_runs_both_arms_and_writes_the_report(tmp_path):
    out = tmp_path / "cmp"
    command = [
        sys.executable, str(ROOT / "examples" / "compare.py"), "--out", str(out),
        "--budget", "3", "--seeds", "0", "--fid-samples", "0", "--tread-routes", "1:3",
        "--", "--data", "digits", "--depth", "4", "--width", "32", "--heads", "2",
        "--batch-size", "16", "--steps", "100000", "--log-every", "5", "--eval-every", "5",
        "--num-samples", "10", "--sample-steps", "2", "--val-size", "32",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (out / "report.md").read_text()
    assert "| baseline | 1 |" in report and "| tread | 1 |" in report
    assert (out / "val_loss_vs_time.png").stat().st_size > 1000
    assert (out / "val_loss_vs_step.png").stat().st_size > 1000
    assert "routes [(1, 3)]" in (out / "seed0" / "tread" / "stdout.log").read_text()
    assert "routes none" in (out / "seed0" / "baseline" / "stdout.log").read_text()
    setup = json.loads((out / "summary.json").read_text())["setup"]
    assert (setup["tokens"], setup["kept"], setup["tread"]["routes"]) == (16, 8, [[1, 3]])
    assert setup["baseline"]["routes"] == [] and setup["parameters"] > 0
    # 2 of 4 blocks at half the tokens: each costs between a quarter (attention) and a half
    assert 4 / 3 * 0.99 < setup["flop_ratio"] < 4 / 2.5
    assert "16 tokens (8 kept inside the route)" in report
    rebuilt = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compare.py"), "--out", str(out), "--report-only"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert rebuilt.returncode == 0 and "budget 3.0 s" in rebuilt.stdout


def test_convergence_mode_stops_tread_with_the_baseline_and_evaluates_checkpoints(tmp_path):
    out = tmp_path / "conv"
    command = [
        sys.executable, str(ROOT / "examples" / "compare.py"), "--out", str(out),
        "--baseline-steps", "12", "--seeds", "0", "--fid-samples", "0", "--tread-routes", "1:3",
        "--curve-fid", "40", "--curve-sample-steps", "2",
        "--", "--data", "digits", "--depth", "4", "--width", "32", "--heads", "2",
        "--batch-size", "16", "--log-every", "3", "--eval-every", "3", "--save-every", "6",
        "--keep-checkpoints", "0", "--num-samples", "10", "--sample-steps", "2",
        "--val-size", "32",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    base, tread = (out / "seed0" / arm for arm in ("baseline", "tread"))
    base_steps = [json.loads(line)["step"] for line in (base / "fid_curve.jsonl").open()]
    assert base_steps == [6, 12]  # every saved checkpoint, each once
    tread_records = [json.loads(line) for line in (tread / "fid_curve.jsonl").open()]
    assert tread_records[-1]["step"] >= 1 and tread_records[0]["sample_steps"] == 2
    assert all(np.isfinite(r["fid"]) and 0 <= r["class_accuracy"] <= 1 for r in tread_records)
    assert (out / "seed0" / "baseline.done").exists()  # what stopped the TREAD arm
    report = (out / "report.md").read_text()
    assert "the baseline trains 12 steps" in report and "## Convergence" in report
    assert (out / "fid_vs_time.png").exists()
    # a second evaluation skips what is done
    again = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fid_curve.py"), str(base), "--samples", "40"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0 and len((base / "fid_curve.jsonl").read_text().splitlines()) == 2
