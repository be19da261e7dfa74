"""Errors raised by tread_fx.

Every user mistake raises a subclass of :class:`TreadFxError`. Each message says what was
asked, what was found, and what to do about it. Subclasses also derive from the builtin
exception a user would expect (``ValueError`` for bad values, ``TypeError`` for bad types,
``AttributeError`` for missing attributes), so existing ``except ValueError`` code keeps working.

Example:
    >>> import tread_fx
    >>> try:
    ...     tread_fx.Route(5, 2)
    ... except tread_fx.InvalidRouteError as err:
    ...     print(type(err).__name__)
    InvalidRouteError
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import warnings

__all__ = [
    "FIRST_LINE",
    "short_first_line",
    "shown",
    "warn_at_caller",
    "TreadFxError",
    "InvalidRouteError",
    "InvalidRateError",
    "BlockStackNotFoundError",
    "AmbiguousBlockStackError",
    "WrappedModelError",
    "AlreadyRoutedError",
    "NotRoutedError",
    "UntraceableModelError",
    "TokenStreamError",
    "SideInputError",
    "SelectionError",
    "RoutedGraphError",
    "RouteCheckError",
    "CheckpointError",
    "RegistrationError",
    "ModelSpecError",
    "ExampleInputError",
    "GraphvizNotFoundError",
    "StreamChoiceWarning",
    "TreadFxInternalError",
    "ThinRouteWarning",
]


FIRST_LINE = 150  # characters: what a traceback's last line shows before the details


def shown(path: str) -> str:
    """A container path for messages: the model itself (a top-level list) has the empty path.

    Example:
        >>> shown("blocks"), shown("")
        ('blocks', 'the model itself')
    """
    return path or "the model itself"


_VOWEL_LETTER_NAMES = set("AEFHILMNORSX")  # "an FSDP", "an MLP", "an SD3": read letter by letter
_SAID_WITH_Y_OR_W = ("uni", "use", "usu", "uti", "ure", "eu", "one", "once")


def with_article(word: str) -> str:
    """``word`` after "a" or "an", as it is read: a class name, an acronym or a number.

    Example:
        >>> [with_article(w) for w in ("OptimizedModule", "DataParallel", "FSDPModule", "DDP")]
        ['an OptimizedModule', 'a DataParallel', 'an FSDPModule', 'a DDP']
        >>> [with_article(w) for w in ("UNet2DModel", "UnitBlock", "Eva", "8-D", "11-D", "3-D")]
        ['a UNet2DModel', 'a UnitBlock', 'an Eva', 'an 8-D', 'an 11-D', 'a 3-D']
    """
    digits = re.match(r"\d+", word)
    if digits:
        an = digits[0].startswith("8") or digits[0] in ("11", "18")
    elif re.match(r"[A-Z]([A-Z0-9-]|$)", word):  # an acronym: its first letter's name
        an = word[0] in _VOWEL_LETTER_NAMES
    else:
        low = word.lower()
        an = low[:1] in tuple("aeiou") and not low.startswith(_SAID_WITH_Y_OR_W)
    return f"{'an' if an else 'a'} {word}"


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the first frame outside tread_fx and torch: the user's line that called them
    (a route is built at the model's first training call, frames below the user's code).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_at_caller("a note")
        >>> caught[0].filename.endswith("errors.py")
        False
    """
    skipped = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    torch = sys.modules.get("torch")
    if torch is not None:
        skipped.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn_at_caller's caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(tuple(skipped)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def short_first_line(message: str, limit: int = FIRST_LINE) -> str:
    """Breaks ``message`` after a clause so that its first line has at most ``limit`` chars.

    A closing parenthetical (``path: problem (the library's own message)``) goes below;
    otherwise the break goes after the last sentence end (``. ``, ``; ``), else the last
    clause end (``: ``, then ``, ``, then a space) outside brackets that keeps the first line
    short; the rest follows on the next line, unchanged. A message whose first line is short
    is returned as it is. (tread_fx's own refusals put their reason and what to do on a first
    line of their own; this keeps other messages readable.)

    Example:
        >>> text = "blocks 2..9 cannot be routed: " + "x " * 80
        >>> short_first_line(text).splitlines()[0]
        'blocks 2..9 cannot be routed:'
    """
    first, newline, rest = message.partition("\n")
    if len(first) <= limit:
        return message
    trailing = _trailing_parenthesis(first)
    if 20 <= trailing <= limit:  # "path: problem (detail ...)": the detail goes below
        return f"{first[:trailing].rstrip()}\n{first[trailing:]}{newline}{rest}"
    depths = itertools.accumulate((c in "([{") - (c in ")]}") for c in first[: limit + 1])
    outside = [depth <= 0 for depth in depths]  # a break never splits a shape or list
    for marks in (r"[.;] ", r": ", ", ", " "):  # a whole sentence first, then a clause
        cuts = [m.start() for m in re.finditer(marks, first[: limit + 1]) if outside[m.start()]]
        if cuts and max(cuts) >= 20:
            cut = max(cuts) + 1  # keep the mark on the first line, drop the space
            break
    else:
        cut = limit
    return f"{first[:cut].rstrip()}\n{first[cut:].lstrip()}{newline}{rest}"


