"""Example inputs for a diffusion backbone, made from its forward signature.

The first forward parameter gets the latent ``x`` (``[B, C, H, W]``, from ``input_shape`` or
from the model: a patch embedder's ``img_size`` and input channels, or ``config.sample_size``);
timestep parameters (``t``, ``timestep(s)``) get ``rand(B)``; label parameters (``y``,
``labels``, ``class_labels``) get ``randint(num_classes)``. Optional parameters keep their
defaults. Anything else cannot be guessed and is an :class:`ExampleInputError`.

Example:
    >>> import tread_fx
    >>> from tread_fx.inspection.inputs import example_inputs
    >>> model = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10)
    >>> args, kwargs = example_inputs(model)
    >>> [tuple(a.shape) for a in args]
    [(1, 1, 8, 8), (1,), (1,)]
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from tread_fx.errors import ExampleInputError

__all__ = ["example_inputs", "default_input_shape", "TIME_NAMES", "LABEL_NAMES"]

TIME_NAMES = frozenset({"t", "timestep", "timesteps", "time", "sigma", "sigmas", "noise_level"})
LABEL_NAMES = frozenset({"y", "label", "labels", "class_labels", "class_label", "classes"})


def _pair(value: object) -> tuple[int, int] | None:
    if isinstance(value, int):
        return value, value
    pair = isinstance(value, (tuple, list)) and len(value) == 2
    if pair and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def _channels(model: nn.Module, embedder: nn.Module | None) -> int | None:
    proj = getattr(embedder, "proj", None)
    config = getattr(model, "config", None)
    for source in (
        getattr(proj, "in_channels", None),
        getattr(embedder, "in_chans", None),
        getattr(model, "in_channels", None),
        getattr(config, "in_channels", None),
    ):
        if isinstance(source, int):
            return source
    return None


def default_input_shape(model: nn.Module, batch: int = 1) -> tuple[int, ...]:
    """The latent shape ``[batch, C, H, W]`` a model expects, read from its attributes.

    Raises:
        ExampleInputError: when the model does not say (pass ``input_shape``).
    """
    embedder = getattr(model, "x_embedder", None)
    if embedder is None:
        embedder = next((m for m in model.modules() if hasattr(m, "img_size")), None)
    size = _pair(getattr(embedder, "img_size", None))
    if size is None:
        config = getattr(model, "config", None)
        size = _pair(getattr(config, "sample_size", None) or getattr(model, "input_size", None))
    channels = _channels(model, embedder)
    if size is None or channels is None:
        raise ExampleInputError(
            f"example inputs for {type(model).__name__} were asked for, but its input size "
            f"(found {size}) or channels (found {channels}) is not recorded on the model "
            "(x_embedder.img_size / in_channels / config.sample_size); pass the latent shape, "
            "e.g. input_shape=(1, 4, 32, 32) (CLI: --input-shape 1,4,32,32)."
        )
    return (batch, channels, *size)


def example_inputs(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    batch: int = 1,
    seed: int = 0,
) -> tuple[tuple, dict]:
    """Make ``(args, kwargs)`` for ``model(*args, **kwargs)`` (see the module docstring).

    Args:
        model: The model.
        input_shape: Shape of the first input; default from :func:`default_input_shape`.
        batch: Batch size when ``input_shape`` is not given.
        seed: Seed of the generator the example values are drawn from (the global RNG is
            not touched).

    Returns:
        ``(args, kwargs)`` on the device and in the dtype of the model's first parameter.

    Example:
        >>> import tread_fx
        >>> m = tread_fx.models.DiT_S_2(input_size=8, in_channels=1, num_classes=10)
        >>> example_inputs(m, input_shape=(2, 1, 8, 8))[0][2].shape
        torch.Size([2])
    """
    shape = tuple(input_shape) if input_shape is not None else default_input_shape(model, batch)
    if not shape or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ExampleInputError(
            f"input_shape={shape} was given; it must be positive integers such as (1, 4, 32, 32)."
        )
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    gen = torch.Generator().manual_seed(seed)
    params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p for p in params if p.default is p.empty and p.kind not in variadic]
    if not required and params:
        required = params[:1]
    args: list[torch.Tensor] = []
    for i, p in enumerate(required):
        if i == 0:
            value = torch.randn(shape, generator=gen)
        elif p.name.lower() in TIME_NAMES:
            value = torch.rand(shape[0], generator=gen)
        elif p.name.lower() in LABEL_NAMES:
            classes = getattr(model, "num_classes", None) or 1000
            value = torch.randint(0, int(classes), (shape[0],), generator=gen)
        else:
            raise ExampleInputError(
                f"example inputs for {type(model).__name__}.forward were asked for, but its "
                f"required parameter {p.name!r} is neither a timestep ({sorted(TIME_NAMES)}) "
                f"nor a label ({sorted(LABEL_NAMES)}); pass example_inputs=(args, kwargs) "
                "yourself (tread_fx.explain) or use a factory with a standard signature."
            )
        args.append(value.to(device=device, dtype=dtype if value.is_floating_point() else None))
    return tuple(args), {}
