"""FSDP2 (``fully_shard`` per block + activation checkpointing) around routed models.

Two CPU processes (gloo) train a routed tread_fx DiT and a routed diffusers Flux for a few
steps on halves of a global batch; one process trains the same models on the whole batch.
Losses and parameters must agree to float tolerance. Activation checkpointing is on in the
sharded runs, in both forms: the composable ``checkpoint`` (``sharding.shard``) and, in the
units accelerate's FSDP2 makes (final norm included), its ``checkpoint_wrapper`` per block.
The token selection is the same in both runs: ``share_selection=True`` (one subset per step
for the whole batch) drawn from the global RNG, seeded identically on every rank before each
step. Run as a script, this file is one rank's worker.
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
    "flux-accelerate": (_flux, _flux_inputs, [(1, 3)], (16, 4)),  # as accelerate shards it
}


def _checkpoint_wrap_blocks(model: torch.nn.Module) -> None:
    """Activation checkpointing as accelerate's FSDP2 applies it: wrapper modules per block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def _inner(block: torch.nn.Module) -> torch.nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)


def _shard_like_accelerate(model: torch.nn.Module) -> None:
    """accelerate's FSDP2 preparation: ``checkpoint_wrapper`` per block, ``fully_shard`` per
    block, the final norm as a unit of its own (a module the routed graph does not call as a
    block: its hooks must still run), then the root."""
    from torch.distributed.fsdp import fully_shard

    _checkpoint_wrap_blocks(model)
    for block in sharding.block_modules(model):
        fully_shard(_inner(block))
    fully_shard([model.norm_out], reshard_after_forward=False)
    fully_shard(model)


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
    result: dict = {"losses": [], "calls": 0}
    if world > 1:
        if name.endswith("-accelerate"):
            _shard_like_accelerate(model)
        else:
            sharding.shard(model, checkpointing=True)
        try:
            tread_fx.route(model, routes=routes, reroute=True)
        except tread_fx.WrappedModelError as err:
            result["refusal"] = str(err)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    routed_block = _inner(sharding.block_modules(model)[1])  # inside route (1, 3)

    def count(*_):
        result["calls"] += 1

    routed_block.register_forward_pre_hook(count)
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
        k.replace("._checkpoint_wrapped_module", ""): (
            p.full_tensor() if hasattr(p, "full_tensor") else p
        )
        .detach()
        .clone()
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
    reference = {name: train_case(name, 0, 1) for name in ("dit", "flux")}  # meanwhile
    reference["flux-accelerate"] = reference["flux"]
    deadline = time.monotonic() + 600
    logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    sharded = torch.load(out, weights_only=True)
    for name, got in sharded.items():
        ref = reference[name]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
        assert ref["losses"][0] > 0 and ref["losses"][-1] != ref["losses"][0], name
        assert got["params"].keys() == ref["params"].keys()
        for key, value in ref["params"].items():
            torch.testing.assert_close(got["params"][key], value, atol=1e-5, rtol=1e-4, msg=key)
        # trace + steps, and with activation checkpointing one recomputation per step; a
        # sharded block is also traced through twice from inside a call of it (its hooks gather
        # the parameters its forward reads): to see how it uses what it is handed, and to find
        # the grid its reshapes use (plan/grid_uses.py). Unsharded, the check before the first
        # call runs it once on fake tensors (passes/rewrite/check.py); sharded (DTensor
        # weights) that check leaves the decision to the first call.
        assert (ref["calls"], got["calls"]) == (2 + STEPS, 3 + 2 * STEPS), name
        # route() after fully_shard is refused, naming the order to use
        assert "already sharded by FSDP2's fully_shard; route first" in got["refusal"]


def test_a_module_hooked_after_the_trace_is_called_by_the_routed_graph():
    """A unit's hooks (FSDP2 gathers parameters in one) run in routed training, also when the
    hook came after the first trace: the trace is redone with the module as one call."""
    model = _dit()
    tread_fx.route(model, routes=[(1, 3)], rate=0.5)
    (x, t, y), _ = _dit_inputs(torch.Generator().manual_seed(0))
    model.train()(x, t, y)  # traced: final_layer inlined
    (first,) = tread_fx.routed_graphs(model)
    model.blocks[1].register_forward_pre_hook(lambda *_: None)
    model(x, t, y)  # a block is called by the graph anyway: no new trace
    assert [g is first for g in tread_fx.routed_graphs(model)] == [True]
    calls = []
    model.final_layer.register_forward_pre_hook(lambda *_: calls.append(1))
    model(x, t, y)  # traced again (the trace runs the hook too), then run
    (second,) = tread_fx.routed_graphs(model)
    calls.clear()
    model(x, t, y)
    assert calls == [1] and second is not first
    assert [g is second for g in tread_fx.routed_graphs(model)] == [True]
    graph = second.gm.graph
    assert any(n.op == "call_module" and n.target == "model.final_layer" for n in graph.nodes)


def test_block_modules_finds_joint_and_single_blocks():
    pytest.importorskip("diffusers")
    flux = _flux()
    blocks = sharding.block_modules(flux)
    assert blocks == [*flux.transformer_blocks, *flux.single_transformer_blocks]
    dit = _dit()
    assert sharding.block_modules(dit) == list(dit.blocks)


if __name__ == "__main__":
    _worker()
