"""Tests of the reference DiT model (tread_fx.models.dit), at tiny sizes on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tread_fx.models import dit
from tread_fx.models.dit import (
    DiT,
    DiT_B_2,
    DiT_models,
    DiT_S_2,
    DiT_XL_2,
    DiTAttention,
    LabelEmbedder,
    get_2d_sincos_pos_embed,
)

NUM_CLASSES = 10


def tiny_dit(**kwargs) -> DiT:
    config = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4)
    config.update(num_classes=NUM_CLASSES, **kwargs)
    return DiT(**config)


def perturb_zero_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Re-initialises every all-zero parameter randomly, so the model computes something."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if not param.any():
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def inputs(model: DiT, batch: int = 3, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    h, w = (s * model.patch_size for s in model.grid_size)
    x = torch.randn(batch, model.in_channels, h, w, generator=generator)
    t = torch.randint(0, 1000, (batch,), generator=generator)
    y = torch.randint(0, model.num_classes, (batch,), generator=generator)
    return x, t, y


@pytest.mark.parametrize("learn_sigma", [True, False])
@pytest.mark.parametrize(("input_size", "patch_size"), [(8, 2), (8, 4), (16, 2), (16, 8), (8, 1)])
def test_output_shape(learn_sigma: bool, input_size: int, patch_size: int) -> None:
    model = tiny_dit(input_size=input_size, patch_size=patch_size, learn_sigma=learn_sigma)
    out = model(*inputs(model, batch=2))
    channels = 8 if learn_sigma else 4
    assert model.out_channels == channels
    assert model.grid_size == (input_size // patch_size,) * 2
    assert out.shape == (2, channels, input_size, input_size)


def test_rectangular_input_and_factory_overrides() -> None:
    model = DiT_S_2(
        input_size=(8, 12),
        in_channels=1,
        num_classes=NUM_CLASSES,
        depth=1,
        hidden_size=64,
        num_heads=4,
    )
    assert model.grid_size == (4, 6) and len(model.blocks) == 1 and model.num_heads == 4
    assert model.pos_embed.shape == (1, 24, 64)
    assert model(*inputs(model, batch=1)).shape == (1, 2, 8, 12)


def test_unpatchify_inverts_patch_layout() -> None:
    model = tiny_dit(input_size=(4, 6), learn_sigma=False)
    image = torch.randn(2, 4, 4, 6)
    p = model.patch_size
    # [B, C, h, p, w, p] -> [B, h*w, p*p*C] with channel last, the layout FinalLayer emits
    tokens = image.reshape(2, 4, 2, p, 3, p).permute(0, 2, 4, 3, 5, 1).reshape(2, 6, -1)
    assert torch.equal(model.unpatchify(tokens), image)


@pytest.mark.parametrize(
    ("factory", "paper_millions"), [(DiT_S_2, 33), (DiT_B_2, 130), (DiT_XL_2, 675)]
)
def test_parameter_count_matches_paper(factory, paper_millions: int) -> None:
    with torch.device("meta"):
        model = factory(input_size=32, in_channels=4)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e6 - paper_millions) / paper_millions < 0.01


def test_registry_names() -> None:
    assert len(DiT_models) == 12 and DiT_models["DiT-XL/2"] is DiT_XL_2
    with torch.device("meta"):
        model = DiT_models["DiT-L/4"]()
    assert (len(model.blocks), model.patch_size, model.num_heads) == (24, 4, 16)


def test_pos_embed_is_fixed_sincos_buffer() -> None:
    model = tiny_dit()
    assert "pos_embed" in model.state_dict()
    assert all(p is not model.pos_embed for p in model.parameters())
    assert torch.equal(model.pos_embed, get_2d_sincos_pos_embed(32, (4, 4)))
    assert not torch.equal(model.pos_embed[0, 0], model.pos_embed[0, 1])


def test_adaln_zero_init_gives_identity_blocks_and_zero_output() -> None:
    model = tiny_dit().eval()
    x = torch.randn(2, 16, 32)
    c = torch.randn(2, 32)
    for block in model.blocks:
        assert torch.equal(block(x, c), x)
    out = model(*inputs(model))
    assert torch.equal(out, torch.zeros_like(out))


def test_label_dropout() -> None:
    embedder = LabelEmbedder(NUM_CLASSES, 16, dropout_prob=1.0)
    labels = torch.arange(NUM_CLASSES)
    null = torch.full_like(labels, NUM_CLASSES)
    embedder.train()
    assert torch.equal(embedder.drop_labels(labels), null)
    assert torch.equal(embedder(labels), embedder.embedding_table(null))
    embedder.eval()
    assert torch.equal(embedder.drop_labels(labels), labels)
    assert torch.equal(embedder(labels), embedder.embedding_table(labels))
    forced = torch.tensor([1, 0] * (NUM_CLASSES // 2))
    dropped = embedder.drop_labels(labels, force_drop_ids=forced)
    assert torch.equal(dropped, torch.where(forced == 1, null, labels))


def test_no_null_class_without_dropout() -> None:
    embedder = LabelEmbedder(NUM_CLASSES, 16, dropout_prob=0.0).train()
    assert embedder.embedding_table.num_embeddings == NUM_CLASSES
    labels = torch.arange(NUM_CLASSES)
    assert torch.equal(embedder.drop_labels(labels), labels)


def test_forward_with_cfg() -> None:
    model = perturb_zero_init(tiny_dit()).eval()
    x, t, y = inputs(model, batch=2)
    # Contract: the 2B batch holds the conditional half first, then the unconditional half.
    x2, t2 = torch.cat([x, torch.randn_like(x)]), torch.cat([t, t])
    y2 = torch.cat([y, torch.full_like(y, NUM_CLASSES)])
    with torch.no_grad():
        cond = model(x, t, y)
        uncond = model(x, t, torch.full_like(y, NUM_CLASSES))
        guided_1 = model.forward_with_cfg(x2, t2, y2, cfg_scale=1.0)
        guided_4 = model.forward_with_cfg(x2, t2, y2, cfg_scale=4.0)
    assert guided_1.shape == (4, model.out_channels, 8, 8)
    torch.testing.assert_close(guided_1[:2, :4], cond[:, :4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(guided_1[2:, :4], cond[:, :4], atol=1e-5, rtol=1e-5)
    expected = uncond[:, :4] + 4.0 * (cond[:, :4] - uncond[:, :4])
    torch.testing.assert_close(guided_4[:2, :4], expected, atol=1e-4, rtol=1e-4)
    # Variance channels are not guided: each half keeps its own prediction.
    torch.testing.assert_close(guided_4[:2, 4:], cond[:, 4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(guided_4[2:, 4:], uncond[:, 4:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [16, 7, 1])
def test_block_accepts_any_token_count(num_tokens: int) -> None:
    model = perturb_zero_init(tiny_dit()).eval()
    block = model.blocks[0]
    x = torch.randn(2, num_tokens, 32)
    c = torch.randn(2, 32)
    with torch.no_grad():
        out = block(x, c)
        # No positional logic inside a block: permuting tokens permutes the output.
        perm = torch.randperm(num_tokens)
        out_perm = block(x[:, perm], c)
    assert out.shape == x.shape
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-5, rtol=1e-5)


def test_gradients_reach_every_parameter() -> None:
    model = perturb_zero_init(tiny_dit(class_dropout_prob=0.5)).train()
    x, t, y = inputs(model, batch=4)
    y = torch.cat([y[:2], torch.full_like(y[2:], NUM_CLASSES)])  # null row is used too
    model(x, t, y).square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name


def test_zero_init_model_learns_after_one_step() -> None:
    model = tiny_dit().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, t, y = inputs(model)
    model(x, t, y).sub(x.repeat(1, 2, 1, 1)).square().mean().backward()
    optimizer.step()
    assert model.final_layer.linear.weight.any()
    assert model(x, t, y).any()


def _stream_first_forward(model: DiT, x, t, y) -> torch.Tensor:
    """DiT.forward as the reference code writes it: ``x_embedder(x) + pos_embed``."""
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    for block in model.blocks:
        h = block(h, c)
    return model.unpatchify(model.final_layer(h, c))


def test_blocks_see_a_contiguous_token_stream_with_the_reference_values() -> None:
    model = perturb_zero_init(tiny_dit(depth=3)).eval()
    x, t, y = inputs(model)
    seen = []
    hooks = [
        block.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))
        for block in model.blocks
    ]
    out = model(x, t, y)
    for hook in hooks:
        hook.remove()
    assert seen == [True] * 3  # timm's PatchEmbed alone gives a transposed [B, N, D] view
    assert not (model.x_embedder(x) + model.pos_embed).is_contiguous()
    grads = []
    for forward in (DiT.forward, _stream_first_forward):
        model.zero_grad(set_to_none=True)
        result = forward(model, x, t, y)
        result.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert torch.equal(result, out)  # bitwise: only the memory layout differs
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_eval_is_deterministic() -> None:
    model = perturb_zero_init(tiny_dit(class_dropout_prob=0.5)).eval()
    x, t, y = inputs(model)
    with torch.no_grad():
        assert torch.equal(model(x, t, y), model(x, t, y))


def test_attention_uses_sdpa_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    attn = DiTAttention(32, num_heads=4, qkv_bias=True)
    x = torch.randn(2, 5, 32)
    assert attn.fused_attn and not attn.uses_flash(x)
    assert not attn.uses_flash(x.to(torch.bfloat16))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    assert attn(x).shape == x.shape
    assert calls


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_size": 10, "patch_size": 4}, "not divisible by patch_size"),
        ({"hidden_size": 30, "num_heads": 4}, "divisible by num_heads"),
        ({"depth": 0}, "depth"),
    ],
)
def test_bad_config_raises_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_dit(**kwargs)


def test_flash_branch_matches_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flash-attn branch (CUDA-only in practice) is checked here with a stand-in kernel."""

    def fake_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, N, H, d] -> [B, H, N, d]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale
        )
        return out.transpose(1, 2)

    attn = DiTAttention(32, num_heads=4, qkv_bias=True).eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        expected = attn(x)
        monkeypatch.setattr(dit, "flash_attn_func", fake_flash_attn_func)
        monkeypatch.setattr(DiTAttention, "uses_flash", staticmethod(lambda x: True))
        got = attn(x)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
