"""The model around its routed graph: the wrappers it sits in, and what of its module tree
a routed call checks, at a cost independent of its size.

``route()`` must see the plain model (route first, then wrap); :func:`unwrap` finds it inside
any nesting of DDP / DataParallel / FSDP / ``torch.compile`` wrappers.

A routed graph bakes in the ``training`` flag of every module whose code it holds inlined
(``if self.training:`` in the model's own forward); modules it *calls* (the blocks, every
``torch.nn`` layer) read their own flag when called. So the cache key of a call holds the
flags of the modules the trace went through only: for a block-stack model a handful (the root,
the embedders, the final layer), whatever the depth. Before the first trace every module is
watched. The module tuples are kept between calls, and whether any hook was registered
anywhere since the last call (``fully_shard`` after a trace: an inlined module must be called
again) is read from torch's hook-handle counter (every ``register_*_hook`` takes a new id).

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    >>> modes = ModuleModes()
    >>> modes.hooks_changed(), modes.modes(model.eval())
    (True, (False, False, False))
    >>> modes.watch(model, {""}), modes.modes(model)  # a trace that called both layers
    (True, (False,))
    >>> _ = model[0].register_forward_pre_hook(lambda m, a: None)
    >>> modes.hooks_changed()
    True
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import operator
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from tread_fx.errors import UntraceableModelError, WrappedModelError, with_article

__all__ = [
    "unwrap",
    "check_unwrapped",
    "check_class_forward",
    "refuse_replica",
    "REPLICATE",
    "WRAPPER_ATTRIBUTES",
    "wrapper_attributes",
    "check_call",
    "ModuleModes",
    "traced_through",
    "call_signature",
    "attributes_kept",
    "random_state_kept",
    "seed_every_generator",
]

_WRAPPERS = {  # class name: (the attribute holding the model, what to pass route() instead)
    "DistributedDataParallel": ("module", "model.module"),
    "DataParallel": ("module", "model.module"),
    "FullyShardedDataParallel": ("module", "the unwrapped module"),
    "OptimizedModule": ("_orig_mod", "model._orig_mod"),
}


def unwrap(model: Any) -> Any:
    """The model inside DDP / DataParallel / FSDP / ``torch.compile`` wrappers (any nesting).

    Example:
        >>> import torch, tread_fx
        >>> model = tread_fx.models.DiT_S_2(input_size=8, depth=2)
        >>> unwrap(torch.compile(torch.nn.DataParallel(model))) is model
        True
    """
    for _ in range(16):
        wrapper = _WRAPPERS.get(type(model).__name__)
        inner = getattr(model, wrapper[0], None) if wrapper else None
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def check_unwrapped(model: Any) -> None:
    """Refuse a model that is wrapped, sharded or compiled already (route first, then wrap).

    Raises:
        WrappedModelError: naming the wrapper and what to pass instead.
    """
    if not isinstance(model, nn.Module):
        raise WrappedModelError(
            f"route() expects an nn.Module, got {type(model).__name__}; pass the model itself."
        )
    name = type(model).__name__
    if name in _WRAPPERS:
        raise WrappedModelError(
            f"route() was given {with_article(name)} wrapper; route the model first, then wrap it "
            f"(route -> DDP/FSDP/torch.compile). To route this one, pass {_WRAPPERS[name][1]}."
        )
    sharded = _fully_sharded(model)
    if sharded is not None:
        what = with_article(name) + (f" whose submodule {sharded!r} is" if sharded else "")
        raise WrappedModelError(
            f"route() was given {what} already sharded by FSDP2's fully_shard; route first, "
            "then shard.\nThat is: tread_fx.route(model, ...), then fully_shard(block) for "
            "each block and fully_shard(model), then torch.compile. "
            "Build the model again (or load its unsharded state_dict) and route that."
        )
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise WrappedModelError(
            f"route() was given {with_article(name)} on which model.compile() was already "
            "called; route first, then compile.\nThat is: tread_fx.route(model, ...), then "
            "model.compile() (or route(..., compile=True), which compiles the routed graph)."
        )


def check_class_forward(model: nn.Module) -> None:
    """Refuse a model whose class defines no ``forward`` and whose forward is set on the
    instance (Open-Sora's ``self.forward = self.forward_ckpt``): tread_fx traces and routes
    the class's ``forward``.

    Raises:
        UntraceableModelError: naming the instance attribute and what to do.

    Example:
        >>> check_class_forward(nn.Linear(2, 2))  # the class's forward: fine
    """
    name = type(model).__name__
    if type(model).forward is nn.Module.forward and callable(vars(model).get("forward")):
        raise UntraceableModelError(
            f"route() was given {with_article(name)} whose class defines no forward; its "
            "forward is set on the instance (self.forward = ...).\nDefine it on the class "
            f"(a subclass of {name} whose forward calls the chosen method), then route that "
            "model: tread_fx traces the class's forward."
        )


def _fully_sharded(model: nn.Module) -> str | None:
    """The path of the first module FSDP2's ``fully_shard`` was applied to (``""``: the model)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # nothing is sharded before it is imported
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return None
    return next((p for p, m in model.named_modules() if isinstance(m, fsdp_module)), None)


REPLICATE = "_replicate_for_data_parallel"  # what DataParallel calls on every module it copies
# torch.compile's lazy-module protocol: ``OptimizedModule`` calls ``_infer_parameters(module,
# args, kwargs)`` of a module that has both attributes eagerly, before dynamo traces the call.
_LAZY_MARK, _LAZY_CALL = "_initialize_hook", "_infer_parameters"
#: The ``model.__dict__`` entries :func:`wrapper_attributes` makes (``unroute()`` drops them).
WRAPPER_ATTRIBUTES = (REPLICATE, _LAZY_MARK, _LAZY_CALL)


def refuse_replica(model: nn.Module) -> None:
    """Refuse ``DataParallel`` replication of a routed model (stored as ``model.REPLICATE``).

    One device (or none) calls the model itself and routes normally.

    Raises:
        WrappedModelError: naming what to use instead.
    """
    raise WrappedModelError(
        f"DataParallel tried to replicate a routed {type(model).__name__} onto several GPUs; "
        "a routed model's traced graphs belong to the one model, so its copies cannot route. "
        "Use DistributedDataParallel (route, then wrap: one process per GPU), or DataParallel "
        "with a single device."
    )


def wrapper_attributes(model: nn.Module, prepare: Any) -> dict[str, Any]:
    """The ``model.__dict__`` entries of a routed model for torch's wrappers: ``DataParallel``
    replicating it calls :func:`refuse_replica`; ``torch.compile(model)`` calls ``prepare(model,
    args, kwargs)`` on the real inputs before each call, outside the compiled region (dynamo
    cannot trace building the routed graph of a new signature). ``prepare`` must pickle.

    Example:
        >>> import torch
        >>> seen = []
        >>> def prepare(module, args, kwargs): seen.append(args[0].shape)
        >>> model = torch.nn.Linear(2, 2)
        >>> model.__dict__.update(wrapper_attributes(model, prepare))
        >>> _ = torch.compile(model, backend="eager")(torch.ones(3, 2))
        >>> seen
        [torch.Size([3, 2])]
    """
    replica = functools.partial(refuse_replica, model)
    return {REPLICATE: replica, _LAZY_MARK: True, _LAZY_CALL: prepare}


_TRAINING = operator.attrgetter("training")


def traced_through(model: nn.Module, called: list[str]) -> set[str]:
    """Paths of ``model``'s modules that are not (inside) one of the ``called`` modules: those
    whose code the trace went through (``""`` is the model itself).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.ReLU())
        >>> sorted(traced_through(model, ["0.0", "1"]))
        ['', '0']
    """
    prefixes = tuple(f"{path}." for path in called)
    return {path for path, _ in model.named_modules() if not f"{path}.".startswith(prefixes)}


class ModuleModes:
    """The per-call module checks of one routed model (see the module docstring)."""

    def __init__(self) -> None:
        self._hook_id = -1
        self._root: nn.Module | None = None
        self._children = -1
        self._paths: set[str] | None = None  # None: every module
        self._watched: tuple[nn.Module, ...] = ()

    def hooks_changed(self) -> bool:
        """Whether a hook was registered (on any module or tensor) since the last call.

        Always ``False`` under ``torch.compile``: compiled code must not read a counter that
        changes (it would recompile); hooks belong on the model before it is compiled.
        """
        if torch.compiler.is_compiling():
            return False
        current = RemovableHandle.next_id
        changed, self._hook_id = current != self._hook_id, current
        return changed

    def watch(self, model: nn.Module, paths: set[str]) -> bool:
        """Watch the modules at ``paths`` too (a new trace went through them); whether the
        watched set changed (keys computed before are stale)."""
        merged = paths if self._paths is None else self._paths | paths
        if merged == self._paths:
            return False
        self._paths = merged
        self._take(model)
        return True

    def _take(self, model: nn.Module) -> None:
        self._root, self._children = model, len(model._modules)
        self._watched = tuple(
            module
            for path, module in model.named_modules()
            if self._paths is None or path in self._paths
        )

    def modes(self, model: nn.Module, refresh: bool = False) -> tuple[bool, ...]:
        """The ``training`` flags of the watched modules (``model.modules()`` order).

        The module tuple is taken again when ``refresh`` is set (a hook was registered), or
        the model or its number of direct children changed (submodules swapped deep inside a
        model are not noticed otherwise; routing does not support changing its structure).
        """
        if refresh or model is not self._root or len(model._modules) != self._children:
            self._take(model)
        if torch.compiler.is_compiling():  # dynamo cannot call an attrgetter
            return tuple(m.training for m in self._watched)
        return tuple(map(_TRAINING, self._watched))


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return ("unhashable", type(value).__qualname__, id(value))


def call_signature(spec: pytree.TreeSpec, flat: list, modes: tuple[bool, ...]) -> tuple:
    """The cache key of a call: input structure, tensor shapes/dtypes/devices, other inputs
    (by value, or identity when unhashable), module modes, autocast and grad mode."""
    leaves = tuple(
        (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else _hashable(v)
        for v in flat
    )
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return spec, leaves, modes, autocast, torch.is_grad_enabled()


def check_call(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise the ``TypeError`` the unrouted model raises for a call that does not fit its forward.

    Raises:
        TypeError: The arguments do not bind to ``type(model).forward`` (before any tracing).

    Example:
        >>> import tread_fx
        >>> model = tread_fx.models.DiT_S_2(input_size=8, depth=2)
        >>> check_call(model, (1, 2), {})
        Traceback (most recent call last):
        TypeError: DiT.forward() missing 1 required positional argument: 'y'
    """
    forward = inspect.unwrap(type(model).forward)
    if not inspect.isfunction(forward) or hasattr(forward, "__signature__"):
        return  # a builtin or a declared signature: let the call itself decide
    try:
        inspect.signature(forward).bind(model, *args, **kwargs)
    except TypeError:
        # Binding fails the same way for the real function, before its body runs, so this
        # raises the very TypeError the unrouted model raises (same message).
        forward(model, *args, **kwargs)
        raise


@contextlib.contextmanager
def attributes_kept(model: nn.Module, only_traced: bool = False) -> Iterator[None]:
    """Put the modules' attributes, parameters and buffers back as they were on leaving.

    Checking and probing run the model's code, and a forward that keeps something on itself
    (a cache, a counter, its last input, BatchNorm statistics) would keep a fake tensor there
    or count the probe as a step: everything is put back, buffer values too. Tracing runs it
    once for real (a change made once, as the first eager call makes it, stays, and the trace
    follows it); with ``only_traced`` only what holds a traced value afterwards is put back
    (a proxy a block traced through kept on itself).

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> with attributes_kept(layer):
        ...     layer.cache = 1
        >>> hasattr(layer, "cache")
        False
    """
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    held = [  # list and dict attributes: their items are put back too (``self.cache[i] = x``)
        (value, copy.copy(value))
        for _, attributes, _, _ in saved
        for value in attributes.values()
        if type(value) in (list, dict)
    ]
    values = [] if only_traced else [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        keep = _holds_proxy if only_traced else (lambda _value: True)
        for module, attributes, parameters, buffers in saved:
            for live, kept in ((module.__dict__, attributes), (module._parameters, parameters),
                               (module._buffers, buffers)):  # fmt: skip
                _put_back(live, kept, keep)
        for container, items in held:
            if keep(container):
                _put_back_items(container, items)
        with torch.no_grad():
            for buffer, value in values:
                buffer.copy_(value)


def _holds_proxy(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    if isinstance(value, (list, tuple, dict)):
        return any(isinstance(item, torch.fx.Proxy) for item in items)
    return isinstance(value, torch.fx.Proxy)


def _put_back(live: dict, kept: dict, keep: Any) -> None:
    for name in [n for n in live if n not in kept and keep(live[n])]:
        del live[name]
    for name, value in kept.items():
        if name not in live or (live[name] is not value and keep(live[name])):
            live[name] = value


def _put_back_items(container: Any, items: Any) -> None:
    container.clear()
    if isinstance(container, list):
        container.extend(items)
    else:
        container.update(items)


@contextlib.contextmanager
def random_state_kept(devices: list[int] | None = None) -> Iterator[None]:
    """torch's (the CPU's and ``devices``'; ``None``: every CUDA device), numpy's and Python's
    random state put back afterwards. A forward may draw from any of them (a training step
    drawing its noise with ``np.random``); a run of the model's code that tread_fx makes
    (tracing, a probe) must leave the user's next call the numbers it would have drawn.

    Example:
        >>> with random_state_kept([]):
        ...     _ = numpy.random.rand(), random.random(), torch.rand(1)
    """
    python, numpy_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        numpy.random.set_state(numpy_state)


def seed_every_generator(seed: int) -> None:
    """Seed torch's, numpy's and Python's global generators (a probe's runs draw alike)."""
    torch.manual_seed(seed)
    numpy.random.seed(seed)
    random.seed(seed)
