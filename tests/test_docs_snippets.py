"""Every ```python block in README.md and docs/*.md runs as pasted; links stay inside the repo
and their #anchors name headings that exist; every command in the README and the user guides
works after command 1 as written.

A block runs in a fresh interpreter (``python -c``-style, from the repository root), so blocks
that register adapters or start process groups cannot leak into other tests. A block whose first
line is ``# docs-test: torchrun ARGS`` runs as ``python -m torch.distributed.run ARGS block.py``,
the command the text around it shows. A ``print(...)`` line ending in ``# prints: TEXT`` shows
its output: the block must print TEXT (those lines appear in its output, in that order).
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the user guides whose commands are written for a fresh clone (.venv/bin/...); the others
# (performance.md, design.md) show commands for an activated environment
GUIDE_NAMES = ("training", "options", "errors", "models", "inspect")
GUIDES = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in GUIDE_NAMES)]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
TORCHRUN = re.compile(r"^# docs-test: torchrun (.*)$", re.M)
PRINTS = re.compile(r"^\s*print\(.*\)\s+# prints: (.*?)\s*$", re.M)


def _blocks() -> list:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(pytest.param(match.group(1), id=f"{doc.relative_to(ROOT)}:{line}"))
    return found


@pytest.mark.parametrize("code", _blocks())
def test_python_block_runs_as_pasted(code: str, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    command = [sys.executable, str(script)]
    torchrun = TORCHRUN.match(code)
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", *shlex.split(torchrun[1])]
        command.append(str(script))
    # from a folder of its own (whatever a block writes lands there), importing this checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    output = iter(line.rstrip() for line in done.stdout.splitlines())
    shown = PRINTS.findall(code)
    assert all(line in output for line in shown), (
        f"the block shows {shown}, printed:\n{done.stdout}"
    )


def test_the_readme_example_shows_that_it_routed() -> None:
    """The README's first block (run above) prints what the route kept, from a real loss."""
    text = (ROOT / "README.md").read_text().split("## What it does")[1]
    code = BLOCK.search(text).group(1)
    assert code in [p.values[0] for p in _blocks()]
    assert "route_info(model)" in code and PRINTS.search(code)
    assert "- noise" in code and ".square().mean()" in code  # a loss against a target, not 0


def test_the_docs_have_python_blocks_and_a_torchrun_one() -> None:
    blocks = [p.values[0] for p in _blocks()]
    assert len(blocks) >= 4
    assert any(TORCHRUN.match(code) for code in blocks)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_inside_the_repository(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links {target}, outside the repository"
        assert path.exists(), f"{doc.name} links {target}, which does not exist"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)  # not code comments
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_link_anchors_name_headings_that_exist(doc: Path) -> None:
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path = (doc.parent / target).resolve() if target else doc
        if path.suffix == ".md" and path.is_file():
            assert anchor in _anchors(path), f"{doc.name} links {target}#{anchor}: no such heading"


def test_the_readme_stays_short_with_both_commands_on_its_first_screen() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 12_000, f"README.md has {len(text)} characters"
    first_screen = "\n".join(text.splitlines()[:12])
    assert "bash scripts/setup.sh && .venv/bin/python examples/train.py" in first_screen
    assert "bash scripts/setup.sh --system && .venv/bin/python -m pytest -n 2 -q" in first_screen


def _readme_commands() -> list[str]:
    text = "\n".join(doc.read_text() for doc in GUIDES)
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```$", text, re.S | re.M):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.extend(part.strip() for part in line.split("&&"))
    inline = re.findall(r"`(\.venv/bin/[^`\n]+ [^`\n]+)`", text)  # a command, not a bare path
    commands += inline
    return commands


def test_every_readme_command_works_after_command_1_as_written() -> None:
    """After ``bash scripts/setup.sh`` the venv has python and tread-fx, not a PATH entry."""
    commands = _readme_commands()
    assert len(commands) >= 10
    text = "\n".join(doc.read_text() for doc in GUIDES)
    saved = set(re.findall(r"Save as `([^`]+\.py)`", text))
    for command in commands:
        words = shlex.split(command)
        assert command.startswith(("bash scripts/setup.sh", "bash benchmarks/", ".venv/bin/")), (
            f"README command {command!r} needs an activated venv; call .venv/bin/... instead"
        )
        assert words[0] in ("bash", ".venv/bin/python", ".venv/bin/tread-fx"), command
        if words[0] == "bash":
            assert (ROOT / words[1]).is_file(), command
        elif words[0] == ".venv/bin/python" and words[1] == "-m":
            module = words[2]
            found = module in ("pytest", "torch.distributed.run", "accelerate.commands.launch")
            assert found or (ROOT / (module.replace(".", "/") + ".py")).is_file(), command
            scripts = [w for w in words[3:] if w.endswith(".py") and w not in saved]
            assert all((ROOT / w).is_file() for w in scripts), command
        elif words[0] == ".venv/bin/python":
            assert (ROOT / words[1]).is_file(), command
        else:
            module, factory = words[2].split(":")
            assert hasattr(importlib.import_module(module), factory), command


@pytest.mark.parametrize("kind", ["explain-text", "diff-dot"])
def test_the_readme_inspect_commands_run(kind: str, tmp_path: Path) -> None:
    commands = [c for c in _readme_commands() if c.startswith(".venv/bin/tread-fx")]
    if kind == "explain-text":
        commands = [c for c in commands if " explain " in c and "--format" not in c]
    else:
        commands = [c for c in commands if " diff " in c and "--format dot" in c]
    words = shlex.split(commands[0])
    cli = [sys.executable, "-m", "tread_fx.cli", *words[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
