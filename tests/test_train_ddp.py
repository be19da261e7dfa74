"""examples/train.py under torch.distributed: two CPU processes (gloo) stay in sync."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_two_process_run_stays_in_sync(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", str(EXAMPLES / "train.py"), "--routes", "none",
           "--depth", "2", "--width", "32", "--heads", "2", "--batch-size", "16", "--steps", "3",
           "--num-samples", "4", "--sample-steps", "2", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sync = [r for r in records if r.get("event") == "sync_check"]
    assert len(sync) == 1 and sync[0]["ok"] is True and sync[0]["world_size"] == 2
    steps = [r for r in records if "event" not in r]
    assert steps[-1]["step"] == 3  # logged once, by rank 0 only
    assert "rank sync check over 2 processes: ok" in proc.stdout
    assert "2 processes" in proc.stdout
    meta = json.loads((out / "checkpoints" / "step_0000003" / "meta.json").read_text())
    assert meta["world_size"] == 2
    from safetensors.torch import load_file

    state = load_file(str(out / "checkpoints" / "step_0000003" / "state.safetensors"))
    assert {"rng/gen/0", "rng/gen/1", "rng/cpu/0", "rng/cpu/1"} <= state.keys()
    assert not torch.equal(state["rng/gen/0"], state["rng/gen/1"])  # ranks draw different noise
