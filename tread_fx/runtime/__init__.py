"""What a routed graph calls while training: token selection and gather/scatter/blend ops.

Nothing here imports the passes or the face; the rewrite pass inserts calls to these
functions into the routed graph.

Example:
    >>> from tread_fx.runtime import get_strategy
    >>> get_strategy("rows").needs_grid
    True
"""

from tread_fx.runtime import guards, ops, selection
from tread_fx.runtime.selection import Strategy, get_strategy, register_strategy

__all__ = ["Strategy", "get_strategy", "guards", "ops", "register_strategy", "selection"]
