import math

import pytest
import torch
from op_counts import CountOps, attention_calls
from torch import nn

from lightning_adaptiveload.models.wan import (
    WAN_CONFIGS,
    WanAttentionBlock,
    WanConfig,
    WanModel,
    from_name_or_config,
    rope_angles,
    rope_apply,
    sinusoidal_embedding,
)
from lightning_adaptiveload.modules.adaln import AdaLayerNorm

TINY = WAN_CONFIGS["tiny"]


def _model(config=TINY, seed=0):
    torch.manual_seed(seed)
    model = WanModel(config)
    # Wan zero-initialises the output projection; give it weights so outputs depend on the input.
    nn.init.normal_(model.head.head.weight, std=0.02)
    return model


def _inputs(model, batch, latent, seed=1, text_len=None):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    x = torch.randn(batch, cfg.in_dim, *latent, generator=g)
    t = torch.rand(batch, generator=g) * 1000
    ctx = torch.randn(batch, text_len or cfg.text_len, cfg.text_dim, generator=g)
    return x, t, ctx


def _expected_parameters(cfg: WanConfig) -> int:
    # The per-part formula from the module docstring of models/wan.py.
    d, f, p = cfg.dim, cfg.ffn_dim, math.prod(cfg.patch_size)
    patch = cfg.in_dim * p * d + d
    text = cfg.text_dim * d + d + d * d + d
    time = cfg.freq_dim * d + d + d * d + d
    proj = 6 * d * d + 6 * d
    block = 8 * d * d + 2 * d * f + 21 * d + f
    head = d * cfg.out_dim * p + cfg.out_dim * p + 2 * d
    return patch + text + time + proj + cfg.num_layers * block + head


@pytest.mark.parametrize(
    ("batch", "latent"),
    [
        (2, (1, 2, 2)),  # one-token image
        (2, (1, 6, 10)),  # image
        (2, (3, 6, 10)),  # video
        (1, (5, 2, 14)),  # odd token grid (5, 1, 7)
        (3, (2, 10, 6)),  # portrait
    ],
)
def test_output_shape_and_dtype(batch, latent):
    model = _model()
    x, t, ctx = _inputs(model, batch, latent)
    out = model(x, t, ctx)
    assert out.shape == x.shape
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_zero_initialised_head_outputs_zero():
    torch.manual_seed(0)
    model = WanModel(TINY)
    x, t, ctx = _inputs(model, 2, (2, 4, 4))
    assert torch.equal(model(x, t, ctx), torch.zeros_like(x))


def test_temporal_patch_and_scalar_timestep():
    cfg = WanConfig(
        dim=48, ffn_dim=96, num_heads=2, num_layers=1, text_dim=8, text_len=4, patch_size=(2, 2, 2)
    )
    model = _model(cfg)
    x, _, ctx = _inputs(model, 2, (4, 2, 6))
    assert model(x, torch.tensor(500.0), ctx).shape == x.shape


def test_samples_do_not_interact():
    model = _model()
    x, t, ctx = _inputs(model, 3, (2, 4, 6))
    batched = model(x, t, ctx)
    for i in range(3):
        alone = model(x[i : i + 1], t[i : i + 1], ctx[i : i + 1])
        torch.testing.assert_close(batched[i : i + 1], alone, rtol=1e-5, atol=1e-5)


def test_short_context_is_zero_padded():
    model = _model()
    x, t, ctx = _inputs(model, 2, (1, 4, 4), text_len=5)
    padded = torch.cat([ctx, ctx.new_zeros(2, TINY.text_len - 5, TINY.text_dim)], dim=1)
    torch.testing.assert_close(model(x, t, ctx), model(x, t, padded))


def test_unpatchify_inverts_token_layout():
    cfg = WanConfig(
        dim=48, ffn_dim=96, num_heads=2, num_layers=1, text_dim=8, text_len=4, patch_size=(2, 2, 3)
    )
    model = WanModel(cfg)
    b, c, (f, h, w), (pt, ph, pw) = 2, cfg.out_dim, (2, 3, 2), cfg.patch_size
    x = torch.randn(b, c, f * pt, h * ph, w * pw)
    tokens = torch.empty(b, f * h * w, pt * ph * pw * c)
    # Token (i, j, k) row-major; channel ((p·ph + q)·pw + r)·C + c (the reference's "fhwpqrc").
    for i in range(f):
        for j in range(h):
            for k in range(w):
                for p in range(pt):
                    for q in range(ph):
                        for r in range(pw):
                            ch = ((p * ph + q) * pw + r) * c
                            tokens[:, (i * h + j) * w + k, ch : ch + c] = x[
                                :, :, i * pt + p, j * ph + q, k * pw + r
                            ]
    assert torch.equal(model.unpatchify(tokens, (f, h, w)), x)


