"""The populations of the coverage sweep: where each :class:`Case` comes from.

- **diffusers**: every model configuration in ``tests/models/transformers/`` of a diffusers
  source checkout (the suite's own ``get_init_dict()``/``get_dummy_inputs()``), with every
  layer-count argument below 4 raised to 4 where the model still builds and runs.
- **timm**: every ``timm.list_models()`` entry that builds tiny (image 32, patch 4, width 64,
  depth 4, 2 heads) and has a candidate block stack; ``per_arch`` keeps one model per
  (model class, block class).

Example:
    >>> from benchmarks.coverage_sources import raise_layer_counts
    >>> raise_layer_counts({"num_layers": 1, "num_single_layers": 2, "in_channels": 1})
    {'num_layers': 4, 'num_single_layers': 4, 'in_channels': 1}
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.coverage_checks import Case
from tread_fx.passes.locate.stacks import candidate_stacks

__all__ = [
    "MIN_LAYERS",
    "raise_layer_counts",
    "diffusers_modules",
    "diffusers_cases",
    "timm_names",
    "timm_case",
    "timm_tiny",
    "transformers_cases",
    "TRANSFORMERS_FAMILIES",
]

MIN_LAYERS = 4
_LAYER_KEY = re.compile(r"(^|_)(layers|depth|blocks|n_layer|num_layer)s?$")
_TRANSFORMER_TESTS = Path("tests") / "models" / "transformers"


def raise_layer_counts(init: dict[str, Any], minimum: int = MIN_LAYERS) -> dict[str, Any]:
    """``init`` with every integer layer-count argument below ``minimum`` raised to it."""
    out = dict(init)
    for key, value in init.items():
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if is_int and 0 < value < minimum and _LAYER_KEY.search(key):
            out[key] = minimum
    return out


# -- diffusers --------------------------------------------------------------------------------


def diffusers_modules(suite: Path) -> list[str]:
    """Module names of the transformer test files under ``suite`` (a folder holding tests/)."""
    folder = Path(suite) / _TRANSFORMER_TESTS
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} does not exist: --suite must be the folder that holds diffusers' tests/ "
            "(see docs/support.md for the two commands that make it)"
        )
    return sorted(p.stem for p in folder.glob("test_*.py"))


def _import_suite_module(suite: Path, module: str) -> Any:
    os.environ.setdefault("DIFFUSERS_TEST_DEVICE", "cpu")
    if str(suite) not in sys.path:
        sys.path.insert(0, str(suite))
    warnings.filterwarnings("ignore")
    return importlib.import_module(f"tests.models.transformers.{module}")


def _config_classes(mod: Any) -> list[type]:
    """The suite's model configurations in ``mod``: classes with init dict and dummy inputs."""
    found = []
    for name, cls in vars(mod).items():
        if not inspect.isclass(cls) or cls.__module__ != mod.__name__ or name.startswith("Test"):
            continue
        if all(hasattr(cls, a) for a in ("get_init_dict", "get_dummy_inputs", "model_class")):
            found.append(cls)
    return found


def _seeded(fn: Any) -> Any:
    def call() -> Any:
        torch.manual_seed(0)
        return fn()

    return call


def _runs(model_class: type, init: dict, inputs: Any) -> bool:
    try:
        torch.manual_seed(0)
        model = model_class(**init)
        with torch.no_grad():
            model.train()
            model(**inputs())
        return True
    except Exception:  # noqa: BLE001 - the raised config does not build: keep the suite's
        return False


def _raise_what_runs(model_class: type, init: dict, inputs: Any) -> tuple[dict, str]:
    """Raise the layer counts all together, else each one that still runs with the suite's
    inputs (some inputs hold one tensor per layer), and say what was raised."""
    raised = raise_layer_counts(init)
    keys = [k for k in raised if raised[k] != init[k]]
    if not keys:
        return init, ""
    if not _runs(model_class, raised, inputs):
        raised = dict(init)
        for key in keys:
            trial = {**raised, key: MIN_LAYERS}
            if _runs(model_class, trial, inputs):
                raised = trial
    changed = [f"{k} {init[k]}->{raised[k]}" for k in keys if raised[k] != init[k]]
    kept = [k for k in keys if raised[k] == init[k]]
    note = "layers raised: " + ", ".join(changed) if changed else ""
    if kept:
        note += ("; " if note else "") + f"kept {', '.join(kept)} (raised, the inputs do not fit)"
    return raised, note


def _diffusers_case(cls: type, unique: bool) -> Case:
    config = cls()
    model_class = config.model_class
    inputs = _seeded(lambda: ({}, config.get_dummy_inputs()))
    init, note = _raise_what_runs(model_class, config.get_init_dict(), lambda: inputs()[1])
    name = model_class.__name__ if unique else cls.__name__.removesuffix("TesterConfig")
    noisy = getattr(config, "main_input_name", None)  # the suite's latent
    noisy = noisy() if callable(noisy) else noisy or "hidden_states"
    return Case(name, "diffusers", lambda: model_class(**init), inputs, note=note, noisy=noisy)


