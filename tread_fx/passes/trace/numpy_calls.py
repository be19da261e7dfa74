"""numpy on traced values: a ufunc on traced numbers is recorded, a tensor leaves torch.

Shape arithmetic is written with numpy as often as with :mod:`math` (``h = int(np.sqrt(n))``,
``np.prod(x.shape[1:])``). numpy asks an object for its array protocols (``__array__``,
``__array_struct__`` ...) and hands a ufunc to ``__array_ufunc__``; a traced value answered
every attribute with a new proxy, so numpy found an invalid ``__array_struct__`` and the
model's own forward was refused. Now:

- a traced *number* offers no array protocol (numpy takes it as a Python object: ``np.prod``
  of traced sizes multiplies them, recorded), and a ufunc on traced numbers is one recorded
  call of :func:`numpy_ufunc`, as ``math.sqrt`` is;
- a numpy scalar constant (``self.scale = np.sqrt(d)``, ``np.float32(0.5)``) enters the graph
  as the Python number it equals (fx has no argument type for it: the forward was refused);
- a traced *tensor* asked for its array protocols, or handed to a ufunc, leaves torch: numpy
  would read its data, so the code around it runs as it is
  (:class:`~tread_fx.passes.trace.opaque.LeavesTorchError`, as for ``t.numpy()``).

Example:
    >>> float(numpy_ufunc("sqrt", 16))
    4.0
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy
import torch
import torch.fx as fx

from tread_fx.passes.trace.opaque import LeavesTorchError

__all__ = ["array_protocol", "array_ufunc", "numpy_ufunc", "python_scalar"]


def numpy_ufunc(name: str, *inputs: Any) -> Any:
    """Call numpy's ufunc ``name``: the routed graph's node for a ufunc on traced numbers (a
    function of this module, so the generated code can name it).

    Example:
        >>> int(numpy_ufunc("ceil", 7 / 2))
        4
    """
    return getattr(numpy, name)(*inputs)


def array_ufunc(proxy: Any, ufunc: Any, method: str, inputs: tuple, kwargs: dict) -> Any:
    """``ValueProxy.__array_ufunc__``: record a plain ufunc call on traced numbers; refuse one
    on a traced tensor as leaving torch; ``NotImplemented`` for other ufunc methods."""
    tracer = proxy.tracer
    values = [tracer.value_of(a) for a in inputs if isinstance(a, fx.Proxy)]
    if any(isinstance(v, torch.Tensor) for v in values):
        raise LeavesTorchError.at(f"numpy.{ufunc.__name__}() of a tensor", tracer)
    if method != "__call__" or kwargs or getattr(numpy, ufunc.__name__, None) is not ufunc:
        return NotImplemented
    return tracer.create_proxy("call_function", numpy_ufunc, (ufunc.__name__, *inputs), {})


def array_protocol(proxy: Any, name: str) -> NoReturn:
    """``ValueProxy.__getattr__`` of numpy's protocol ``name``: none on a traced number, and
    a traced tensor leaves torch."""
    if isinstance(proxy.tracer.value_of(proxy), torch.Tensor):
        raise LeavesTorchError.at(f"numpy's {name} of a tensor", proxy.tracer)
    raise AttributeError(name)


def python_scalar(value: Any) -> Any:
    """A numpy scalar as the Python number it equals (``.item()``: exact, and torch treats
    both as a Python scalar); anything else unchanged.

    Example:
        >>> python_scalar(numpy.float32(0.5)), python_scalar("x")
        (0.5, 'x')
    """
    return value.item() if isinstance(value, numpy.generic) else value