@pytest.mark.parametrize(
    ("latent", "text_len", "match"),
    [
        ((3, 5, 4), 16, "not divisible by patch_size"),
        ((2, 4, 4), 17, r"Expected \[2, L <= 16, 32\]"),
    ],
)
def test_bad_inputs_raise(latent, text_len, match):
    model = _model()
    x, t, ctx = _inputs(model, 2, latent, text_len=text_len)
    with pytest.raises(ValueError, match=match):
        model(x, t, ctx)


def test_bad_channel_count_raises():
    model = _model()
    with pytest.raises(ValueError, match=r"Expected \[B, 16, F, H, W\]"):
        model(torch.randn(1, 4, 1, 2, 2), torch.zeros(1), torch.randn(1, 16, 32))


@pytest.mark.parametrize(
    ("name", "expected"),
    [("wan2_1_1_3b", 1_418_996_800), ("wan2_1_14b", 14_288_491_584)],
)
def test_published_parameter_counts_on_meta(name, expected):
    with torch.device("meta"):
        model = WanModel(name)
    assert all(p.is_meta for p in model.parameters())
    cfg = WAN_CONFIGS[name]
    assert model.num_parameters() == _expected_parameters(cfg) == expected
    # Names on the model cards: "1.3B" and "14B" (the 1.3B counts its 1.42B as 1.3B).
    assert 1.3e9 <= expected <= 1.45e9 if name == "wan2_1_1_3b" else 14.0e9 <= expected <= 14.5e9
    head_dim = cfg.dim // cfg.num_heads
    assert head_dim == 128


def test_tiny_parameter_count_matches_formula():
    assert WanModel(TINY).num_parameters() == _expected_parameters(TINY)


def test_adaln_sites_are_adalayernorm():
    model = WanModel(TINY)
    sites = [m for m in model.modules() if isinstance(m, AdaLayerNorm)]
    assert len(sites) == 2 * TINY.num_layers + 1
    for block in model.blocks:
        assert isinstance(block, WanAttentionBlock)
        assert isinstance(block.norm1, AdaLayerNorm) and isinstance(block.norm2, AdaLayerNorm)
        assert block.norm1.weight is None and block.norm1.eps == 1e-6
        assert block.modulation.shape == (1, 6, TINY.dim)
        # The cross-attention pre-norm is a plain affine LayerNorm, not a modulation site.
        assert block.norm3.weight.shape == (TINY.dim,)
    assert isinstance(model.head.norm, AdaLayerNorm)
    assert model.head.modulation.shape == (1, 2, TINY.dim)


