"""A second run into the same --out never loses the first: refused without --resume/--overwrite,
pruning by step number never deletes the checkpoint just written, ``latest`` always resolves."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
ckpt = importlib.import_module("checkpoint")
train = importlib.import_module("train")
run_dir = importlib.import_module("run_dir")

TINY = ["--routes", "1:2", "--depth", "2", "--width", "32", "--heads", "2", "--batch-size", "16"]
TINY += ["--num-samples", "4", "--sample-steps", "2", "--log-every", "1", "--eval-every", "100"]
TINY += ["--val-size", "16", "--keep-checkpoints", "2"]


def _steps(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))


def _latest_step(out: Path) -> int:
    return ckpt.read_meta(out)[1]["step"]


def test_pruning_is_by_step_number_and_keeps_the_checkpoint_just_written(tmp_path):
    """step_0000060 written beside step_0000500/600 (the issue's scenario) survives pruning."""
    model = nn.Linear(2, 2)
    opt = __import__("torch").optim.SGD(model.parameters(), lr=0.1)
    for step in (500, 600, 60):
        ckpt.save_checkpoint(tmp_path, step, model, None, opt, {}, {}, keep=2)
    names = sorted(p.name for p in tmp_path.glob("step_*"))
    assert names == ["step_0000060", "step_0000600"]
    assert ckpt.find_checkpoint(tmp_path).name == "step_0000060"  # latest resolves


def test_keep_one_keeps_only_the_checkpoint_just_written(tmp_path):
    for step in (9, 70, 3):
        (tmp_path / f"step_{step:07d}").mkdir()
    removed = ckpt.prune_checkpoints(tmp_path, 1, tmp_path / "step_0000003")
    assert sorted(p.name for p in removed) == ["step_0000009", "step_0000070"]
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_0000003"]


def test_a_second_run_into_the_same_out_is_refused_or_overwritten_and_stays_resumable(
    tmp_path, capsys
):
    out = tmp_path / "run"
    first = [*TINY, "--steps", "6", "--save-every", "3", "--out", str(out)]
    assert train.main(first) == 0
    assert _steps(out) == [3, 6] and _latest_step(out) == 6
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()

    # The same command with fewer steps: refused in one line, nothing touched.
    second = [*TINY, "--steps", "2", "--save-every", "1", "--out", str(out)]
    assert train.main(second) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a previous run" in err and "--resume" in err and "--overwrite" in err, err
    assert "\n" not in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert _latest_step(out) == 6

    # --resume continues the first run (a bare --resume means --out).
    assert (
        train.main([*TINY, "--steps", "8", "--save-every", "3", "--out", str(out), "--resume"]) == 0
    )
    assert _latest_step(out) == 8 and _steps(out) == [6, 8]

    # --overwrite replaces it: the fewer-step run's checkpoints are the only ones, resumable.
    assert train.main([*second, "--overwrite"]) == 0
    assert _steps(out) == [1, 2] and _latest_step(out) == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert max(r["step"] for r in records if "step" in r) == 2  # the old metrics are gone
    assert json.loads((out / "args.json").read_text())["steps"] == 2
    assert train.main([*TINY, "--steps", "3", "--out", str(out), "--resume"]) == 0
    assert _latest_step(out) == 3


def test_resume_and_overwrite_exclude_each_other(tmp_path, capsys):
    argv = [*TINY, "--steps", "1", "--out", str(tmp_path), "--resume", "--overwrite"]
    assert train.main(argv) == 2
    assert "exclude each other" in capsys.readouterr().err


def test_overwrite_deletes_only_what_the_scripts_write(tmp_path):
    for name in ("args.json", "metrics.csv", "samples_0000010.png", "notes.md"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoints" / "step_0000001").mkdir(parents=True)
    run_dir.clear_run(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.md"]


def test_train_diffusers_refuses_a_previous_run(tmp_path):
    pytest.importorskip("diffusers")
    (tmp_path / "checkpoints").mkdir()
    script = ROOT / "examples" / "train_diffusers.py"
    config = ROOT / "examples" / "configs" / "tiny_sd3.json"  # valid: the folder is what is wrong
    command = [sys.executable, str(script), "--config", str(config), "--batch-size", "8",
               "--val-size", "16", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "holds a previous run (checkpoints)" in done.stderr


COMPARE = [sys.executable, str(ROOT / "examples" / "compare.py")]
ARMS = ["--", "--depth", "2", "--width", "32", "--heads", "2", "--batch-size", "16"]


def test_compare_refuses_a_previous_comparison(tmp_path):
    (tmp_path / "command.json").write_text('{"argv": []}')
    command = [*COMPARE, "--out", str(tmp_path), *ARMS]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 1 and "holds a previous comparison" in done.stderr, done.stderr
    assert "--overwrite" in done.stderr and not (tmp_path / "seed0").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tread-routes", "5:2", *ARMS], "train.py: --routes 5:2: 5:2 needs 0 <= start < end"),
        (["--tread-routes", "0:9", *ARMS], "depth (2 blocks)"),
        ([*ARMS, "--batch-size", "4096"], "fewer than --batch-size 4096"),
        ([*ARMS, "--rate", "2"], "--rate must be in [0, 1)"),
        ([*ARMS, "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--budget", "0", *ARMS], "--budget must be > 0"),
    ],
)
def test_compare_checks_every_argument_before_the_folder(tmp_path, args, message):
    (tmp_path / "command.json").write_text('{"argv": []}')
    command = [*COMPARE, "--out", str(tmp_path), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    err = done.stderr.strip()
    assert done.returncode == 2 and message in err and "previous" not in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["command.json"]


def test_the_setup_line_names_processes_without_accelerate_internals():
    tu = importlib.import_module("train_utils")
    assert tu.processes(1, "NO") == "1 process"  # was "1 process(es) (NO)"
    assert tu.processes(2, "MULTI_CPU") == "2 processes (MULTI_CPU)"


def test_fid_curve_checks_its_arguments_before_any_folder(tmp_path, capsys):
    fid_curve = importlib.import_module("fid_curve")
    with pytest.raises(SystemExit) as exc:
        fid_curve.main([str(tmp_path / "no_run"), "--samples", "0"])
    assert exc.value.code == 2 and "--samples" in capsys.readouterr().err
    assert fid_curve.main([str(tmp_path / "no_run")]) == 2
    assert "no_run has no checkpoints/" in capsys.readouterr().err
