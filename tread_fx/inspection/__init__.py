"""Inspection: ``explain`` and what it is made of (report, render, graph diff, FLOPs, CLI).

Reads the same passes as ``route()``; nothing outside this folder imports it except the
package root's re-export of :func:`explain`.

Example:
    >>> from tread_fx.inspection import explain
    >>> explain.__module__
    'tread_fx.inspection.explain'
"""

from tread_fx.inspection.explain import Explanation, explain

__all__ = ["Explanation", "explain"]
