"""The output folder of a training run: refuse to mix a new run into an old one.

``train_args.add_shared_args`` defines ``--resume [PATH]`` (no PATH: the ``--out`` folder)
and ``--overwrite``. A folder holding a previous run (its ``args.json``, ``metrics.jsonl`` or
``checkpoints/``) is refused unless ``--resume`` continues that run or ``--overwrite`` replaces
it, as most trainers do. ``--overwrite`` deletes only what the scripts write
(:data:`RUN_FILES`); other files in the folder stay.

Example:
    >>> import argparse, tempfile
    >>> out = tempfile.mkdtemp()
    >>> args = argparse.Namespace(out=out, resume=None, overwrite=False)
    >>> claim_run_dir(args)          # an empty folder is fine
    >>> _ = (Path(out) / "args.json").write_text("{}")
    >>> try:
    ...     claim_run_dir(args)
    ... except UsageError as err:
    ...     print(str(err).split(";")[0])  # doctest: +ELLIPSIS
    --out ... holds a previous run (args.json)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_args import UsageError  # noqa: E402

__all__ = ["RUN_FILES", "MARKERS", "claim_run_dir", "clear_run"]

MARKERS = ("args.json", "metrics.jsonl", "checkpoints")
RUN_FILES = (
    *MARKERS,
    "metrics.csv",
    "samples.png",
    "samples_*.png",
    "transformer",
    "fid_curve.jsonl",
)


def _previous_run(out: Path) -> list[str]:
    return [name for name in MARKERS if (out / name).exists()]


def claim_run_dir(args: argparse.Namespace) -> None:
    """Checks that ``--out`` may be written; resolves a bare ``--resume`` to ``--out``.

    Call it on every process before any process writes (before the process group starts).

    Args:
        args: Parsed arguments with ``out``, ``resume`` and ``overwrite``.

    Raises:
        UsageError: ``--out`` holds a previous run and neither ``--resume`` nor ``--overwrite``
            was given, or both were given.
    """
    if args.resume is True:
        args.resume = str(args.out)
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other: continue or replace")
    found = _previous_run(Path(args.out))
    if found and not args.resume and not args.overwrite:
        raise UsageError(
            f"--out {args.out} holds a previous run ({', '.join(found)}); add --resume to "
            "continue it, --overwrite to replace it, or pick another --out"
        )


def clear_run(out: str | Path) -> list[Path]:
    """Deletes the files of a previous run in ``out`` (:data:`RUN_FILES`); returns them.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp())
        >>> _ = (out / "metrics.jsonl").write_text(""); _ = (out / "notes.txt").write_text("")
        >>> [p.name for p in clear_run(out)], sorted(p.name for p in out.iterdir())
        (['metrics.jsonl'], ['notes.txt'])
    """
    out, removed = Path(out), []
    for pattern in RUN_FILES:
        for path in sorted(out.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed
