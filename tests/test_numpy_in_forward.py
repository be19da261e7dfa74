"""numpy in a model's forward (issue 41: the tracer follows the Python a model writes).

Shape arithmetic written with numpy (``int(np.sqrt(n))``, ``np.prod(x.shape[1:])``,
``np.ceil``) in the model's own forward was refused ("invalid __array_struct__": a traced
size answered numpy's array protocols with proxies), and so was a numpy scalar kept as an
attribute (``self.scale = np.sqrt(d)``: fx has no argument type for it). Now a ufunc on traced
numbers is one recorded call and a numpy scalar is the Python number it equals; numpy handed a
traced tensor still leaves torch (refused in the model's own forward, naming the line).
``tread_fx/passes/trace/numpy_calls.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from idiom_models import B, Block, D, IdiomModel, N, routed_by_hand, twins

import tread_fx
from tread_fx.errors import UntraceableModelError


class NumpyBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.scale = np.sqrt(D)  # a numpy scalar attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = int(np.sqrt(x.shape[1] * 4))  # 8 at 16 tokens, 5 at 8: a width, no reshape
        return x + self.lin(self.norm(x)) / self.scale + x[..., :side].mean() * 0


class Model(IdiomModel):
    def __init__(self) -> None:
        super().__init__(NumpyBlock)
        self.gain = np.float32(0.5)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * self.gain
        grid = int(np.sqrt(h.shape[1]))  # a square token grid, read with numpy
        width = int(np.prod(h.shape[2:]))
        h = h.reshape(h.shape[0], grid, grid, width).flatten(1, 2)
        return h / np.log2(np.ceil(h.shape[1] / 2))


def test_numpy_shape_arithmetic_and_scalars_route_as_by_hand():
    (model, reference), x = twins(Model), torch.randn(B, N, 8)
    eager = reference.eval()(x)
    tread_fx.route(model, routes=[(1, 3)], rate=0.5, seed=0)
    torch.testing.assert_close(model.eval()(x), eager, rtol=0, atol=0)
    out = model.train()(x)
    (info,) = tread_fx.route_info(model)
    torch.testing.assert_close(out, routed_by_hand(reference.train(), x, info.kept))


def test_a_numpy_ufunc_of_a_tensor_in_the_models_forward_is_refused_naming_its_line():
    class Leaves(Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.as_tensor(np.tanh(self.embed(x)))  # numpy reads the tokens' data
            for block in self.blocks:
                h = self.step(block, h)
            return self.out(h)

    model = Leaves()
    tread_fx.route(model, routes=[(1, 3)], rate=0.5)
    with pytest.raises(UntraceableModelError, match=r"numpy\.tanh\(\) of a tensor at .*:\d+"):
        model.train()(torch.randn(B, N, 8))
