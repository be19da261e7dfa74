"""Builders of the research population's SSM and linear-attention cases (see ``population.py``).

The Mamba models vendor ``mamba_ssm``, whose fast path calls CUDA kernels (``causal_conv1d``,
``selective_scan``): :func:`vendored_mamba` imports the vendored package with those kernels
replaced by its own reference path (``selective_scan_ref``, ``mamba_inner_ref``) and a plain
causal ``F.conv1d``. The RWKV model's WKV kernel becomes :func:`bi_wkv`, the same math.

Example:
    >>> import torch
    >>> from benchmarks.research.cases_ssm import BUILDERS, bi_wkv, causal_conv1d_ref
    >>> "feizc/DiS" in BUILDERS
    True
    >>> k = v = torch.randn(2, 5, 3)
    >>> bi_wkv(2, 5, 3, torch.ones(3), torch.zeros(3), k, v).shape
    torch.Size([2, 5, 3])
    >>> causal_conv1d_ref(torch.randn(1, 3, 5), torch.randn(3, 4), None, "silu").shape
    torch.Size([1, 3, 5])
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.metadata
import sys
import types
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.coverage_community_repos import import_snapshot
from benchmarks.research.kernels import provide_module, xformers_attention
from benchmarks.research.population import Build, entries

__all__ = ["BUILDERS", "bi_wkv", "causal_conv1d_ref", "listed_config", "vendored_mamba"]

Inputs = Callable[[], tuple[tuple, dict]]


def listed_config(repo: str, **fixes: Any) -> dict:
    """The listed tiny config of ``repo`` (``population.json``), with ``fixes`` (each said in
    the row's note)."""
    entry = next(e for e in entries() if e["repo"] == repo)
    return {**copy.deepcopy(entry["config"]), **fixes}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _class_inputs(t_long: bool = False) -> Inputs:
    """``(x [2, 4, 16, 16], t [2] (float, or long), y [2] long)``."""

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, 4, 16, 16, generator=_gen())
        t = torch.tensor([100, 700]) if t_long else torch.tensor([100.0, 700.0])
        return (x, t, torch.tensor([1, 2])), {}

    return inputs


