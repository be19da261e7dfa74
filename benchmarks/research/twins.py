"""Hand-written routed forwards of DiS and Diffusion-RWKV, compared with ``route()`` (issue 58).

Each twin is our own edit of the repository's ``forward`` (read from the snapshot, never
copied into the project): the same modules called in the same order, with the route's
gather written before its first block and the scatter after its last, the kept ids taken from
``tread_fx.route_info`` of the routed call. ``route()`` runs with its defaults
(``route(model)``: the paper's rule for the depth, ``selection="auto"``).

- **DiS** (in, mid and out blocks of bidirectional Mamba over ``[label, time, patches]``, a
  ``(hidden, residual)`` pair from block to block, long skips): the route covers
  ``in_blocks[1:]``, ``mid_block`` and ``out_blocks[0]``; both values of the pair are gathered
  and scattered, skips made inside the route are scattered where they are used after it.
- **Diffusion-RWKV** (the TREAD paper's RWKV backbone): row selection (its blocks reshape the
  tokens to the patch grid they are handed); the routed blocks see the kept grid ``r x W``,
  and the bidirectional WKV mixes the kept tokens at their original distances, normalised by
  the full count as the inlined blocks are (docs/design.md).

Run: ``python -m benchmarks.research.twins --snapshots DIR`` (after the research sweep made
the snapshots); prints the largest difference per model.

Example:
    >>> from benchmarks.research.twins import TWINS
    >>> sorted(TWINS)
    ['feizc/DiS', 'feizc/Diffusion-RWKV']
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import tread_fx
from benchmarks.coverage_checks import randomize_zero_init
from benchmarks.research.population import builders

__all__ = ["TWINS", "compare", "main"]


def _gather(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return x.gather(1, ids[..., None].expand(-1, -1, x.shape[-1]))


def _scatter(full: torch.Tensor, ids: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    return full.scatter(1, ids[..., None].expand(-1, -1, full.shape[-1]), part)


def dis_twin(model: torch.nn.Module, ids: torch.Tensor, x, timesteps, labels) -> torch.Tensor:
    """DiS's forward (``fused_add_norm=False``, 2 in blocks) with route (1, 4) by hand."""
    code = sys.modules[type(model).__module__]
    h = model.patch_embed(x)
    time_token = model.time_embed(code.timestep_embedding(timesteps, model.embed_dim))[:, None]
    label = model.label_emb(labels, model.training)[:, None]
    h = torch.cat((label, torch.cat((time_token, h), dim=1)), dim=1) + model.pos_embed
    h0, r0 = model.in_blocks[0](h, None)
    h1, r1 = model.in_blocks[1](_gather(h0, ids), _gather(r0, ids))
    hm, rm = model.mid_block(h1, r1)
    ho, ro = model.out_blocks[0](hm, rm, skip=h1)
    h, r = _scatter(h0, ids, ho), _scatter(r0, ids, ro)
    h, r = model.out_blocks[1](h, r, skip=h0)
    hidden = model.norm_f(r + model.drop_path(h))
    out = model.final_layer(hidden, c=time_token + label)[:, model.extras :]
    return code.unpatchify(out, model.out_channels)


def _wkv_at(ids: torch.Tensor, full: int) -> Callable:
    """The bidirectional WKV over the kept tokens at their original positions ``ids``, the
    decay and bonus normalised by the full count ``full`` (the block divides by the kept)."""

    def wkv(b, t, c, w, u, k, v):
        w, u = w * t / full, u * t / full
        dist = (ids[:, :, None] - ids[:, None, :]).abs()[..., None].to(k.dtype)
        logits = -(dist - 1) * w + k[:, None]
        diagonal = torch.eye(t, dtype=torch.bool)[..., None]
        logits = torch.where(diagonal, u + k[:, None], logits)
        weights = torch.exp(logits - logits.amax(dim=2, keepdim=True))
        return (weights * v[:, None]).sum(2) / (weights.sum(2) + 1e-6)

    return wkv


def drwkv_twin(model: torch.nn.Module, ids: torch.Tensor, x, timesteps, labels) -> torch.Tensor:
    """Diffusion-RWKV's forward (2 in blocks) with route (1, 4) by hand, row selection."""
    code = sys.modules[type(model).__module__]
    height, width = model.patch_resolution
    kept_grid = (ids.shape[1] // width, width)
    h = model.patch_embed(x)
    c = model.time_embed(timesteps) + model.label_emb(labels, model.training)
    h = h + model.pos_embed
    h0 = model.in_blocks[0](h, c=c, patch_resolution=model.patch_resolution)
    full_wkv, code.RUN_CUDA = code.RUN_CUDA, _wkv_at(ids, height * width)
    try:
        h1 = model.in_blocks[1](_gather(h0, ids), c=c, patch_resolution=kept_grid)
        hm = model.mid_block(h1, c=c, patch_resolution=kept_grid)
        ho = model.out_blocks[0](hm, c=c, patch_resolution=kept_grid, skip=h1)
    finally:
        code.RUN_CUDA = full_wkv
    h = model.out_blocks[1](_scatter(h0, ids, ho), c=c, patch_resolution=model.patch_resolution,
                            skip=h0)  # fmt: skip
    out = model.final_layer(model.norm_f(h), c=c)
    return code.unpatchify(out, model.out_channels)


TWINS = {"feizc/DiS": dis_twin, "feizc/Diffusion-RWKV": drwkv_twin}


def compare(repo: str, snapshots: Path) -> dict:
    """Route the repository's model with ``route(model)`` and compare one training forward
    with its twin on the same kept ids and the same random draws."""
    build = builders()[repo](Path(snapshots) / repo.replace("/", "+"))
    torch.manual_seed(0)
    model = build.make().train()
    randomize_zero_init(model)  # adaLN gates start at 0: the routed blocks would be identities
    args, kwargs = build.inputs()
    tread_fx.route(model, seed=0)
    torch.manual_seed(1)
    routed = model(*args, **kwargs)
    info = tread_fx.route_info(model)[0]
    torch.manual_seed(1)
    with torch.no_grad():
        twin = TWINS[repo](model, info.kept, *args, **kwargs)
    return {
        "repo": repo,
        "selection": info.selection,
        "route": (info.route.start, info.route.end),
        "kept": f"{info.kept.shape[1]} of {info.num_tokens}",
        "max_abs_diff": float((routed.detach() - twin).abs().max()),
        "equal": bool(torch.allclose(routed.detach(), twin, rtol=1e-5, atol=1e-6)),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    """Command line: compare every twin, print one line each."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.research.twins")
    parser.add_argument("--snapshots", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = [compare(repo, args.snapshots) for repo in TWINS]
    for row in rows:
        print(row)
    return rows


if __name__ == "__main__":
    main()
