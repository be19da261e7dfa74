"""Builders of the research population's video cases (see ``population.py``).

Each builder imports the listed model file from its snapshot (a package ``__init__`` that
pulls in pipelines, VAEs or text encoders is skipped with :func:`import_bare`), applies the
listed run-time edits (CUDA-only kernels and device-bound helpers replaced by plain PyTorch of
the same math) and says how to call the model; every edit and config fix is in the note.

Example:
    >>> from benchmarks.research.cases_video import BUILDERS
    >>> "Vchitect/Latte" in BUILDERS
    True
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.coverage_community_repos import import_snapshot
from benchmarks.research.population import Build

__all__ = [
    "BUILDERS",
    "called_under_autocast",
    "cu_seqlens_here",
    "flex_as_sdpa",
    "import_bare",
    "snapshot_function",
    "torch_allowing_math",
    "wan_attention",
]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen())


def import_bare(root: Path, dotted: str, packages: tuple[str, ...] | list[str]) -> Any:
    """Import module ``dotted`` from snapshot ``root`` with ``packages`` registered bare
    (``import_snapshot(..., bare=...)``)."""
    return import_snapshot(root, dotted, bare=tuple(packages))[0]


def _frames_inputs(label: bool) -> tuple[tuple, dict]:
    """``(x [2, F=4, C=4, 8, 8], t [2][, y [2]])``: a class-conditional video DiT call."""
    labels = (torch.tensor([1, 2]),) if label else ()
    return (_randn(2, 4, 4, 8, 8), torch.tensor([0.1, 0.7]), *labels), {}


def _latte(root: Path) -> Build:
    mod = import_bare(root, "models.latte", ("models",))
    config = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=4,
                  num_heads=4, mlp_ratio=4.0, num_frames=4, num_classes=10, learn_sigma=True,
                  extras=2, attention_mode="math")  # fmt: skip
    return Build(lambda: mod.Latte(**config), lambda: _frames_inputs(label=True),
                 note="models/__init__.py (latte_t2v: old diffusers) not run")  # fmt: skip


def _vdt(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models")
    config = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=4,
                  num_heads=4, mlp_ratio=4.0, num_classes=1, learn_sigma=True, mode="video",
                  num_frames=4)  # fmt: skip
    return Build(lambda: mod.VDT(**config), lambda: _frames_inputs(label=False))


def wan_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: Any = None,
    k_lens: torch.Tensor | None = None, dropout_p: float = 0.0,
    softmax_scale: float | None = None, q_scale: float | None = None, causal: bool = False,
    window_size: tuple = (-1, -1), **_: Any,
) -> torch.Tensor:  # fmt: skip
    """Wan's ``flash_attention`` (varlen flash-attn, ``[B, L, H, D]``) as SDPA: keys past
    ``k_lens`` masked out, in the inputs' dtype."""
    if q_lens is not None or tuple(window_size) != (-1, -1):
        raise NotImplementedError("q_lens / sliding window have no stand-in")
    q = q * q_scale if q_scale is not None else q
    mask = None
    if k_lens is not None:
        mask = (torch.arange(k.shape[1], device=k.device) < k_lens[:, None])[:, None, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        dropout_p=dropout_p, is_causal=causal, scale=softmax_scale,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous()


def flex_as_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any = None,
    scale: float | None = None, **_: Any,
) -> torch.Tensor:  # fmt: skip
    """``flex_attention`` with a ``BlockMask`` as SDPA with the dense mask of its
    ``mask_mod`` over the lengths the block mask was made for (CPU flex has no backward)."""
    mask = None
    if block_mask is not None:  # the mask_mod broadcast over the index grid (no vmap)
        q_len, kv_len = block_mask.seq_lengths
        rows = torch.arange(q_len, device=query.device)[:, None]
        mask = block_mask.mask_mod(0, 0, rows, torch.arange(kv_len, device=query.device)[None])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


_WAN = dict(model_type="t2v", patch_size=(1, 2, 2), text_len=8, in_dim=4, dim=64, ffn_dim=128,
            freq_dim=32, text_dim=32, out_dim=4, num_heads=4, num_layers=4, qk_norm=True,
            cross_attn_norm=True)  # fmt: skip
