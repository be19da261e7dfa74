"""The value-carrying fx tracer: every proxy also knows the value the eager forward computes.

:class:`ValueTracer` runs each recorded operation on real values beside the symbolic one, so
Python that reads shapes (``if x.shape[1] == ...``, ``int(N ** 0.5)``) resolves exactly as it
does eagerly. Python that reads tensor *data* (``bool(t)``, ``.item()``, ``torch.equal``)
raises :class:`DataDependentError` inside a submodule, and is read with a runtime guard in the
model's own forward. Torch functions, methods and attributes that return a Python value read
from metadata (``torch.is_floating_point(t)``, ``x.is_contiguous()``) are answered from the
real value, as :mod:`.torch_api` sorts them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx._symbolic_trace import _orig_module_call
from torch.fx.proxy import Attribute
from torch.utils import _pytree as pytree

from tread_fx.adapters.values import TensorMeta
from tread_fx.passes.trace import dataclass_args
from tread_fx.passes.trace.autograd_flags import (
    requires_grad_of,
    with_grad_flags,
)
from tread_fx.passes.trace.concats import record_leaf_concatenation
from tread_fx.passes.trace.mutation import is_inplace_method
from tread_fx.passes.trace.numpy_calls import python_scalar
from tread_fx.passes.trace.opaque import (
    LeavesTorchError,
    function_forward_in_stack,
    function_forwards,
)
from tread_fx.passes.trace.support import (
    DataDependentError,
    has_call_hooks,
    is_compiled_module_wrapper,
    is_stateless,
    store_object_constant,
    user_frame,
)
from tread_fx.passes.trace.thread_calls import NumpyDraws
from tread_fx.passes.trace.torch_api import (
    ANSWERED_KINDS,
    check_traced_metadata,
    is_tensor_result,
    kind_of_attribute,
    kind_of_function,
    kind_of_method,
)
from tread_fx.passes.trace.value_proxy import ValueAttribute, ValueProxy
from tread_fx.registry import leaf_functions, leaf_modules
from tread_fx.runtime.guards import check_traced_length, check_traced_value

__all__ = [
    "EXAMPLE_KEY",
    "EagerFailure",
    "ValueAttribute",
    "ValueProxy",
    "ValueTracer",
    "fetch_attr",
]

EXAMPLE_KEY = "tread_example_inputs"  # a leaf call's kept real inputs, in ``node.meta``
_PLAIN = (int, float, bool, str, type(None))

_GUARD_KINDS = {"bool()": "bool", "int()": "int", "an index": "int", "float()": "float"}
_DATA_METHODS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__"})


class EagerFailure(Exception):
    """The model's own code failed on real values: re-raised unchanged to the user."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


def _meta_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), value.dtype, value.device)
    if type(value) in (tuple, list):
        return type(value)(_meta_of(v) for v in value)
    return value if isinstance(value, _PLAIN) else None


