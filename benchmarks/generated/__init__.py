"""A generator of small random diffusion backbones and a differential check (issue 42).

Each seed draws a backbone's features (:mod:`~benchmarks.generated.grammar`), writes its
source with a hand-routed twin (:mod:`~benchmarks.generated.source`), imports it from its
file and checks ``tread_fx.route()`` against the twin (:mod:`~benchmarks.generated.check`).
``python -m benchmarks.generated --seeds 0:300`` prints the table and every finding.

Example:
    >>> from benchmarks.generated import check
    >>> check(0).outcome in ("routed", "refused", "wrong", "foreign", "generator error")
    True
"""

from benchmarks.generated.check import OUTCOMES, Result, check
from benchmarks.generated.grammar import Draw, draw
from benchmarks.generated.source import module_source

__all__ = ["OUTCOMES", "Draw", "Result", "check", "draw", "module_source"]
