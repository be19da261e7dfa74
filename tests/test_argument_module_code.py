"""Modules handed to a block as an argument whose code lives in another Python module than
the block's (a rotary module from ``pos_embed.py`` called inside each block, as LightningDiT
does). Tracing the block on its own (to read its graph) must see that module's code as the
model's: a library call in it (einops) runs on real values. Where nothing can be made a leaf
to get past a failure in such a module, the trace ends with a refusal: it used to try the
same trace again forever."""

from __future__ import annotations

import contextlib
import signal

import pytest
import torch
from rotary_parts import EinopsRotary, ItemReadingScale
from test_module_arguments import B, Block, D, N, RotaryDiT
from third_party_checks import INVARIANTS, Case

import tread_fx
from tread_fx.errors import UntraceableModelError
from tread_fx.passes.trace.tracer import trace_call


class EinopsRotaryDiT(RotaryDiT):
    """The module-argument test model with a rotary module whose code lives in another file
    (``rotary_parts``) and calls einops."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__(depth)
        self.rope = EinopsRotary(N, D)


def _inputs():
    return (torch.randn(B, N, 3, generator=torch.Generator().manual_seed(21)),), {}


CASE = Case("einops-rotary-argument", EinopsRotaryDiT, _inputs, routes=[(1, 3)])


class _RanTooLong(BaseException):
    """Not an ``Exception``: the trace's own retry loop must not catch it."""


@contextlib.contextmanager
def _ends_within(seconds: int):
    """Fail (instead of hanging the suite) when the code inside runs past ``seconds``."""

    def on_alarm(signum, frame):
        raise _RanTooLong(f"still running after {seconds} s (a trace retried forever?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_block_traces_through_the_argument_modules_library_call():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(B, N, D)
    with _ends_within(60):
        traced = trace_call(block, (x, EinopsRotary(N, D)), {}, set())
    assert not traced.auto_leaves
    called = [n.target for n in traced.gm.graph.nodes if n.op == "call_module"]
    assert not any(str(t).startswith("arg_module_") for t in called)  # its code is inlined
    rope = traced.wrapper.arg_module_1
    torch.testing.assert_close(traced.gm(x)[0], block(x, rope))


def test_no_progress_past_an_argument_module_is_a_refusal():
    block, x = Block(), torch.randn(B, N, D)
    with _ends_within(60), pytest.raises(UntraceableModelError):
        trace_call(block, (x, ItemReadingScale()), {}, {"qkv"})


def test_routes():
    with _ends_within(120):
        model = tread_fx.route(EinopsRotaryDiT(), routes=CASE.routes, rate=0.5, seed=0)
        model.train()(*_inputs()[0])
    assert tread_fx.route_info(model)[0].kept.shape[1] == N // 2


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
def test_invariants(check):
    with _ends_within(300):
        check(CASE)
