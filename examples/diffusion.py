"""Diffusion objectives, samplers and EMA for the example training scripts.

Two objectives, each a small class with the same interface:

* :class:`RectifiedFlow` -- ``x_t = (1 - t) x0 + t noise``, the network predicts the velocity
  ``noise - x0``, ``t ~ logit-normal(0, 1)``.
* :class:`EDM` -- Karras et al. (2022) preconditioning, ``D(x; sigma) = c_skip x + c_out
  F(c_in x, c_noise)`` with ``sigma_data = 0.5``, ``ln sigma ~ N(-1.2, 1.2)`` and the loss weight
  ``(sigma^2 + sigma_data^2) / (sigma sigma_data)^2``.

``sample_training(x0, generator)`` returns ``((x_in, t_in), target, weight)``: what the network is
called with (besides the labels), what it should output, and a per-sample weight broadcastable
to the output. ``loss(model, x0, y, reduction="none")`` returns the per-element weighted squared
error ``[B, C, H, W]`` so that token-level losses can be built on it.

Timesteps handed to the network are scaled to a DDPM-like range (``time_scale = 1000``): RF passes
``1000 t``, EDM passes ``1000 c_noise = 250 ln sigma``.

A network that outputs ``2 C`` channels (``learn_sigma``) has its first ``C`` channels used.

Samplers: :func:`sample` integrates the probability-flow ODE with Euler or Heun steps and
classifier-free guidance (conditional and null-class batches concatenated in one call).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "EDM",
    "OBJECTIVES",
    "RectifiedFlow",
    "guided_prediction",
    "make_ema",
    "make_objective",
    "sample",
    "take_channels",
    "update_ema",
    "warmup_ema_decay",
]

ModelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _randn(shape, generator: torch.Generator | None, like: torch.Tensor) -> torch.Tensor:
    device = generator.device if generator is not None else like.device
    return torch.randn(shape, generator=generator, device=device).to(like.device)


def _gen_device(generator: torch.Generator | None, device) -> torch.device:
    return generator.device if generator is not None else torch.device(device)


def _bcast(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """Reshapes a per-sample ``[B]`` tensor to ``[B, 1, ..., 1]`` with ``ndim`` dims."""
    return v.reshape(-1, *([1] * (ndim - 1)))


def take_channels(output: torch.Tensor, channels: int) -> torch.Tensor:
    """The first ``channels`` channels of a network output (drops learned-sigma channels)."""
    if output.shape[1] == channels:
        return output
    if output.shape[1] == 2 * channels:
        return output[:, :channels]
    raise ValueError(
        f"model output has {output.shape[1]} channels; expected {channels} or {2 * channels}"
    )


class _Objective:
    """Shared pieces: the loss on top of ``sample_training``."""

    name = ""
    time_scale = 1000.0

    def sample_time(self, n: int, generator: torch.Generator | None, device) -> torch.Tensor:
        raise NotImplementedError

    def sample_training(
        self,
        x0: torch.Tensor,
        generator: torch.Generator | None = None,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(
        self,
        model: ModelFn,
        x0: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator | None = None,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Weighted squared error between the network output and the training target.

        Args:
            model: Called as ``model(x_in, t_in, y)``.
            x0: Clean data ``[B, C, H, W]``.
            y: Labels ``[B]``.
            generator: Source of the time and noise draws (ignored for given ``t``/``noise``).
            t: Optional fixed times (RF: ``t`` in ``[0, 1]``; EDM: ``sigma``), shape ``[B]``.
            noise: Optional fixed standard normal noise shaped like ``x0``.
            reduction: ``"mean"`` (a scalar) or ``"none"`` (float32 ``[B, C, H, W]``).

        Returns:
            The loss.
        """
        (x_in, t_in), target, weight = self.sample_training(x0, generator, t, noise)
        pred = take_channels(model(x_in, t_in, y), x0.shape[1]).float()
        per_element = weight * (pred - target).square()
        if reduction == "none":
            return per_element
        if reduction == "mean":
            return per_element.mean()
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")