# -- plain-PyTorch kernels -----------------------------------------------------------------


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``causal_conv1d_fn`` (``x [B, D, L]``, depthwise ``weight [D, W]``) as ``F.conv1d``:
    the library's own ``causal_conv1d_ref``."""
    width = weight.shape[1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    out = out[..., : x.shape[-1]]
    return out if activation is None else F.silu(out)


def _inner_no_out_proj(ssi: types.ModuleType) -> Callable[..., torch.Tensor]:
    """``mamba_inner_fn_no_out_proj`` (bimamba v2): ``mamba_inner_ref`` without the output
    projection, i.e. the gated scan output ``[B, D, L]``, on the module's ``selective_scan_ref``.

    DiMSUM's ``_cond`` variants pass ``init_states``: their CUDA conv
    (``causal_conv1d_fwd_cond``) writes the plain causal conv into that buffer
    (``out = init_x``), so the value is the same and ``init_states`` is ignored here."""

    def inner(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, A, B=None,
              C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
              delta_softplus=True, init_states=None):  # fmt: skip
        length, rank, d_state = xz.shape[-1], delta_proj_weight.shape[1], A.shape[-1]
        x, z = xz.chunk(2, dim=1)
        x = causal_conv1d_ref(x, conv1d_weight.squeeze(1), conv1d_bias, "silu")
        x_dbl = F.linear(x.transpose(1, 2).reshape(-1, x.shape[1]), x_proj_weight)
        delta = (delta_proj_weight @ x_dbl[:, :rank].t()).reshape(-1, xz.shape[0], length)
        delta = delta.transpose(0, 1)

        def per_token(cols: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            cols = cols if bias is None else cols + bias
            return cols.reshape(xz.shape[0], length, d_state).transpose(1, 2).contiguous()

        B = per_token(x_dbl[:, rank : rank + d_state], B_proj_bias) if B is None else B
        C = per_token(x_dbl[:, -d_state:], C_proj_bias) if C is None else C
        return ssi.selective_scan_ref(x, delta, A, B, C, D, z=z, delta_bias=delta_bias,
                                      delta_softplus=delta_softplus)  # fmt: skip

    return inner


def _kernel_stand_ins(ssi: types.ModuleType) -> dict[str, Any]:
    """Each CUDA entry point of a ``selective_scan_interface`` and its reference stand-in."""
    found = {
        "causal_conv1d_fn": causal_conv1d_ref,
        "selective_scan_fn": getattr(ssi, "selective_scan_ref", None),
        "mamba_inner_fn": getattr(ssi, "mamba_inner_ref", None),
        "bimamba_inner_fn": getattr(ssi, "bimamba_inner_ref", None),
        "mamba_inner_fn_no_out_proj": _inner_no_out_proj(ssi),
        "mamba_inner_fn_no_out_proj_cond": _inner_no_out_proj(ssi),
    }
    if hasattr(ssi, "mamba_inner_ref"):
        found["mamba_inner_fn_cond"] = lambda *args, init_states=None, **kw: ssi.mamba_inner_ref(
            *args, **kw
        )
    return {name: fn for name, fn in found.items() if fn is not None}


def _norm_stand_ins(ln: types.ModuleType) -> dict[str, Any]:
    """``layer_norm_fn``/``rms_norm_fn`` (Triton) as the file's own ``layer_norm_ref`` and
    ``rms_norm_ref`` (the residual handed on in fp32 where asked, as the kernel does)."""

    def layer_norm_fn(x, weight, bias, residual=None, eps=1e-6, prenorm=False,
                      residual_in_fp32=False, is_rms_norm=False):  # fmt: skip
        ref = ln.rms_norm_ref if is_rms_norm else ln.layer_norm_ref
        out, res = ref(x, weight, bias, residual=residual, eps=eps, prenorm=True)
        res = res.float() if residual_in_fp32 else res
        return (out, res) if prenorm else out

    def rms_norm_fn(x, weight, bias, residual=None, prenorm=False, residual_in_fp32=False,
                    eps=1e-6):  # fmt: skip
        return layer_norm_fn(x, weight, bias, residual, eps, prenorm, residual_in_fp32, True)

    return {"layer_norm_fn": layer_norm_fn, "rms_norm_fn": rms_norm_fn}


def _package_stub(folder: Path, package: str) -> types.ModuleType:
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        del sys.modules[name]
    stub = types.ModuleType(package)
    stub.__path__ = [str(Path(folder) / package.replace(".", "/"))]
    sys.modules[package] = stub
    return stub


def vendored_mamba(folder: Path, modules: tuple[str, ...], package: str = "mamba_ssm") -> list:
    """Import ``package.<module>`` for each of ``modules`` from ``folder/package`` (a vendored
    or installed ``mamba_ssm``) with its CUDA and Triton kernels replaced by its reference path.

    The package's ``__init__`` (language-model utilities importing an old ``transformers``) is
    not run; the CUDA extension modules are empty stand-ins so the interface file imports, and
    every imported module's kernel names are rebound to their stand-ins (a model file importing
    them afterwards gets the stand-ins). The package exports ``Mamba``/``Mamba2`` as its
    ``__init__`` would."""
    for name in ("causal_conv1d_cuda", "selective_scan_cuda"):
        provide_module(name)
    provide_module("causal_conv1d", causal_conv1d_fn=causal_conv1d_ref, causal_conv1d_update=None)
    stub = _package_stub(folder, package)
    with _on_path(folder):
        ssi = importlib.import_module(f"{package}.ops.selective_scan_interface")
        triton_dir = Path(stub.__path__[0]) / "ops" / "triton"
        names = [n for n in ("layernorm", "layer_norm") if (triton_dir / f"{n}.py").exists()]
        norms = [importlib.import_module(f"{package}.ops.triton.{n}") for n in names]
        loaded = [importlib.import_module(f"{package}.{m}") for m in modules]
    stand_ins = _kernel_stand_ins(ssi)
    for ln in norms:
        stand_ins.update(_norm_stand_ins(ln))
    for module in [ssi, *norms, *loaded]:
        for name, fn in stand_ins.items():
            if name in vars(module):
                setattr(module, name, fn)
    for module in loaded:
        for name in ("Mamba", "Mamba2"):
            if module.__name__.endswith(("mamba_simple", "mamba2")) and hasattr(module, name):
                setattr(stub, name, getattr(module, name))
    stub.selective_scan_fn, stub.mamba_inner_fn = ssi.selective_scan_fn, ssi.mamba_inner_fn
    return loaded


@contextlib.contextmanager
def _on_path(folder: Path) -> Iterator[None]:
    saved = sys.path[:]
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path[:] = saved


def bi_wkv(B: int, T: int, C: int, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Vision-RWKV's bidirectional WKV (``cuda/wkv_cuda.cu``) in plain PyTorch:
    ``y_t = (sum_{i!=t} e^{-(|t-i|-1) w + k_i} v_i + e^{u + k_t} v_t) / (same without v + eps)``
    over all ``T`` tokens, per channel; ``k, v [B, T, C]``, ``w, u [C]``."""
    pos = torch.arange(k.shape[1], device=k.device)
    dist = (pos[:, None] - pos[None, :]).abs()
    logits = -(dist - 1)[..., None].to(k.dtype) * w + k[:, None]  # [B, t, i, C]
    diagonal = torch.eye(k.shape[1], dtype=torch.bool, device=k.device)[..., None]
    logits = torch.where(diagonal, u + k[:, None], logits)
    weights = torch.exp(logits - logits.amax(dim=2, keepdim=True))
    return (weights * v[:, None]).sum(2) / (weights.sum(2) + 1e-6)


@contextlib.contextmanager
def _no_cpp_extension_load() -> Iterator[None]:
    """``torch.utils.cpp_extension.load`` returns an empty module while a file imports."""
    import torch.utils.cpp_extension as ext

    saved = ext.load
    ext.load = lambda name, *_, **__: types.ModuleType(name)
    try:
        yield
    finally:
        ext.load = saved


# -- other stand-ins -------------------------------------------------------------------------


class BlockDiagonalMask:
    """xformers' ``BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen)``: sample ``i``'s
    queries attend to sample ``i``'s keys in a packed ``[1, sum(N), H, D]`` call."""

    def __init__(self, q_seqlen: list[int], kv_seqlen: list[int] | None = None) -> None:
        self.q_seqlen, self.kv_seqlen = list(q_seqlen), list(kv_seqlen or q_seqlen)

    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int] | None = None) -> Any:
        return cls(q_seqlen, kv_seqlen)

    @staticmethod
    def _lengths(seqlens: list) -> torch.Tensor:
        return torch.tensor([int(n) for n in seqlens])  # xformers takes float counts as ints

    def materialize(self, device: torch.device) -> torch.Tensor:
        """The boolean ``[sum(q), sum(kv)]`` mask (True: attend)."""
        q = torch.repeat_interleave(torch.arange(len(self.q_seqlen)), self._lengths(self.q_seqlen))
        k = torch.repeat_interleave(
            torch.arange(len(self.kv_seqlen)), self._lengths(self.kv_seqlen)
        )
        return (q[:, None] == k[None, :]).to(device)


def memory_efficient_attention(q, k, v, attn_bias=None, p: float = 0.0, scale=None, **_: Any):
    """xformers' ``memory_efficient_attention`` (``[B, N, H, D]``) as SDPA, a block-diagonal
    bias as its dense mask."""
    if isinstance(attn_bias, BlockDiagonalMask):
        attn_bias = attn_bias.materialize(q.device)
    return xformers_attention(q, k, v, attn_bias=attn_bias, p=p, scale=scale)


def _installed_mamba(modules: tuple[str, ...]) -> list:
    """``vendored_mamba`` on the installed ``mamba_ssm`` (2.x, built without CUDA)."""
    site = Path(importlib.metadata.distribution("mamba_ssm").locate_file(""))
    return vendored_mamba(site, modules)


@contextlib.contextmanager
def _tolerant_auto_register() -> Iterator[None]:
    """transformers' ``Auto*.register`` ignores a name it already holds (fla 0.1 registers
    ``bitnet``, which transformers 5 ships) while fla imports."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    saved = {cls: cls.__dict__.get("register") for cls in (AutoConfig, AutoModel,
                                                           AutoModelForCausalLM)}  # fmt: skip
    for cls in saved:

        def register(*args, _orig=cls.register, **kw):
            with contextlib.suppress(ValueError):
                return _orig(*args, **kw)

        cls.register = staticmethod(register)
    try:
        yield
    finally:
        for cls, value in saved.items():
            if value is None:
                delattr(cls, "register")
            else:
                cls.register = value


def _fla_rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    """fla's Triton ``rms_norm`` as its own ``rms_norm_ref``."""
    from fla.modules import layernorm

    out, res = layernorm.rms_norm_ref(x, weight, bias, residual=residual, eps=eps, prenorm=True)
    res = res.float() if residual_in_fp32 else res
    return (out, res) if prenorm else out


def _swiglu_linear(x, y, weight, bias=None) -> torch.Tensor:
    """fla's ``swiglu_linear`` (a CUDA jiterator kernel): ``(swish(x) * y) W + b``."""
    return F.linear(F.silu(x) * y, weight, bias)


# -- builders --------------------------------------------------------------------------------

_MAMBA_NOTE = ("mamba_ssm imported without its __init__ (LM utilities need an old "
               "transformers); CUDA causal_conv1d/selective_scan/mamba_inner_fn -> F.conv1d + "
               "selective_scan_ref/mamba_inner_ref; Triton layer/rms norm fns -> the file's "
               "*_norm_ref")  # fmt: skip
_INNER_NOTE = "bimamba v2 mamba_inner_fn_no_out_proj -> the same on selective_scan_ref"


def _dis(root: Path) -> Build:
    vendored_mamba(root / "mamba", ("modules.mamba_simple",))
    (mod,) = import_snapshot(root, "models_dis")
    config = listed_config("feizc/DiS")
    note = f"vendored {_MAMBA_NOTE}; {_INNER_NOTE}"
    return Build(lambda: mod.DisModel(**config), _class_inputs(), note=note)


def _drwkv(root: Path) -> Build:
    with _no_cpp_extension_load():
        (mod,) = import_snapshot(root, "models_drwkv")
    mod.RUN_CUDA = bi_wkv
    config = listed_config("feizc/Diffusion-RWKV")
    note = ("WKV cpp_extension load + RUN_CUDA -> bi_wkv, the same bidirectional WKV in "
            "PyTorch; mmcv 1.7.2 installed (BaseModule kept)")  # fmt: skip
    return Build(lambda: mod.DiffRWKVModel(**config), _class_inputs(), note=note)


def _dim(root: Path) -> Build:
    from diffusers.models.transformers import transformer_2d

    sys.modules.setdefault("diffusers.models.transformer_2d", transformer_2d)
    vendored_mamba(root, ("modules.mamba_simple",))
    mod, init = import_snapshot(root, "mamba_attn_diff.models.mamba_2d",
                                "mamba_attn_diff.utils.init_weights")  # fmt: skip
    config = listed_config("tyshiwo1/DiM-DiffusionMamba", num_layers=5)

    def make() -> nn.Module:
        model = mod.Mamba2DModel(**config)
        init.init_embedders(model)  # what utils.get_nnet does after building
        return model

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, 4, 8, 8, generator=_gen())
        kw = dict(timestep=torch.tensor([100, 700]), class_labels=torch.tensor([1, 2]))
        return (x,), {**kw, "return_dict": False}

    note = (f"vendored {_MAMBA_NOTE}; diffusers.models.transformer_2d aliased to "
            "diffusers.models.transformers.transformer_2d (moved in diffusers 0.42); num_layers "
            "4 -> 5 (the code asserts (num_layers - encoder_start_blk_id) % 2 == 0)")  # fmt: skip
    return Build(make, inputs, note=note)


