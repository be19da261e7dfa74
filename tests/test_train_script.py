"""examples/train.py end to end: a subprocess run, model building, and every argument error."""

from __future__ import annotations

import csv
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
train = importlib.import_module("train")

TINY = ["--depth", "2", "--width", "32", "--heads", "2", "--batch-size", "16"]
TINY += ["--num-samples", "4", "--sample-steps", "2"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(EXAMPLES / "train.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_subprocess_baseline_run(tmp_path):
    out = tmp_path / "run"
    proc = _run("--routes", "none", *TINY, "--steps", "4", "--log-every", "2", "--eval-every",
                "4", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    # non-TTY output (no bar): each log line shows the total and an ETA
    assert re.search(
        r"step 2/4 \| loss [0-9.]+ \| [0-9.]+ it/s \| ETA \d+:\d\d", proc.stdout + proc.stderr
    )
    last = records[-1]
    assert {"step", "time_s", "train_loss", "val_loss", "steps_per_s"} <= last.keys()
    assert last["val_loss"] > 0 and last["time_s"] > 0 and last["steps_per_s"] > 0
    assert records[0]["val_loss"] is None  # evaluated every 4 steps only
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [2, 4]
    png = (out / "samples.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = out / "checkpoints" / "step_0000004"
    assert (out / "checkpoints" / "latest").read_text() == ckpt.name
    from safetensors.torch import load_file

    state = load_file(str(ckpt / "model.safetensors"))
    model = train.build_model("dit", depth=2, hidden_size=32, num_heads=2, input_size=8,
                              in_channels=1, num_classes=10, learn_sigma=False)  # fmt: skip
    model.load_state_dict(state)  # the plain, unrouted state_dict
    assert json.loads((ckpt / "meta.json").read_text())["args"]["routes"] == "none"


def _previous_run(out: Path) -> list[str]:
    """What a finished run leaves in ``out`` (its markers, see examples/run_dir.py)."""
    (out / "checkpoints").mkdir(parents=True)
    (out / "args.json").write_text("{}")
    return sorted(p.name for p in out.iterdir())


def test_bad_argument_in_a_subprocess(tmp_path):
    """README command 1 ran before (a run in --out): the bad argument is still what is said."""
    out = tmp_path / "train"
    before = _previous_run(out)
    proc = _run("--routes", "5:2", *TINY, "--steps", "1", "--out", str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0  # one line
    assert "--routes 5:2" in proc.stderr and "start < end" in proc.stderr
    assert "previous run" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routes", "5:2"], "--routes 5:2: 5:2 needs 0 <= start < end <= depth (2 blocks)"),
        (["--routes", "0:9"], "depth (2 blocks)"),
        (["--data", "latents", "--data-dir", "/no/such/dir"], "/no/such/dir"),
        (["--batch-size", "4096"], "fewer than --batch-size 4096"),
        (["--width", "30"], "cannot build model"),
        (["--rate", "1.5"], "--rate"),
    ],
)
def test_every_argument_is_checked_before_the_run_folder(args, message, capsys, tmp_path):
    before = _previous_run(tmp_path)
    argv = [*TINY, "--routes", "none", "--steps", "1", "--out", str(tmp_path), *args]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "previous run" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--routes", "5:2"], "--routes 5:2: 5:2 needs 0 <= start < end <= depth (2 blocks)"),
        (["--routes", "0:9"], "depth (2 blocks)"),
        (["--routes", "2-6"], "is not START:END"),
        (["--data", "fashion-mnist", "--data-dir", "/no/such/dir"], "/no/such/dir"),
        (["--data", "latents", "--data-dir", "/no/such/dir"], "/no/such/dir"),
        (["--cfg-scale", "3", "--label-drop", "0"], "--cfg-scale != 1 needs --label-drop > 0"),
        (["--batch-size", "0"], "--batch-size"),
        (["--rate", "1.5"], "--rate"),
        (["--batch-size", "4096"], "fewer than --batch-size 4096"),
        (["--model", "mamba", "--heads", "4"], "does not take --heads"),
        (["--width", "30"], "cannot build model"),
    ],
)
def test_argument_errors(args, message, capsys, tmp_path):
    argv = [*TINY, "--routes", "none", "--steps", "1", "--out", str(tmp_path), *args]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(["--objective", "ddpm"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "invalid choice: 'ddpm'" in err and "\n" not in err


def test_nan_loss_stops_naming_the_step(capsys, tmp_path):
    argv = [*TINY, "--routes", "none", "--steps", "8", "--out", str(tmp_path), "--lr", "1e30",
            "--grad-clip", "0"]  # fmt: skip
    assert train.main(argv) == 1
    err = capsys.readouterr().err
    assert "loss is" in err and "at step" in err
    assert not (tmp_path / "checkpoints").exists()


def test_parse_routes():
    assert train.parse_routes("none", 12) == []
    assert train.parse_routes("auto", 12) == [(2, 8)]
    assert train.parse_routes("auto", 8) == [(2, 4)]
    assert train.parse_routes("auto", 4) == [(1, 3)]
    assert train.parse_routes("2:6,7:9", 12) == [(2, 6), (7, 9)]
    assert train.parse_routes("2:-2", 12) == [(2, 10)]
    with pytest.raises(train.UsageError, match="not overlap"):
        train.parse_routes("2:6,5:9", 12)


def _available(family: str) -> bool:
    try:
        importlib.import_module(f"tread_fx.models.{family}")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("name", ["dit", "mamba", "rwkv", "DiT_S_2", "DiT-S/2"])
def test_build_model_families(name):
    family = name.lower().split("_")[0].split("-")[0]
    if not _available(family):
        pytest.skip(f"tread_fx.models.{family} not present")
    torch.manual_seed(0)
    heads = {"num_heads": 2} if family == "dit" else {}
    model = train.build_model(name, depth=2, hidden_size=32, input_size=8, in_channels=1,
                              num_classes=10, learn_sigma=False, **heads)  # fmt: skip
    assert train.num_blocks(model) == 2
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([10.0, 500.0]), torch.tensor([1, 10])
    assert model(x, t, y).shape == (2, 1, 8, 8)


def test_build_model_defaults_and_errors():
    model = train.build_model("dit", input_size=8, in_channels=1, num_classes=10)
    assert train.num_blocks(model) == 8 and model.patch_size == 2
    with pytest.raises(train.UsageError, match="unknown model"):
        train.build_model("resnet50")


def test_edm_learned_sigma_and_time_budget(tmp_path):
    out = tmp_path / "edm"
    argv = [*TINY, "--routes", "none", "--objective", "edm", "--learn-sigma", "--sampler",
            "euler", "--steps", "100000", "--time-budget", "0.5", "--out", str(out)]  # fmt: skip
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert 1 <= last["step"] < 100000 and last["time_s"] >= 0.5
    assert last["val_loss"] is not None  # the last step is always evaluated
    assert (out / "checkpoints" / f"step_{last['step']:07d}" / "model.safetensors").is_file()


def test_rank_shards_partition_the_global_batch():
    tu = importlib.import_module("train_utils")
    single = tu.Shards(100, 8, 0, 1, seed=3)
    ranks = [tu.Shards(100, 8, r, 2, seed=3) for r in range(2)]
    for step in (0, 5, 12, 13, 40):  # 12 batches per epoch: crosses epoch boundaries
        whole = single.indices(step)
        parts = [s.indices(step) for s in ranks]
        assert sorted(torch.cat(parts).tolist()) == sorted(whole.tolist())
        assert len(set(whole.tolist())) == 8
    assert not torch.equal(single.indices(0), single.indices(12))  # a new permutation per epoch
    with pytest.raises(ValueError, match="fewer than --batch-size"):
        tu.Shards(4, 8, 0, 1, seed=0)


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_sample_grid_png(tmp_path, channels):
    from PIL import Image

    tu = importlib.import_module("train_utils")
    images = torch.rand(7, channels, 8, 8) * 2 - 1
    tu.save_grid(images, tmp_path / "g.png", nrow=3)
    with Image.open(tmp_path / "g.png") as img:
        assert img.size == (3 * 34 + 2, 3 * 34 + 2)  # 8 px upscaled x4, 2 px borders
        assert img.mode == ("L" if channels == 1 else "RGB")