class RectifiedFlow(_Objective):
    """Rectified flow / flow matching with a velocity target.

    Args:
        logit_mean: Mean of the logit-normal time distribution.
        logit_std: Standard deviation of the logit-normal time distribution.
        time_scale: Factor applied to ``t`` before it is handed to the network.
    """

    name = "rf"

    def __init__(
        self, logit_mean: float = 0.0, logit_std: float = 1.0, time_scale: float = 1000.0
    ) -> None:
        self.logit_mean, self.logit_std, self.time_scale = logit_mean, logit_std, time_scale

    def sample_time(self, n: int, generator: torch.Generator | None, device) -> torch.Tensor:
        """``t = sigmoid(N(logit_mean, logit_std))``, shape ``[n]``."""
        z = torch.randn(n, generator=generator, device=_gen_device(generator, device))
        return torch.sigmoid(self.logit_mean + self.logit_std * z).to(device)

    def sample_training(self, x0, generator=None, t=None, noise=None):
        """Returns ``((x_t, time_scale t), noise - x0, ones)``; see the module docstring."""
        x0 = x0.float()
        t = self.sample_time(x0.shape[0], generator, x0.device) if t is None else t.float()
        noise = _randn(x0.shape, generator, x0) if noise is None else noise.float()
        tb = _bcast(t, x0.ndim)
        x_t = (1 - tb) * x0 + tb * noise
        weight = torch.ones_like(tb)
        return (x_t, t * self.time_scale), noise - x0, weight

    # --- sampling: the ODE dx/dt = v(x, t), integrated from t = 1 to t = 0 -----------------
    def time_grid(self, steps: int, device) -> torch.Tensor:
        """Decreasing times ``1 -> 0`` of length ``steps + 1``."""
        return torch.linspace(1.0, 0.0, steps + 1, device=device)

    def initial_scale(self, grid: torch.Tensor) -> float:
        """Standard deviation of the starting noise."""
        return 1.0

    def derivative(self, predict: Callable, x: torch.Tensor, t: float) -> torch.Tensor:
        """``dx/dt`` at ``(x, t)``; ``predict(x_in, t_in)`` gives the (guided) network output."""
        t_in = torch.full((x.shape[0],), t * self.time_scale, device=x.device)
        return predict(x, t_in)

    def can_correct(self, t_next: float) -> bool:
        """Whether a Heun correction may evaluate the network at ``t_next``."""
        return True