def _zigma(root: Path) -> Build:
    vendored_mamba(root, ("modules.mamba_simple",), package="dis_mamba.mamba_ssm")
    _, mod = import_snapshot(root, "utils.utils_zigzag", "model_zigma")
    config = listed_config("CompVis/zigma")

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, 4, 8, 8, generator=_gen())
        return (x, torch.tensor([0.1, 0.7]), torch.tensor([1, 2])), {}

    note = f"vendored dis_mamba {_MAMBA_NOTE}; device='cpu' (listed)"
    return Build(lambda: mod.ZigMa(**config), inputs, note=note)


def _dimsum(root: Path) -> Build:
    vendored_mamba(root / "mamba", ("modules.mamba_simple",))
    (mod,) = import_snapshot(root / "dimsum", "models_dim")
    config = listed_config("VinAIResearch/DiMSUM")
    note = (f"vendored {_MAMBA_NOTE}; CondMamba's *_cond kernels -> the same stand-ins "
            "(the CUDA cond conv overwrites init_states with the plain conv)")  # fmt: skip
    return Build(lambda: mod.DiM(**config), _class_inputs(), note=note)


def _dimba(root: Path) -> Build:
    provide_module("xformers")
    provide_module("xformers.ops", memory_efficient_attention=memory_efficient_attention)
    provide_module("xformers.ops.fmha", BlockDiagonalMask=BlockDiagonalMask)
    vendored_mamba(root / "mamba", ("modules.mamba_simple",))
    (mod,) = import_snapshot(root, "diffusion.model.nets.dimba")
    config = listed_config("feizc/Dimba", class_dropout_prob=0.0)

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, 4, 16, 16, generator=_gen())
        y = torch.randn(2, 1, 8, 32, generator=_gen())
        return (x, torch.tensor([100.0, 700.0]), y), {"mask": torch.ones(2, 8)}

    note = (f"vendored {_MAMBA_NOTE} (create_block hard-codes rms_norm/fused_add_norm: "
            f"rms_norm_fn -> rms_norm_ref); {_INNER_NOTE}; xformers memory_efficient_attention"
            " + BlockDiagonalMask -> SDPA with the dense block-diagonal mask; class_dropout_prob "
            "0.1 -> 0 (CaptionEmbedder.token_drop calls torch.rand(...).cuda() in training)"
            )  # fmt: skip
    return Build(lambda: mod.Dimba(**config), inputs, note=note)


