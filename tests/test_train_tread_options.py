"""examples/train.py with TREAD's loss and re-entry options (a few steps, tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--depth", "4", "--width", "32", "--heads", "2", "--batch-size", "16", "--val-size", "16",
    "--num-samples", "10", "--sample-steps", "2", "--log-every", "2", "--eval-every", "2",
]  # fmt: skip


def _train(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "examples" / "train.py"), *TINY, *extra]
    command += ["--out", str(tmp_path / "run")]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_masked_loss_blend_fp32_reentry_and_routing_probability_train(tmp_path):
    result = _train(
        tmp_path, "--steps", "4", "--routes", "1:3", "--loss", "masked",
        "--reconstruction-weight", "0.1", "--reinsert", "blend", "--blend", "0.7", "0.3",
        "--fp32-reentry", "--routing-probability", "0.75", "--bf16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x
    ]
    losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(losses) == 2 and all(0 < v < 100 for v in losses)


def test_bad_tread_options_stop_with_a_clear_message(tmp_path):
    result = _train(tmp_path, "--steps", "1", "--routing-probability", "0")
    assert result.returncode == 2 and "--routing-probability must be in (0, 1]" in result.stderr
    result = _train(tmp_path, "--steps", "1", "--loss", "maskdit")
    assert result.returncode == 2 and "invalid choice" in result.stderr
