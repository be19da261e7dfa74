"""Builders of the research population's text-to-image MMDiT / cross-attention DiT cases.

Each builder imports the listed model file from its snapshot, builds the listed class at a
tiny config and says how to call it (see ``population.py``). CUDA-only kernels imported at a
file's top (flash-attn, xformers) are provided as plain PyTorch of the same math.

Example:
    >>> from benchmarks.research.cases_mmdit import BUILDERS
    >>> "black-forest-labs/flux" in BUILDERS
    True
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.coverage_community_repos import import_snapshot
from benchmarks.research.kernels import flash_attn_func, provide_module
from benchmarks.research.population import Build

__all__ = ["BUILDERS"]

T = torch.tensor([0.1, 0.7])


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _ids(h: int, w: int) -> torch.Tensor:
    """Flux-style image ids ``[2, h*w, 3]``: (0, row, col)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(1, h * w, 3).repeat(2, 1, 1)


def _unavailable(*_: Any, **__: Any) -> Any:
    """A flash-attn entry point on a path the CPU float32 run never takes."""
    raise NotImplementedError("flash-attn kernel: not available on CPU (fp16/bf16 path only)")


@contextmanager
def _stand_ins(names: tuple[str, ...], provide: Callable[[], None]) -> Iterator[None]:
    """Stand-in modules ``names`` while a model file imports them, then out of
    ``sys.modules`` again (library availability checks must not find them later)."""
    added = [n for n in names if n not in sys.modules]
    provide()
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _provide_flash_attn() -> None:
    provide_module("flash_attn", flash_attn_func=flash_attn_func, __version__="2.0.0",
                   flash_attn_varlen_func=_unavailable,
                   flash_attn_varlen_qkvpacked_func=_unavailable)  # fmt: skip
    provide_module("flash_attn.bert_padding", index_first_axis=_unavailable,
                   pad_input=_unavailable, unpad_input=_unavailable)  # fmt: skip


def _flash_attn() -> Any:
    """``flash_attn`` (imported at a file's top; its kernels are used only on the fp16/bf16
    path, or replaced after import)."""
    return _stand_ins(("flash_attn", "flash_attn.bert_padding"), _provide_flash_attn)


def _import_file(path: Path, name: str) -> ModuleType:
    """Import one file as module ``name`` without running its package's ``__init__``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _import_without_inits(
    root: Path, dotted: str, *packages: str, purge: bool = True
) -> ModuleType:
    """Import ``dotted`` from ``root`` with ``packages`` registered bare: their
    ``__init__`` (which pulls parts the model file does not use) is not run. ``purge``
    first drops modules already imported under the same top-level name."""
    top = dotted.split(".")[0]
    for name in [m for m in sys.modules if purge and m.split(".")[0] == top]:
        del sys.modules[name]
    for name in packages:
        module = ModuleType(name)
        module.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = module
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(dotted)
    finally:
        sys.path.remove(str(root))


@contextmanager
def _cuda_calls_stay_on_cpu() -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor itself (a hard-coded placement at construction)."""
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *_, **__: self
    try:
        yield
    finally:
        torch.Tensor.cuda = saved


def _import_patched(path: Path, name: str, old: str, new: str) -> ModuleType:
    """Import ``path`` as ``name`` with one text replacement made in memory (the file and
    its bytecode cache are left as they are)."""
    source = path.read_text()
    if old not in source:
        raise RuntimeError(f"{path.name}: the text to patch is not there")
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module
    exec(compile(source.replace(old, new, 1), str(path), "exec"), module.__dict__)  # noqa: S102
    return module


# -- xformers (PixArt) --------------------------------------------------------------------


class _BlockDiagonalMask:
    """xformers' ``fmha.BlockDiagonalMask``: sample ``i``'s queries see only its keys."""

    def __init__(self, q_seqlen: list[int], kv_seqlen: list[int]) -> None:
        self.q_seqlen, self.kv_seqlen = [int(n) for n in q_seqlen], [int(n) for n in kv_seqlen]

    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int] | None = None):
        return cls(q_seqlen, q_seqlen if kv_seqlen is None else kv_seqlen)

    def materialize(self, device: torch.device) -> torch.Tensor:
        """The ``[sum(q), sum(kv)]`` boolean mask (True: attend)."""
        q = torch.repeat_interleave(torch.arange(len(self.q_seqlen)), torch.tensor(self.q_seqlen))
        k = torch.repeat_interleave(torch.arange(len(self.kv_seqlen)), torch.tensor(self.kv_seqlen))
        return (q[:, None] == k[None, :]).to(device)