class ValueTracer(fx.Tracer):
    """An fx tracer whose proxies carry the eager values (see module docstring)."""

    def __init__(
        self,
        leaf_paths: set[str],
        example: dict[str, Any],
        functions=(),
        through_hooks=False,
        opaque_functions: frozenset[type] = frozenset(),
        input_grads: dict[str, bool] | None = None,
    ) -> None:
        leaves = (*leaf_functions(), *functions)
        super().__init__(autowrap_functions=leaves, param_shapes_constant=False)
        self.leaf_function_ids = {id(f) for f in leaves}
        self.leaf_paths = leaf_paths
        # modules holding the blocks (an ``nn.TransformerEncoder``'s layers): traced through
        self.holders = {p.rsplit(".", k)[0] for p in leaf_paths for k in range(1, p.count("."))}
        self.example = example
        self.values: dict[fx.Node, Any] = {}
        self.tainted: set[fx.Node] = set()
        self.autograd_reads: set[fx.Node] = set()  # ``x.grad_fn``: not what training sees
        # whether each value requires grad in the real call (:mod:`.autograd_flags`)
        self.grad_flags: dict[fx.Node, bool] = {}
        self.input_grads = input_grads or {}  # placeholder -> the real input's requires_grad
        self.module_stack: list[str] = []
        self.running_eager = 0
        self.numpy_draws = NumpyDraws()  # np.random draws of traced code are refused
        self.model_namespaces: set[int] = set()  # the model's modules' globals (ids)
        self.sizes_call: Any = None  # the C call taking sizes as varargs now parsed
        self.type_checks: list = []  # frames calling ``isinstance`` now (innermost last)
        self.checkpointed: set[int] = set()
        self.example_classes: set[tuple] = set()
        self.through_hooks = through_hooks
        # custom autograd Functions whose ``apply`` is one node (:mod:`.opaque`)
        self.opaque_functions = opaque_functions
        self.function_forwards = function_forwards()

    # -- values -----------------------------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ValueProxy(node, self)

    def value_of(self, proxy: fx.Proxy) -> Any:
        if isinstance(proxy, Attribute) and proxy._node is None:
            return getattr(self.value_of(proxy.root), proxy.attr)
        return self.values[proxy.node]

    def _values(self, tree: Any) -> Any:
        return fx.node.map_aggregate(tree, self._value_of_leaf)

    def _value_of_leaf(self, a: Any) -> Any:
        if isinstance(a, fx.Proxy):
            return self.value_of(a)
        return dataclass_args.map_fields(a, self._values) if dataclass_args.is_instance(a) else a

    def concrete(self, proxy: fx.Proxy, what: str) -> Any:
        """Return a proxy's Python value if it is shape-derived; a value read from tensor data
        in the model's own forward is returned with a runtime guard; else refuse."""
        value = self.value_of(proxy)
        if isinstance(value, torch.Tensor) and self.in_own_code():
            return self.guarded(proxy, value, _GUARD_KINDS.get(what, "item"), what)
        if isinstance(value, torch.Tensor) or proxy.node in self.tainted:
            source = "tensor data"
            if proxy.node in self.autograd_reads:
                source = "autograd state (the trace runs without gradients on detached copies)"
            raise DataDependentError.at(f"{what} of a value computed from {source}", self)
        return value

    def in_own_code(self) -> bool:
        """Whether the trace runs the model's own forward now, or a module holding its blocks
        (``nn.TransformerDecoder`` comparing its mask with a causal one): code that stays in
        the graph, where a read of tensor data gets a runtime guard."""
        return not self.running_eager and all(p in self.holders for p in self.module_stack)

    def guarded(self, proxy: fx.Proxy, tensor: torch.Tensor, kind: str, what: str) -> Any:
        """The Python value of ``tensor`` read as ``kind``, checked on every routed call."""
        reads = {"bool": bool, "int": int, "float": float, "tolist": torch.Tensor.tolist}
        value = reads.get(kind, torch.Tensor.item)(tensor)
        where = user_frame()
        self.create_proxy("call_function", check_traced_value, (proxy, value, kind, where), {})
        return value

    def structure(self, proxy: fx.Proxy, what: str) -> Any:
        """Return a value whose length/iteration is needed. A tuple/list a call on tensors
        returned (einops ``pack``) is unpacked by its length, checked on every call
        (:func:`check_traced_length`); its items stay graph values."""
        value = self.value_of(proxy)
        if proxy.node in self.tainted:
            if type(value) in (tuple, list) and what in ("iteration", "len()"):
                check = (proxy, len(value), user_frame())
                self.create_proxy("call_function", check_traced_length, check, {})
            else:
                self.concrete(proxy, what)
        return value

    def _run(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._values(args), self._values(kwargs)
        if not self.running_eager:
            self.numpy_draws.check(self)  # the traced code since the last run drew none
        self.running_eager += 1
        try:
            with torch.no_grad():  # traced code sees the caller's (thread-local) grad mode
                return self._run_eager(kind, target, args, kwargs)
        except DataDependentError:
            raise
        except Exception as err:  # the model's own code failed on real values
            raise EagerFailure(err) from err
        finally:
            self.running_eager -= 1
            if not self.running_eager:
                self.numpy_draws.mark()  # what eager code draws, it draws at every call

    def _run_eager(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "call_module":
            return _orig_module_call(self.root.get_submodule(target), *args, **kwargs)
        if kind == "get_attr":
            return fetch_attr(self.root, target)
        raise AssertionError(f"unexpected node kind {kind}")

    def api_kind(self, access: str, target: Any) -> str:
        """What torch's API ``target`` returns for a real tensor (:mod:`.torch_api`); probed
        on real tensors once, as eager code (the trace's patches pass it through)."""
        lookup = {"attribute": kind_of_attribute, "method": kind_of_method}
        self.running_eager += 1
        try:
            return lookup.get(access, kind_of_function)(target)
        finally:
            self.running_eager -= 1

    def _metadata_answer(self, kind: str, target: Any, args: tuple, value: Any) -> Any:
        """The real answer of a metadata read of a traced tensor (:mod:`.torch_api`), or
        ``None`` when the call is recorded as it is."""
        if kind not in ("call_function", "call_method") or target is getattr:
            return None
        if is_tensor_result(value) or not self._reads_tensor(args):
            return None
        api = self.api_kind("method" if kind == "call_method" else "function", target)
        return (api, value) if api in ("metadata", "guarded") else None

    def _reads_tensor(self, args: tuple) -> bool:
        proxies = [a for a in pytree.tree_leaves(args) if isinstance(a, fx.Proxy)]
        return any(isinstance(self.value_of(p), torch.Tensor) for p in proxies)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, **extra):
        if kind == "call_method" and target == "numpy":  # the value leaves torch
            raise LeavesTorchError.at("Tensor.numpy()", self)
        if kind == "call_method" and target in _DATA_METHODS:
            raise DataDependentError.at(f"Tensor.{target}()", self)
        if kind != "placeholder" and not self.running_eager:
            inside = function_forward_in_stack(self.function_forwards)
            if inside is not None:  # a custom autograd Function: its apply becomes one node
                raise inside
        if kind == "placeholder":
            value = self.example[target]
        else:
            value = self._run(kind, target, args, kwargs)
        answer = self._metadata_answer(kind, target, args, value)
        if answer is not None and answer[0] == "metadata":
            return value  # dtype, device, layout only: the call key holds them
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, **extra)
        node = proxy.node
        if is_inplace_method(node):
            node.meta["tread_where"] = user_frame()
        if kind == "call_module" and id(self.root.get_submodule(target)) in self.checkpointed:
            node.meta["tread_checkpoint"] = True
        if kind == "call_module" and target in self.leaf_paths:
            self._keep_example_inputs(node, target, args, kwargs)
        self.values[node] = value
        self.grad_flags[node] = requires_grad_of(self, kind, target, node, value)
        node.meta["tread_meta"] = _meta_of(value)
        if kind == "call_function" and id(target) in self.leaf_function_ids:
            record_leaf_concatenation(node, value, self.values)  # pack([x, registers])
        if self._is_tainted(kind, target, node, value):
            self.tainted.add(node)
        if answer is not None:  # strides, inference, conj: checked on every call
            check = (proxy, value, user_frame())
            self.create_proxy("call_function", check_traced_metadata, check, {})
            return value
        return proxy

    def _keep_example_inputs(self, node: fx.Node, target: str, args, kwargs) -> None:
        """Keep the real inputs of each leaf class's first call of each signature (the plan
        stage traces routed blocks through on them, :mod:`.block`; the pipeline drops them)."""
        key = (type(self.root.get_submodule(target)), _call_signature(self._values((args, kwargs))))
        if key not in self.example_classes:
            self.example_classes.add(key)
            node.meta[EXAMPLE_KEY] = with_grad_flags(self, (args, kwargs))

    def create_arg(self, a: Any) -> Any:
        """Give ``get_attr`` nodes that fx makes for tensor attributes their value and meta; an
        object fx has no argument type for becomes a constant (:func:`store_object_constant`);
        a numpy scalar (``np.sqrt(d)`` kept as an attribute) is the Python number it equals."""
        if dataclass_args.is_instance(a) and dataclass_args.holds_proxy(a):
            build = dataclass_args.constructor(type(a))
            return self.create_proxy("call_function", build, (), dataclass_args.init_fields(a)).node
        try:
            arg = super().create_arg(python_scalar(a))
        except NotImplementedError:
            name = store_object_constant(self.root, a)
            if name is None:
                raise
            arg = self.create_node("get_attr", name, (), {})
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and arg not in self.values:
            value = fetch_attr(self.root, arg.target)
            self.values[arg] = value
            arg.meta["tread_meta"] = _meta_of(value)
        return arg

    def _is_tainted(self, kind: str, target: Any, node: fx.Node, value: Any) -> bool:
        if isinstance(value, torch.Tensor) or kind not in ("call_function", "call_method"):
            return False
        tensors = isinstance(value, (tuple, list)) and len(value) > 0
        if tensors and all(isinstance(v, torch.Tensor) for v in value):
            return False  # chunk/split/unbind: only the count is read, and it is shape-derived
        inputs = node.all_input_nodes
        if any(n in self.tainted for n in inputs):
            return True
        if not any(isinstance(self.values.get(n), torch.Tensor) for n in inputs):
            return False
        if target in (len, operator.getitem):
            return False
        if kind == "call_method":
            api = self.api_kind("method", target)
        elif target is getattr:
            api = self.api_kind("attribute", node.args[1])
        else:
            api = self.api_kind("function", target)
        if api == "untraced":  # autograd state: exact only on the live parameters and buffers
            tensors = [n for n in inputs if isinstance(self.values.get(n), torch.Tensor)]
            if all(n.op == "get_attr" for n in tensors):
                return False
            self.autograd_reads.add(node)
            return True
        return api not in ANSWERED_KINDS

    # -- modules ----------------------------------------------------------------------------
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths or isinstance(m, leaf_modules()):
            return True
        if has_call_hooks(m):  # FSDP2 units, checkpoint hooks: called, so the hooks still run
            return not self.through_hooks
        if module_qualified_name in self.holders:  # torch.nn's own too: its blocks are seen
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward, args: tuple, kwargs: dict) -> Any:
        if self.running_eager:
            return forward(*args, **kwargs)
        try:
            path = self.path_of_module(m)
        except NameError:  # not a submodule of the model: its code is traced as the caller's
            if not (is_compiled_module_wrapper(m) or is_stateless(m)):
                raise
            return forward(*args, **kwargs)
        if self.is_leaf_module(m, path):
            return self.create_proxy("call_module", path, args, kwargs)
        self.numpy_draws.check(self)  # drawn by the caller's code before this module
        self.module_stack.append(path)
        try:
            if self.through_hooks and has_call_hooks(m):
                out = self._trace_inside_hooks(m, args, kwargs)
            else:
                out = forward(*args, **kwargs)
            self.numpy_draws.check(self)  # drawn by this module's own code: it becomes a leaf
            return out
        except (DataDependentError, EagerFailure):
            raise
        except Exception as err:  # remember the innermost module that failed to trace
            if getattr(err, "tread_module_path", None) is None:
                err.tread_module_path = path
            raise
        finally:
            self.module_stack.pop()

    def _trace_inside_hooks(self, m: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Trace ``m.forward`` on the proxies from inside a real call of ``m``, whose hooks run on
        the values (FSDP2 gathers the parameters): for a graph that is only read, never run."""
        traced: list[Any] = []
        own = m.__dict__.get("forward")
        original = m.forward
        grad_mode = torch.is_grad_enabled()

        def forward_traced(*_values: Any, **_kw: Any) -> Any:
            with torch.set_grad_enabled(grad_mode):  # the hooks ran without, the trace sees it
                traced.append(original(*args, **kwargs))
            return self._values(traced[-1])

        m.forward = forward_traced
        try:
            with torch.no_grad():
                _orig_module_call(m, *self._values(args), **self._values(kwargs))
        finally:
            del m.forward  # back to the class's forward, or the instance's own
            if own is not None:
                m.forward = own
        return traced[-1]

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if self.running_eager:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def _call_signature(values: Any) -> tuple:
    """What tells two calls of a leaf class apart: structure, tensor shapes and dtypes, plain
    constants (a hybrid stack's attention layers get a mask its SSM layers do not)."""
    leaves, spec = pytree.tree_flatten(values)
    return str(spec), tuple(
        (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
        else v if isinstance(v, _PLAIN) else id(v)
        for v in leaves
    )  # fmt: skip


def fetch_attr(root: nn.Module, target: str) -> Any:
    """The attribute at a dotted ``target`` of ``root`` (a ``get_attr`` node's value).

    Example:
        >>> fetch_attr(nn.Sequential(nn.Linear(2, 3)), "0.bias").shape
        torch.Size([3])
    """
    return operator.attrgetter(target)(root)
