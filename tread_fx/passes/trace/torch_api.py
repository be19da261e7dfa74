"""What each overridable torch function returns for a real tensor, decided by running it.

The tracer meets torch functions, ``Tensor`` methods and ``Tensor`` attributes on traced
values. One that returns a tensor is an op the trace records. One that returns a Python value
is sorted here by *behaviour*, on small real tensors (never by its name):

- ``"data"``: the answer changes with the data (``item``, ``tolist``, ``equal``,
  ``data_ptr``): read with the runtime guard, or refused.
- ``"shape"``: the same for equal metadata, and changed by the shape (``dim``, ``numel``,
  ``stride``, ``is_same_size``): a graph value (token counts are rewritten where routed).
- ``"metadata"``: changed by dtype, device or layout only (``is_floating_point``,
  ``element_size``, ``get_device``, ``itemsize``): answered from the value the proxy carries.
  The call key holds every input's dtype and device, so the answer holds for the whole trace.
- ``"guarded"``: changed by state the tracer carries but the call key does not hold
  (strides, an inference tensor, a conjugate view: ``is_contiguous``, ``is_inference``):
  answered from the carried value, and checked on every call (:func:`check_traced_metadata`).
- ``"untraced"``: changed by state the trace cannot know (autograd, the version counter: it
  runs without gradients on detached copies): refused as data is.
- ``"tensor"`` (a tensor, tensors, ``None``) and ``"unprobed"`` (no probe ran): untouched.

:data:`REFUSED` lists the few refused on purpose, whatever they return.

Example:
    >>> kind_of_function(torch.is_floating_point), kind_of_method("dim")
    ('metadata', 'shape')
    >>> kind_of_method("item"), kind_of_attribute("is_leaf"), kind_of_method("is_contiguous")
    ('data', 'untraced', 'guarded')
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import itertools
import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

from tread_fx.runtime.guards import GUARD_MARK

__all__ = [
    "REFUSED",
    "ANSWERED_KINDS",
    "check_traced_metadata",
    "classify",
    "enumerate_api",
    "is_tensor_result",
    "kind_of_attribute",
    "kind_of_function",
    "kind_of_method",
    "probed",
]

#: The kinds whose Python answer the trace reads from the carried value.
ANSWERED_KINDS = ("shape", "metadata", "guarded")

# refused on purpose, whatever the probes say: name -> reason
REFUSED = {
    "__hash__": "identity of the tensor object, not of its value: differs between calls",
    "__repr__": "prints the data",
    "__format__": "prints the data",
    "is_shared": "a storage property set outside the model (share_memory_), not in the key",
    "is_pinned": "a storage property set outside the model (pin_memory), not in the key",
}
_SHAPES = ((2, 3), (1,))  # the base tensor of a probe; one element for ``item``-like reads
_UNTRACED_STATE = ("autograd", "version")  # the trace runs without grad on detached copies
_CARRIED_STATE = ("strides", "inference", "conj")  # reproduced by the trace, not in the key


def _uniform(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).uniform_(-1.0, 1.0, generator=generator)


def _data_draws(shape: tuple, slots: int) -> Iterator[list[torch.Tensor]]:
    """Tensors of one metadata and different data (and aliasing) for ``slots`` arguments."""
    g = torch.Generator().manual_seed(0)
    yield [_uniform(shape, g) for _ in range(slots)]
    yield [_uniform(shape, g) for _ in range(slots)]
    yield [torch.zeros(shape) for _ in range(slots)]
    yield [torch.ones(shape) for _ in range(slots)]
    shared = _uniform(shape, g)
    yield [shared] * slots  # the same object
    yield [shared.clone() for _ in range(slots)]  # equal data, other objects


def _variations(base: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(dimension, reference, varied)``: two tensors that differ in one piece of metadata
    or state only (``reference`` is ``base`` but where that state needs another dtype)."""
    yield "dtype", base, base.double()
    yield "dtype", base, (base * 10).long()
    yield "dtype", base, base > 0
    yield "dtype", base, base.to(torch.complex64)
    yield "shape", base, base.reshape(-1)[:1].clone() if base.numel() > 1 else base.repeat(3)
    yield "shape", base, base.reshape(-1, 1).clone()
    if base.dim() == 2:
        yield "strides", base, base.t().contiguous().t()  # same shape and data
    offset = torch.empty(base.numel() + 1)[1:].view(base.shape).copy_(base)
    yield "strides", base, offset  # a view at a storage offset
    with torch.enable_grad():
        leaf = base.clone().requires_grad_()
        yield "autograd", base, leaf
        yield "autograd", base, leaf * 1.0
        retained = leaf * 1.0
        retained.retain_grad()
        yield "autograd", base, retained
        yield "autograd", base, torch.aminmax(torch.stack([leaf, leaf]), dim=0).max  # output_nr
    bumped = base.clone()
    bumped.add_(0)
    yield "version", base, bumped
    with torch.inference_mode():
        yield "inference", base, base.clone()
    complex_base = base.to(torch.complex64)
    yield "conj", complex_base, complex_base.conj().resolve_conj().conj()  # the conj bit
    yield "conj", complex_base.imag, complex_base.conj().imag  # the negative bit