def _memory_efficient_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: Any = None, p: float = 0.0,
    scale: float | None = None, **_: Any,
) -> torch.Tensor:  # fmt: skip
    """xformers' ``memory_efficient_attention`` (``[B, N, H, D]``) as SDPA; a tensor bias is
    ``[B*H, Nq, Nk]`` additive, a block-diagonal bias becomes its boolean mask."""
    b, n, h, _ = q.shape
    mask = attn_bias
    if isinstance(attn_bias, _BlockDiagonalMask):
        mask = attn_bias.materialize(q.device)
    elif isinstance(attn_bias, torch.Tensor):
        mask = attn_bias.reshape(b, h, n, k.shape[1])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, dropout_p=p,
        scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2)


def _provide_xformers() -> None:
    fmha = SimpleNamespace(BlockDiagonalMask=_BlockDiagonalMask)
    provide_module("xformers.ops", memory_efficient_attention=_memory_efficient_attention,
                   fmha=fmha)  # fmt: skip


# -- flash_attn_no_pad (HunyuanImage) -----------------------------------------------------


def _flash_attn_no_pad(
    qkv: torch.Tensor, key_padding_mask: torch.Tensor, causal: bool = False,
    dropout_p: float = 0.0, softmax_scale: float | None = None, **_: Any,
) -> torch.Tensor:  # fmt: skip
    """HunyuanImage's ``flash_attn_no_pad`` (packed ``[B, S, 3, H, D]``, padded keys left
    out, padded query rows zero) as SDPA."""
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    keep = key_padding_mask.bool()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :],
                                         dropout_p=dropout_p, is_causal=causal,
                                         scale=softmax_scale)  # fmt: skip
    return out.transpose(1, 2) * keep[:, :, None, None].to(out.dtype)


# -- builders -----------------------------------------------------------------------------


def _minrf(root: Path) -> Build:
    # by path: an installed ``mmdit`` package would make import_snapshot drop site-packages
    mod = _import_file(root / "advanced/mmdit.py", "minrf_mmdit")
    config = dict(in_channels=4, out_channels=4, patch_size=2, dim=64, n_layers=4,
                  n_double_layers=2, n_heads=4, global_conddim=64, cond_seq_dim=32,
                  max_seq=64)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 4, 8, 8), T, {"c_seq": _randn(2, 8, 32)}), {}

    return Build(lambda: mod.MMDiT(**config), inputs)


_SD35_CONTEXT = {"target": "torch.nn.Linear", "params": {"in_features": 32, "out_features": 256}}


def _sd35(root: Path) -> Build:
    (mod,) = import_snapshot(root, "mmditx")
    config = dict(input_size=8, patch_size=2, in_channels=4, depth=4, mlp_ratio=4.0,
                  adm_in_channels=32, pos_embed_max_size=8, num_patches=64, qk_norm="rms",
                  x_block_self_attn_layers=[1], context_embedder_config=_SD35_CONTEXT)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 4, 8, 8), T, _randn(2, 32), _randn(2, 8, 32)), {}

    def make() -> torch.nn.Module:
        model = mod.MMDiTX(**config)
        for norm in model.modules():  # torch.empty weights, always loaded from a checkpoint
            if isinstance(norm, mod.RMSNorm) and norm.weight is not None:
                torch.nn.init.ones_(norm.weight)
        return model

    note = ("width fixed by the file to 64*depth (256, 4 heads); RMSNorm weights (torch.empty, "
            "never initialised by the file) set to ones")  # fmt: skip
    return Build(make, inputs, note=note)


def _flux_inputs(extra: dict | None = None, guidance: bool = False):
    def inputs() -> tuple[tuple, dict]:
        kw = dict(img=_randn(2, 16, 16), img_ids=_ids(4, 4), txt=_randn(2, 8, 32),
                  txt_ids=torch.zeros(2, 8, 3), timesteps=T)  # fmt: skip
        kw.update(extra or {})
        if guidance:
            kw["guidance"] = torch.tensor([3.5, 3.5])
        return (), kw

    return inputs