def _xdiffusion(root: Path) -> Build:
    mod, utils = import_snapshot(root, "xdiffusion.score_networks.diffussm", "xdiffusion.utils")
    config = listed_config("swookey-thinky/xdiffusion")["config"]

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, 4, 8, 8, generator=_gen())
        return (x, {"timestep": torch.tensor([100, 700])}), {}

    note = "config handed as xdiffusion.utils.DotConfig (as the yaml's score_network params)"
    return Build(lambda: mod.DiffusionSSM(utils.DotConfig(config)), inputs, note=note)


def _vespa(root: Path) -> Build:
    vendored_mamba(root / "mamba", ("modules.mamba_simple",))
    (mod,) = import_snapshot(root, "models_vespa")
    config = listed_config("feizc/Vespa")

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(4, 4, 16, 16, generator=_gen())
        context = torch.randn(4, 8, 32, generator=_gen())
        return (x, torch.tensor([100.0, 100.0, 700.0, 700.0])), {"f": 2, "context": context}

    note = f"vendored {_MAMBA_NOTE}; {_INNER_NOTE}; 2 videos x 2 frames in the batch"
    return Build(lambda: mod.VeSpaVideoModel(**config), inputs, note=note)


class _SelectiveScanRef:
    """VMamba's ``SelectiveScanCore/Oflex/Mamba`` Functions (CUDA) as ``selective_scan_ref``."""

    ref: Callable[..., torch.Tensor]

    @classmethod
    def apply(cls, u, delta, A, B, C, D=None, delta_bias=None, delta_softplus=False, *_: Any):
        return cls.ref(u, delta, A, B, C, D, delta_bias=delta_bias, delta_softplus=delta_softplus)


