"""Internal errors are named: a failure of tread_fx's own code in a pass reaches the user as
a :class:`~tread_fx.errors.TreadFxInternalError` naming the stage, the block and the model's
file:line being processed; the model's own exceptions stay the model's.

Who raised it is read from the traceback: the innermost frame outside torch and the Python
standard library is tread_fx's (``tread_fx/`` less ``tread_fx/models/``) for an internal error, the
model's (or a library it calls) otherwise. An exception the model's code raised while being
traced on real values is marked by the trace pass (``tread_model_error``) and stays the
model's even though tread_fx's tracer ran the failing op.

Each stage's time is added up by :func:`stage_clock` while one is open (``route()`` keeps it
per routed graph: ``tread_fx.routed_graphs(model)[0].stage_seconds``).

Example:
    >>> from tread_fx.stages import stage, stage_clock
    >>> with stage_clock() as seconds:
    ...     with stage("planning", lambda: {"block": "blocks.1"}):
    ...         pass
    >>> list(seconds)
    ['planning']
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import site
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tread_fx.errors import TreadFxError, TreadFxInternalError

__all__ = [
    "stage",
    "stage_clock",
    "raised_by_tread_fx",
    "source_line",
    "model_frame",
    "own_file",
    "neutral_file",
    "written_by_user",
]

_OWN = os.path.dirname(os.path.abspath(__file__)) + os.sep
# the reference backbones live in the package but are model code, like anyone's
_MODELS = os.path.join(_OWN, "models") + os.sep
_NEUTRAL = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
)
# where installed packages live: code there is a library's, whoever imports it
_INSTALLED = tuple(
    os.path.abspath(p) + os.sep
    for p in {
        *site.getsitepackages(),
        site.getusersitepackages(),
        *(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")),
    }
)
_CLOCK: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "tread_fx_stage_clock", default=None
)


def neutral_file(path: str) -> bool:
    """Whether ``path`` is code of torch, the standard library or tread_fx itself."""
    return os.path.abspath(path).startswith(_NEUTRAL) or own_file(path)


def own_file(path: str) -> bool:
    """Whether ``path`` is tread_fx's own code (its package, less the reference models)."""
    path = os.path.abspath(path)
    return path.startswith(_OWN) and not path.startswith(_MODELS)


def written_by_user(path: str) -> bool:
    """Whether ``path`` is a source file of code someone runs from where they keep it (a model's
    repository, a script, a test), not an installed package, the standard library or tread_fx.

    Example:
        >>> written_by_user(os.__file__), written_by_user("<string>")
        (False, False)
    """
    path = os.path.abspath(path)
    return os.path.isfile(path) and not own_file(path) and not path.startswith(_INSTALLED)


def raised_by_tread_fx(err: BaseException) -> bool:
    """Whether ``err`` was raised by tread_fx's own code (not the model's, not on purpose)."""
    if isinstance(err, TreadFxError) or getattr(err, "tread_model_error", False):
        return False
    frame = next(_frames(err), None)
    return frame is not None and own_file(frame.filename)


def _frames(err: BaseException) -> Iterator[traceback.FrameSummary]:
    """The frames of ``err``'s traceback outside torch and the standard library, innermost first."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if not os.path.abspath(frame.filename).startswith(_NEUTRAL):
            yield frame


def source_line(obj: Any) -> str:
    """``file:line`` of ``obj``'s ``forward`` (a module) or of ``obj`` itself ('' if unknown)."""
    target = type(obj).forward if isinstance(obj, nn.Module) else obj
    try:
        target = inspect.unwrap(target)
        return f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        return ""


def model_frame(err: BaseException) -> str:
    """The innermost frame of the model's code (outside torch, stdlib, tread_fx), if any."""
    frame = next((f for f in _frames(err) if not own_file(f.filename)), None)
    return f"{frame.filename}:{frame.lineno}" if frame else ""


@contextlib.contextmanager
def stage(name: str, focus: Callable[[], dict[str, Any]]) -> Iterator[None]:
    """Run one stage of the pipeline; an internal failure becomes ``TreadFxInternalError``.

    Args:
        name: The stage, as a verb phrase (``"tracing"``, ``"locating"``, ``"planning"``,
            ``"rewriting"``).
        focus: Called on failure: ``{"block": path, "module": nn.Module, "model": model,
            "route": (start, end)}`` (any may be missing), what the stage was working on.

    Raises:
        TreadFxInternalError: tread_fx's own code raised (the original as ``__cause__``).
    """
    started = time.perf_counter()
    try:
        yield
    except Exception as err:
        if not raised_by_tread_fx(err):
            raise
        raise _internal(name, focus(), err) from err
    finally:
        seconds = _CLOCK.get()
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started


@contextlib.contextmanager
def stage_clock() -> Iterator[dict[str, float]]:
    """Add up the wall seconds of every :func:`stage` run inside, by stage name.

    Yields:
        ``{stage name: seconds}``, filled as the stages finish (a stage that runs twice, once
        per route, is summed).
    """
    seconds: dict[str, float] = {}
    token = _CLOCK.set(seconds)
    try:
        yield seconds
    finally:
        _CLOCK.reset(token)


def _internal(name: str, focus: dict[str, Any], err: BaseException) -> TreadFxInternalError:
    block = focus.get("block")
    where = model_frame(err) or source_line(focus.get("module") or focus.get("model"))
    model = focus.get("model")
    detail = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    return TreadFxInternalError(
        f"internal error in tread_fx while {name}"
        + (f" route {focus['route']}" if focus.get("route") else "")
        + (f" at block {block}" if block else "")
        + f": {type(err).__name__}\n"
        + (f"  {detail}\n" if detail else "")
        + (f"  model code being processed: {where}\n" if where else "")
        + f"This is a bug in tread_fx, not in {type(model).__name__ if model else 'your model'}: "
        "please report it with this message, the traceback and the model's code (or a small "
        "model that shows it).",
        stage=name,
        block=block,
        where=where,
    )
