"""The research-repository cases of the coverage sweep's community population.

Model files of the repositories where diffusion research is done, brought in at run time from
a snapshot: ``--snapshots DIR`` holds one folder per repository (named as in
:data:`SNAPSHOT_FILES`) with the listed files at their paths and a ``COMMIT`` file. They are
never committed here; docs/support.md shows the commands that make the folder. Each model
file is imported by path, as the repository's own scripts import it.

Example:
    >>> from benchmarks.coverage_community_repos import SNAPSHOT_FILES
    >>> SNAPSHOT_FILES["dit"]
    ('facebookresearch/DiT', ['models.py'])
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.coverage_checks import Case
from benchmarks.coverage_community_cases import _case, _dit_inputs, _gen

__all__ = ["REPO_CASES", "SNAPSHOT_FILES", "import_snapshot", "make_snapshot"]

# snapshot folder -> (repository, the files taken from it)
SNAPSHOT_FILES = {
    "dit": ("facebookresearch/DiT", ["models.py"]),
    "sit": ("willisma/SiT", ["models.py"]),
    "uvit": (
        "baofff/U-ViT",
        ["libs/__init__.py", "libs/uvit.py", "libs/uvit_t2i.py", "libs/timm.py"],
    ),
    "mdt": ("sail-sg/MDT", ["masked_diffusion/models.py"]),
    "lightningdit": (
        "hustvl/LightningDiT",
        [f"models/{f}.py" for f in ("lightningdit", "pos_embed", "rmsnorm", "swiglu_ffn")],
    ),
    "repa": ("sihyun-yu/REPA", ["models/sit.py", "models/mmdit.py"]),
    "tread": ("CompVis/tread", ["dit.py", "routing_module.py"]),
}


def make_snapshot(name: str, git_dir: Path, snapshots: Path) -> Path:
    """Copy the model files of repository ``name`` from a clone (or bare mirror) at its HEAD
    into ``snapshots/name`` and record the commit in ``snapshots/name/COMMIT``.

    Command line: ``python -m benchmarks.coverage_community_repos NAME GIT_DIR SNAPSHOTS``.
    """
    folder = Path(snapshots) / name
    folder.mkdir(parents=True, exist_ok=True)
    git = ["git", f"--git-dir={Path(git_dir)}"] if Path(git_dir, "HEAD").exists() else [
        "git", "-C", str(git_dir)]  # fmt: skip
    archive = subprocess.run([*git, "archive", "HEAD", *SNAPSHOT_FILES[name][1]], check=True,
                             capture_output=True)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True)
    (folder / "COMMIT").write_text(commit.stdout.decode().strip() + "\n")
    return folder


def import_snapshot(root: Path, *modules: str, bare: tuple[str, ...] = ()) -> list[Any]:
    """Import ``modules`` (dotted) from a snapshot folder, as its repository's scripts do.

    While importing, the folder is first on ``sys.path`` and no other entry that holds the
    same top-level name is on it (several repositories call theirs ``models``, as this
    project does); a module already imported under that name is dropped first. Packages in
    ``bare`` are registered without running their ``__init__`` (which imports a pipeline,
    a dataset or a simulator the model file does not need).
    """
    tops = {m.split(".")[0] for m in (*modules, *bare)}
    for name in [m for m in sys.modules if m.split(".")[0] in tops]:
        del sys.modules[name]
    for package in bare:
        module = types.ModuleType(package)
        module.__path__ = [str(Path(root, *package.split(".")))]
        sys.modules[package] = module
        parent, _, leaf = package.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, module)

    def holds(entry: str) -> bool:
        where = Path(entry or ".")
        return any((where / t).exists() or (where / f"{t}.py").exists() for t in tops)

    saved = sys.path[:]
    sys.path[:] = [str(root), *(p for p in saved if not holds(p))]
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        sys.path[:] = saved


# -- research repositories (snapshots) ----------------------------------------------------

_DIT = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, num_heads=2, num_classes=10)


def _repo_dit(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "models")
    yield _case("DiT", "DiT", lambda: mod.DiT(depth=4, **_DIT), _dit_inputs())


def _repo_sit(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "models")
    yield _case("SiT", "SiT", lambda: mod.SiT(depth=4, **_DIT), _dit_inputs())


def _repo_uvit(root: Path) -> Iterator[Case]:
    uvit, t2i = import_snapshot(root, "libs.uvit", "libs.uvit_t2i")
    kw = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=64, depth=5, num_heads=2)

    def t2i_inputs() -> tuple[tuple, dict]:
        g = _gen()
        x, t = torch.randn(2, 3, 16, 16, generator=g), torch.tensor([10.0, 500.0])
        return (x, t, torch.randn(2, 8, 32, generator=g)), {}

    yield _case(
        "U-ViT",
        "UViT (class-conditional)",
        lambda: uvit.UViT(num_classes=10, **kw),
        _dit_inputs(3, 16),
        note="in_blocks, mid_block, out_blocks with cat([x, skip]) long skips; time "
        "and label tokens in front",
    )
    yield _case(
        "U-ViT",
        "UViT (text-to-image)",
        lambda: t2i.UViT(clip_dim=32, num_clip_token=8, **kw),
        t2i_inputs,
        note="time and 8 text tokens in front of 16 image tokens",
    )


def _repo_mdt(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "masked_diffusion.models")
    yield _case(
        "MDT",
        "MDTv2",
        lambda: mod.MDTv2(depth=6, decode_layer=2, **_DIT),
        _dit_inputs(),
        note="encoder blocks, side interpolater, decoder blocks with long skips; "
        "masking off (inference form)",
    )


def _repo_lightningdit(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "models.lightningdit")
    paper = dict(use_qknorm=True, use_swiglu=True, use_rope=True, use_rmsnorm=True)
    yield _case(
        "LightningDiT",
        "LightningDiT",
        lambda: mod.LightningDiT(depth=4, **paper, **_DIT),
        _dit_inputs(),
        note="the paper's config: RoPE module passed to every block, SwiGLU, RMSNorm, QK norm",
    )


def _repo_repa(root: Path) -> Iterator[Case]:
    sit, mmdit = import_snapshot(root, "models.sit", "models.mmdit")

    def mmdit_inputs() -> tuple[tuple, dict]:
        g = _gen()
        x = torch.randn(2, 4, 8, 8, generator=g)
        return (x, torch.tensor([0.1, 0.5])), {"context": torch.randn(2, 8, 768, generator=g)}

    yield _case(
        "REPA",
        "SiT",
        lambda: sit.SiT(
            depth=4,
            encoder_depth=2,
            z_dims=[32],
            projector_dim=64,
            qk_norm=False,
            decoder_hidden_size=64,
            **_DIT,
        ),
        _dit_inputs(),
        note="projector taps block 2's tokens (the REPA loss)",
    )
    yield _case(
        "REPA",
        "MMDiT",
        lambda: mmdit.MMDiT(
            input_size=32,
            patch_size=2,
            in_channels=4,
            depth=4,
            encoder_depth=2,
            z_dims=[32],
            projector_dim=64,
        ),
        mmdit_inputs,
        note="width is 32 x depth (128 at depth 4); 8x8 latent (16 tokens) under a 16x16 "
        "position table cropped to it; 8 context tokens",
    )


def _repo_tread(root: Path) -> Iterator[Case]:
    (mod,) = import_snapshot(root, "dit")
    yield _case(
        "TREAD",
        "DiT (its own routing off)",
        lambda: mod.DiT(depth=4, **_DIT),
        _dit_inputs(),
        note="the TREAD authors' DiT, enable_routing=False",
    )


REPO_CASES = {
    "dit": _repo_dit,
    "sit": _repo_sit,
    "uvit": _repo_uvit,
    "mdt": _repo_mdt,
    "lightningdit": _repo_lightningdit,
    "repa": _repo_repa,
    "tread": _repo_tread,
}


if __name__ == "__main__":
    print(make_snapshot(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
