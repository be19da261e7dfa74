"""Python's number and sequence protocols on traced values, recorded like any other op.

Model code does arithmetic on sizes with builtins as well as operators: ``round(n / 2)``,
``q, r = divmod(n, w)``, ``x.shape.numel()``, and numpy (:mod:`.numpy_calls`). fx's proxy
defines the operators only, so these were refused ("type ValueProxy doesn't define
__round__"). :class:`PythonProtocols` records them as calls of the builtins (their values
computed on the real values, as for every node), and :class:`TracedShape` is ``x.shape``.

Example:
    >>> TracedShape((2, 3)).numel()
    6
"""

from __future__ import annotations

import math
from typing import Any

from torch.utils import _pytree as pytree

from tread_fx.passes.trace.numpy_calls import array_ufunc

__all__ = ["PythonProtocols", "TracedShape"]


class PythonProtocols:
    """Mixed into the tracer's proxy: ``round``, ``divmod`` and numpy ufuncs on traced values
    are recorded calls (``self.tracer.create_proxy``)."""

    tracer: Any

    def __round__(self, ndigits: int | None = None) -> Any:
        args = (self,) if ndigits is None else (self, ndigits)
        return self.tracer.create_proxy("call_function", round, args, {})

    def __divmod__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", divmod, (self, other), {})

    def __rdivmod__(self, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", divmod, (other, self), {})

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        return array_ufunc(self, ufunc, method, inputs, kwargs)  # np.sqrt(n)


class TracedShape(tuple):
    """``x.shape`` of a traced tensor: a real tuple (``isinstance(x.shape, tuple)`` holds) of
    traced sizes, with ``torch.Size``'s ``numel()`` (their product, recorded)."""

    def numel(self) -> Any:
        return math.prod(self)


# a tuple of traced sizes to torch's pytree too (the tracing thread's TorchFunctionMode looks
# for proxies among a call's leaves: an unregistered tuple subclass was one opaque leaf)
pytree.register_pytree_node(
    TracedShape,
    lambda shape: (list(shape), None),
    lambda items, _: TracedShape(items),
    serialized_type_name="tread_fx.TracedShape",
)
