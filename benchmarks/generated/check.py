"""The per-seed differential check: ``route()`` against the generator's hand-routed twin.

:func:`check` writes the seed's module to a directory, imports it the way user code is
imported (``importlib.util.spec_from_file_location``), builds the model, gives zero-initialised
weights small random values, and records the eval output. Then ``tread_fx.route(model,
routes=ROUTES, rate=RATE, seed=0)`` and one routed training forward; the twin runs on a copy of
the unrouted model with the kept ids ``route_info`` reports, and the two must agree on the
output and on every parameter's gradient of a scalar loss. Then the samples must stay apart:
with the selection fixed, changing the first sample of the noisy input (the first argument,
its samples along the module's ``BATCH_DIM``) may change no other sample's routed output
(:func:`benchmarks.coverage_provenance.samples_mixed`, the unrouted twin copy as the pristine
model). Eval after routing must be bitwise the reference. The outcome is one of:

- ``routed``: the routed model equals the twin (a must-refuse model never gets here);
- ``refused``: a ``TreadFxError`` from ``route()`` or the routed call;
- ``wrong``: a mismatch, a by-construction fact of the twin violated (a company token
  routed, a wrong kept count), a route that mixes samples (said first when the twin differs
  too), eval changed, or a must-refuse model routed without error;
- ``foreign``: any other exception from ``route()``, the routed call or ``route_info``;
- ``generator error``: the generated module failed on its own (a bug of the generator; its
  unrouted training forward mixing the samples along ``BATCH_DIM`` is one).

Example:
    >>> result = check(0)
    >>> result.outcome in OUTCOMES
    True
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import tempfile
import traceback
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

import tread_fx
from benchmarks.coverage_checks import randomize_zero_init
from benchmarks.coverage_provenance import samples_mixed
from benchmarks.generated.grammar import BATCH, draw
from benchmarks.generated.source import module_source, protected_ids

__all__ = ["OUTCOMES", "Result", "check", "check_quietly", "load_module", "perturbed"]

OUTCOMES = ("routed", "refused", "wrong", "foreign", "generator error")
_TOL = dict(rtol=1e-5, atol=1e-5)
_GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


@dataclass
class Result:
    """What one seed's check found.

    Attributes:
        seed: The seed.
        features: The draw's feature labels.
        routable: Whether the generator marked the model routable.
        outcome: One of :data:`OUTCOMES`.
        message: The error or mismatch, one line (empty when routed).
        warnings: Warnings raised while routing and running (category: first line).
    """

    seed: int
    features: list[str]
    routable: bool
    outcome: str
    message: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def finding(self) -> bool:
        """Anything but the expected outcome (routed if routable, else refused)."""
        return self.outcome != ("routed" if self.routable else "refused")


class _Wrong(Exception):
    """A mismatch between the routed model and the twin."""


class _GeneratorError(Exception):
    """The generated module failed on its own."""


def _one_line(err: BaseException) -> str:
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {text}"[:500]


def load_module(seed: int, directory: Path) -> types.ModuleType:
    """Write the module of ``seed`` into ``directory`` and import it from its file.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     load_module(0, Path(tmp)).SEED
        0
    """
    path = Path(directory) / f"generated_{seed}.py"
    path.write_text(module_source(draw(seed)))
    name = f"generated_backbone_{seed}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def perturbed(kept: torch.Tensor, protected: list[int], num_tokens: int) -> torch.Tensor:
    """``kept`` with one unprotected id per sample swapped for a routed-around one (a twin
    fed this must disagree: the check's own test that it can fail)."""
    out = kept.clone()
    for row in range(kept.shape[0]):
        ids = set(kept[row].tolist())
        free = [i for i in range(num_tokens) if i not in ids]
        swap = [j for j, i in enumerate(kept[row].tolist()) if i not in protected]
        if free and swap:
            out[row, swap[0]] = free[0]
    return out.sort(dim=1).values


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
    }


def _compare(routed: torch.Tensor, expected: torch.Tensor, model, twin_model) -> None:
    try:
        torch.testing.assert_close(routed, expected, **_TOL)
    except AssertionError as err:
        raise _Wrong(f"output differs from the twin: {_one_line(err)}") from err
    mine, theirs = _grads(model), _grads(twin_model)
    for name, grad in theirs.items():
        try:
            torch.testing.assert_close(mine[name], grad, **_GRAD_TOL)
        except AssertionError as err:
            raise _Wrong(f"gradient of {name} differs from the twin: {_one_line(err)}") from err


def _setup(module: types.ModuleType):
    """Build, randomise, run the reference eval forward and self-test the twin."""
    try:
        model = module.build()
        randomize_zero_init(model)
        args, kwargs = module.inputs()
        with torch.no_grad():
            reference = model.eval()(*args, **kwargs)
        twin_model = copy.deepcopy(model).train()
        if module.ROUTABLE:  # a must-refuse model cannot scatter back: no routed twin
            _self_test(module, twin_model, args, kwargs, reference)
    except Exception as err:
        raise _GeneratorError(_one_line(err)) from err
    return model, args, kwargs, reference, twin_model