def _lamamba(root: Path) -> Build:
    _installed_mamba(())
    _SelectiveScanRef.ref = staticmethod(sys.modules["mamba_ssm.ops.selective_scan_interface"]
                                         .selective_scan_ref)  # fmt: skip
    vmamba, mod = import_snapshot(root, "model.vmamba", "model.lamamba")
    for module in (vmamba, mod):
        for name in ("SelectiveScanCore", "SelectiveScanOflex", "SelectiveScanMamba"):
            if hasattr(module, name):
                setattr(module, name, _SelectiveScanRef)
    config = listed_config(
        "yunxiangfu2001/LaMamba-Diff", in_resolution=8, depths=[1] * 4, dims=16, num_heads=[2] * 4
    )
    note = ("SelectiveScanCore/Oflex/Mamba (selective_scan_cuda_*) -> mamba_ssm 2.3.2's "
            "selective_scan_ref; forward_type v2 uses the PyTorch CrossScan/CrossMerge; "
            "in_resolution 16 -> 8 (the token grid: pos_embed [1, R, R, C]); 2 stages -> 4 "
            "(depths [1]*4, dims=16 -> [16, 32, 64, 64]; the code hard-codes skip=2 stages "
            "without downsampling, so 2 listed stages of different widths cannot build)"
            )  # fmt: skip
    return Build(lambda: mod.LaMambaDiff(**config), _class_inputs(t_long=True), note=note)


