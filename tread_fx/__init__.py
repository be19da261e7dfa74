"""tread_fx: TREAD token routing for any PyTorch diffusion backbone, as a torch.fx pass.

The package root is the public surface; ``__all__`` lists all of it. The folders behind it:
``passes`` (trace -> locate -> plan -> rewrite), ``runtime`` (what a routed graph calls),
``adapters`` (side-input rules), ``inspection`` (``explain``, reports, the CLI), ``training``
(losses, forced routing, sparse guidance) and ``models`` (reference backbones).

Example:
    >>> import tread_fx
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10)
    >>> model = tread_fx.route(model, routes=[(2, 8)], rate=0.5)
"""

import importlib
from typing import TYPE_CHECKING, Any

from tread_fx import errors
from tread_fx.errors import *  # noqa: F403

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and editors
    from tread_fx import adapters, models, passes, routes
    from tread_fx.adapters import register_adapter
    from tread_fx.api import RouteInfo, is_routed, route, route_info, routed_graphs, unroute
    from tread_fx.config import RoutingConfig, resolve_config
    from tread_fx.inspection import explain
    from tread_fx.passes.rewrite.insert import Reinsert
    from tread_fx.registry import register_leaf_function, register_leaf_module
    from tread_fx.routes import Route
    from tread_fx.training import force_routing, losses, sparse_guidance

# Everything else loads on first use (PEP 562), so ``import tread_fx`` (and ``tread-fx --help``)
# does not import torch until a name that needs it is touched.
_LAZY = {  # module -> the public names it defines (the package itself: its sub-packages)
    "tread_fx": ("adapters", "models", "passes", "routes"),
    "tread_fx.adapters": ("register_adapter",),
    "tread_fx.api": ("RouteInfo", "is_routed", "route", "route_info", "routed_graphs", "unroute"),
    "tread_fx.config": ("RoutingConfig", "resolve_config"),
    "tread_fx.inspection.explain": ("explain",),
    "tread_fx.passes.rewrite.insert": ("Reinsert",),
    "tread_fx.registry": ("register_leaf_function", "register_leaf_module"),
    "tread_fx.routes": ("Route",),
    "tread_fx.training": ("force_routing", "losses", "sparse_guidance"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """Imports a public name on first use and keeps it (``tread_fx.route``, ...)."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'tread_fx' has no attribute {name!r}")
    module = _MODULE_OF[name]
    if module == __name__:  # a sub-package
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    *errors.__all__,
    "Reinsert",
    "Route",
    "RouteInfo",
    "RoutingConfig",
    "adapters",
    "explain",
    "force_routing",
    "is_routed",
    "losses",
    "models",
    "passes",
    "register_adapter",
    "register_leaf_function",
    "register_leaf_module",
    "resolve_config",
    "route",
    "route_info",
    "routed_graphs",
    "routes",
    "sparse_guidance",
    "unroute",
]
