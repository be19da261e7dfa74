"""What a new user hit (issue 15): the models namespace, misleading errors, packaging."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_dit
from torch import nn

import tread_fx
from tread_fx.errors import TokenStreamError
from tread_fx.models import dit, mamba, rwkv


def test_every_reference_factory_is_in_the_models_namespace() -> None:
    for module in (dit, mamba, rwkv):
        registry = next(v for k, v in vars(module).items() if k.endswith("_models"))
        for factory in registry.values():
            assert getattr(tread_fx.models, factory.__name__) is factory
            assert factory.__name__ in tread_fx.models.__all__
    model = tread_fx.models.Mamba_S_2(input_size=8, in_channels=1, num_classes=10, depth=2)
    assert isinstance(model, torch.nn.Module)


class ConvBlock(nn.Module):
    """A residual conv block: its stream is a [B, C, H, W] feature map, not tokens."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.conv(h))


class TinyCNN(nn.Module):
    def __init__(self, channels: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(depth)])
        self.head = nn.Conv2d(channels, 4, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)) * t[:, None, None, None])


def test_a_cnn_stack_is_refused_at_route_not_on_the_first_step() -> None:
    model = TinyCNN()
    with pytest.raises(TokenStreamError, match="no token sequence flows through TinyCNN") as err:
        tread_fx.route(model, [(1, 3)])  # its blocks are convolutions: known without a call
    assert "route a token-based backbone" in str(err.value).splitlines()[0]
    assert not tread_fx.is_routed(model)


def test_a_missing_forward_argument_is_the_models_own_type_error() -> None:
    model = tiny_dit(depth=4)
    x, t = torch.randn(2, 1, 8, 8), torch.rand(2)
    with pytest.raises(TypeError) as unrouted:
        model.train()(x, t)
    tread_fx.route(model, [(1, 3)])
    with pytest.raises(TypeError) as routed:
        model.train()(x, t)
    assert not isinstance(routed.value, tread_fx.TreadFxError)
    assert str(routed.value) == str(unrouted.value)
    assert "missing 1 required positional argument: 'y'" in str(routed.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        model(x, t, torch.tensor([1, 2]), z=1)
    with pytest.raises(TypeError) as explained:
        tread_fx.explain(tiny_dit(depth=4), [(1, 3)], 0.5, (x, t))
    assert str(explained.value) == str(unrouted.value)


def _routed_after_one_step() -> tuple[nn.Module, tuple]:
    model = tread_fx.route(tiny_dit(depth=4), [(1, 3)], seed=0)
    inputs = (torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2]))
    return model, inputs


def test_route_info_looks_through_ddp(tmp_path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model, inputs = _routed_after_one_step()
        ddp = nn.parallel.DistributedDataParallel(model)
        assert tread_fx.route_info(ddp) is None
        ddp.train()(*inputs).sum().backward()
        info = tread_fx.route_info(ddp)
        assert info is not None and info[0].kept.shape == (2, 8)
        assert tread_fx.is_routed(ddp) and tread_fx.routed_graphs(ddp)
        with tread_fx.force_routing(ddp, rate=0.25):
            pass
        assert tread_fx.unroute(ddp) is ddp and not tread_fx.is_routed(model)
        with pytest.raises(tread_fx.NotRoutedError, match="inside a DistributedDataParallel"):
            tread_fx.route_info(ddp)
    finally:
        dist.destroy_process_group()


def test_route_info_looks_through_compile_and_data_parallel() -> None:
    model, inputs = _routed_after_one_step()
    model.train()(*inputs)
    compiled = torch.compile(model, backend="eager")
    nested = nn.DataParallel(torch.compile(nn.DataParallel(model), backend="eager"))
    for wrapper in (compiled, nested):
        assert tread_fx.route_info(wrapper) is tread_fx.route_info(model)
    with pytest.raises(tread_fx.WrappedModelError, match="_orig_mod"):
        tread_fx.route(compiled, [(1, 3)])  # routing still wants the model itself


def test_pyproject_license_is_an_spdx_expression() -> None:
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"  # PEP 639, setuptools >= 77
    classifiers = pyproject["project"].get("classifiers", [])
    assert not any(c.startswith("License ::") for c in classifiers)
    assert any(r.startswith("setuptools>=7") for r in pyproject["build-system"]["requires"])


def test_the_cli_says_what_it_is_doing_on_stderr(capsys) -> None:
    from tread_fx.cli import main

    tiny = '{"depth": 4, "input_size": 8, "in_channels": 1, "num_classes": 10}'
    threads = torch.get_num_threads()
    assert main(["explain", "tread_fx.models:DiT_S_2", "--routes", "1:3", "--kwargs", tiny]) == 0
    out, err = capsys.readouterr()
    for stage in ("tracing", "planning", "FLOPs", "done in"):
        assert stage in err, err
    assert "tracing" not in out and torch.get_num_threads() == threads
    assert main(["diff", "tread_fx.models:DiT_S_2", "--kwargs", tiny, "-q", "--routes", "1:3"]) == 0
    assert capsys.readouterr().err == ""


def test_resized_nodes_are_not_marked_as_unchanged_in_the_text_diff() -> None:
    model = tiny_dit(depth=4)
    inputs = (torch.randn(1, 1, 8, 8), torch.rand(1), torch.tensor([1]))
    diff = tread_fx.explain(model, [(1, 3)], 0.5, inputs, flops=False).diff
    lines = str(diff).splitlines()
    resized = [line for line in lines if line.split()[1:2] == ["model_blocks_2"]]
    assert resized and all(line.lstrip().startswith("* ") for line in resized), lines
    assert not any(line.lstrip().startswith("= ") for line in lines)


def test_a_model_defined_without_a_file_routes() -> None:
    """Classes defined in a notebook, a REPL or ``python -c`` live in a module with no file."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import torch, tread_fx
        from torch import nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, h):
                return h + self.fc(h)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(Block() for _ in range(4))

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x

        tread_fx.route(Net(), [(1, 3)], example_inputs=(torch.randn(2, 16, 8),))
        print("routed")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "routed", done.stderr[-2000:]
