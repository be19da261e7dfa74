"""Reference diffusion backbones: DiT (transformer), Mamba and RWKV (state-space)."""

from tread_fx.models.dit import *  # noqa: F403
from tread_fx.models.dit import __all__ as _dit_all

__all__ = [*_dit_all]
