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

__all__ = [
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
    "CheckpointError",
    "RegistrationError",
    "ModelSpecError",
    "ExampleInputError",
    "GraphvizNotFoundError",
    "StreamChoiceWarning",
    "TreadFxInternalError",
    "ThinRouteWarning",
]


class TreadFxError(Exception):
    """Base class of every error tread_fx raises on purpose."""


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
    """Several streams could be routed and a documented rule chose one (``stream=`` picks)."""


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