def _answer(fn: Callable, args: list) -> Any:
    try:
        value = fn(*args)
    except Exception as err:  # noqa: BLE001 - raising is an answer too
        return ("raises", type(err))
    if value is NotImplemented:  # a binary dunder declining an int
        return ("raises", TypeError)
    return ("value", value)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(type(a[1]) is type(b[1]) and a[1] == b[1])
    except Exception:  # noqa: BLE001 - values that do not compare: not the same
        return False


def is_tensor_result(value: Any) -> bool:
    """Whether ``value`` is a tensor, ``None`` or a tuple/list of those (an op's result)."""
    if value is None or isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and all(is_tensor_result(v) for v in value)


def _patterns(fn: Callable, test: dict) -> Iterator[tuple[tuple, tuple]]:
    """``(base shape, slots)`` to try: a slot is ``"T"`` (a tensor) or ``0`` (an int)."""
    try:
        params = inspect.signature(test[fn]).parameters.values()
        arity = [sum(p.default is p.empty and p.kind <= p.POSITIONAL_OR_KEYWORD for p in params)]
    except (KeyError, TypeError, ValueError):
        arity = [1, 2, 3]
    for n, shape in itertools.product(arity, _SHAPES):
        if 1 <= n <= 3:
            for rest in itertools.product(("T", 0), repeat=n - 1):
                yield shape, ("T", *rest)


def _fill(slots: tuple, tensors: list[torch.Tensor]) -> list:
    it = iter(tensors)
    return [next(it) if s == "T" else s for s in slots]


def _moves(fn: Callable, slots: tuple, others: list, reference: Any, varied: Any) -> bool:
    """Whether ``varied`` in place of ``reference`` (as every tensor argument, or as the first
    with the ``others`` after it) changes the answer."""
    n = len(others) + 1
    pairs = (([reference] * n, [varied] * n), ([reference, *others], [varied, *others]))
    return any(
        not _same(_answer(fn, _fill(slots, before)), _answer(fn, _fill(slots, after)))
        for before, after in pairs
    )


def _probe(fn: Callable, shape: tuple, slots: tuple) -> str | None:
    """The kind of ``fn`` called as ``slots`` on tensors of ``shape``; ``None``: it fails."""
    draws = _data_draws(shape, slots.count("T"))
    first = next(draws)
    answer = _answer(fn, _fill(slots, first))
    if answer[0] == "raises":
        return None
    if is_tensor_result(answer[1]):
        return "tensor"
    if not all(_same(answer, _answer(fn, _fill(slots, d))) for d in draws):
        return "data"
    moved = {
        dim
        for dim, reference, varied in _variations(first[0])
        if _moves(fn, slots, first[1:], reference, varied)
    }
    if moved & set(_UNTRACED_STATE):
        return "untraced"
    if "shape" in moved:
        return "shape"
    return "guarded" if moved & set(_CARRIED_STATE) else "metadata"