def _flux(root: Path) -> Build:
    (mod,) = import_snapshot(root / "src", "flux.model")
    params = mod.FluxParams(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=32,
                            hidden_size=64, mlp_ratio=4.0, num_heads=4, depth=2,
                            depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
                            qkv_bias=True, guidance_embed=False)  # fmt: skip
    return Build(lambda: mod.Flux(params), _flux_inputs({"y": _randn(2, 32)}), noisy="img")


def _kohya_flux(root: Path) -> Build:
    (mod,) = import_snapshot(root, "library.flux_models")
    params = mod.FluxParams(in_channels=16, vec_in_dim=32, context_in_dim=32, hidden_size=64,
                            mlp_ratio=4.0, num_heads=4, depth=2, depth_single_blocks=2,
                            axes_dim=[4, 6, 6], theta=10000, qkv_bias=True,
                            guidance_embed=False)  # fmt: skip
    note = "txt_attention_mask left at its default None"
    return Build(lambda: mod.Flux(params), _flux_inputs({"y": _randn(2, 32)}), noisy="img",
                 note=note)  # fmt: skip


def _chroma(root: Path) -> Build:
    import_snapshot(root / "src", "models.chroma.module.layers")
    mod = _import_patched(root / "src/models/chroma/model.py", "models.chroma.model",
                          "    _use_compiled: bool\n",
                          "    _use_compiled: bool\n    use_x0: bool = False\n")  # fmt: skip
    params = mod.ChromaParams(in_channels=16, context_in_dim=32, hidden_size=64, mlp_ratio=4.0,
                              num_heads=4, depth=2, depth_single_blocks=2, axes_dim=[4, 6, 6],
                              theta=10000, qkv_bias=True, guidance_embed=True,
                              approximator_in_dim=16, approximator_depth=1,
                              approximator_hidden_size=32, _use_compiled=False)  # fmt: skip
    note = "ChromaParams given the `use_x0: bool = False` field its module-level use needs"
    inputs = _flux_inputs({"txt_mask": torch.ones(2, 8)}, guidance=True)
    return Build(lambda: mod.Chroma(params), inputs, noisy="img", note=note)


def _lumina_inputs(cap_mask_dtype: torch.dtype):
    def inputs() -> tuple[tuple, dict]:
        mask = torch.ones(2, 8, dtype=cap_mask_dtype)
        return (_randn(2, 4, 8, 8), T, _randn(2, 8, 32), mask), {}

    return inputs


def _lumina2(root: Path) -> Build:
    with _flash_attn():
        (mod,) = import_snapshot(root, "models.model")
    config = dict(patch_size=2, in_channels=4, dim=64, n_layers=4, n_refiner_layers=1,
                  n_heads=4, n_kv_heads=2, multiple_of=16, norm_eps=1e-5, qk_norm=True,
                  cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[64, 16, 16])  # fmt: skip
    note = "flash_attn (fp16/bf16 path only) provided as an unused stub; float32 takes SDPA"
    return Build(lambda: mod.NextDiT(**config), _lumina_inputs(torch.bool), note=note)


def _lumina_next(root: Path) -> Build:
    with _flash_attn():
        (mod,) = import_snapshot(root / "lumina_next_t2i_mini", "models.nextdit")
    config = dict(patch_size=2, in_channels=4, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                  multiple_of=16, norm_eps=1e-5, learn_sigma=True, qk_norm=True,
                  cap_feat_dim=32, scale_factor=1.0, use_flash_attn=False)  # fmt: skip

    def make() -> torch.nn.Module:
        with _cuda_calls_stay_on_cpu():
            return mod.NextDiT(**config)

    note = ("flash_attn (fp16/bf16 path only) provided as an unused stub; float32 takes SDPA; "
            "the RoPE table's hard-coded .cuda() in __init__ kept on CPU")  # fmt: skip
    return Build(make, _lumina_inputs(torch.long), note=note)


