"""Reference diffusion backbones: DiT (transformer), Mamba and RWKV (state-space).

Plain PyTorch: nothing here imports tread_fx. One file per backbone and one, ``layers``, for what
they share (embedders, final layer, sin-cos positions, ``unpatchify``, ``forward_with_cfg``'s
contract); the factories of all three are exported here (``tread_fx.models.DiT_B_2``,
``tread_fx.models.Mamba_S_2``, ``tread_fx.models.RWKV_S_2``), the shared layers too, the blocks
from their own modules.

Example:
    >>> from tread_fx import models
    >>> sorted(models.Mamba_models), sorted(models.RWKV_models)
    (['Mamba-B/2', 'Mamba-S/2'], ['RWKV-B/2', 'RWKV-S/2'])
"""

from tread_fx.models import dit, layers, mamba, rwkv
from tread_fx.models.dit import *  # noqa: F403
from tread_fx.models.dit import __all__ as _dit_all
from tread_fx.models.layers import *  # noqa: F403
from tread_fx.models.layers import __all__ as _layers_all
from tread_fx.models.mamba import DiffusionMamba, Mamba_B_2, Mamba_models, Mamba_S_2
from tread_fx.models.rwkv import RWKV_B_2, RWKV_S_2, DiffusionRWKV, RWKV_models

__all__ = [
    *_dit_all,
    *_layers_all,
    "DiffusionMamba",
    "DiffusionRWKV",
    "Mamba_B_2",
    "Mamba_S_2",
    "Mamba_models",
    "RWKV_B_2",
    "RWKV_S_2",
    "RWKV_models",
    "dit",
    "layers",
    "mamba",
    "rwkv",
]
