"""Diffusers transformers for ``train_diffusers.py``: building them, conditioning, input adapters.

A diffusers transformer is built from a class name and a config (``--model``/``--config``) or
loaded from a local folder (``--pretrained``). Its forward signature decides the *input family*,
one function each that turns ``(x [B, C, H, W], t in [0, 1], condition ids [B])`` into the
forward's keyword arguments and its output back into ``[B, C', H, W]``:

* ``packed`` -- forwards taking ``img_ids`` and ``txt_ids`` (``FluxTransformer2DModel``,
  ``ChromaTransformer2DModel``): the image is packed into ``p x p`` patches, one token each
  (``p = sqrt(in_channels / C)``), with ``(0, row, col)`` position ids; the text ids are
  zeros; ``timestep`` is ``t`` (the model scales it by 1000); ``guidance`` (when
  ``guidance_embeds``) is ``--guidance``.
* ``image`` -- forwards taking ``hidden_states [B, C, H, W]`` and ``encoder_hidden_states``
  (``SD3Transformer2DModel``, ``PixArtTransformer2DModel``): the image as is,
  ``timestep = 1000 t``; ``pooled_projections`` and ``added_cond_kwargs`` when the forward
  takes them.

Text conditioning is a table with one row per class label and a last *null* row (label
dropout and classifier-free guidance): ``encoder_hidden_states [K + 1, T, D]`` and, for
forwards taking ``pooled_projections``, ``[K + 1, P]``. Without ``--text-embeds`` the table is
a **stand-in**: seeded random rows (zeros for the null row) with the widths the config asks
for (``joint_attention_dim``, ``caption_channels`` or ``cross_attention_dim``;
``pooled_projection_dim``), ``T = --text-tokens``. It stands for a text encoder's output for a
prompt per class; nothing is downloaded.

Example:
    >>> import torch
    >>> cond = standin_conditioning(10, text_dim=24, pooled_dim=16, tokens=8)
    >>> cond.text.shape, cond.pooled.shape, cond.null_id
    (torch.Size([11, 8, 24]), torch.Size([11, 16]), 10)
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tread_fx.errors import TreadFxError

__all__ = ["Adapter", "Conditioning", "ModelError", "build_model", "load_conditioning"]
__all__ += ["check_shapes", "make_adapter", "pick_family", "standin_conditioning", "text_widths"]
__all__ += ["FAMILIES"]

FAMILIES = {  # family -> (how it is recognised, the classes it was tested with)
    "packed": ("forward takes img_ids and txt_ids", "FluxTransformer2DModel"),
    "image": (
        "forward takes hidden_states [B, C, H, W] and encoder_hidden_states",
        "SD3Transformer2DModel, PixArtTransformer2DModel",
    ),
}
BUILT = {"hidden_states", "timestep", "encoder_hidden_states", "pooled_projections", "img_ids",
         "txt_ids", "guidance", "added_cond_kwargs", "return_dict"}  # fmt: skip
TEXT_DIMS = ("joint_attention_dim", "caption_channels", "cross_attention_dim", "text_embed_dim")


class ModelError(TreadFxError, ValueError):
    """A model class, config file, checkpoint folder or text table that cannot be used."""


def _supported() -> str:
    return "; ".join(f"{k}: {how} (tested: {tested})" for k, (how, tested) in FAMILIES.items())


def _model_class(name: str | None, source: str) -> type:
    import diffusers

    if name is None:
        raise ModelError(f"{source}: no _class_name in it; pass --model CLASS")

    cls = getattr(diffusers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        raise ModelError(f"--model {name}: not a diffusers model class; supported: {_supported()}")
    return cls


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{what} {path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelError(f"{what} {path}: not a JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{what} {path}: expected a JSON object of constructor arguments")
    return data


def build_model(
    name: str | None, config: str | None = None, pretrained: str | None = None
) -> nn.Module:
    """A diffusers model from ``--model NAME --config FILE`` or ``--pretrained FOLDER``.

    Args:
        name: Class name in ``diffusers`` (default: the config's ``_class_name``).
        config: JSON file of constructor arguments (keys starting with ``_`` are ignored).
        pretrained: Local folder with ``config.json`` and safetensors weights, or a pipeline
            folder with a ``transformer/`` subfolder. Nothing is downloaded.

    Raises:
        ModelError: Unknown class, missing/malformed/mismatched config, unknown constructor
            keys, or a folder without safetensors weights; the message names the file.
    """
    if (config is None) == (pretrained is None):
        raise ModelError("pass exactly one of --config FILE (new model) and --pretrained FOLDER")
    if pretrained is not None:
        folder = Path(pretrained)
        if not (folder / "config.json").is_file() and (folder / "transformer").is_dir():
            folder = folder / "transformer"
        cfg = _read_json(folder / "config.json", "--pretrained")
        cls = _model_class(name or cfg.get("_class_name"), f"{folder / 'config.json'}")
        try:
            return cls.from_pretrained(str(folder), local_files_only=True, use_safetensors=True)
        except (OSError, ValueError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelError(
                f"--pretrained {folder}: cannot load {cls.__name__}: {first}"
            ) from None
    path = Path(config)
    cfg = _read_json(path, "--config")
    cls = _model_class(name or cfg.get("_class_name"), f"--config {path}")
    params = inspect.signature(cls.__init__).parameters
    unknown = sorted(k for k in cfg if not k.startswith("_") and k not in params)
    if unknown:
        raise ModelError(f"--config {path}: {cls.__name__} does not take {', '.join(unknown)}")
    try:
        return cls.from_config({k: v for k, v in cfg.items() if not k.startswith("_")})
    except (TypeError, ValueError, AssertionError, RuntimeError) as err:
        raise ModelError(f"--config {path}: cannot build {cls.__name__}: {err}") from None


def pick_family(model: nn.Module) -> str:
    """The input family of ``model`` from its forward signature (see the module docstring).

    Raises:
        ModelError: No family fits, or the forward requires inputs no family builds.
    """
    params = inspect.signature(type(model).forward).parameters
    names = set(params) - {"self"}
    required = {n for n, p in params.items() if p.default is p.empty and n != "self"}
    required -= {n for n, p in params.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if {"img_ids", "txt_ids"} <= names:
        family = "packed"
    elif {"hidden_states", "encoder_hidden_states"} <= names:
        family = "image"
    else:
        family = None
    if family is None or required - BUILT:
        missing = f" (it requires {', '.join(sorted(required - BUILT))})" if family else ""
        raise ModelError(
            f"{type(model).__name__}: this example cannot build its forward's inputs{missing}; "
            f"supported: {_supported()}"
        )
    return family


@dataclass
class Conditioning:
    """Text conditioning per condition id (class label); the last row is the null condition.

    Attributes:
        text: ``encoder_hidden_states`` rows ``[K + 1, T, D]``.
        pooled: ``pooled_projections`` rows ``[K + 1, P]``, or ``None``.
        source: Where the rows come from (for the log).
    """

    text: torch.Tensor
    pooled: torch.Tensor | None
    source: str

    @property
    def null_id(self) -> int:
        """The id of the null (empty prompt) row."""
        return self.text.shape[0] - 1

    def to(self, device: torch.device) -> Conditioning:
        """A copy on ``device``."""
        pooled = None if self.pooled is None else self.pooled.to(device)
        return Conditioning(self.text.to(device), pooled, self.source)


def standin_conditioning(
    num_classes: int, text_dim: int, pooled_dim: int | None, tokens: int = 8, seed: int = 0
) -> Conditioning:
    """Deterministic stand-in text embeddings: seeded N(0, 1) rows per class, a zero null row."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(num_classes, tokens, text_dim, generator=gen)
    text = torch.cat([text, text.new_zeros(1, tokens, text_dim)])
    pooled = None
    if pooled_dim:
        pooled = torch.randn(num_classes, pooled_dim, generator=gen)
        pooled = torch.cat([pooled, pooled.new_zeros(1, pooled_dim)])
    return Conditioning(text, pooled, f"stand-in (seeded random, {tokens} tokens per class)")


def load_conditioning(
    path: str, num_classes: int, text_dim: int, pooled_dim: int | None
) -> Conditioning:
    """Precomputed text embeddings per class from a safetensors file.

    The file holds ``prompt_embeds [K, T, D]`` (one prompt per class, e.g. the encoded
    ``"a photo of the digit 3"``) and, for models with pooled projections,
    ``pooled_prompt_embeds [K, P]``. ``K + 1`` rows: the last is the empty prompt (used for
    label dropout and guidance); with ``K`` rows the null condition is zeros.

    Raises:
        ModelError: Missing/unreadable file, a missing tensor or a shape that does not fit.
    """
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except Exception as err:  # any reader failure means an unusable file
        raise ModelError(
            f"--text-embeds {path}: cannot read ({type(err).__name__}: {err})"
        ) from None
    wanted = {"prompt_embeds": (text_dim,)} | ({"pooled_prompt_embeds": ()} if pooled_dim else {})
    rows = {}
    for key, tail in wanted.items():
        value = tensors.get(key)
        width = text_dim if key == "prompt_embeds" else pooled_dim
        ndim = 3 if tail else 2
        if value is None or value.ndim != ndim or value.shape[-1] != width:
            found = "missing" if value is None else f"shape {list(value.shape)}"
            raise ModelError(f"--text-embeds {path}: needs {key} [K(+1), ..., {width}], {found}")
        if value.shape[0] not in (num_classes, num_classes + 1):
            raise ModelError(
                f"--text-embeds {path}: {key} has {value.shape[0]} rows for {num_classes} "
                f"classes; give {num_classes} (null row zeros) or {num_classes + 1} (last: empty)"
            )
        if value.shape[0] == num_classes:
            value = torch.cat([value, value.new_zeros(1, *value.shape[1:])])
        rows[key] = value.float()
    return Conditioning(rows["prompt_embeds"], rows.get("pooled_prompt_embeds"), str(path))


def text_widths(model: nn.Module) -> tuple[int, int | None]:
    """``(D, P)``: the text embedding width and the pooled width (``None``: not taken)."""
    cfg, params = dict(model.config), inspect.signature(type(model).forward).parameters
    text_dim = next((cfg[k] for k in TEXT_DIMS if cfg.get(k)), None)
    if text_dim is None:
        raise ModelError(f"{type(model).__name__}: no text width in its config ({TEXT_DIMS})")
    pooled = cfg.get("pooled_projection_dim") if "pooled_projections" in params else None
    return int(text_dim), pooled and int(pooled)


@dataclass
class Adapter:
    """Calls a diffusers transformer as ``adapter(x, t, ids) -> [B, C', H, W]``.

    Attributes:
        model: What to call (the plain, DDP-wrapped or FSDP-sharded transformer).
        family: ``"packed"`` or ``"image"``.
        cond: The text table (on the model's device).
        params: Names the forward takes.
        config: The model's config.
        guidance: Guidance value for models with ``guidance_embeds``.
    """

    model: Any
    family: str
    cond: Conditioning
    params: frozenset
    config: dict
    guidance: float = 1.0

    def __call__(self, x: torch.Tensor, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"encoder_hidden_states": self.cond.text[ids]}
        if "pooled_projections" in self.params:
            kwargs["pooled_projections"] = self.cond.pooled[ids]
        if "guidance" in self.params and self.config.get("guidance_embeds"):
            kwargs["guidance"] = torch.full_like(t, self.guidance)
        if self.family == "packed":
            return _packed_call(self, x, t, kwargs)
        return _image_call(self, x, t, kwargs)

    def eval(self) -> Adapter:
        """Puts the model in eval mode (routing off); returns ``self``."""
        self.model.eval()
        return self


def _packed_call(adapter: Adapter, x: torch.Tensor, t: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Flux-like: ``p x p`` patches as tokens with ``(0, row, col)`` ids; ``timestep = t``."""
    b, c, h, w = x.shape
    p = math.isqrt(adapter.config["in_channels"] // c)
    tokens = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    rows, cols = torch.meshgrid(
        torch.arange(h // p, device=x.device), torch.arange(w // p, device=x.device), indexing="ij"
    )
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    txt_ids = x.new_zeros(kwargs["encoder_hidden_states"].shape[1], 3)
    out = adapter.model(
        hidden_states=tokens.reshape(b, (h // p) * (w // p), c * p * p), timestep=t,
        img_ids=img_ids, txt_ids=txt_ids, return_dict=False, **kwargs,
    )[0]  # fmt: skip
    c_out = out.shape[-1] // (p * p)
    out = out.reshape(b, h // p, w // p, c_out, p, p).permute(0, 3, 1, 4, 2, 5)
    return out.reshape(b, c_out, h, w)


def _image_call(adapter: Adapter, x: torch.Tensor, t: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """SD3/PixArt-like: the image as is, ``timestep = 1000 t``, size conditioning if asked."""
    if "added_cond_kwargs" in adapter.params:
        extra = {"resolution": None, "aspect_ratio": None}
        if adapter.config.get("use_additional_conditions"):
            size = torch.tensor([x.shape[2], x.shape[3]], dtype=x.dtype, device=x.device)
            extra = {"resolution": size.expand(x.shape[0], 2),
                     "aspect_ratio": (size[:1] / size[1:]).expand(x.shape[0], 1)}  # fmt: skip
        kwargs["added_cond_kwargs"] = extra
    return adapter.model(hidden_states=x, timestep=1000 * t, return_dict=False, **kwargs)[0]


def check_shapes(model: nn.Module, family: str, shape: tuple[int, ...]) -> None:
    """Refuses a config that does not fit the data ``(C, H, W)``, naming the keys to change."""
    cfg, (c, h, w) = dict(model.config), shape
    name, in_ch = type(model).__name__, cfg.get("in_channels")
    if family == "packed":
        p = math.isqrt(max(1, (in_ch or 0) // c))
        if in_ch != c * p * p or h % p or w % p:
            raise ModelError(
                f"{name}: in_channels {in_ch} must be C * p * p for the data's C = {c} channels "
                f"and a patch p dividing {h}x{w} (e.g. {4 * c} for 2x2 patches)"
            )
    elif in_ch != c:
        raise ModelError(f"{name}: in_channels {in_ch} must equal the data's {c} channels")
    elif h % (cfg.get("patch_size") or 1) or w % (cfg.get("patch_size") or 1):
        raise ModelError(f"{name}: patch_size {cfg.get('patch_size')} does not divide {h}x{w}")


def make_adapter(
    model: nn.Module, shape: tuple[int, ...], cond: Conditioning, guidance: float = 1.0
) -> Adapter:
    """The adapter for ``model`` on data of shape ``(C, H, W)``, after checking both fit."""
    family = pick_family(model)
    check_shapes(model, family, shape)
    params = frozenset(inspect.signature(type(model).forward).parameters)
    return Adapter(model, family, cond, params, dict(model.config), guidance)
