"""FSDP2 (``fully_shard`` per block + activation checkpointing) around routed models.

Two CPU processes (gloo) train a routed tread_fx DiT and a routed diffusers Flux for a few
steps on halves of a global batch; one process trains the same models on the whole batch.
Losses and parameters must agree to float tolerance. The token selection is the same in both
runs: ``share_selection=True`` (one subset per step for the whole batch) drawn from the global
RNG, seeded identically on every rank before each step. Run as a script, this file is one
rank's worker.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import sharding  # noqa: E402

import tread_fx  # noqa: E402
from benchmarks.coverage_checks import first_tensor, randomize_zero_init  # noqa: E402

GLOBAL_BATCH, STEPS, LR = 4, 3, 1e-3


def _dit() -> torch.nn.Module:
    return tread_fx.models.DiT(input_size=8, patch_size=2, depth=4, in_channels=1,
                               num_classes=10, hidden_size=32, num_heads=2,
                               class_dropout_prob=0.0)  # fmt: skip


def _flux() -> torch.nn.Module:
    import diffusers

    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
    )  # fmt: skip


def _dit_inputs(gen: torch.Generator) -> tuple[tuple, dict]:
    b = GLOBAL_BATCH
    x, t = torch.randn(b, 1, 8, 8, generator=gen), torch.rand(b, generator=gen)
    return (x, t, torch.randint(0, 10, (b,), generator=gen)), {}


def _flux_inputs(gen: torch.Generator) -> tuple[tuple, dict]:
    b, text = GLOBAL_BATCH, 5
    grid = torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij")
    kwargs = dict(
        encoder_hidden_states=torch.randn(b, text, 24, generator=gen),
        pooled_projections=torch.randn(b, 16, generator=gen),
        timestep=torch.rand(b, generator=gen),
        img_ids=torch.stack(grid, -1).reshape(16, 3),
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )
    return (torch.randn(b, 16, 4, generator=gen),), kwargs


CASES = {  # factory, inputs, routes, output shape per sample
    "dit": (_dit, _dit_inputs, [(1, 3)], (2, 8, 8)),
    "flux": (_flux, _flux_inputs, [(1, 3)], (16, 4)),
}


def _shard_of(value, rank: int, world: int):
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == GLOBAL_BATCH:
        per = GLOBAL_BATCH // world
        return value[rank * per : (rank + 1) * per]
    return value  # ids tables, flags: the same on every rank


def train_case(name: str, rank: int, world: int) -> dict:
    """A few routed AdamW steps on this rank's half (or all) of a fixed global batch.

    Returns:
        ``losses`` (mean over the global batch per step), ``params`` (full tensors) and, when
        sharded, ``refusal``: the message of ``route()`` called on the sharded model.
    """
    make, inputs, routes, out_shape = CASES[name]
    torch.manual_seed(0)
    model = make()
    randomize_zero_init(model)
    tread_fx.route(model, routes=routes, rate=0.5, share_selection=True)
    result: dict = {"losses": []}
    if world > 1:
        sharding.shard(model, checkpointing=True)
        try:
            tread_fx.route(model, routes=routes, reroute=True)
        except tread_fx.WrappedModelError as err:
            result["refusal"] = str(err)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    for step in range(STEPS):
        args, kwargs = inputs(torch.Generator().manual_seed(10 + step))
        target = torch.randn(GLOBAL_BATCH, *out_shape, generator=torch.Generator().manual_seed(20))
        args = tuple(_shard_of(a, rank, world) for a in args)
        kwargs = {k: _shard_of(v, rank, world) for k, v in kwargs.items()}
        torch.manual_seed(100 + step)  # the same shared token subset on every rank
        out = first_tensor(model(*args, **kwargs))
        loss = (out - _shard_of(target, rank, world)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
        result["losses"].append(float(mean) / world)
    result["params"] = {
        k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for k, p in model.named_parameters()
    }
    return result


def _worker() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    results = {name: train_case(name, rank, world) for name in CASES}
    if rank == 0:
        torch.save(results, sys.argv[1])
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_two_fsdp2_processes_match_one_process_on_the_global_batch(tmp_path):
    pytest.importorskip("diffusers")
    out = tmp_path / "sharded.pt"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(ROOT)}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, __file__, str(out)], env={**env, "RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    reference = {name: train_case(name, 0, 1) for name in CASES}  # meanwhile, one process
    deadline = time.monotonic() + 150
    logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    sharded = torch.load(out, weights_only=True)
    for name, ref in reference.items():
        got = sharded[name]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
        assert ref["losses"][0] > 0 and ref["losses"][-1] != ref["losses"][0], name
        assert got["params"].keys() == ref["params"].keys()
        for key, value in ref["params"].items():
            torch.testing.assert_close(got["params"][key], value, atol=1e-5, rtol=1e-4, msg=key)
        # route() after fully_shard is refused, naming the order to use
        assert "already sharded by FSDP2's fully_shard; route first" in got["refusal"]


def test_block_modules_finds_joint_and_single_blocks():
    pytest.importorskip("diffusers")
    flux = _flux()
    blocks = sharding.block_modules(flux)
    assert blocks == [*flux.transformer_blocks, *flux.single_transformer_blocks]
    dit = _dit()
    assert sharding.block_modules(dit) == list(dit.blocks)


if __name__ == "__main__":
    _worker()