def test_block_modulation_is_fp32_strided_views(monkeypatch):
    seen = []
    original = AdaLayerNorm.forward

    def spy(self, x, scale, shift, **kwargs):
        seen.append((scale, shift))
        return original(self, x, scale, shift, **kwargs)

    monkeypatch.setattr(AdaLayerNorm, "forward", spy)
    model = _model()
    x, t, ctx = _inputs(model, 2, (1, 4, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, t, ctx)
    block_sites = seen[:2]  # norm1 and norm2 of block 0
    (s1, h1), (s2, h2) = block_sites
    for tensor in (s1, h1, s2, h2):
        assert tensor.dtype == torch.float32
        assert tensor.shape == (2, 1, TINY.dim)
        assert tensor.stride() == (6 * TINY.dim, TINY.dim, 1)
    # All four are views of the one [B, 6, D] modulation tensor, at Wan's chunk offsets.
    base = h1.data_ptr()
    offsets = [(tt.data_ptr() - base) // 4 for tt in (h1, s1, h2, s2)]
    assert offsets == [0, TINY.dim, 3 * TINY.dim, 4 * TINY.dim]


def test_sinusoidal_embedding_values():
    t = torch.tensor([0.0, 3.0, 999.0])
    emb = sinusoidal_embedding(t, 8)
    assert emb.dtype == torch.float32 and emb.shape == (3, 8)
    for row, tv in zip(emb, t.tolist(), strict=True):
        for i in range(4):
            omega = 10000.0 ** (-i / 4)
            assert row[i].item() == pytest.approx(math.cos(tv * omega), abs=1e-6)
            assert row[4 + i].item() == pytest.approx(math.sin(tv * omega), abs=1e-6)


def _complex_rope(x, grid, head_dim):
    # Independent fp64 formulation: per-axis frequencies as complex phasors on adjacent pairs.
    f, h, w = grid
    pairs = head_dim // 2
    bands = (pairs - 2 * (pairs // 3), pairs // 3, pairs // 3)
    pos = torch.stack(
        torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1
    ).reshape(-1, 3)
    phase = []
    for axis, n in enumerate(bands):
        omega = 10000.0 ** (-torch.arange(n, dtype=torch.float64) / n)
        phase.append(pos[:, axis : axis + 1].double() * omega)
    rot = torch.polar(torch.ones(f * h * w, pairs, dtype=torch.float64), torch.cat(phase, -1))
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], pairs, 2).contiguous())
    return torch.view_as_real(xc * rot[None, :, None, :]).flatten(-2)


@pytest.mark.parametrize(("grid", "head_dim"), [((3, 4, 5), 16), ((2, 3, 2), 128), ((1, 1, 7), 10)])
def test_rope_matches_complex_rotation(grid, head_dim):
    x = torch.randn(2, math.prod(grid), 3, head_dim)
    cos, sin = rope_angles(grid, head_dim)
    out = rope_apply(x, cos, sin)
    torch.testing.assert_close(out.double(), _complex_rope(x, grid, head_dim), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_pairwise_rotation_bit_for_bit(dtype):
    # rope_apply's swap-and-sign form must round as the textbook pairwise form does (eager), so a
    # checkpoint trained with either resumes on the other unchanged.
    grid, head_dim = (3, 4, 5), 128
    x = torch.randn(2, math.prod(grid), 3, head_dim).to(dtype)
    cos, sin = rope_angles(grid, head_dim)
    x0, x1 = x.float().unflatten(-1, (head_dim // 2, 2)).unbind(-1)
    c, s = cos[None, :, None], sin[None, :, None]
    pairwise = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    out = rope_apply(x, cos, sin)
    assert out.dtype == torch.float32
    assert torch.equal(out, pairwise)


def test_rope_scores_depend_only_on_relative_position():
    grid, head_dim = (6, 7, 8), 24
    cos, sin = rope_angles(grid, head_dim)
    f, h, w = grid

    def flat(pos):
        return (pos[0] * h + pos[1]) * w + pos[2]

    q, k = torch.randn(2, head_dim, dtype=torch.float32).unbind(0)
    x = torch.zeros(1, f * h * w, 2, head_dim)
    x[0, :, 0] = q
    x[0, :, 1] = k
    rot = rope_apply(x, cos, sin)[0]

    def score(pq, pk):
        return rot[flat(pq), 0] @ rot[flat(pk), 1]

    base = score((1, 2, 0), (3, 0, 4))
    for shift in [(1, 0, 0), (0, 3, 0), (0, 0, 2), (2, 4, 3)]:
        pq = tuple(a + s for a, s in zip((1, 2, 0), shift, strict=True))
        pk = tuple(a + s for a, s in zip((3, 0, 4), shift, strict=True))
        assert score(pq, pk).item() == pytest.approx(base.item(), rel=1e-4, abs=1e-4)
    # A different relative offset gives a different score (the encoding is not trivial).
    assert abs(score((1, 2, 0), (3, 0, 5)).item() - base.item()) > 1e-3


def test_rope_bands_follow_wan_split():
    # head_dim 128 → 64 pairs: 22 for time, 21 for height, 21 for width.
    cos, sin = rope_angles((2, 2, 2), 128)
    angles = torch.atan2(sin, cos).reshape(2, 2, 2, 64)
    assert torch.equal(angles[0, 0, 0], torch.zeros(64))
    moved_f, moved_h, moved_w = angles[1, 0, 0], angles[0, 1, 0], angles[0, 0, 1]
    assert (moved_f[:22] != 0).all() and (moved_f[22:] == 0).all()
    assert (moved_h[22:43] != 0).all() and (moved_h[:22] == 0).all() and (moved_h[43:] == 0).all()
    assert (moved_w[43:] != 0).all() and (moved_w[:43] == 0).all()
    # First pair of each band turns by one radian per position step.
    assert moved_f[0].item() == pytest.approx(1.0) and moved_w[43].item() == pytest.approx(1.0)


def test_gradients_reach_every_parameter():
    model = _model()
    x, t, ctx = _inputs(model, 2, (2, 4, 4))
    model(x, t, ctx).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.slow  # 5 s on a 2-core CPU under load: off the quick path
def test_gradient_checkpointing_gives_same_gradients():
    x, t, ctx = _inputs(_model(), 2, (2, 4, 4))
    grads = []
    for mode in (False, True, "selective", "full"):
        model = _model()
        model.set_gradient_checkpointing(mode)
        model(x, t, ctx).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for other in grads[1:]:
        for name in grads[0]:
            torch.testing.assert_close(grads[0][name], other[name], msg=name)



@pytest.mark.parametrize(("mode", "attention_runs", "ffn_runs"), [("none", 1, 1), ("selective", 1, 2), ("full", 2, 2)])
def test_checkpointing_modes_recompute_what_they_say(mode, attention_runs, ffn_runs):
    """Selective keeps the attention kernels' outputs (no second attention forward in backward)
    and recomputes the rest of the block; full recomputes everything; none nothing."""
    model = _model()
    model.set_gradient_checkpointing(mode)
    assert all(block.checkpointing == mode for block in model.blocks)
    x, t, ctx = _inputs(model, 2, (2, 4, 4))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION), CountOps() as ops:
        model(x, t, ctx).square().mean().backward()
    per_pass = 2 * model.config.num_layers  # self- and cross-attention in every block
    assert attention_calls(ops.counts) == attention_runs * per_pass
    # gelu runs once per block forward (once more per recompute), plus once in the text MLP.
    assert ops.counts["gelu"] == ffn_runs * model.config.num_layers + 1


def test_checkpointing_mode_reaches_wrapped_blocks():
    class Wrapper(torch.nn.Module):  # what FSDP1 puts around a block: attributes set on it stay on it
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    model = _model()
    model.blocks[0] = Wrapper(model.blocks[0])
    model.set_gradient_checkpointing("selective")
    assert model.blocks[0].inner.checkpointing == "selective" and model.blocks[1].checkpointing == "selective"
    assert not hasattr(model.blocks[0], "checkpointing")


def test_checkpointing_mode_errors():
    model = _model()
    with pytest.raises(ValueError, match="'some' is not valid.*selective"):
        model.set_gradient_checkpointing("some")


def test_bf16_autocast_close_to_fp32():
    model = _model()
    x, t, ctx = _inputs(model, 2, (2, 4, 6))
    ref = model(x, t, ctx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, ctx)
    assert out.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 0.05


def test_from_name_or_config():
    assert from_name_or_config("tiny") is TINY
    assert from_name_or_config(TINY) is TINY
    cfg = from_name_or_config(
        {"dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 2, "patch_size": [1, 2, 2]}
    )
    assert cfg.patch_size == (1, 2, 2) and cfg.text_dim == 4096
    short = from_name_or_config({"preset": "wan2_1_1_3b", "num_layers": 4})
    assert short.num_layers == 4 and short.dim == 1536 and short.ffn_dim == 8960
    assert from_name_or_config({"preset": "tiny"}) == TINY
    with pytest.raises(
        ValueError, match=r"Unknown Wan model preset 'wan_1b'.*'tiny', 'wan2_1_14b', 'wan2_1_1_3b'"
    ):
        from_name_or_config("wan_1b")
    with pytest.raises(ValueError, match=r"Unknown WanConfig fields \['hidden'\]"):
        from_name_or_config({"hidden": 3})
    with pytest.raises(TypeError, match="Expected a preset name"):
        from_name_or_config(3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_heads": 5}, "divisible by `num_heads`"),
        ({"num_heads": 16}, "head_dim=4"),
        ({"window_size": (4, 4)}, "window_size"),
        ({"dim": 0}, r"WanConfig\(dim=0\)"),
    ],
)
def test_bad_config_raises(kwargs, match):
    fields = {"dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        WanConfig(**fields)


def test_residual_stream_dtype_follows_residual_fp32():
    # Under bf16 autocast, `residual_fp32=False` keeps the stream between blocks (and the modulated norms'
    # outputs) in bf16, as diffusers' block does; the default keeps both in fp32, as Wan does. Both stay
    # close to an fp32 run of the same weights without autocast (an update dropped or mis-gated would not).
    import dataclasses

    seen: dict[str, list[torch.dtype]] = {}
    x, t, ctx = _inputs(_model(), 2, (2, 4, 6))
    ref = _model()(x, t, ctx)
    for name, config in (("fp32", TINY), ("bf16", dataclasses.replace(TINY, residual_fp32=False))):
        model = _model(config)
        seen[name] = []
        for block in model.blocks:
            block.register_forward_pre_hook(lambda m, args, s=seen[name]: s.append(args[0].dtype))
            block.norm1.register_forward_hook(lambda m, args, out, s=seen[name]: s.append(out.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, t, ctx)
        assert out.dtype == torch.float32
        assert (out - ref).norm() / ref.norm() < 0.05, name
    assert set(seen["fp32"]) == {torch.float32} and set(seen["bf16"]) == {torch.bfloat16}
    assert len(seen["bf16"]) == 2 * TINY.num_layers
    # Without autocast the embedding computes in fp32, so the stream is fp32 either way.
    model = _model(dataclasses.replace(TINY, residual_fp32=False))
    assert (model(x, t, ctx) - _model()(x, t, ctx)).abs().max() == 0