def diffusers_cases(suite: Path, module: str) -> Iterator[Case | tuple[str, str]]:
    """Cases of one suite module; ``(name, reason)`` for a configuration that cannot be made."""
    try:
        mod = _import_suite_module(Path(suite), module)
    except Exception as err:  # noqa: BLE001 - an import failure is "not buildable here"
        yield module, f"import: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return
    classes = _config_classes(mod)
    if not classes:
        yield module, "no model configuration (get_init_dict/get_dummy_inputs) in the module"
    for cls in classes:
        try:
            yield _diffusers_case(cls, unique=len(classes) == 1)
        except Exception as err:  # noqa: BLE001 - the suite's config cannot be made here
            yield cls.__name__, f"config: {type(err).__name__}: {str(err).splitlines()[0][:200]}"


# -- timm -------------------------------------------------------------------------------------

TIMM_TINY = dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2, num_classes=10)


def timm_tiny(name: str) -> nn.Module:
    """``timm.create_model(name)`` at the tiny size (raises if the model takes no such size)."""
    import timm

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return timm.create_model(name, pretrained=False, **TIMM_TINY)


def _stack_class(model: nn.Module) -> str | None:
    stacks = candidate_stacks(model)
    if not stacks:
        return None
    path, container = max(stacks.items(), key=lambda kv: len(kv[1]))
    return type(next(iter(container))).__name__


def timm_names(per_arch: bool) -> tuple[list[str], dict[str, str]]:
    """Tiny-buildable timm models with a block stack, and why each other one was left out.

    Args:
        per_arch: Keep one model per (model class, block class).

    Returns:
        ``(names, skipped)`` where ``skipped`` maps a name to the reason.
    """
    import timm

    names, skipped, seen = [], {}, set()
    for name in timm.list_models():
        try:
            model = timm_tiny(name)
        except Exception as err:  # noqa: BLE001 - not tiny-buildable with these arguments
            skipped[name] = f"not tiny-buildable: {type(err).__name__}"
            continue
        block = _stack_class(model)
        if block is None:
            skipped[name] = "no ModuleList/Sequential of blocks"
            continue
        arch = (type(model).__name__, block)
        if per_arch and arch in seen:
            continue
        seen.add(arch)
        names.append(name)
    return names, skipped


def timm_case(name: str) -> Case:
    """The coverage case of one timm model (batch 2, 3x32x32 images)."""

    def inputs() -> tuple[tuple, dict]:
        return (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)),), {}

    probe = timm_tiny(name)
    arch = f"{type(probe).__name__} / {_stack_class(probe)}"
    return Case(name, "timm", lambda: timm_tiny(name), inputs, note=arch, noisy=0)  # the image


# -- transformers: the state-space and hybrid family ----------------------------------------

TRANSFORMERS_TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_cache=False,
)  # fmt: skip
_SCAN = dict(mamba_n_groups=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2)
# per family, what the tiny config needs beyond TRANSFORMERS_TINY (scan sizes, layer patterns)
TRANSFORMERS_FAMILIES = {
    "Mamba": dict(state_size=4, expand=2, conv_kernel=2, time_step_rank=4),
    "Mamba2": dict(state_size=4, expand=2, conv_kernel=2, num_heads=4, n_groups=1, chunk_size=16),
    "FalconMamba": dict(state_size=4, expand=2, conv_kernel=2, time_step_rank=4),
    "Rwkv": dict(attention_hidden_size=32, context_length=64),
    "Bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=16, attn_layer_indices=[1],
                  **_SCAN),
    "GraniteMoeHybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=16,
                             num_local_experts=2, num_experts_per_tok=1,
                             layer_types=["mamba", "attention"] * 2, **_SCAN),
    "Lfm2": dict(layer_types=["conv", "full_attention"] * 2, conv_L_cache=2),
    "NemotronH": dict(mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=4,
                      conv_kernel=2, expand=2, chunk_size=16, hybrid_override_pattern="M*M-",
                      mlp_hidden_act="relu2"),
    "Qwen3Next": dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=2, num_experts=2,
                      num_experts_per_tok=1, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32,
                      layer_types=["linear_attention", "full_attention"] * 2),
    "Jamba": dict(num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
                  expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=0,
                  mamba_d_state=4, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=4),
}  # fmt: skip


def transformers_cases() -> Iterator[Case | tuple[str, str]]:
    """The state-space and hybrid models of transformers at tiny configs (16 embedded tokens)."""
    import transformers

    def inputs() -> tuple[tuple, dict]:
        embeds = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
        return (), {"inputs_embeds": embeds, "use_cache": False}

    for family, extra in TRANSFORMERS_FAMILIES.items():
        try:
            config = getattr(transformers, f"{family}Config")(**{**TRANSFORMERS_TINY, **extra})
            model_class = getattr(transformers, f"{family}Model")
        except Exception as err:  # noqa: BLE001 - not in this transformers version
            yield f"{family}Model", f"config: {type(err).__name__}: {str(err)[:200]}"
            continue
        make = lambda c=config, m=model_class: m(c)  # noqa: E731
        yield Case(f"{family}Model", "transformers", make, inputs, noisy="inputs_embeds")
