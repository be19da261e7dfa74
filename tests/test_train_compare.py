"""examples/compare.py: both arms run, the report and plots are written (tiny budget)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (out / "report.md").read_text()
    assert "| baseline | 1 |" in report and "| tread | 1 |" in report
    assert (out / "val_loss_vs_time.png").stat().st_size > 1000
    assert (out / "val_loss_vs_step.png").stat().st_size > 1000
    assert "routes [(1, 3)]" in (out / "seed0" / "tread" / "stdout.log").read_text()
    assert "routes none" in (out / "seed0" / "baseline" / "stdout.log").read_text()
    rebuilt = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compare.py"), "--out", str(out), "--report-only"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert rebuilt.returncode == 0 and "budget 3.0 s" in rebuilt.stdout
