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

from tread_fx import adapters, errors, models, passes, routes
from tread_fx.adapters import register_adapter
from tread_fx.api import RouteInfo, is_routed, route, route_info, routed_graphs, unroute
from tread_fx.config import RoutingConfig, resolve_config
from tread_fx.errors import *  # noqa: F403
from tread_fx.inspection import explain
from tread_fx.passes.rewrite import Reinsert
from tread_fx.registry import register_leaf_function, register_leaf_module
from tread_fx.routes import Route
from tread_fx.training import force_routing, losses, sparse_guidance

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