_WAN_NOTE = ("wan/__init__.py and wan/modules/__init__.py (T5, VAE, xfuser) not run; "
             "flash_attention -> SDPA with the k_lens key mask")  # fmt: skip


def _wan(root: Path) -> Build:
    mod = import_bare(root, "wan.modules.model", ("wan", "wan.modules"))
    mod.flash_attention = wan_attention

    def inputs() -> tuple[tuple, dict]:
        x = list(_randn(2, 4, 4, 8, 8).unbind(0))
        context = list(_randn(2, 8, 32).unbind(0))
        return (x, torch.tensor([100.0, 700.0]), context, 64), {}

    make = lambda: mod.WanModel(window_size=(-1, -1), **_WAN)  # noqa: E731
    return Build(make, inputs, note=_WAN_NOTE)


def _self_forcing(root: Path) -> Build:
    model = import_bare(root, "wan.modules.model", ("wan", "wan.modules"))
    model.flash_attention = wan_attention
    causal = importlib.import_module("wan.modules.causal_model")
    causal.flex_attention = flex_as_sdpa

    def inputs() -> tuple[tuple, dict]:
        steps = torch.tensor([[100.0, 300.0, 500.0, 700.0], [50.0, 250.0, 450.0, 650.0]])
        return (_randn(2, 4, 4, 8, 8), steps, _randn(2, 8, 32), 64), {}

    make = lambda: causal.CausalWanModel(local_attn_size=-1, sink_size=0, **_WAN)  # noqa: E731
    note = f"{_WAN_NOTE}; torch.compile(flex_attention) -> SDPA with the BlockMask's dense mask"
    return Build(make, inputs, note=note)


def cu_seqlens_here(text_mask: torch.Tensor, img_len: int) -> torch.Tensor:
    """HunyuanVideo's ``get_cu_seqlens`` (made on ``device="cuda"``) on the mask's device."""
    batch, max_len = text_mask.shape[0], text_mask.shape[1] + img_len
    text_len = text_mask.sum(dim=1)
    cu = torch.zeros([2 * batch + 1], dtype=torch.int32, device=text_mask.device)
    for i in range(batch):
        cu[2 * i + 1] = i * max_len + text_len[i] + img_len
        cu[2 * i + 2] = (i + 1) * max_len
    return cu


def _musubi(root: Path) -> Build:
    src = root / "src"
    mod, pos = import_snapshot(src, "musubi_tuner.hunyuan_model.models",
                               "musubi_tuner.hunyuan_model.posemb_layers")  # fmt: skip
    mod.get_cu_seqlens = cu_seqlens_here
    config = dict(text_states_dim=32, text_states_dim_2=32, patch_size=[1, 2, 2], in_channels=4,
                  hidden_size=64, heads_num=4, mlp_width_ratio=4.0, mm_double_blocks_depth=2,
                  mm_single_blocks_depth=2, rope_dim_list=[4, 6, 6], qkv_bias=True,
                  qk_norm=True, qk_norm_type="rms", guidance_embed=False,
                  text_projection="single_refiner", use_attention_mask=True, attn_mode="torch",
                  split_attn=False)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        cos, sin = pos.get_nd_rotary_pos_embed([4, 6, 6], [4, 4, 4], theta=256, use_real=True)
        kwargs = dict(text_states=_randn(2, 8, 32), text_mask=torch.ones(2, 8, dtype=torch.long),
                      text_states_2=_randn(2, 32), freqs_cos=cos, freqs_sin=sin,
                      return_dict=False)  # fmt: skip
        return (_randn(2, 4, 4, 8, 8), torch.tensor([100.0, 700.0])), kwargs

    make = lambda: mod.HYVideoDiffusionTransformer(**config)  # noqa: E731
    note = "attn_mode='torch' (SDPA); get_cu_seqlens (device='cuda', unused by SDPA) on CPU"
    return Build(make, inputs, note=note)


