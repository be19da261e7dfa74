"""tread_fx: TREAD token routing for any PyTorch diffusion backbone, as a torch.fx pass."""

from tread_fx import errors, registry
from tread_fx.errors import *  # noqa: F403
from tread_fx.registry import register_leaf_function, register_leaf_module

__all__ = [*errors.__all__, "register_leaf_function", "register_leaf_module"]
