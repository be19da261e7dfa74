"""ATen-level op and FLOP counts of a traced graph, per block and in total.

Everything runs on fake tensors (no compute, no memory; the model is not modified):

1. The graph is interpreted once. Block calls are not executed: a stub returns outputs of the
   right shapes (found by running one block per distinct call signature) and passes zero
   gradients back, so a ``TorchDispatchMode`` counts the ATen ops and FLOPs of everything
   *outside* the blocks, forward and backward (``torch.autograd.grad``).
2. Each distinct block call (module structure + argument shapes) is traced with ``make_fx``
   through ``torch.func.functional_call``, forward only and forward + backward; its ATen
   graph gives the block's op and FLOP counts (kept as :attr:`BlockCost.aten_forward`).

The total is the outside part plus every block call, so a 28-block model costs two block
traces (full and routed token count), not 28. FLOPs use :data:`FLOP_FORMULAS` on top of
``torch.utils.flop_counter``, so the totals equal :func:`flop_counter` on a real step.

Example:
    >>> import torch, tread_fx
    >>> from tread_fx.inspection.flops import profile_graph
    >>> from tread_fx.passes.trace.tracer import trace_call
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10, depth=2)
    >>> args = (torch.randn(1, 1, 8, 8), torch.rand(1), torch.tensor([3]))
    >>> traced = trace_call(model.train(), args, {}, {"blocks.0", "blocks.1"})
    >>> prof = profile_graph(traced.gm, list(args), ["blocks.0", "blocks.1"])
    >>> prof.blocks[0].forward.flops == prof.blocks[1].forward.flops > 0
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import (
    FlopCounterMode,
    conv_flop_count,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

from tread_fx.inspection.records import BlockCost, Cost, GraphProfile, OpCounts
from tread_fx.passes.trace.support import dynamo_wrappers_run_original
from tread_fx.passes.trace.tracer import MODEL_PREFIX
from tread_fx.runtime.ops import call_in_fp32

__all__ = [
    "FLOP_FORMULAS",
    "flop_counter",
    "module_arg_index",
    "profile_graph",
    "fake_shapes",
    "block_nodes",
]

aten = torch.ops.aten


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation,
                        transposed, _output_padding, _groups, output_mask, out_shape=None,
                        **kwargs) -> int:  # fmt: skip
    flops = 0
    if output_mask[0]:  # grad_input: a transposed conv of grad_out with the same weight
        flops += conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[1]:  # grad_weight: one multiply-add per (output position, weight) pair
        flops += conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return flops


FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
    aten.convolution_backward: _conv_backward_flop,
}
"""FLOP formulas added to or corrected in ``torch.utils.flop_counter``.

The CPU flash-attention kernel has no formula there, and its convolution backward counts the
weight gradient of a grouped convolution ``groups`` times (a depthwise conv over ``C``
channels as if it were dense: Mamba's causal conv). Pass them to
``FlopCounterMode(custom_mapping=FLOP_FORMULAS)`` (or use :func:`flop_counter`) to count like
this module.
"""


def flop_counter(display: bool = False) -> FlopCounterMode:
    """The project's FLOP counter: ``FlopCounterMode`` with :data:`FLOP_FORMULAS` added.

    Count every FLOP figure with this one (benchmarks, tests, coverage): torch's stock counter
    counts 0 FLOPs for CPU attention and over-counts a grouped convolution's backward.

    Args:
        display: Print torch's per-module table when the counter exits.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> q = torch.randn(1, 2, 8, 4)  # [B, heads, tokens, head_dim]
        >>> with flop_counter() as counter:
        ...     _ = F.scaled_dot_product_attention(q, q, q)
        >>> counter.get_total_flops()  # 2 matmuls of 2 * 1 * 2 * 8 * 8 * 4 FLOPs
        2048
    """
    return FlopCounterMode(display=display, custom_mapping=FLOP_FORMULAS)


_FORMULAS = {**flop_registry, **{k: shape_wrapper(v) for k, v in FLOP_FORMULAS.items()}}


def _add_op(counts: OpCounts, op: Any, args: Any, kwargs: dict, out: Any) -> None:
    """Add one ATen call ``op(*args, **kwargs) -> out`` (and its FLOPs) to ``counts``."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace == "prim":
        return
    counts.ops[str(op)] += 1
    formula = _FORMULAS.get(op.overloadpacket)
    if formula is not None:
        counts.flops += int(formula(*args, **kwargs, out_val=out))


def _count_graph(graph: fx.Graph) -> OpCounts:
    """The ATen ops and FLOPs of an ATen graph whose nodes carry ``meta['val']``."""
    counts = OpCounts()
    for node in graph.nodes:
        if node.op == "call_function":
            args, kwargs = pytree.tree_map_only(
                fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs)
            )
            _add_op(counts, node.target, args, kwargs, node.meta.get("val"))
    return counts


_PAUSED = [0]


