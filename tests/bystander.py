"""Run code in another thread while a model's first routed call is held mid-trace.

The model's ``head`` runs its ``hook`` once, while traced (``Gate`` in
``test_module_threads.py``): the hook lets the other thread run, then waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def run_beside_a_trace(
    model: nn.Module, inputs: Any, look: Callable[[], None]
) -> tuple[torch.Tensor, list[BaseException]]:
    """``model.train()(inputs)`` (a first routed call: it traces) with ``look()`` run in
    another thread while the trace is held; (the output, what ``look`` raised)."""
    errors: list[BaseException] = []
    entered, release = threading.Event(), threading.Event()

    def bystander() -> None:
        try:
            entered.wait(timeout=60)
            look()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)
        finally:
            release.set()

    def held_mid_trace() -> None:  # the main thread is inside the trace here
        entered.set()
        release.wait(timeout=120)

    model.head.hook = held_mid_trace
    thread = threading.Thread(target=bystander)
    thread.start()
    out = model.train()(inputs)
    thread.join(timeout=120)
    assert model.head.hook is None, "the hook ran (the trace happened)"
    return out, errors