def _hunyuan_dit(root: Path) -> Build:
    models, posemb = import_snapshot(root, "hydit.modules.models", "hydit.modules.posemb_layers")
    args = SimpleNamespace(learn_sigma=True, text_states_dim=32, text_states_dim_t5=48,
                           text_len=8, text_len_t5=8, norm="layer", is_ipa=False,
                           infer_mode="torch", use_flash_attn=False, qk_norm=True,
                           size_cond=None, use_style_cond=False, use_fp16=False,
                           gc_rate=0.0)  # fmt: skip
    config = dict(input_size=(8, 8), patch_size=2, in_channels=4, hidden_size=64, depth=6,
                  num_heads=4, mlp_ratio=4.0, log_fn=lambda *_: None)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        cos, sin = posemb.get_2d_rotary_pos_embed(16, 4)
        kw = dict(encoder_hidden_states=_randn(2, 8, 32), text_embedding_mask=torch.ones(2, 8),
                  encoder_hidden_states_t5=_randn(2, 8, 48),
                  text_embedding_mask_t5=torch.ones(2, 8), cos_cis_img=cos, sin_cis_img=sin,
                  return_dict=False)  # fmt: skip
        return (_randn(2, 4, 8, 8), T), kw

    note = "depth 6, not 5: the long skips pair up only at an even depth (5 pops an empty list)"
    return Build(lambda: models.HunYuanDiT(args, **config), inputs, note=note)


def _pixart(root: Path) -> Build:
    with _stand_ins(("xformers", "xformers.ops"), _provide_xformers):
        (mod,) = import_snapshot(root, "diffusion.model.nets.PixArt")
    config = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=4,
                  num_heads=4, mlp_ratio=4.0, pred_sigma=True, caption_channels=32,
                  model_max_length=8, qk_norm=False, kv_compress_config=None,
                  class_dropout_prob=0.0)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 4, 8, 8), T, _randn(2, 1, 8, 32), torch.ones(2, 8, dtype=torch.long)), {}

    note = ("xformers memory_efficient_attention (+ fmha.BlockDiagonalMask.from_seqlens) "
            "-> SDPA with the equivalent block-diagonal boolean mask; class_dropout_prob=0 "
            "(caption dropout in training calls torch.rand(...).cuda())")  # fmt: skip
    return Build(lambda: mod.PixArt(**config), inputs, note=note)


def _micro_diffusion(root: Path) -> Build:
    (mod,) = import_snapshot(root, "micro_diffusion.models.dit")
    config = dict(input_size=8, patch_size=2, in_channels=4, dim=64, depth=4, head_dim=16,
                  multiple_of=16, caption_channels=32, qkv_multipliers=[1.0],
                  ffn_multipliers=[4.0], use_patch_mixer=True, patch_mixer_depth=2,
                  patch_mixer_dim=32, num_experts=4, expert_capacity=1,
                  experts_every_n=2)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 4, 8, 8), T, _randn(2, 1, 8, 32)), {}

    return Build(lambda: mod.DiT(**config), inputs)


def _omnigen(root: Path) -> Build:
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        raise RuntimeError(
            f"OmniGen's Phi3Transformer.forward is written for transformers 4.45 (its pin); with "
            f"{transformers.__version__} the Phi3 layers need position_embeddings it never makes"
        )

    mod = _import_without_inits(root, "OmniGen.model", "OmniGen")
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=4,
                                     vocab_size=128, max_position_embeddings=64,
                                     pad_token_id=2)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        text, img = 8, 16
        mask = torch.ones(text + 1 + img, text + 1 + img)
        mask[: text + 1, : text + 1] = torch.tril(torch.ones(text + 1, text + 1))
        mask[: text + 1, text + 1 :] = 0
        ids = torch.randint(0, 128, (2, text), generator=torch.Generator().manual_seed(1))
        kw = dict(input_ids=ids, input_img_latents=None, input_image_sizes={},
                  attention_mask=mask.expand(2, -1, -1).clone(),
                  position_ids=torch.arange(text + 1 + img).expand(2, -1).clone(),
                  return_past_key_values=False)  # fmt: skip
        return (_randn(2, 4, 8, 8), T), kw

    build = lambda: mod.OmniGen(config, patch_size=2, in_channels=4, pos_embed_max_size=16)  # noqa: E731
    note = ("pad_token_id=2 (the Phi3Config default 32000 is outside vocab 128; 2 is "
            "OmniGenProcessor's); OmniGen/__init__ (scheduler, pipeline) not run; mask as "
            "OmniGenProcessor.create_mask makes it")  # fmt: skip
    return Build(build, inputs, note=note)