def _trailing_parenthesis(text: str) -> int:
    """Where the parenthesis that closes ``text`` opens (-1 when ``text`` does not end in one)."""
    body = text.rstrip(".")
    if not body.endswith(")"):
        return -1
    depth = 0
    for i in range(len(body) - 1, -1, -1):
        depth += (body[i] == ")") - (body[i] == "(")
        if depth == 0:
            return i if body[i - 1 : i] == " " else -1
    return -1


class TreadFxError(Exception):
    """Base class of every error tread_fx raises on purpose.

    Its first line is at most :data:`FIRST_LINE` characters (what was asked and found); the
    details (what to do) follow on the next lines.
    """

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (short_first_line(args[0]),)
        super().__init__(*args)


class InvalidRouteError(TreadFxError, ValueError):
    """A route is malformed, out of range, or overlaps another route."""


class InvalidRateError(TreadFxError, ValueError):
    """A routing rate is outside [0, 1) or leaves no token to process."""


class BlockStackNotFoundError(TreadFxError, AttributeError):
    """No block stack was found, or ``blocks=`` names something that is not one."""


class AmbiguousBlockStackError(TreadFxError, ValueError):
    """Several unrelated block stacks qualify equally; ``blocks=`` must choose."""


class WrappedModelError(TreadFxError, TypeError):
    """``route()`` was given a DDP/FSDP/``torch.compile`` wrapper instead of the model."""


class AlreadyRoutedError(TreadFxError, ValueError):
    """``route()`` was called on a model that is already routed."""


class NotRoutedError(TreadFxError, ValueError):
    """An operation that needs a routed model was given an unrouted one."""


class UntraceableModelError(TreadFxError, TypeError):
    """The model's forward cannot be traced, even with auto-leaves."""


class TokenStreamError(TreadFxError, ValueError):
    """The token stream between blocks cannot be identified or has an unusable shape."""


class SideInputError(TreadFxError, ValueError):
    """A value entering or leaving a routed region cannot be handled safely."""


class SelectionError(TreadFxError, ValueError):
    """A token selection strategy cannot be applied (unknown name, no grid, ...)."""


class RoutedGraphError(TreadFxError, RuntimeError):
    """The rewritten graph failed where the original forward succeeded."""


class RouteCheckError(TreadFxError, ValueError):
    """A routed graph fails on fake tensors before its first call, where the original runs."""


class CheckpointError(TreadFxError, ValueError):
    """A checkpoint file is missing, corrupt or does not match the model."""


class RegistrationError(TreadFxError, TypeError):
    """Something of the wrong kind was given to a registry."""


class ModelSpecError(TreadFxError, ValueError):
    """A ``package.module:factory`` model spec (``tread-fx`` CLI) cannot be loaded."""


class ExampleInputError(TreadFxError, ValueError):
    """Example inputs for a model cannot be made from its signature and the options given."""


class GraphvizNotFoundError(TreadFxError, RuntimeError):
    """Rendering SVG needs Graphviz's ``dot`` program, which is not installed."""


class StreamChoiceWarning(UserWarning):
    """Several streams could be routed and a documented rule chose one (``stream=`` picks; for
    interleaved block stacks of equal token counts, ``blocks=``)."""


class ThinRouteWarning(UserWarning):
    """The routes span under half of the blocks the token stream flows through."""


class TreadFxInternalError(TreadFxError, RuntimeError):
    """tread_fx's own code failed in a pass (a bug to report); the original is ``__cause__``.

    Attributes:
        stage: The pass that failed (``"tracing"``, ``"locating"``, ``"planning"``,
            ``"rewriting"``).
        block: The block being processed, if known.
        where: The model's ``file:line`` being processed, if known.
    """

    def __init__(self, message: str, stage: str = "", block: str | None = None, where: str = ""):
        super().__init__(message)
        self.stage, self.block, self.where = stage, block, where
