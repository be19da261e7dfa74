"""Training helpers: TREAD losses, forced routing and sparse guidance.

Example:
    >>> from tread_fx.training import force_routing, sparse_guidance
    >>> force_routing.__module__
    'tread_fx.training.guidance'
"""

from tread_fx.training import losses
from tread_fx.training.guidance import force_routing, sparse_guidance

__all__ = ["force_routing", "losses", "sparse_guidance"]