class _AtenCounter(TorchDispatchMode):
    """Counts ATen ops and FLOPs, except while a block stub runs."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = OpCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _PAUSED[0]:
            _add_op(self.counts, func, args, kwargs, out)
        return out


class _Paused:
    def __enter__(self) -> None:
        _PAUSED[0] += 1

    def __exit__(self, *exc: Any) -> None:
        _PAUSED[0] -= 1


def _trace_cost(fn: Callable, state: dict, tensors: list, mode: str) -> tuple[Cost, fx.GraphModule]:
    """Forward: ATen graph of ``fn(state, *tensors)`` (``make_fx``); backward: counted.
    Code the model compiles itself runs (and is traced) as its original Python."""
    with dynamo_wrappers_run_original():
        forward = make_fx(fn, tracing_mode=mode, _allow_non_fake_inputs=True)(state, *tensors)
        with _Paused():
            out = fn(state, *tensors)
    backward = _AtenCounter()
    with backward:
        _grads(out, [*tensors, *state.values()])
    return Cost(_count_graph(forward.graph), backward.counts), forward


def _grads(out: Any, wrt: list) -> Any:
    """Gradients of ``out`` (all-ones output gradients) w.r.t. the tensors needing them."""
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [t for t in wrt if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or not wrt:
        return None
    ones = [torch.ones_like(o) for o in outs]
    return torch.autograd.grad(outs, wrt, ones, allow_unused=True)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _shape(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)):
        return tuple(_shape(v) for v in value)
    return None


@dataclass
class _Signature:
    """A block call reduced to what determines its cost and outputs."""

    key: tuple
    module: nn.Module
    flat: list
    spec: Any
    positions: list[int]
    outputs: Any = None  # (spec, leaves): TensorMeta-like tuples or constants


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
    return value


def _signature(gm: fx.GraphModule, node: fx.Node, path: str, args: tuple, kwargs: dict):
    if node.op == "call_function":  # checkpoint(module, *args): count the module call
        args = args[1:]
        kwargs = {k: v for k, v in kwargs.items() if k != "use_reentrant"}
    module = gm.get_submodule(MODEL_PREFIX + path)
    flat, spec = pytree.tree_flatten((args, kwargs))
    flat = [_leaf(v) for v in flat]
    positions = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    described = tuple(
        (tuple(v.shape), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) else repr(v)
        for v in flat
    )
    key = (type(module), repr(module), _settings(module), described, str(spec))
    return _Signature(key, module, flat, spec, positions)


def _settings(module: nn.Module) -> tuple:
    """Plain attributes of the module and its children (a ``window_size`` that ``repr``
    leaves out): blocks of one class that differ in them cost differently."""
    plain = (bool, int, float, str, tuple, type(None))
    return tuple(
        (path, name, value)
        for path, sub in module.named_modules()
        for name, value in vars(sub).items()
        if not name.startswith("_") and name != "training" and isinstance(value, plain)
    )


def _call(sig: _Signature) -> Callable:
    def call_block(state: dict, *tensors: Any) -> Any:
        leaves = list(sig.flat)
        for pos, tensor in zip(sig.positions, tensors):
            leaves[pos] = tensor
        a, kw = pytree.tree_unflatten(leaves, sig.spec)
        return functional_call(sig.module, state, a, kw)

    return call_block


def _output_meta(sig: _Signature) -> tuple:
    with _Paused(), torch.no_grad():
        out = _call(sig)(_state(sig.module), *[sig.flat[i] for i in sig.positions])
    leaves, spec = pytree.tree_flatten(out)
    metas = [
        (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else v for v in leaves
    ]
    return spec, metas


class _Stub(torch.autograd.Function):
    """Stands in for a block call: outputs of the right shapes, zero input gradients."""

    @staticmethod
    def forward(ctx, metas: list, *inputs: torch.Tensor) -> tuple:
        with _Paused():
            ctx.inputs = [(i.shape, i.dtype, i.device) for i in inputs]
            outs = [torch.empty(s, dtype=d, device=dev) for s, d, dev in metas]
            ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
            return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        with _Paused():
            return (None, *[torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.inputs])


def _stubbed_call(sig: _Signature, args: tuple, kwargs: dict) -> Any:
    spec, metas = sig.outputs
    tensor_metas = [m for m in metas if isinstance(m, tuple) and len(m) == 3]
    leaves = pytree.tree_leaves((args, kwargs))
    inputs = [v for v in leaves if isinstance(v, torch.Tensor) and v.requires_grad]
    outs = iter(_Stub.apply(tensor_metas, *inputs) if tensor_metas else ())
    leaves = [next(outs) if isinstance(m, tuple) and len(m) == 3 else m for m in metas]
    return pytree.tree_unflatten(leaves, spec)


class _Capture(fx.Interpreter):
    """Runs a graph on fake tensors with block calls stubbed; records shapes and calls."""

    def __init__(self, gm: fx.GraphModule, block_nodes: dict[fx.Node, str], cache: dict) -> None:
        super().__init__(gm)
        self.block_nodes = block_nodes
        self.cache = cache
        self.shapes: dict[str, Any] = {}
        self.calls: dict[fx.Node, _Signature] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n in self.block_nodes:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            sig = _signature(self.module, n, self.block_nodes[n], args, kwargs)
            if sig.key not in self.cache:
                sig.outputs = _output_meta(sig)
                self.cache[sig.key] = sig
            sig.outputs = self.cache[sig.key].outputs
            self.calls[n] = sig
            value = _stubbed_call(sig, args, kwargs)
        else:
            value = super().run_node(n)
        self.shapes[n.name] = _shape(value)
        return value


def module_arg_index(node: fx.Node) -> int | None:
    """Where the block sits among the arguments of a wrapped block call, else ``None``.

    The rewrite calls blocks as ``checkpoint(block, ...)``, ``call_in_fp32(block, ...)`` or
    ``checkpoint(call_in_fp32, block, ...)``; the block is a ``get_attr`` node.
    """
    if node.op != "call_function" or node.target not in (checkpoint, call_in_fp32):
        return None
    for i, arg in enumerate(node.args[:2]):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            return i
    return None


def block_nodes(gm: fx.GraphModule, paths: Sequence[str]) -> dict[fx.Node, str]:
    """Block calls by module path: plain calls and calls through activation checkpointing."""
    wanted, found = set(paths), {}
    for node in gm.graph.nodes:
        target = None
        if node.op == "call_module":
            target = node.target
        elif (index := module_arg_index(node)) is not None:
            target = node.args[index].target
        if isinstance(target, str) and target.startswith(MODEL_PREFIX):
            path = target.removeprefix(MODEL_PREFIX)
            if path in wanted:
                found[node] = path
    return found


def fake_shapes(
    gm: fx.GraphModule, inputs: Sequence[torch.Tensor], block_paths: Sequence[str] = ()
) -> dict[str, Any]:
    """Shape of every tensor value of ``gm(*inputs)``, by node name, from a fake-tensor run.

    Example:
        >>> import torch
        >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 3))
        >>> fake_shapes(gm, [torch.randn(2, 4)])["linear"]
        (2, 3)
    """

    def run(values: list, mode: str) -> dict[str, Any]:
        capture = _Capture(gm, block_nodes(gm, block_paths), {})
        with torch.no_grad() if mode == "real" else contextlib.nullcontext():
            capture.run(*values)
        return capture.shapes

    return _fake_or_real(run, inputs)


def profile_graph(
    gm: fx.GraphModule,
    inputs: Sequence[torch.Tensor],
    block_paths: Sequence[str],
    block_costs: dict | None = None,
) -> GraphProfile:
    """Count ATen ops and FLOPs of ``gm(*inputs)``, per block call and in total.

    Args:
        gm: A traced (original or routed) GraphModule; module targets start with ``model.``.
        inputs: Its inputs (real or fake tensors; only shapes, dtypes and devices matter).
        block_paths: Module paths of the blocks (relative to the model).
        block_costs: A dict to share block costs between calls (same model, two graphs).

    Returns:
        The :class:`GraphProfile`; ``total`` counts one training step (forward + backward
        with all-ones output gradients, gradients for every parameter).
    """
    costs = {} if block_costs is None else block_costs

    def run(values: list, mode: str) -> GraphProfile:
        cache: dict[tuple, _Signature] = {}
        capture = _Capture(gm, block_nodes(gm, block_paths), cache)
        forward, backward = _AtenCounter(), _AtenCounter()
        with forward:
            outputs = capture.run(*values)
        with backward:
            _grads(outputs, list(gm.parameters()))
        for key, sig in cache.items():
            if key not in costs:
                tensors = [sig.flat[i] for i in sig.positions]
                costs[key] = _trace_cost(_call(sig), _state(sig.module), tensors, mode)
        blocks = []
        for node, sig in capture.calls.items():
            cost, graph = costs[sig.key]
            blocks.append(BlockCost(cost.forward, cost.backward, capture.block_nodes[node], graph))
        outside = Cost(forward.counts, backward.counts)
        return GraphProfile(sum(blocks, outside), blocks, outside, capture.shapes)

    return _fake_or_real(run, inputs)


def _fake_or_real(run: Callable[[list, str], Any], inputs: Sequence[torch.Tensor]) -> Any:
    """``run(values, "fake")`` on fake copies of ``inputs``; what fake tensors cannot run
    (data-dependent code such as ``nonzero``, ops without a fake kernel) on real copies.
    Code the model compiles itself runs as its original Python (nothing compiled on fakes)."""
    try:
        with dynamo_wrappers_run_original(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            return run([mode.from_tensor(t) for t in inputs], "fake")
    except Exception:  # noqa: BLE001 - what fake tensors cannot run runs on real values
        with dynamo_wrappers_run_original():
            return run([t.detach().clone() for t in inputs], "real")
