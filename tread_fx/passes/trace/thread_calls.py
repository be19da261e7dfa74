"""What the tracing thread calls in C, seen by a profile function of that thread only.

``sys.setprofile`` is per thread: the tracing thread's profile function sees each call of a C
function (a ``c_call`` event, with the function object) before it runs, and no other thread's
calls. It serves two needs without replacing any name:

- **Python random numbers** drawn by traced (not eager) code: every draw of :mod:`random`'s
  functions (``random.random()``, ``random.uniform()``, ``random.choice()`` ...) reaches a C
  method (``random()``, ``getrandbits()``) of the generator they share; the call is refused
  with :class:`~.support.DataDependentError` before it runs, as a drawn number would be baked
  into the graph. numpy's draws (``np.random.choice``) are compiled methods no profile
  function sees: :class:`NumpyDraws` finds them by the global generator's state instead.
- **Sizes as varargs** (``torch.ones(b, n)``, ``t.expand(b, -1)``, ``b`` a traced size):
  torch's argument parser rejects a first vararg that has ``__torch_function__``. While such a
  call is being parsed, the tracer's int-valued proxies present none
  (:data:`ValueTracer.sizes_call <.value_tracer.ValueTracer>` is set); the parser reads the
  size by ``__index__`` and the tracing thread's ``TorchFunctionMode``
  (:func:`~.support.factories_take_proxies`) records the call with the traced sizes.

- **Type checks**: the frames calling ``isinstance`` (``tracer.type_checks``), so that a
  traced value's ``__class__`` is its tensor's class for ``isinstance`` called by the model's
  code (:class:`~.value_proxy.ValueProxy`), never for C code checking for a tensor.

A profile function already set in the thread (a Python one) is called too, and set again
afterwards.

Example:
    >>> import random
    >>> class Tracer:
    ...     running_eager, module_stack, sizes_call, type_checks = 0, [], None, []
    >>> with watch_thread_calls(Tracer()):
    ...     try:
    ...         random.uniform(0, 1)
    ...     except DataDependentError as err:
    ...         print(err.what)
    Python-level randomness (random.uniform)
"""

from __future__ import annotations

import contextlib
import random
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy
import torch

from tread_fx.passes.trace.support import DataDependentError

__all__ = ["SIZES_AS_VARARGS", "watch_thread_calls", "NumpyDraws"]

#: functions and ``Tensor`` methods whose sizes may be passed as varargs (``torch.ones(b, n)``)
SIZES_AS_VARARGS = (
    (torch.ones, torch.zeros, torch.empty, torch.rand, torch.randn),
    frozenset(("expand", "view", "reshape", "repeat", "tile", "new_zeros", "new_ones", "permute")),
)
_FUNCTION_IDS = frozenset(map(id, SIZES_AS_VARARGS[0]))  # by id: a bound method may not hash
# the generator of :mod:`random`'s functions, and its C methods every draw of them calls (an
# instance a library makes for itself, seeded on import, is not the model's randomness)
_SHARED = random.random.__self__
_DRAWS = frozenset(("random", "getrandbits"))


def _random_draw(frame: types.FrameType | None) -> DataDependentError:
    """The refusal of a draw whose C call ``frame`` makes: named by the outermost function
    of :mod:`random` it runs in, located at that function's caller."""
    name, caller = "random", frame
    while caller is not None and caller.f_globals is vars(random):
        name, caller = caller.f_code.co_name, caller.f_back
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller else "<unknown location>"
    return DataDependentError(f"Python-level randomness (random.{name})", None, where)


def _profile(tracer: Any, previous: Callable | None) -> Callable:
    """The profile function: cheap for the many events that concern none of the needs."""
    checks, names, tensor = tracer.type_checks, SIZES_AS_VARARGS[1], torch.Tensor

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if previous is not None:
            previous(frame, event, arg)
        if event == "c_call":
            if arg is isinstance:
                checks.append(frame)
                return
            owner = getattr(arg, "__self__", None)
            if owner is _SHARED:
                if arg.__name__ in _DRAWS and not tracer.running_eager:
                    checks.clear()  # raising here ends this profile function
                    err = _random_draw(frame)
                    err.module_path = tracer.module_stack[-1] if tracer.module_stack else None
                    raise err
            elif id(arg) in _FUNCTION_IDS or (isinstance(owner, tensor) and arg.__name__ in names):
                tracer.sizes_call = arg  # a tensor's method is a bound method here, always
        elif event == "c_return" or event == "c_exception":
            if arg is isinstance:
                if checks:
                    checks.pop()
            elif arg is tracer.sizes_call:
                tracer.sizes_call = None

    return profile


@contextlib.contextmanager
def watch_thread_calls(tracer: Any) -> Iterator[None]:
    """Refuse Python random draws of traced code and mark calls taking sizes as varargs
    (see module docstring), in the calling thread only, while the context is open."""
    previous = sys.getprofile()
    sys.setprofile(_profile(tracer, previous if callable(previous) else None))
    try:
        yield
    finally:
        tracer.sizes_call = None
        tracer.type_checks.clear()
        _restore_profile(previous)


def _restore_profile(previous: Any) -> None:
    """Set the thread's profiler back. A C profiler (``cProfile.Profile``: ``sys.getprofile``
    gives its object, which is not callable) is paused during the trace and enabled again with
    its own ``enable()``, keeping its flags and counts; ``sys.setprofile`` of that object would
    make every later call raise ``TypeError: 'Profile' object is not callable``."""
    if previous is None or callable(previous):
        sys.setprofile(previous)
    else:
        sys.setprofile(None)
        previous.enable()


class NumpyDraws:
    """Draws from numpy's global generator (``np.random.choice`` ...) by traced code, found by
    the generator's state: :meth:`check` between the runs of eager code (a leaf module, an
    op computed for real), whose own draws happen at every call and are fine, refuses a change
    since :meth:`mark`. A drawn number would be baked into the graph (efficientvit's training
    step drew its timesteps so: every routed step would reuse the traced ones).

    Example:
        >>> draws = NumpyDraws()
        >>> _ = numpy.random.rand()
        >>> draws.changed()
        True
    """

    def __init__(self) -> None:
        self.mark()

    def mark(self) -> None:
        """Remember where the generator is now."""
        _, self._key, self._pos, *_ = numpy.random.get_state()

    def changed(self) -> bool:
        """Whether the generator moved since :meth:`mark`."""
        _, key, pos, *_ = numpy.random.get_state()
        return pos != self._pos or not numpy.array_equal(key, self._key)

    def check(self, tracer: Any) -> None:
        """Refuse a draw since :meth:`mark`, in the module ``tracer`` is in."""
        if self.changed():
            raise DataDependentError.at(
                "numpy randomness (np.random's global generator, drawn before this line)", tracer
            )
