"""Tracing forwards that mutate tensors or their module, or call type-checking libraries.

- **Item assignment** (``mask[:, :n] = 1``): one out-of-place :func:`functional_setitem` node,
  which the assigned-into Python object stands for from then on.
- **In-place methods** (``x.add_(y)``) are recorded as they are, and :func:`thread_inplace`
  makes later users of the mutated value read the in-place node (data flow follows it).
- **Library functions that type-check their arguments** (einops' ``rearrange`` rejects a
  proxy): :func:`library_function_of` finds in the traceback the library function the model's
  code called, to trace again with it as a leaf function (no per-library code).
- **Changes to the module** (:func:`side_effects`): flags set, in-place writes to its state.
- **Values kept on the module** (:func:`stored_traced_values`): a traced value the forward
  stored on a module (``self.cache[i] = x``) for a later call to read; a routed graph returns
  only the outputs and would leave it stale, so such a forward is refused.

Example:
    >>> import torch
    >>> functional_setitem(torch.zeros(2, 3), (slice(None), 1), 5.0)
    tensor([[0., 5., 0.],
            [0., 5., 0.]])
"""

from __future__ import annotations

import os
import sys
import traceback
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from tread_fx.stages import neutral_file, written_by_user

__all__ = [
    "functional_setitem",
    "thread_inplace",
    "library_function_of",
    "is_inplace_method",
    "defining_modules",
    "drop_unused_sizes",
    "module_flags",
    "side_effects",
    "stored_traced_values",
    "state_mutations",
]


def functional_setitem(tensor: torch.Tensor, key: Any, value: Any) -> torch.Tensor:
    """``tensor[key] = value`` without touching ``tensor``: returns the written copy.

    Python lists and dicts (a list of per-sample tensors) are copied the same way.
    """
    out = tensor.clone() if isinstance(tensor, torch.Tensor) else type(tensor)(tensor)
    out[key] = value
    return out


def is_inplace_method(node: fx.Node) -> bool:
    """Whether ``node`` calls an in-place tensor method (``add_``, ``copy_``, not ``__x__``)."""
    target = node.target
    return (
        node.op == "call_method"
        and isinstance(target, str)
        and target.endswith("_")
        and not target.endswith("__")
    )