def _ltx(root: Path) -> Build:
    (mod,) = import_snapshot(root, "ltx_video.models.transformers.transformer3d")
    config = dict(num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16,
                  num_layers=4, cross_attention_dim=64, activation_fn="gelu-approximate",
                  attention_bias=True, adaptive_norm="single_scale_shift",
                  standardization_norm="rms_norm", norm_elementwise_affine=False,
                  caption_channels=32, qk_norm="rms_norm", positional_embedding_type="rope",
                  positional_embedding_theta=10000.0,
                  positional_embedding_max_pos=[20, 2048, 2048],
                  timestep_scale_multiplier=1000.0)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        grid = torch.stack(torch.meshgrid(*(torch.arange(4.0),) * 3, indexing="ij"))
        kwargs = dict(indices_grid=grid.reshape(1, 3, 64).expand(2, 3, 64).clone(),
                      encoder_hidden_states=_randn(2, 8, 32),
                      timestep=torch.tensor([[0.1], [0.7]]),
                      encoder_attention_mask=torch.ones(2, 8), return_dict=False)  # fmt: skip
        return (_randn(2, 64, 16),), kwargs

    return Build(lambda: mod.Transformer3DModel(**config), inputs)


def _framepack(root: Path) -> Build:
    mod = import_bare(root, "diffusers_helper.models.hunyuan_video_packed",
                      ("diffusers_helper", "diffusers_helper.models"))  # fmt: skip
    config = dict(in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=16,
                  num_layers=2, num_single_layers=2, num_refiner_layers=1, mlp_ratio=4.0,
                  patch_size=2, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True,
                  text_embed_dim=32, pooled_projection_dim=32, rope_theta=256.0,
                  rope_axes_dim=(4, 6, 6), has_image_proj=False,
                  has_clean_x_embedder=True)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        kwargs = dict(timestep=torch.tensor([700.0]), encoder_hidden_states=_randn(1, 8, 32),
                      encoder_attention_mask=torch.ones(1, 8, dtype=torch.long),
                      pooled_projections=_randn(1, 32), guidance=torch.tensor([6000.0]),
                      latent_indices=torch.tensor([[3, 4, 5, 6]]),
                      clean_latents=_randn(1, 16, 2, 8, 8),
                      clean_latent_indices=torch.tensor([[0, 7]]), return_dict=False)  # fmt: skip
        return (_randn(1, 16, 4, 8, 8),), kwargs

    note = ("in_channels=out_channels=16 (clean_x_embedder's convs take 16 channels, fixed); "
            "batch 1 (the no-varlen SDPA path, as listed)")  # fmt: skip
    return Build(lambda: mod.HunyuanVideoTransformer3DModelPacked(**config), inputs, note=note)