def _ssm_video(root: Path) -> Build:
    (mod,) = import_snapshot(root, "video_diffusion_pytorch.wip_video_diffusion_pytorch")
    config = listed_config("shim0114/SSM-Meets-Video-Diffusion-Models")

    def inputs() -> tuple[tuple, dict]:
        x = torch.randn(2, 3, 4, 16, 16, generator=_gen())
        return (x, torch.tensor([100, 700])), {}

    return Build(lambda: mod.Unet3D(**config), inputs)


def _mail(root: Path) -> Build:
    from omegaconf import OmegaConf

    simple, block = _installed_mamba(("modules.mamba_simple", "modules.block"))
    # mamba_ssm 1.x's Block (add, norm, mixer) is 2.x's Block without an MLP
    simple.Block = partial(block.Block, mlp_cls=nn.Identity)
    (mod,) = import_snapshot(root, "agents.models.oc_ddpm.diffusion_mamba")
    config = listed_config("ALRhub/MaIL")
    config["mamba"] = OmegaConf.create(config["mamba"])

    def make() -> nn.Module:
        with _on_path(root):  # hydra imports the MixerModel target by name
            return mod.DiffusionMambaOnly(**config)

    def inputs() -> tuple[tuple, dict]:
        g = _gen()
        actions, states = torch.randn(2, 16, 4, generator=g), torch.randn(2, 1, 32, generator=g)
        return (actions, torch.tensor([0.1, 0.7]), states, None), {}

    note = (f"installed mamba_ssm 2.3.2 (no CUDA build): {_MAMBA_NOTE}; 1.x API "
            "mamba_simple.Block = 2.x modules.block.Block, mlp_cls=nn.Identity")  # fmt: skip
    return Build(make, inputs, note=note)