def thread_inplace(graph: fx.Graph) -> None:
    """Make later users of a value mutated in place read the in-place node instead (it returns
    the tensor it mutates, so no value changes; later readers now depend on the mutation)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not is_inplace_method(node) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        mutated = node.args[0]
        for user in [u for u in mutated.users if u is not node and order[u] > order[node]]:
            user.replace_input_with(mutated, node)


def library_function_of(
    err: BaseException, model_files: set[str]
) -> tuple[Callable, types.ModuleType | None] | None:
    """The library function that rejected a traced value when ``err`` was raised, with the
    module of the code that called it (where fx must find the function's name to patch it);
    else ``None``.

    The library is that of the traceback's innermost frame outside torch, the standard library
    and tread_fx, below the model's own code; its function is the first frame of that library
    in the calling chain, reached by a global name of its caller: a module-level function, or
    one bound to a name of the caller's module (a closure or a replaced kernel assigned
    there). Code of another library on the way is traced through like the model's:
    x-transformers' ``apply_rotary_pos_emb`` calling einops makes einops' ``rearrange`` the
    leaf, so the rotary table's use is seen. The model's code is ``model_files`` (absolute
    paths: the files of its classes) and every file not installed as a package (a helper
    module beside them in its repository, such as ``math.py`` next to ``model.py``)."""
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    files = [os.path.abspath(f.f_code.co_filename) for f in frames]
    in_model = [i for i, f in enumerate(files) if f in model_files or written_by_user(f)]
    if not in_model:
        return None
    outside = [i for i in range(in_model[-1] + 1, len(frames)) if not neutral_file(files[i])]
    if not outside or outside[0] != in_model[-1] + 1:  # the model's code called no library
        return None
    entry, package = outside[-1], _package(frames[outside[-1]])
    while entry - 1 in outside and _package(frames[entry - 1]) == package:
        entry -= 1
    callee, caller = frames[entry], frames[entry - 1].f_globals
    module = sys.modules.get(caller.get("__name__", ""))
    code = callee.f_code
    fn = callee.f_globals.get(code.co_name)  # a module-level function
    if getattr(fn, "__code__", None) is not code:
        fn = next((f for f in caller.values() if getattr(f, "__code__", None) is code), None)
    return None if fn is None else (fn, module)


def _package(frame: types.FrameType) -> str:
    """The top-level package of the code running in ``frame``."""
    return str(frame.f_globals.get("__name__", "")).split(".")[0]


def defining_modules(fn: Callable) -> list[types.ModuleType]:
    """The module defining ``fn`` and its parent packages (which re-export it, as
    ``einops.rearrange`` does): the namespaces where fx must patch the name."""
    parts = (getattr(fn, "__module__", "") or "").split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return [sys.modules[n] for n in names if n in sys.modules]


def drop_unused_sizes(graph: fx.Graph) -> None:
    """Remove ``x.size(i)`` nodes nobody reads (``x.shape`` traces every dim; most go unused)."""
    sizes = [n for n in graph.nodes if n.op == "call_method" and n.target == "size"]
    for node in reversed([n for n in sizes if not n.users]):
        graph.erase_node(node)


def module_flags(model: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """Every submodule's plain Python attributes (flags such as ``self.initialized``)."""
    plain = (bool, int, float, str, type(None))
    return {
        (path, key): value
        for path, module in model.named_modules()
        for key, value in vars(module).items()
        if isinstance(value, plain) and not key.startswith("__")
    }


def state_mutations(graph: fx.Graph) -> list[fx.Node]:
    """In-place ops on module state (a parameter or buffer read with ``get_attr``): replayed
    on every routed call, they would rescale a weight each step (and fail under autograd)."""
    return [
        n
        for n in graph.nodes
        if is_inplace_method(n) and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"
    ]


def side_effects(before: dict, model: torch.nn.Module, graph: fx.Graph) -> list[str]:
    """What a trace did to the module: changed flags and in-place writes to its state."""
    after = module_flags(model)
    changed = [f"{p}.{k}" if p else k for (p, k) in before if after.get((p, k)) != before[(p, k)]]
    writes = [
        f"{n.args[0].target.removeprefix('model.')}.{n.target}() at {n.meta.get('tread_where')}"
        for n in state_mutations(graph)
    ]
    return [f"attribute {c} changed" for c in changed] + [f"in-place {w}" for w in writes]


def stored_traced_values(model: torch.nn.Module) -> list[str]:
    """Attributes of the model's modules that hold a traced value computed from the call's
    data after a trace, directly or in a list, tuple or dict attribute
    (``self.reuse_feature[i] = x``): ``path.name[key]``."""
    found = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            where = f"{path}.{name}" if path else name
            for key, item in _items(value):
                if isinstance(item, fx.Proxy) and _from_input_data(item.node):
                    found.append(where if key is None else f"{where}[{key!r}]")
    return found


def _from_input_data(node: fx.Node) -> bool:
    """Whether ``node`` is computed from the call's tensor data, not only from sizes and
    constants (a memo of a table per grid size is recomputed by every routed call anyway)."""
    seen, todo = {node}, [node]
    while todo:
        current = todo.pop()
        if current.op == "placeholder":
            return True
        for arg in current.all_input_nodes:
            if arg not in seen and not isinstance(arg.meta.get("tread_meta"), int):
                seen.add(arg)
                todo.append(arg)
    return False


def _items(value: Any) -> Any:
    """``(key, item)`` pairs of a container attribute; ``(None, value)`` for anything else."""
    if isinstance(value, dict):
        return value.items()
    if isinstance(value, (list, tuple)):
        return enumerate(value)
    return [(None, value)]
