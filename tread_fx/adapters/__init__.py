"""Side-input adapters: the rules that make values entering a routed region fit the kept tokens.

- :mod:`~tread_fx.adapters.values`: what a rule sees (:class:`SideValue`, :class:`StreamLayout`),
  :class:`Adapter` and the registry (user rules first).
- :mod:`~tread_fx.adapters.rules`: the built-in rules, one table.
- :mod:`~tread_fx.adapters.token_tables`: row maps and the graph functions that cut token
  tables (RoPE tables, masks, position ids, values folding the batch with the tokens) to
  the kept tokens.

Example:
    >>> from tread_fx.adapters import adapters
    >>> adapters()[-1].name
    'per-token-by-shape'
"""

from tread_fx.adapters.rules import BUILTIN_ADAPTERS
from tread_fx.adapters.values import (
    Adapter,
    SideValue,
    StreamLayout,
    TensorMeta,
    adapters,
    register_adapter,
    unregister_adapter,
)

__all__ = [
    "Adapter",
    "BUILTIN_ADAPTERS",
    "SideValue",
    "StreamLayout",
    "TensorMeta",
    "adapters",
    "register_adapter",
    "unregister_adapter",
]

for _rule in BUILTIN_ADAPTERS:
    register_adapter(_rule, first=False)