def _hidream(root: Path) -> Build:
    (mod,) = import_snapshot(root, "hi_diffusers.models.transformers.transformer_hidream_image")
    config = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                  num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                  caption_channels=[32, 32], text_emb_dim=32, num_routed_experts=2,
                  num_activated_experts=1, axes_dims_rope=[8, 4, 4], max_resolution=[16, 16],
                  llama_layers=[0, 1, 2, 3])  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        states = [_randn(2, 8, 32), _randn(4, 2, 8, 32)]
        kw = dict(encoder_hidden_states=states, pooled_embeds=_randn(2, 32), return_dict=False)
        return (_randn(2, 4, 8, 8), T), kw

    note = "axes_dims_rope [8, 4, 4], not [4, 4]: the ids have 3 axes (as in the released 64/32/32)"
    return Build(lambda: mod.HiDreamImageTransformer2DModel(**config), inputs, note=note)


def _f_lite(root: Path) -> Build:
    mod = _import_file(root / "f_lite/model.py", "f_lite_model")
    config = dict(in_channels=4, patch_size=2, hidden_size=64, depth=4, num_heads=4,
                  mlp_ratio=4.0, cross_attn_input_size=32, residual_v=True,
                  train_bias_and_rms=True, use_rope=True, gradient_checkpoint=False)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 4, 8, 8), _randn(2, 8, 32), T), {}

    note = "f_lite/model.py imported alone (the package __init__ pulls the pipeline)"
    return Build(lambda: mod.DiT(**config), inputs, note=note)


def _hunyuan_image(root: Path) -> Build:
    base = "hyimage.models.hunyuan.modules."
    with _flash_attn():
        _import_without_inits(root, base + "flash_attn_no_pad", "hyimage.models.text_encoder")
    dit = _import_without_inits(root, base + "hunyuanimage_dit", purge=False)
    blocks, refiner = sys.modules[base + "models"], sys.modules[base + "token_refiner"]
    blocks.flash_attn_no_pad = _flash_attn_no_pad
    refiner.flash_attn_no_pad = _flash_attn_no_pad
    config = dict(patch_size=[2, 2], in_channels=4, hidden_size=64, heads_num=4,
                  mlp_width_ratio=4.0, mlp_act_type="gelu_tanh", mm_double_blocks_depth=2,
                  mm_single_blocks_depth=2, rope_dim_list=[8, 8], qkv_bias=True, qk_norm=True,
                  qk_norm_type="rms", guidance_embed=False, text_projection="single_refiner",
                  use_attention_mask=True, text_states_dim=32, rope_theta=256,
                  glyph_byT5_v2=False, use_meanflow=False)  # fmt: skip

    def inputs() -> tuple[tuple, dict]:
        return (_randn(2, 4, 8, 8), T, _randn(2, 8, 32), torch.ones(2, 8, dtype=torch.bool)), {}

    note = ("flash_attn_no_pad (flash_attn_varlen_qkvpacked_func + unpad/pad) -> SDPA with the "
            "key-padding mask, padded query rows zero; hyimage/models/text_encoder/__init__ "
            "(text encoders, unused) not run")  # fmt: skip
    return Build(lambda: dit.HYImageDiffusionTransformer(**config), inputs, note=note)


BUILDERS = {
    "cloneofsimo/minRF": _minrf,
    "Stability-AI/sd3.5": _sd35,
    "black-forest-labs/flux": _flux,
    "Alpha-VLLM/Lumina-Image-2.0": _lumina2,
    "Tencent/HunyuanDiT": _hunyuan_dit,
    "PixArt-alpha/PixArt-sigma": _pixart,
    "SonyResearch/micro_diffusion": _micro_diffusion,
    "VectorSpaceLab/OmniGen": _omnigen,
    "lodestone-rock/flow": _chroma,
    "HiDream-ai/HiDream-I1": _hidream,
    "fal-ai/f-lite": _f_lite,
    "Alpha-VLLM/Lumina-T2X": _lumina_next,
    "kohya-ss/sd-scripts": _kohya_flux,
    "Tencent-Hunyuan/HunyuanImage-2.1": _hunyuan_image,
}