@functools.cache
def probed(fn: Callable, name: str) -> tuple[str, tuple | None, tuple | None]:
    """``(kind, base shape, argument slots)`` of overridable ``fn`` (its ``__name__`` is
    ``name``): the kind (module docstring) and the call that decided it (``None``: none ran).

    Example:
        >>> probed(torch.Tensor.size, "size")
        ('shape', (2, 3), ('T',))
    """
    if name in REFUSED:
        return "data", None, None
    return _in_fresh_thread(functools.partial(_probe_all, fn))


def _probe_all(fn: Callable) -> tuple[str, tuple | None, tuple | None]:
    test = torch.overrides.get_testing_overrides()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for shape, slots in _patterns(fn, test):
            kind = _probe(fn, shape, slots)
            if kind is not None:
                return kind, shape, slots
    return "unprobed", None, None


def _in_fresh_thread(work: Callable[[], Any]) -> Any:
    """``work()`` run in tread_fx's probe thread: torch's thread-local state there is the
    default (no ``torch.device`` context, inference mode, autocast or torch function mode of
    the caller, none of the tracer's patches), so a cached probe answer never depends on where
    it was first asked."""
    return _probe_thread().submit(work).result()


@functools.cache
def _probe_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tread_fx-probe")


def classify(fn: Callable, name: str) -> str:
    """The kind (module docstring) of overridable ``fn``; ``name`` is its ``__name__``.

    Example:
        >>> classify(torch.Tensor.numel, "numel")
        'shape'
    """
    return probed(fn, name)[0]


@functools.cache
def enumerate_api() -> dict[tuple[str, str], Callable]:
    """Every overridable torch function, ``Tensor`` method and ``Tensor`` attribute, and the
    ``Tensor`` methods torch does not let override (``stride``): a proxy records those too.

    Returns:
        ``{(access, name): callable}``, access ``"function"`` (the callable is a graph
        target), ``"method"`` or ``"attribute"`` (called with the tensor).
    """
    found: dict[tuple[str, str], Callable] = {}
    for namespace, functions in torch.overrides.get_overridable_functions().items():
        for fn in functions:
            if namespace is torch.Tensor:
                found.setdefault(("method", fn.__name__), fn)
            elif inspect.ismodule(namespace):
                found.setdefault(("function", f"{namespace.__name__}.{fn.__name__}"), fn)
            else:  # a property's descriptor: the getter
                name = getattr(getattr(namespace, "fget", namespace), "__name__", "")
                found.setdefault(("attribute", name), operator.attrgetter(name))
    for fn in torch.overrides.get_ignored_functions():  # no __torch_function__, still methods
        name = getattr(fn, "__name__", "")
        if name and getattr(torch.Tensor, name, None) is fn:
            found.setdefault(("method", name), fn)
    return found


@functools.cache
def _functions() -> dict[int, tuple[Callable, str]]:
    api = enumerate_api()
    return {id(fn): (fn, key[1]) for key, fn in api.items() if key[0] == "function"}


def kind_of_function(target: Any) -> str:
    """The kind of a ``call_function`` target; ``"unprobed"`` for one outside torch's API."""
    entry = _functions().get(id(target))
    return "unprobed" if entry is None else classify(entry[0], entry[1].rsplit(".", 1)[-1])


def kind_of_method(name: str) -> str:
    """The kind of ``Tensor.<name>(...)``."""
    fn = enumerate_api().get(("method", name))
    return "unprobed" if fn is None else classify(fn, name)


def kind_of_attribute(name: str) -> str:
    """The kind of ``tensor.<name>``."""
    fn = enumerate_api().get(("attribute", name))
    return "unprobed" if fn is None else classify(fn, name)


@torch.fx.node.has_side_effect
def check_traced_metadata(value: Any, expected: Any, where: str) -> None:
    """Check that a metadata answer outside the call key (``is_contiguous``) is as traced.

    Example:
        >>> check_traced_metadata(True, True, "model.py:3")
    """
    if value != expected:
        raise RuntimeError(f"{GUARD_MARK}: the value read at {where} differs from {expected!r}")
