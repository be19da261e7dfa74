"""tread_fx: TREAD token routing for any PyTorch diffusion backbone, as a torch.fx pass.

Example:
    >>> import tread_fx
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10)
    >>> model = tread_fx.route(model, routes=[(2, 8)], rate=0.5)
"""

from tread_fx import adapters, errors, guidance, losses, ops, registry, routes, selection
from tread_fx.api import RouteInfo, is_routed, route, route_info, routed_graphs, unroute
from tread_fx.errors import *  # noqa: F403
from tread_fx.explain import explain
from tread_fx.guidance import force_routing, sparse_guidance
from tread_fx.passes.rewrite import Reinsert
from tread_fx.registry import register_leaf_function, register_leaf_module
from tread_fx.routes import Route

# isort: split
# models/ register leaf functions, so they are imported after the registry is bound here.
from tread_fx import models, passes

__all__ = [
    *errors.__all__,
    "Reinsert",
    "Route",
    "RouteInfo",
    "adapters",
    "explain",
    "force_routing",
    "guidance",
    "is_routed",
    "losses",
    "models",
    "ops",
    "passes",
    "register_leaf_function",
    "register_leaf_module",
    "registry",
    "route",
    "route_info",
    "routed_graphs",
    "routes",
    "selection",
    "sparse_guidance",
    "unroute",
]
