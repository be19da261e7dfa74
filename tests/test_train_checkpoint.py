"""examples/checkpoint.py and train.py resume: round trip, exact continuation, bad files."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
ckpt = importlib.import_module("checkpoint")
train = importlib.import_module("train")

from tread_fx.errors import CheckpointError  # noqa: E402

TINY = ["--routes", "none", "--depth", "2", "--width", "32", "--heads", "2", "--batch-size", "16"]
TINY += ["--num-samples", "4", "--sample-steps", "2", "--log-every", "1", "--eval-every", "2"]
TINY += ["--save-every", "0"]


def _trained_pair(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip(tmp_path):
    model, opt = _trained_pair()
    ema = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    rng = {"cpu/0": torch.get_rng_state()}
    path = ckpt.save_checkpoint(tmp_path, 7, model, ema, opt, rng, {"args": {"lr": 0.01}})
    assert path.name == "step_0000007" and (tmp_path / "latest").read_text() == path.name
    assert sorted(p.name for p in path.iterdir()) == [
        "ema.safetensors", "meta.json", "model.safetensors", "state.safetensors",
    ]  # fmt: skip
    model2, opt2 = _trained_pair(seed=1)
    ema2 = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    meta, rng2 = ckpt.load_checkpoint(tmp_path, model2, ema2, opt2)  # via the latest pointer
    assert meta["step"] == 7 and meta["args"] == {"lr": 0.01}
    assert torch.equal(rng2["cpu/0"], rng["cpu/0"])
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(ema.state_dict().values(), ema2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for pid in s1["state"]:
        for key, value in s1["state"][pid].items():
            assert torch.equal(value, s2["state"][pid][key])


def test_keep_only_newest(tmp_path):
    model, opt = _trained_pair()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model, None, opt, {}, {}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000002", "step_0000003"]


def test_bad_checkpoints_name_the_file(tmp_path):
    model, opt = _trained_pair()
    path = ckpt.save_checkpoint(tmp_path, 1, model, model, opt, {}, {})
    with pytest.raises(CheckpointError, match="nowhere: checkpoint not found"):
        ckpt.load_checkpoint(tmp_path / "nowhere", model, None, opt)
    other = nn.Sequential(nn.Linear(3, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    with pytest.raises(CheckpointError, match="model.safetensors: does not match the model"):
        ckpt.load_checkpoint(path, other, None, None)
    (path / "ema.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="ema.safetensors: corrupt or unreadable"):
        ckpt.load_checkpoint(path, model, model, opt)
    (path / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="meta.json: corrupt or unreadable"):
        ckpt.load_checkpoint(path, model, None, opt)
    (path / "meta.json").write_text(json.dumps({"format": 99, "step": 1, "optimizer": {}}))
    with pytest.raises(CheckpointError, match="meta.json: format 99"):
        ckpt.load_checkpoint(path, model, None, opt)


def _weights(run: Path, step: int, name: str) -> dict[str, torch.Tensor]:
    return ckpt.read_tensors(run / "checkpoints" / f"step_{step:07d}" / f"{name}.safetensors")


def test_resume_continues_exactly(tmp_path):
    """6 steps straight == 3 steps, then resume for 3 more: bitwise, on the baseline."""
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert train.main([*TINY, "--steps", "6", "--out", str(straight)]) == 0
    assert train.main([*TINY, "--steps", "3", "--out", str(halves)]) == 0
    assert train.main([*TINY, "--steps", "6", "--out", str(halves), "--resume", str(halves)]) == 0
    for name in ("model", "ema"):
        a, b = _weights(straight, 6, name), _weights(halves, 6, name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    sa, sb = _weights(straight, 6, "state"), _weights(halves, 6, "state")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # optimizer moments and RNG states

    def losses(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["train_loss"] for r in map(json.loads, lines) if "event" not in r}

    assert losses(straight) == losses(halves)
    meta = json.loads((halves / "checkpoints" / "step_0000006" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["args"]["steps"] == 6 and meta["train_time"] > 0


def test_resume_errors(tmp_path, capsys):
    run = tmp_path / "run"
    assert train.main([*TINY, "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    # A different architecture is refused, naming the checkpoint's meta.json.
    args = [*TINY, "--steps", "2", "--out", str(run), "--resume", str(run)]
    assert train.main([*args, "--width", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert "step_0000001/meta.json" in err and "--width 32" in err and "\n" not in err
    # A corrupt weight file is an error naming it.
    (run / "checkpoints" / "step_0000001" / "model.safetensors").write_bytes(b"junk")
    assert train.main(args) == 2
    assert "model.safetensors: corrupt or unreadable" in capsys.readouterr().err
    fresh = ["--out", str(tmp_path / "fresh")]
    assert train.main([*TINY, *fresh, "--resume", str(tmp_path / "none")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