def _cosmos(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.cosmos_predict2_modeling")
    config = dict(max_img_h=16, max_img_w=16, max_frames=4, in_channels=4, out_channels=4,
                  patch_spatial=2, patch_temporal=1, concat_padding_mask=True,
                  model_channels=64, num_blocks=4, num_heads=4, mlp_ratio=4.0,
                  crossattn_emb_channels=32, pos_emb_cls="rope3d", pos_emb_learnable=False,
                  use_adaln_lora=True, adaln_lora_dim=16, extra_per_block_abs_pos_emb=False,
                  rope_enable_fps_modulation=False, use_llm_adapter=False)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        kwargs = dict(padding_mask=torch.zeros(2, 1, 8, 8))
        return (_randn(2, 4, 4, 8, 8), torch.tensor([0.1, 0.7]), _randn(2, 8, 32)), kwargs

    return Build(lambda: mod.MiniTrainDIT(**config), inputs, note="attention backend 'torch'")


def snapshot_function(path: Path, name: str, namespace: dict) -> Any:
    """Function ``name`` of snapshot file ``path``, run alone in ``namespace`` (for a helper
    whose module imports what this machine lacks)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)  # noqa: S102
    return namespace[name]


def called_under_autocast(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` whose calls run under CPU bf16 autocast (hooks on the model), as a pipeline
    that calls it under CUDA bf16 autocast."""
    entered: list = []

    def enter(*_: Any) -> None:
        entered.append(torch.autocast("cpu", dtype=torch.bfloat16))
        entered[-1].__enter__()

    def leave(*_: Any) -> None:
        entered.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
    return model


def _mochi(root: Path) -> Build:
    get_props = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *_: types.SimpleNamespace(major=0)
    try:
        (mod,) = import_snapshot(root / "src", "genmo.mochi_preview.dit.joint_model"
                                 ".asymm_models_joint")  # fmt: skip
    finally:
        torch.cuda.get_device_properties = get_props
    from torch.nn.attention import SDPBackend, sdpa_kernel

    layers = sys.modules["genmo.mochi_preview.dit.joint_model.layers"]
    mod.sdpa_kernel = lambda backends: sdpa_kernel([backends, SDPBackend.MATH])
    mod.sdpa_attn_ctx = lambda training=False: sdpa_kernel(SDPBackend.MATH)
    pipelines = root / "src/genmo/mochi_preview/pipelines.py"
    names = dict(torch=torch, F=F, Dict=dict, Union=Any, cast=lambda _, v: v)
    packed = snapshot_function(pipelines, "compute_packed_indices", names)
    config = dict(patch_size=2, in_channels=4, hidden_size_x=64, hidden_size_y=32, depth=4,
                  num_heads=4, mlp_ratio_x=192.0, mlp_ratio_y=4.0, t5_feat_dim=32,
                  t5_token_length=8, attention_mode="sdpa", qk_norm=True,
                  qkv_bias=False)  # fmt: skip

    def make() -> torch.nn.Module:
        model = mod.AsymmDiTJoint(**config)
        model.pos_frequencies.data = torch.randn(model.pos_frequencies.shape)  # torch.empty
        for norm in model.modules():  # RMSNorm weights are torch.empty too (loaded later)
            if isinstance(norm, layers.RMSNorm):
                torch.nn.init.ones_(norm.weight)
        return called_under_autocast(model)

    def inputs() -> tuple[tuple, dict]:
        mask = torch.ones(1, 8, dtype=torch.bool)
        indices = packed(torch.device("cpu"), mask, num_latents=256)
        kwargs = dict(y_feat=[_randn(1, 8, 32)], y_mask=[mask], packed_indices=indices)
        return (_randn(1, 4, 4, 8, 8), torch.tensor([0.7])), kwargs

    note = ("attn_imports: torch.cuda.get_device_properties guarded at import; sdpa_kernel "
            "contexts allow MATH; called under CPU bf16 autocast (hooks; prepare_qkv asserts "
            "bf16, the pipeline calls it under CUDA bf16 autocast); torch.empty parameters "
            "(pos_frequencies, RMSNorm weights; loaded from a checkpoint) set to randn / ones; "
            "qk_norm=True, qkv_bias=False (the released config; qk_norm is asserted); "
            "mlp_ratio_x=192 (the block asserts an MLP width of 12288); batch 1 (sdpa mode); "
            "compute_packed_indices run from pipelines.py alone with num_latents=256 "
            "(T*H*W latents, listed 64)")  # fmt: skip
    return Build(make, inputs, note=note)


def torch_allowing_math() -> types.ModuleType:
    """``torch`` for a model module, but ``torch.backends.cuda.sdp_kernel(...)`` (a CUDA
    backend choice that turns the math kernel off) allows every SDPA backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]
    every = [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]
    allow = lambda **_: sdpa_kernel(every)  # noqa: E731
    proxy.backends = types.SimpleNamespace(cuda=types.SimpleNamespace(sdp_kernel=allow))
    return proxy


def _open_sora_plan(root: Path) -> Build:
    packages = ("opensora", "opensora.models", "opensora.models.diffusion",
                "opensora.models.diffusion.opensora_v1_3")  # fmt: skip
    mod = import_bare(root, "opensora.models.diffusion.opensora_v1_3.modeling_opensora", packages)
    sys.modules["opensora.models.diffusion.opensora_v1_3.modules"].torch = torch_allowing_math()
    config = dict(num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4,
                  num_layers=4, cross_attention_dim=48, attention_bias=True, sample_size_h=8,
                  sample_size_w=8, sample_size_t=4, patch_size=2, patch_size_t=1,
                  activation_fn="gelu-approximate", norm_elementwise_affine=False,
                  norm_eps=1e-06, caption_channels=32, sparse1d=True, sparse_n=4)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        kwargs = dict(encoder_hidden_states=_randn(2, 1, 8, 32),
                      attention_mask=torch.ones(2, 4, 8, 8),
                      encoder_attention_mask=torch.ones(2, 1, 8), return_dict=False)  # fmt: skip
        return (_randn(2, 4, 4, 8, 8), torch.tensor([100, 700])), kwargs

    note = ("the opensora, opensora.models(.diffusion) __init__ files (VAEs, inpaint) not run; "
            "attention_head_dim=12, cross_attention_dim=48 (RoPE3D needs a head dim divisible "
            "by 3, listed 16/64); sparse_n=4 (the forward prepares masks for 1 and 4 only, "
            "listed 2); sdp_kernel(mem-efficient only, CUDA) -> any SDPA backend")  # fmt: skip
    return Build(lambda: mod.OpenSoraT2V_v1_3(**config), inputs, note=note)


def _pyramid_flow(root: Path) -> Build:
    mod = import_bare(root, "pyramid_dit.flux_modules.modeling_pyramid_flux",
                      ("pyramid_dit", "pyramid_dit.flux_modules"))  # fmt: skip
    config = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                  attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                  pooled_projection_dim=32, axes_dims_rope=[4, 6, 6], use_flash_attn=False,
                  use_temporal_causal=True, interp_condition_pos=True,
                  use_gradient_checkpointing=False)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        gen = _gen()
        draw = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
        sample = [[draw(2, 4, 2, 4, 4)], [draw(2, 4, 1, 4, 4), draw(2, 4, 2, 8, 8)]]
        kwargs = dict(encoder_hidden_states=draw(4, 8, 32), encoder_attention_mask=torch.ones(
            4, 8, dtype=torch.long), pooled_projections=draw(4, 32),
            timestep_ratio=torch.tensor([0.9, 0.9, 0.4, 0.4]))  # fmt: skip
        return (sample,), kwargs

    note = ("pyramid_dit and pyramid_dit.flux_modules __init__ files (pipeline, VAE) not run; "
            "latents 4-channel (in_channels=16 is 2x2-packed: patch_size is hard-coded 2): "
            "stage 0 [2,4,2,4,4], stage 1 history [2,4,1,4,4] + noisy [2,4,2,8,8]")  # fmt: skip
    return Build(lambda: mod.PyramidFluxTransformer(**config), inputs, note=note)


def _vchitect(root: Path) -> Build:
    (mod,) = import_snapshot(root, "models.VchitectXL")
    config = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
                  pooled_projection_dim=32, out_channels=4, pos_embed_max_size=8,
                  tp_size=1)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        kwargs = dict(encoder_hidden_states=_randn(1, 8, 32), pooled_projections=_randn(1, 32),
                      timestep=torch.tensor([700.0]), return_dict=False)  # fmt: skip
        return (_randn(1, 4, 4, 8, 8),), kwargs

    note = ("batch 1, as the pipeline calls it (the blocks get temb.repeat(F, 1) beside "
            "[B, L, C] text: batch 2 fails unrouted)")  # fmt: skip
    return Build(lambda: mod.VchitectXLTransformerModel(**config), inputs, note=note)


def _never(name: str) -> type:
    """A stand-in for an imported name the built model never calls (raises if called)."""

    def fail(*_: Any, **__: Any) -> None:
        raise NotImplementedError(f"{name} has no stand-in here")

    return type(name, (), {"apply": staticmethod(fail), "__init__": fail})


_STAND_INS = ("flash_attn", "liger_kernel", "tensornvme")


def _open_sora(root: Path) -> Build:
    from benchmarks.research.kernels import flash_attn_func, provide_module

    importlib.import_module("colossalai.booster")  # before the stand-ins (it probes flash_attn)
    provide_module("flash_attn", flash_attn_func=flash_attn_func)
    provide_module("liger_kernel.ops.rope", LigerRopeFunction=_never("LigerRopeFunction"))
    provide_module("liger_kernel.ops.rms_norm", LigerRMSNormFunction=_never("LigerRMSNorm"))
    provide_module("tensornvme.async_file_io", AsyncFileWriter=_never("AsyncFileWriter"))
    mod = import_bare(root, "opensora.models.mmdit.model",
                      ("opensora", "opensora.models", "opensora.models.mmdit"))  # fmt: skip
    for name in [m for m in sys.modules if m.split(".")[0] in _STAND_INS]:
        del sys.modules[name]  # bound in the model files; gone for other importers
    layers = sys.modules["opensora.models.mmdit.layers"]
    layers.FusedRMSNorm.forward = layers.RMSNorm.forward
    config = dict(from_pretrained=None, cache_dir=None, in_channels=16, vec_in_dim=32,
                  context_in_dim=32, hidden_size=64, mlp_ratio=4.0, num_heads=4, depth=2,
                  depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000, qkv_bias=True,
                  guidance_embed=False, cond_embed=False, fused_qkv=True,
                  grad_ckpt_settings=None, use_liger_rope=False, patch_size=2)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        grid = torch.stack(torch.meshgrid(*(torch.arange(4.0),) * 3, indexing="ij"), -1)
        kwargs = dict(img_ids=grid.reshape(1, 64, 3).expand(2, 64, 3).clone(),
                      txt=_randn(2, 8, 32), txt_ids=torch.zeros(2, 8, 3),
                      timesteps=torch.tensor([0.1, 0.7]), y_vec=_randn(2, 32))  # fmt: skip
        return (_randn(2, 64, 16),), kwargs

    note = ("opensora.models(.mmdit) __init__ files (VAEs, text encoders) not run; flash_attn "
            "-> SDPA (kernels.flash_attn_func); FusedRMSNorm (liger Triton) -> the file's "
            "RMSNorm.forward; liger_kernel and tensornvme (AsyncFileWriter, checkpoint saving) "
            "provided as names never called")  # fmt: skip
    return Build(lambda: mod.MMDiTModel(mod.MMDiTConfig(**config)), inputs, note=note)


def _videosys(root: Path) -> Build:
    mod = import_bare(root, "videosys.models.transformers.open_sora_transformer_3d",
                      ("videosys",))  # fmt: skip
    config = dict(input_size=(4, 8, 8), input_sq_size=8, in_channels=4, patch_size=(1, 2, 2),
                  hidden_size=64, depth=2, num_heads=4, mlp_ratio=4.0, pred_sigma=True,
                  caption_channels=32, model_max_length=8, qk_norm=True,
                  enable_flash_attn=False, class_dropout_prob=0.0)  # fmt: skip

    def make() -> torch.nn.Module:
        model = mod.STDiT3(mod.STDiT3Config(**config))
        manager = object.__new__(mod.ParallelManager)  # its sizes-1 state, no process groups
        vars(manager).update(dp_size=1, cp_size=1, sp_size=1, dp_group=None, cp_group=None,
                             sp_group=None, dp_rank=0, cp_rank=None, sp_rank=None)  # fmt: skip
        model.enable_parallel(parallel_mgr=manager)
        return model

    def inputs() -> tuple[tuple, dict]:
        size = torch.tensor([64.0, 64.0])
        kwargs = dict(mask=torch.ones(2, 8, dtype=torch.long), fps=torch.tensor([24.0, 24.0]),
                      height=size, width=size.clone())  # fmt: skip
        return (_randn(2, 4, 4, 8, 8), torch.tensor([100.0, 700.0]), _randn(2, 1, 8, 32)), kwargs

    note = ("videosys/__init__.py (pipelines) not run; a ParallelManager holding the state "
            "__init__ gives dp = cp = sp = 1, without process groups (a ProcessGroup cannot be "
            "deep-copied); enable_flash_attn=False, PAB off; class_dropout_prob=0 (the "
            "caption drop draws its mask with .cuda() in training)")  # fmt: skip
    return Build(make, inputs, note=note)


BUILDERS = {
    "Vchitect/Latte": _latte,
    "RERV/VDT": _vdt,
    "Wan-Video/Wan2.1": _wan,
    "guandeh17/Self-Forcing": _self_forcing,
    "kohya-ss/musubi-tuner": _musubi,
    "Lightricks/LTX-Video": _ltx,
    "lllyasviel/FramePack": _framepack,
    "tdrussell/diffusion-pipe": _cosmos,
    "genmoai/mochi": _mochi,
    "PKU-YuanGroup/Open-Sora-Plan": _open_sora_plan,
    "jy0205/Pyramid-Flow": _pyramid_flow,
    "Vchitect/Vchitect-2.0": _vchitect,
    "hpcaitech/Open-Sora": _open_sora,
    "NUS-HPC-AI-Lab/VideoSys": _videosys,
}
