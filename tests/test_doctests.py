"""Every docstring example in tread_fx (face, passes, runtime, adapters, inspection, training,
models) runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import tread_fx

PACKAGES = (tread_fx,)  # passes/, models/ and the rest are its sub-packages
MODULES = sorted(
    {package.__name__ for package in PACKAGES}
    | {
        info.name
        for package in PACKAGES
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + ".")
    }
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    torch.manual_seed(0)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