def _mamba_policy(root: Path) -> Build:
    _installed_mamba(("modules.mamba_simple", "modules.mamba2"))
    (mod,) = import_snapshot(root / "3D-Diffusion-Policy",
                             "diffusion_policy_3d.model.diffusion.conditional_unet1d")  # fmt: skip
    config = listed_config("SageCao1125/Mamba-Policy")

    def inputs() -> tuple[tuple, dict]:
        g = _gen()
        sample, cond = torch.randn(2, 16, 4, generator=g), torch.randn(2, 32, generator=g)
        return (sample, torch.tensor([100, 700])), {"global_cond": cond}

    note = f"installed mamba_ssm 2.3.2 (no CUDA build): {_MAMBA_NOTE}"
    return Build(lambda: mod.ConditionalUnet1D(**config), inputs, note=note)


def _diffma(root: Path) -> Build:
    _installed_mamba(("modules.mamba_simple",))
    *_, mod = import_snapshot(root, "block.mamba_block", "tools", "model")
    config = listed_config("wongzbb/DiffMa-Diffusion-Mamba")

    def inputs() -> tuple[tuple, dict]:
        g = _gen()
        x, y = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 64, generator=g)
        y2, w = torch.randn(2, 64, 64, generator=g), torch.rand(2, 64, 1, generator=g)
        return (x, torch.tensor([100, 700]), y, y2, w), {}

    note = (f"installed mamba_ssm 2.3.2 (no CUDA build): {_MAMBA_NOTE} (block/mamba.py imports "
            "them by name); block/mamba2.py imported, unused (use_mamba2=False)")  # fmt: skip
    return Build(lambda: mod.DiffMa(**config), inputs, note=note)


def _dig(root: Path) -> Build:
    with _tolerant_auto_register():
        importlib.import_module("fla.models")
    from fla.modules import activations, layernorm

    layernorm.rms_norm = _fla_rms_norm
    swish = activations.swish  # a torch.cuda.jiterator kernel
    activations.ACT2FN = {k: F.silu if f is swish else f for k, f in activations.ACT2FN.items()}
    _, blocks, mod = import_snapshot(root, "models_dit", "module_dig", "models_dig")
    blocks.swiglu_linear = _swiglu_linear
    config = listed_config("hustvl/DiG")
    note = ("flash-linear-attention 0.1: attn_model='naive' (naive_recurrent_gla, PyTorch); "
            "fla RMSNorm's Triton rms_norm -> fla's rms_norm_ref; fla swish (CUDA jiterator) -> "
            "F.silu, swiglu_linear -> F.linear(silu(x) * y); transformers Auto*.register "
            "tolerates fla's duplicate names while fla imports")  # fmt: skip
    return Build(lambda: mod.DiG(**config), _class_inputs(t_long=True), note=note)


BUILDERS = {
    "feizc/DiS": _dis,
    "feizc/Diffusion-RWKV": _drwkv,
    "tyshiwo1/DiM-DiffusionMamba": _dim,
    "CompVis/zigma": _zigma,
    "hustvl/DiG": _dig,
    "VinAIResearch/DiMSUM": _dimsum,
    "feizc/Dimba": _dimba,
    "swookey-thinky/xdiffusion": _xdiffusion,
    "feizc/Vespa": _vespa,
    "yunxiangfu2001/LaMamba-Diff": _lamamba,
    "shim0114/SSM-Meets-Video-Diffusion-Models": _ssm_video,
    "ALRhub/MaIL": _mail,
    "SageCao1125/Mamba-Policy": _mamba_policy,
    "wongzbb/DiffMa-Diffusion-Mamba": _diffma,
}