def _self_test(module, twin_model, args, kwargs, reference: torch.Tensor) -> None:
    """The twin keeping every token is the unrouted forward (the generator's own check)."""
    d = draw(module.SEED)
    rows, count = (BATCH, d.stream_tokens)  # samples by construction, wherever their dim
    if d.video:  # the routed stream folds frames ([B * F, h * w, D]) or positions
        frames, positions = d.grid[0], d.grid[1] * d.grid[2]
        if d.video.stack == "temporal":  # [B * h * w, F, D]
            frames, positions = positions, frames
        rows, count = BATCH * frames, positions
    every = torch.arange(count).expand(rows, -1)
    with torch.no_grad():
        full = module.twin(twin_model, args, kwargs, every, checks=False)
    torch.testing.assert_close(full, reference, **_TOL)


def _run_twin(module, twin_model, args, kwargs, kept, weight) -> torch.Tensor:
    try:
        expected = module.twin(twin_model, args, kwargs, kept)
    except AssertionError as err:
        raise _Wrong(f"twin: by construction {err}") from err
    except Exception as err:
        raise _GeneratorError(f"twin failed: {_one_line(err)}") from err
    (expected * weight).sum().backward()
    return expected


def _detach_records(model: torch.nn.Module) -> None:
    """Detach the tensors a training forward left on the modules' own attributes (a hook
    recording a block's output): a module holding one cannot be deep-copied, and the
    samples check copies both models."""
    for sub in model.modules():
        for key, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(sub, key, value.detach())


def _samples_apart(module, pristine, model, args, kwargs) -> str:
    """Why the routed training forward mixes samples ('' when it keeps them apart)."""
    _detach_records(pristine)
    _detach_records(model)
    why, note = samples_mixed(pristine, model, (args, kwargs), 0, module.BATCH_DIM)
    if note:  # the generated model's own forward mixes them: BATCH_DIM or the model is wrong
        raise _GeneratorError(f"{note} (BATCH_DIM = {module.BATCH_DIM})")
    return why


def _differential(module, seed: int, perturb_kept: bool, route_options: dict) -> None:
    model, args, kwargs, reference, twin_model = _setup(module)
    tread_fx.route(model, routes=module.ROUTES, rate=module.RATE, seed=0, **route_options)
    routed = model.train()(*args, **kwargs)
    infos = tread_fx.route_info(model)
    if not module.ROUTABLE:
        raise _Wrong(f"must-refuse model routed without error ({module.REASON})")
    kept = infos[0].kept
    if perturb_kept:
        kept = perturbed(kept, protected_ids(draw(seed)), infos[0].num_tokens)
    weight = torch.randn(routed.shape, generator=torch.Generator().manual_seed(seed))
    (routed * weight).sum().backward()
    try:
        expected = _run_twin(module, twin_model, args, kwargs, kept, weight)
        _compare(routed.detach(), expected.detach(), model, twin_model)
        differs = None
    except _Wrong as err:
        differs = err
    mixed = _samples_apart(module, twin_model, model, args, kwargs)
    if mixed:
        raise _Wrong(mixed + (f"; and the {differs}" if differs else ""))
    if differs is not None:
        raise differs
    with torch.no_grad():
        after = model.eval()(*args, **kwargs)
    if not torch.equal(after, reference):
        raise _Wrong("eval output after routing is not bitwise the unrouted model's")


def _outcome(module, seed: int, perturb_kept: bool, route_options: dict) -> tuple[str, str]:
    try:
        _differential(module, seed, perturb_kept, route_options)
    except _Wrong as err:
        return "wrong", str(err)
    except _GeneratorError as err:
        return "generator error", str(err)
    except tread_fx.TreadFxError as err:
        return "refused", _one_line(err)
    except Exception as err:
        where = traceback.extract_tb(err.__traceback__)[-1]
        return "foreign", f"{_one_line(err)} (at {Path(where.filename).name}:{where.lineno})"
    return "routed", ""


def check(
    seed: int,
    *,
    perturb_kept: bool = False,
    keep: Path | None = None,
    route_options: dict | None = None,
) -> Result:
    """Check one seed (see the module docstring); ``keep`` keeps the written source there.

    Args:
        seed: The generator seed.
        perturb_kept: Feed the twin a perturbed kept set (the check must then say ``wrong``).
        keep: Directory for the module's source (default: a temporary one, removed).
        route_options: More keyword arguments for ``route()`` (the tests force a route
            across samples with ``batch_dim=``; the check must then say ``wrong``).

    Example:
        >>> check(1).seed
        1
    """
    d = draw(seed)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(keep) if keep is not None else Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            module = load_module(seed, directory)
        except Exception as err:
            return Result(seed, d.features(), d.routable, "generator error", _one_line(err))
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outcome, message = _outcome(module, seed, perturb_kept, route_options or {})
        finally:
            sys.modules.pop(module.__name__, None)
    seen = [f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}" for w in caught]
    return Result(seed, d.features(), d.routable, outcome, message, list(dict.fromkeys(seen)))


def check_quietly(seed: int, keep: Path | None = None) -> Result:
    """:func:`check` with warnings silenced (for worker processes of ``--jobs``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check(seed, keep=keep)
