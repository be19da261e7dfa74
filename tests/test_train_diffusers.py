"""examples/train_diffusers.py: tiny Flux, SD3 and PixArt train routed on accelerate, fine-tune
from a saved folder, resume exactly, run as two DDP processes, and refuse bad input (exit 2)."""

from __future__ import annotations

import importlib
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("accelerate")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIGS = EXAMPLES / "configs"
sys.path.insert(0, str(EXAMPLES))
td = importlib.import_module("train_diffusers")
da = importlib.import_module("diffusers_adapters")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

FAST = ["--batch-size", "8", "--val-size", "16", "--num-samples", "10", "--sample-steps", "2"]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps one process-wide state; each in-process run starts from none."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "name, extra",
    [
        ("flux", []),
        ("sd3", ["--gradient-checkpointing"]),
        ("pixart", ["--mixed-precision", "bf16"]),
    ],
)
def test_a_tiny_routed_model_trains_and_writes_samples(name, extra, tmp_path):
    out = tmp_path / name
    argv = ["--config", str(CONFIGS / f"tiny_{name}.json"), *FAST, *extra, "--steps", "10"]
    assert td.main([*argv, "--log-every", "5", "--eval-every", "10", "--out", str(out)]) == 0
    records = _records(out)
    assert [r["step"] for r in records] == [5, 10]
    assert all(math.isfinite(r["train_loss"]) for r in records)
    assert math.isfinite(records[-1]["val_loss"]) and math.isfinite(records[-1]["val_loss_ema"])
    assert (out / "samples.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    assert {"model.safetensors", "ema.safetensors", "meta.json"} <= {p.name for p in ckpt.iterdir()}
    # the saved folder is a plain diffusers model: the EMA weights, unrouted keys
    model = da.build_model(None, pretrained=str(out / "transformer"))
    assert (
        type(model).__name__
        == json.loads((CONFIGS / f"tiny_{name}.json").read_text())["_class_name"]
    )


def test_fine_tuning_from_a_folder_resumes_exactly(tmp_path):
    """``--pretrained`` loads a saved folder; 4 steps straight == 2 + resume + 2, bitwise."""
    import diffusers

    torch.manual_seed(0)
    config = json.loads((CONFIGS / "tiny_pixart.json").read_text())
    del config["_class_name"]
    diffusers.PixArtTransformer2DModel(**config).save_pretrained(tmp_path / "pre" / "transformer")
    argv = ["--pretrained", str(tmp_path / "pre"), *FAST, "--lr", "1e-4", "--grad-accum", "2"]
    assert td.main([*argv, "--steps", "4", "--out", str(tmp_path / "straight")]) == 0
    AcceleratorState = importlib.import_module("accelerate.state").AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    assert td.main([*argv, "--steps", "2", "--out", str(tmp_path / "split")]) == 0
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = [
        "--steps",
        "4",
        "--resume",
        str(tmp_path / "split"),
        "--out",
        str(tmp_path / "split"),
    ]
    assert td.main([*argv, *resumed]) == 0
    from safetensors.torch import load_file

    def final(run: str) -> dict:
        return load_file(str(tmp_path / run / "checkpoints" / "step_0000004" / "model.safetensors"))

    straight, split = final("straight"), final("split")
    assert straight.keys() == split.keys()
    assert all(torch.equal(straight[k], split[k]) for k in straight)
    assert _records(tmp_path / "split")[-1]["step"] == 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_two_cpu_processes_under_torchrun_train_in_sync(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", str(EXAMPLES / "train_diffusers.py"),
           "--config", str(CONFIGS / "tiny_flux.json"), *FAST, "--steps", "3", "--ema", "0",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "2 processes (MULTI_CPU)" in proc.stdout
    sync = [r for r in _records(out) if r.get("event") == "sync_check"]
    assert len(sync) == 1 and sync[0]["ok"] is True and sync[0]["world_size"] == 2


def _fsdp_on_cpu_main() -> int:
    """``train_diffusers.main`` with accelerate switched to FSDP2 after it joined torchrun's
    CPU process group. accelerate itself keeps CPU runs on DDP; the switch sets its private
    shared state, so this may need updating with accelerate."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    make = td.make_accelerator

    def make_fsdp(args):
        acc = make(args)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            activation_checkpointing=True, state_dict_type="FULL_STATE_DICT",
        )  # fmt: skip
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["fsdp_plugin"] = plugin
        return acc

    td.make_accelerator = make_fsdp
    return td.main(sys.argv[1:])


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_accelerates_fsdp2_preparation_trains_saves_and_samples_on_two_cpu_processes(tmp_path):
    """What ``accelerate launch`` with configs/accelerate_fsdp2.yaml does on GPUs: blocks and the
    final norm sharded, checkpoint_wrapper per block, EMA off, every rank evaluates/samples."""
    out = tmp_path / "fsdp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", __file__, "--config",
           str(CONFIGS / "tiny_flux.json"), *FAST, "--steps", "3", "--save-every", "2",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "2 processes (FSDP)" in proc.stdout
    records = _records(out)
    assert [r["step"] for r in records] == [3]  # the main process logs, once
    assert all(math.isfinite(r["train_loss"]) and r["val_loss_ema"] is None for r in records)
    for step in ("step_0000002", "step_0000003"):
        assert (out / "checkpoints" / step / "pytorch_model_fsdp.bin").is_file()
    saved = da.build_model(None, pretrained=str(out / "transformer"))  # gathered, unrouted
    fresh = da.build_model(None, str(CONFIGS / "tiny_flux.json"))
    assert saved.state_dict().keys() == fresh.state_dict().keys()
    assert (out / "samples.png").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "NoSuchModel", "--config", "{cfg}"], "--model NoSuchModel: not a diffusers"),
        (["--config", "{tmp}/missing.json"], "missing.json: file not found"),
        (["--config", "{tmp}/broken.json"], "broken.json: not a JSON file"),
        (["--config", "{tmp}/typo.json"], "does not take num_layerz"),
        (["--config", "{cfg}", "--routes", "1-3"], "'1-3' is not START:END"),
        (["--config", "{cfg}", "--routes", "1:9"], "resolves to blocks 1..8, outside"),
        (["--config", "{cfg}", "--pretrained", "{tmp}"], "exactly one of --config"),
        (["--config", "{cfg}", "--data", "latents"], "--data-dir"),
        (["--config", "{cfg}", "--batch-size", "3", "--grad-accum", "2"], "multiple of"),
    ],
)
def test_bad_input_stops_with_one_line_and_exit_code_2(argv, message, tmp_path, capsys):
    """Even with a previous run in --out: every argument is checked before the folder."""
    (tmp_path / "broken.json").write_text("{not json")
    config = json.loads((CONFIGS / "tiny_sd3.json").read_text())
    (tmp_path / "typo.json").write_text(json.dumps({**config, "num_layerz": 2}))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    argv = [a.format(cfg=CONFIGS / "tiny_sd3.json", tmp=tmp_path) for a in argv]
    assert td.main([*FAST, *argv, "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("train_diffusers.py: error:")
    assert __import__("re").search(message, err) and "previous run" not in err, err
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]


def test_an_unsupported_forward_is_named_with_what_is_supported():
    import diffusers

    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8,
                                            in_channels=1, num_layers=2, sample_size=8,
                                            patch_size=2)  # fmt: skip
    with pytest.raises(da.ModelError, match=r"(?s)DiTTransformer2DModel.*supported: packed"):
        da.pick_family(model)


def test_config_and_data_mismatch_is_refused_naming_the_key():
    model = da.build_model(None, str(CONFIGS / "tiny_flux.json"))
    cond = da.standin_conditioning(10, 32, 32)
    with pytest.raises(da.ModelError, match="in_channels 4 must be C \\* p \\* p .* C = 3"):
        da.make_adapter(model, (3, 8, 8), cond)


def test_text_embeddings_from_a_file(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "text.safetensors")
    save_file({"prompt_embeds": torch.ones(10, 4, 32), "pooled_prompt_embeds": torch.ones(10, 32)},
              path)  # fmt: skip
    cond = da.load_conditioning(path, 10, 32, 32)
    assert cond.text.shape == (11, 4, 32) and cond.null_id == 10 and cond.text[10].abs().sum() == 0
    with pytest.raises(da.ModelError, match="prompt_embeds has 10 rows for 7 classes"):
        da.load_conditioning(path, 7, 32, 32)
    with pytest.raises(da.ModelError, match=r"needs prompt_embeds .*64\], shape \[10, 4, 32\]"):
        da.load_conditioning(path, 10, 64, None)


if __name__ == "__main__":
    sys.exit(_fsdp_on_cpu_main())
