"""Training checkpoints as safetensors (tensors) plus JSON (everything else).

A checkpoint is a directory::

    step_0001000/
        model.safetensors      the plain model.state_dict() (unrouted; loadable on its own)
        ema.safetensors        the EMA model's state_dict()
        state.safetensors      optimizer tensors ("optim/<param id>/<name>") and RNG states
                               ("rng/<kind>/<rank>")
        meta.json              step, args, optimizer param groups and scalars, world size, ...

Nothing is unpickled when loading. Directories are written under a temporary name and renamed,
and ``latest`` (a text file beside them) names the newest, so an interrupted save never leaves a
half-written checkpoint behind. Every problem raises :class:`tread_fx.errors.CheckpointError`
naming the offending file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tread_fx.errors import CheckpointError

__all__ = [
    "FORMAT_VERSION",
    "find_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "read_meta",
    "read_tensors",
    "save_checkpoint",
]

FORMAT_VERSION = 1


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def _split_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Splits ``optimizer.state_dict()`` into tensors and JSON-able rest."""
    tensors, scalars = {}, {}
    for pid, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{pid}/{name}"] = value
            else:
                scalars.setdefault(str(pid), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _join_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, pid, name = key.split("/", 2)
            state.setdefault(int(pid), {})[name] = value
    for pid, entries in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(entries)
    groups = [  # JSON turned tuples (AdamW's betas) into lists
        {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}
        for group in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def save_checkpoint(
    directory: str | Path,
    step: int,
    model: nn.Module,
    ema: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    rng: dict[str, torch.Tensor],
    meta: dict[str, Any],
    keep: int = 0,
) -> Path:
    """Writes ``<directory>/step_<step>/`` atomically and points ``latest`` at it.

    Args:
        directory: The checkpoints directory (created if needed).
        step: Number of optimizer steps taken.
        model: The unwrapped model; its plain ``state_dict()`` is saved.
        ema: The EMA model, or ``None``.
        optimizer: The optimizer.
        rng: Random states as uint8 tensors, keyed ``"<kind>/<rank>"``.
        meta: JSON-serialisable extras (args, timings, ...).
        keep: Keep only this many newest checkpoints (0 keeps all).

    Returns:
        The checkpoint directory.
    """
    from safetensors.torch import save_file

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_cpu(model.state_dict()), str(tmp / "model.safetensors"))
    if ema is not None:
        save_file(_cpu(ema.state_dict()), str(tmp / "ema.safetensors"))
    optim_tensors, optim_meta = _split_optimizer(optimizer.state_dict())
    state = {**optim_tensors, **{f"rng/{k}": v for k, v in rng.items()}}
    save_file(_cpu(state), str(tmp / "state.safetensors"))
    record = {"format": FORMAT_VERSION, "step": step, "optimizer": optim_meta, **meta}
    (tmp / "meta.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    (root / "latest.tmp").write_text(final.name)
    (root / "latest.tmp").replace(root / "latest")
    prune_checkpoints(root, keep, final)
    return final


def _step_of(path: Path) -> int:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return -1


def prune_checkpoints(root: str | Path, keep: int, current: Path) -> list[Path]:
    """Deletes all but the ``keep`` highest-numbered ``step_*`` folders, never ``current``.

    By step number, not by name (``step_60`` and ``step_0000500`` sort the wrong way as
    strings), and the checkpoint just written (the one ``latest`` names) is always kept.

    Args:
        root: The checkpoints directory.
        keep: How many to keep (0 keeps all); ``current`` counts as one of them.
        current: The checkpoint just written.

    Returns:
        The deleted folders.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> for step in (500, 600, 60):
        ...     (root / f"step_{step:07d}").mkdir()
        >>> [p.name for p in prune_checkpoints(root, 2, root / "step_0000060")]
        ['step_0000500']
    """
    if keep <= 0:
        return []
    current = Path(current)
    others = [p for p in Path(root).glob("step_*") if p.is_dir() and p.name != current.name]
    others.sort(key=_step_of, reverse=True)
    removed = others[keep - 1 :]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    return removed


def find_checkpoint(path: str | Path) -> Path:
    """Resolves ``path`` to a checkpoint directory.

    Accepts a checkpoint directory, a checkpoints directory holding ``latest``, or a run's output
    directory holding ``checkpoints/latest``.
    """
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        pointer = root / "latest"
        if pointer.is_file():
            target = root / pointer.read_text().strip()
            if not (target / "meta.json").is_file():
                raise CheckpointError(f"{pointer}: points to {target}, which has no meta.json")
            return target
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint not found")
    raise CheckpointError(f"{path}: not a checkpoint (no meta.json, no latest pointer)")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Loads a safetensors file, turning any failure into a CheckpointError naming it."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint")
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: corrupt or unreadable ({err})") from None


def _load_module(module: nn.Module, path: Path) -> None:
    tensors = read_tensors(path)
    try:
        module.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:3])
        raise CheckpointError(f"{path}: does not match the model ({detail})") from None


def read_meta(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """Resolves ``path`` (see :func:`find_checkpoint`) and reads its ``meta.json``.

    Returns:
        ``(checkpoint directory, meta record)``.

    Raises:
        CheckpointError: Missing, corrupt or of another format, naming the file.
    """
    directory = find_checkpoint(path)
    meta_path = directory / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        version = meta.get("format")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{meta_path}: corrupt or unreadable ({err})") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: format {version!r}, this script reads {FORMAT_VERSION}"
        )
    try:
        meta["step"] = int(meta["step"])
        meta["optimizer"]["param_groups"]  # noqa: B018 - must be present
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{meta_path}: incomplete ({err!r})") from None
    meta["path"] = str(directory)
    return directory, meta


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    ema: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Loads a checkpoint into ``model``, ``ema`` and ``optimizer`` in place.

    Args:
        path: Anything :func:`find_checkpoint` accepts.
        model: The unwrapped model.
        ema: The EMA model (``None`` to skip).
        optimizer: The optimizer (``None`` to skip).

    Returns:
        ``(meta, rng)``: the ``meta.json`` record and the RNG states keyed ``"<kind>/<rank>"``.

    Raises:
        CheckpointError: Missing, corrupt or mismatched files, naming the file.
    """
    directory, meta = read_meta(path)
    optim_meta = meta["optimizer"]
    _load_module(model, directory / "model.safetensors")
    if ema is not None:
        _load_module(ema, directory / "ema.safetensors")
    state_path = directory / "state.safetensors"
    state = read_tensors(state_path)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(_join_optimizer(state, optim_meta))
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{state_path}: optimizer state does not fit ({err})") from None
    rng = {k[len("rng/") :]: v for k, v in state.items() if k.startswith("rng/")}
    return meta, rng
