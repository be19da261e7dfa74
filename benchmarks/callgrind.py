"""Counting the instructions of a stretch of Python code with valgrind's callgrind.

A process started by :func:`command` runs under ``valgrind --tool=callgrind
--instr-atstart=no``: nothing is counted (and the start-up, the import of torch, the tracing
and the warm-up steps run faster) until the process itself asks for it. It asks through
callgrind's client requests, which are machine-code sequences that only valgrind reacts to
(no-ops natively): :class:`Marker` compiles them into a tiny shared library (``cc`` and
``valgrind/callgrind.h``) and calls them with :mod:`ctypes`. ``Marker.dump(name)`` writes
the counts since the last zero or dump into one file named after the process and the dump's
sequence number, then zeroes them: :func:`read_dumps` reads every file's name and
instruction total (``Ir``).

Example:
    >>> from benchmarks.callgrind import parse_dump
    >>> parse_dump("desc: Trigger: Client Request: route()#0\\nevents: Ir\\nsummary: 42\\n")
    ('route()#0', 42)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["MARKER_SOURCE", "unavailable", "build_marker", "Marker", "command", "parse_dump"]
__all__ += ["read_dumps"]

MARKER_SOURCE = """\
#include <valgrind/callgrind.h>
void tread_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void tread_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void tread_zero(void) { CALLGRIND_ZERO_STATS; }
void tread_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""
_TRIGGER = "desc: Trigger: Client Request: "
_HEADERS = ("/usr/include/valgrind/callgrind.h", "/usr/local/include/valgrind/callgrind.h")


def unavailable() -> str | None:
    """Why instructions cannot be counted here (``None`` when they can).

    Example:
        >>> reason = unavailable()
        >>> reason is None or "valgrind" in reason or "cc" in reason
        True
    """
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (apt-get install valgrind)"
    if shutil.which("cc") is None:
        return "no C compiler 'cc' to build the callgrind marker library"
    if not any(Path(h).exists() for h in _HEADERS):
        return "valgrind/callgrind.h is missing (install valgrind's development headers)"
    return None


def build_marker(folder: str | Path | None = None) -> Path:
    """Compile :data:`MARKER_SOURCE` into ``<folder>/tread_callgrind_<hash>.so`` (once).

    Raises:
        RuntimeError: When :func:`unavailable` gives a reason, or the compiler fails.
    """
    reason = unavailable()
    if reason:
        raise RuntimeError(f"counting instructions needs valgrind's callgrind: {reason}")
    folder = Path(folder or tempfile.gettempdir())
    digest = hashlib.sha1(MARKER_SOURCE.encode()).hexdigest()[:10]
    library = folder / f"tread_callgrind_{digest}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"tread_callgrind_{digest}.c"
    source.write_text(MARKER_SOURCE)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    run = subprocess.run(
        ["cc", "-shared", "-fPIC", "-O1", "-o", str(partial), str(source)],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise RuntimeError(f"compiling the callgrind marker failed:\n{run.stderr}")
    partial.replace(library)
    return library


class Marker:
    """The client requests of one process (no-ops when the process runs without valgrind).

    Args:
        library: The library :func:`build_marker` wrote.
    """

    def __init__(self, library: str | Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        self._lib.tread_dump.argtypes = [ctypes.c_char_p]

    def start(self) -> None:
        """Start counting (``CALLGRIND_START_INSTRUMENTATION``)."""
        self._lib.tread_start()

    def stop(self) -> None:
        """Stop counting (``CALLGRIND_STOP_INSTRUMENTATION``)."""
        self._lib.tread_stop()

    def zero(self) -> None:
        """Forget what was counted so far (``CALLGRIND_ZERO_STATS``)."""
        self._lib.tread_zero()

    def dump(self, name: str) -> None:
        """Write the counts since the last zero or dump, named ``name``, and zero them."""
        self._lib.tread_dump(name.encode())


def command(out_dir: str | Path, argv: list[str]) -> list[str]:
    """The valgrind command line that runs ``argv`` with its dumps in ``out_dir``."""
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={Path(out_dir) / 'callgrind.out.%p'}",
        "--quiet",
        *argv,
    ]


def parse_dump(text: str) -> tuple[str | None, int]:
    """The name of one dump (its client-request trigger) and its instruction total (``Ir``,
    the file's closing ``totals:`` line where it has one)."""
    name, total = None, 0
    for line in text.splitlines():
        if line.startswith(_TRIGGER):
            name = line.removeprefix(_TRIGGER).strip()
        elif line.startswith(("summary:", "totals:")):
            total = int(line.split(":", 1)[1].split()[0])
    return name, total


def read_dumps(out_dir: str | Path) -> dict[str, tuple[int, Path]]:
    """Every named dump in ``out_dir``: ``name -> (instructions, file)``."""
    dumps: dict[str, tuple[int, Path]] = {}
    for path in sorted(Path(out_dir).glob("callgrind.out.*")):
        name, total = parse_dump(path.read_text())
        if name is not None:
            dumps[name] = (total, path)
    return dumps
