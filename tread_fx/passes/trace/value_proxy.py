"""Proxies that also know their values (:class:`ValueProxy`), for :mod:`.value_tracer`.

Python protocols on a proxy (``bool``, ``int``, ``len``, iteration, ``in``, formatting,
attribute probes, item assignment) are answered from the value the eager forward computes,
through the tracer's ``concrete``/``structure``/``guarded`` (data read in the model's own
forward is guarded; shape-derived Python resolves as it does eagerly).

Example:
    >>> # made by ValueTracer.proxy for every traced node; see tread_fx.passes.trace.tracer
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.proxy import Attribute

from tread_fx.passes.trace.autograd_flags import answer_requires_grad
from tread_fx.passes.trace.mutation import functional_setitem
from tread_fx.passes.trace.numpy_calls import array_protocol
from tread_fx.passes.trace.python_protocols import PythonProtocols, TracedShape
from tread_fx.passes.trace.support import asks_as_model_code

__all__ = ["ValueAttribute", "ValueProxy"]


class _TorchFunction:
    """``ValueProxy.__torch_function__``: fx's, except on a proxy of an ``int`` while the
    tracing thread calls a function taking sizes as varargs (``torch.ones(b, n)``, see
    :mod:`.thread_calls`): torch's argument parser rejects a first vararg that has one, so it
    has none, and the tracing thread's ``TorchFunctionMode`` records the call."""

    def __get__(self, proxy: Any, cls: type) -> Any:
        fx_function = vars(fx.Proxy)["__torch_function__"].__get__(proxy, cls)
        if proxy is None or getattr(proxy.tracer, "sizes_call", None) is None:
            return fx_function
        if type(proxy.tracer.values.get(proxy.node)) is not int:
            return fx_function
        return torch._C._disabled_torch_function_impl


class ValueProxy(PythonProtocols, fx.Proxy):
    """A proxy that also knows the value the eager forward computes at this point."""

    __torch_function__ = _TorchFunction()

    @property
    def __class__(self) -> type:  # type: ignore[override]
        """The class of the tensor this stands for where the model's code asks with
        ``isinstance`` (which reads ``__class__`` when the type does not match; the tracing
        thread's profile function keeps the frames calling it, :mod:`.thread_calls`, and
        :func:`.support.asks_as_model_code` decides), else this proxy's own class. Only a
        call of ``isinstance`` itself: C code that checks for a tensor the same way (and
        would then read the proxy as one) sees the proxy's class."""
        tracer = self.__dict__.get("tracer")
        checks = getattr(tracer, "type_checks", None)
        if not checks or not asks_as_model_code(checks[-1], tracer.model_namespaces):
            return type(self)
        try:
            value = tracer.value_of(self)
        except (KeyError, AttributeError):  # not recorded (yet): a proxy being made
            return type(self)
        return type(value) if isinstance(value, torch.Tensor) else type(self)

    @property
    def value(self) -> Any:
        return self.tracer.value_of(self)

    def _concrete(self, what: str) -> Any:
        return self.tracer.concrete(self, what)

    def __bool__(self) -> bool:
        return bool(self._concrete("bool()"))

    def __int__(self) -> int:
        return int(self._concrete("int()"))

    def __index__(self) -> int:
        return operator.index(self._concrete("an index"))

    def __float__(self) -> float:
        return float(self._concrete("float()"))

    def __len__(self) -> int:
        return len(self.tracer.structure(self, "len()"))

    def __iter__(self) -> Iterator[fx.Proxy]:
        value = self.tracer.structure(self, "iteration")
        for i in range(len(value)):
            yield self[i]

    def __contains__(self, item: Any) -> bool:
        return item in self.tracer.structure(self, "`in`")

    def keys(self) -> Any:
        return self.tracer.structure(self, "keys()").keys()

    def __dir__(self) -> list[str]:
        return dir(self.tracer.value_of(self))  # ``x.__dir__()``: the names the value has

    def __format__(self, spec: str) -> str:
        value = self.tracer.value_of(self)
        if isinstance(value, (int, float, str)) and self.node not in self.tracer.tainted:
            return format(value, spec)  # shape-derived: f-strings in messages read naturally
        return format(repr(self), spec)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__array"):  # numpy's protocols (np.asarray, np.prod(x.shape))
            array_protocol(self, name)
        value = self.tracer.value_of(self)
        if isinstance(value, torch.Tensor) and not hasattr(value, name):
            # as eagerly: ``hasattr``/``inspect.signature`` probes (einx) see no attribute
            raise AttributeError(f"'Tensor' object has no attribute {name!r}")
        if (
            isinstance(value, torch.Tensor)
            and self.tracer.api_kind("attribute", name) == "metadata"
        ):
            return getattr(value, name)  # dtype, device: part of the signature guard
        if name == "requires_grad" and isinstance(value, torch.Tensor):
            return answer_requires_grad(self)  # as training sees it, checked on every call
        if name == "shape" and isinstance(value, torch.Tensor):
            # a real tuple (``isinstance(x.shape, tuple)`` holds) of traced sizes
            return TracedShape(self.size(i) for i in range(value.dim()))
        return ValueAttribute(self, name)

    def __setitem__(self, key: Any, value: Any) -> None:
        """``x[key] = value``: one out-of-place node; this object now stands for its result."""
        written = self.tracer.create_proxy(
            "call_function", functional_setitem, (self, key, value), {}
        )
        self.node = written.node


class ValueAttribute(ValueProxy, Attribute):
    """Lazy attribute access (``x.shape``, ``x.view``) that also carries its value."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer, value = self.tracer, self.tracer.value_of(self.root)
        own = tracer.in_own_code()
        if self.attr in ("item", "tolist") and own and isinstance(value, torch.Tensor):
            return tracer.guarded(self.root, value, self.attr, f"Tensor.{self.attr}()")
        return super().__call__(*args, **kwargs)