class EDM(_Objective):
    """EDM (Karras et al. 2022) preconditioning and loss.

    Args:
        sigma_data: Data standard deviation assumed by the preconditioning.
        p_mean: Mean of ``ln sigma`` during training.
        p_std: Standard deviation of ``ln sigma`` during training.
        sigma_min: Smallest sampling noise level.
        sigma_max: Largest sampling noise level.
        rho: Exponent of the Karras sampling schedule.
        time_scale: Factor applied to ``c_noise = ln(sigma) / 4`` for the network.
    """

    name = "edm"

    def __init__(
        self,
        sigma_data: float = 0.5,
        p_mean: float = -1.2,
        p_std: float = 1.2,
        sigma_min: float = 0.002,
        sigma_max: float = 80.0,
        rho: float = 7.0,
        time_scale: float = 1000.0,
    ) -> None:
        self.sigma_data, self.p_mean, self.p_std = sigma_data, p_mean, p_std
        self.sigma_min, self.sigma_max, self.rho = sigma_min, sigma_max, rho
        self.time_scale = time_scale

    def precondition(self, sigma: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Returns ``(c_skip, c_out, c_in, c_noise)`` for noise levels ``sigma`` (any shape)."""
        sd2 = self.sigma_data**2
        c_skip = sd2 / (sigma**2 + sd2)
        c_out = sigma * self.sigma_data / (sigma**2 + sd2).sqrt()
        c_in = 1 / (sigma**2 + sd2).sqrt()
        c_noise = sigma.log() / 4
        return c_skip, c_out, c_in, c_noise

    def loss_weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """``lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2``."""
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def sample_time(self, n: int, generator: torch.Generator | None, device) -> torch.Tensor:
        """``sigma = exp(N(p_mean, p_std))``, shape ``[n]``."""
        z = torch.randn(n, generator=generator, device=_gen_device(generator, device))
        return (self.p_mean + self.p_std * z).exp().to(device)

    def sample_training(self, x0, generator=None, t=None, noise=None):
        """Returns ``((c_in x, scaled c_noise), F-target, lambda c_out^2)``.

        With ``x = x0 + sigma noise`` the network target is ``(x0 - c_skip x) / c_out``; the weight
        ``lambda c_out^2`` makes ``weight (F - target)^2`` equal ``lambda (D(x) - x0)^2``.
        """
        x0 = x0.float()
        sigma = self.sample_time(x0.shape[0], generator, x0.device) if t is None else t.float()
        noise = _randn(x0.shape, generator, x0) if noise is None else noise.float()
        c_skip, c_out, c_in, c_noise = (_bcast(c, x0.ndim) for c in self.precondition(sigma))
        x = x0 + _bcast(sigma, x0.ndim) * noise
        target = (x0 - c_skip * x) / c_out
        weight = self.loss_weight(_bcast(sigma, x0.ndim)) * c_out**2
        return (c_in * x, c_noise.flatten() * self.time_scale), target, weight

    def denoise(self, output: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """``D(x; sigma) = c_skip x + c_out F`` from the raw network output ``F``."""
        c_skip, c_out, _, _ = (_bcast(c, x.ndim) for c in self.precondition(sigma))
        return c_skip * x + c_out * output.float()

    # --- sampling: the ODE dx/dsigma = (x - D(x; sigma)) / sigma, sigma_max -> 0 ---------------
    def time_grid(self, steps: int, device) -> torch.Tensor:
        """Karras schedule ``sigma_max -> sigma_min`` (``steps`` levels) followed by 0."""
        ramp = torch.linspace(0, 1, steps, device=device, dtype=torch.float64)
        lo, hi = self.sigma_min ** (1 / self.rho), self.sigma_max ** (1 / self.rho)
        sigmas = (hi + ramp * (lo - hi)) ** self.rho
        return torch.cat([sigmas, sigmas.new_zeros(1)]).float()

    def initial_scale(self, grid: torch.Tensor) -> float:
        """Standard deviation of the starting noise: the first noise level."""
        return float(grid[0])

    def derivative(self, predict: Callable, x: torch.Tensor, t: float) -> torch.Tensor:
        """``dx/dsigma`` at ``(x, sigma=t)``."""
        sigma = torch.full((x.shape[0],), t, device=x.device)
        c_in, c_noise = self.precondition(sigma)[2:]
        output = predict(x * _bcast(c_in, x.ndim), c_noise * self.time_scale)
        return (x - self.denoise(output, x, sigma)) / t

    def can_correct(self, t_next: float) -> bool:
        """Heun's correction is skipped on the final step to ``sigma = 0``."""
        return t_next > 0


OBJECTIVES = {"rf": RectifiedFlow, "edm": EDM}


def make_objective(name: str) -> RectifiedFlow | EDM:
    """An objective by name (``"rf"`` or ``"edm"``) with default settings."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]()


def guided_prediction(
    model: ModelFn,
    x: torch.Tensor,
    t_in: torch.Tensor,
    y: torch.Tensor,
    cfg_scale: float,
    null_label: int,
) -> torch.Tensor:
    """Network output with classifier-free guidance, ``uncond + s (cond - uncond)``.

    With ``cfg_scale == 1`` this is a single conditional call; otherwise conditional and null-class
    inputs are concatenated into one batch of ``2B``. Only the first ``C`` output channels are used.
    """
    channels = x.shape[1]
    if cfg_scale == 1.0:
        return take_channels(model(x, t_in, y), channels).float()
    both = model(
        torch.cat([x, x]), torch.cat([t_in, t_in]), torch.cat([y, torch.full_like(y, null_label)])
    )
    cond, uncond = take_channels(both, channels).float().chunk(2)
    return uncond + cfg_scale * (cond - uncond)


@torch.no_grad()
def sample(
    objective: RectifiedFlow | EDM,
    model: ModelFn,
    labels: torch.Tensor,
    shape: tuple[int, int, int],
    steps: int = 32,
    method: str = "heun",
    cfg_scale: float = 1.0,
    null_label: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draws samples by integrating the objective's probability-flow ODE.

    Deterministic for a given ``generator`` (only the starting noise is random).

    Args:
        objective: :class:`RectifiedFlow` or :class:`EDM`.
        model: Called as ``model(x, t, y)``; put it in eval mode first.
        labels: Class labels ``[B]`` on the model's device.
        shape: ``(C, H, W)`` of one sample.
        steps: Number of ODE steps (Heun uses up to ``2 steps - 1`` network calls per sample).
        method: ``"euler"`` or ``"heun"``.
        cfg_scale: Classifier-free guidance scale; 1 disables guidance.
        null_label: The model's null class (needed when ``cfg_scale != 1``).
        generator: Source of the starting noise.

    Returns:
        Float32 samples ``[B, C, H, W]``.
    """
    if method not in ("euler", "heun"):
        raise ValueError(f"unknown sampler {method!r}; choose 'euler' or 'heun'")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if cfg_scale != 1.0 and null_label is None:
        raise ValueError("classifier-free guidance (cfg_scale != 1) needs the model's null_label")
    device = labels.device
    grid = objective.time_grid(steps, device).tolist()
    x = _randn((labels.shape[0], *shape), generator, labels.new_empty(0, dtype=torch.float32))
    x = x * objective.initial_scale(torch.tensor(grid))

    def predict(x_in: torch.Tensor, t_in: torch.Tensor) -> torch.Tensor:
        return guided_prediction(model, x_in, t_in, labels, cfg_scale, null_label)

    for t, t_next in zip(grid[:-1], grid[1:]):
        d = objective.derivative(predict, x, t)
        x_next = x + (t_next - t) * d
        if method == "heun" and objective.can_correct(t_next):
            d_next = objective.derivative(predict, x_next, t_next)
            x_next = x + (t_next - t) * 0.5 * (d + d_next)
        x = x_next
    return x


def _unwrap(model: nn.Module) -> nn.Module:
    """Strips DistributedDataParallel / ``torch.compile`` wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def make_ema(model: nn.Module) -> nn.Module:
    """An fp32, frozen, eval-mode deep copy of ``model`` to hold the exponential moving average."""
    ema = copy.deepcopy(_unwrap(model)).float().eval()
    ema.requires_grad_(False)
    return ema


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """``ema = decay * ema + (1 - decay) * model``, accumulated in fp32 (no warm-up).

    Parameters are matched by name; buffers are copied. ``model`` may be DDP- or compile-wrapped.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
    source = _unwrap(model)
    ema_params = dict(ema.named_parameters())
    for name, param in source.named_parameters():
        ema_params[name].lerp_(param.detach().to(ema_params[name].dtype), 1.0 - decay)
    ema_buffers = dict(ema.named_buffers())
    for name, buf in source.named_buffers():
        if name in ema_buffers:
            ema_buffers[name].copy_(buf)


def warmup_ema_decay(decay: float, step: int) -> float:
    """Optional warm-up: ``min(decay, (1 + step) / (10 + step))`` for early steps."""
    return min(decay, (1 + step) / (10 + step))
