"""The project's attention backends inside diffusers' Wan: the processor's own path computes what diffusers'
processor computes (self-attention with RoPE and cross-attention, fp32 on CPU), and FA4 on a GPU."""

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import WanTransformer3DModel  # noqa: E402

from lightning_adaptiveload.integrations import diffusers_attention as da  # noqa: E402
from lightning_adaptiveload.ops import attention as attn  # noqa: E402


def _tiny(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2,
                                 rope_max_seq_len=64).to(device, dtype)


def _inputs(device="cpu", dtype=torch.float32):
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(2, 4, 3, 8, 8, generator=g, device=device, dtype=dtype)
    return x, torch.tensor([10.0, 700.0], device=device), torch.randn(2, 7, 24, generator=g, device=device, dtype=dtype)


def test_own_path_matches_diffusers_processor(monkeypatch):
    model = _tiny()
    x, t, ctx = _inputs()
    with torch.no_grad():
        want = model(x, t, ctx, return_dict=False)[0]
    assert da.set_wan_attention_backend(model, "fa4") == 4  # 2 blocks x (self, cross)
    # On CPU the own path runs its attention through SDPA (FA4 needs a GPU): the rest is the path under test.
    monkeypatch.setattr(da, "attention", lambda q, k, v, backend: attn.attention(q, k, v, "sdpa"))
    with torch.no_grad():
        got = model(x, t, ctx, return_dict=False)[0]
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    # "sdpa" is diffusers' own processor path: bit-equal.
    da.set_wan_attention_backend(model, "sdpa")
    with torch.no_grad():
        assert torch.equal(model(x, t, ctx, return_dict=False)[0], want)


def test_bad_backend_is_refused():
    with pytest.raises(ValueError, match=r"backend='flash'\)` is not valid"):
        da.set_wan_attention_backend(_tiny(), "flash")


@pytest.mark.cuda
def test_fa4_in_diffusers_wan_matches_sdpa_on_gpu():
    if reason := attn.fa4_unsupported_reason("cuda", torch.bfloat16, 16):
        pytest.skip(reason)
    model = _tiny("cuda", torch.bfloat16)
    x, t, ctx = _inputs("cuda", torch.bfloat16)
    want = model(x, t, ctx, return_dict=False)[0].float()
    want.square().mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    da.set_wan_attention_backend(model, "fa4")
    got = model(x, t, ctx, return_dict=False)[0].float()
    got.square().mean().backward()
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    for n, p in model.named_parameters():
        if n in grads and grads[n].norm() > 0:
            assert ((p.grad.float() - grads[n]).norm() / grads[n].norm()).item() < 5e-2, n


def test_diffusers_wan_module_switches_its_processors():
    from lightning_adaptiveload.integrations.diffusers import DiffusersWanModule

    module = DiffusersWanModule(_tiny(), text_len=7)
    assert module.attention == "auto" and module.attention_backends == ("sdpa", "fa4")
    assert module.attention_heads == (2, 16)
    module._use_attention("fa4")
    procs = [m.processor for m in module.transformer.modules() if hasattr(m, "processor")]
    assert procs and all(isinstance(p, da.WanBackendAttnProcessor) and p.backend == "fa4" for p in procs)
    module.set_attention_plan({96: "sdpa"})
    assert all(p.backend == "sdpa" for p in procs)
    with pytest.raises(ValueError, match=r"DiffusersWanModule\(attention='flash'\)` is not valid"):
        DiffusersWanModule(_tiny(), text_len=7, attention="flash")
    fixed = DiffusersWanModule(_tiny(), text_len=7, attention="fa4")
    with pytest.raises(ValueError, match=r"attention='fa4'\)` cannot run: FA4 runs on CUDA"):
        fixed.on_fit_start()


# HunyuanVideo (dual- and single-stream blocks), CogVideoX (text first) and LTX-Video (self-attention with RoPE over
# the flat channels, cross-attention with the text mask) through their tiny Hydra configs, as users pick them with
# `model=`, and Wan for the same module-level switch.
FAMILIES = ["diffusers_hunyuan_video_tiny", "diffusers_cogvideox_tiny", "diffusers_ltx_video_tiny",
            "diffusers_wan2_1_tiny"]
JOINT = ("diffusers_hunyuan_video_tiny", "diffusers_cogvideox_tiny")


def _family_module(name, **overrides):
    from pathlib import Path

    from hydra.utils import instantiate
    from omegaconf import OmegaConf, open_dict

    import lightning_adaptiveload

    node = OmegaConf.load(Path(lightning_adaptiveload.__file__).parent.parent / "conf" / "model" / f"{name}.yaml")
    with open_dict(node):
        node.update(overrides)
    torch.manual_seed(0)
    module = instantiate(node)
    module.configure_model()
    return module


def _loss_and_grads(module, batch):
    module.zero_grad(set_to_none=True)
    loss = module.compute_loss(batch, torch.Generator(device=module.device).manual_seed(0))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", FAMILIES)
def test_each_familys_own_attention_path_gives_diffusers_loss_and_gradients(monkeypatch, name):
    module = _family_module(name)
    assert module.attention_backends == ("sdpa", "fa4")
    batch = module.synthetic_batch(2, (3, 2, 2))  # frames > 1: the 3-D RoPE is exercised
    video = 3 * 2 * 2
    want_loss, want = _loss_and_grads(module, batch)
    shapes = []

    def own(q, k, v, backend):  # on CPU the own path runs its attention through SDPA (FA4 needs a GPU)
        shapes.append((backend, tuple(q.shape), tuple(k.shape)))
        return attn.attention(q, k, v, "sdpa")

    monkeypatch.setattr(da, "attention", own)
    module._use_attention("fa4")
    got_loss, got = _loss_and_grads(module, batch)
    assert shapes and all(b == "fa4" for b, _, _ in shapes)
    heads, head_dim = module.attention_heads
    text = module.hparams["text_len"]
    if name in JOINT:  # joint attention: video and text tokens in one (B, S, H, D) sequence
        assert all(q == k == (2, video + text, heads, head_dim) for _, q, k in shapes)
    else:  # self-attention over the video tokens and cross-attention to the text, each on the own path
        assert {(q, k) for _, q, k in shapes} == {((2, video, heads, head_dim), (2, n, heads, head_dim))
                                                  for n in (video, text)}
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-7)
    assert got.keys() == want.keys()
    for n, g in want.items():
        assert ((got[n] - g).norm() / g.norm().clamp_min(1e-12)).item() < 1e-4, n
    # Back to "sdpa": diffusers' own processors' path, bit-equal.
    module._use_attention("sdpa")
    shapes.clear()
    assert torch.equal(_loss_and_grads(module, batch)[0], want_loss) and not shapes


@pytest.mark.parametrize("name", ["diffusers_hunyuan_video_tiny", "diffusers_ltx_video_tiny"])
def test_a_padded_text_mask_keeps_diffusers_masked_path(monkeypatch, name):
    module = _family_module(name)
    batch = module.synthetic_batch(2, (1, 2, 2))
    padded = dict(batch, context_mask=torch.tensor([[1] * 5 + [0] * 3] * 2))
    want = module.compute_loss(padded, torch.Generator().manual_seed(0))
    backends = []
    real = da.attention
    monkeypatch.setattr(da, "attention", lambda q, k, v, backend: backends.append((q.shape, k.shape)) or real(
        q, k, v, "sdpa"))
    module._use_attention("fa4")
    got = module.compute_loss(padded, torch.Generator().manual_seed(0))
    if name == "diffusers_hunyuan_video_tiny":  # the joint mask covers every attention: none on the own path
        assert not backends and torch.equal(got, want)
    else:  # LTX: self-attention (no mask) on the own path, the masked cross-attention on diffusers'
        assert backends and all(q == k for q, k in backends)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_bad_backend_is_refused_by_every_processor():
    for cls in (da.CogVideoXBackendAttnProcessor, da.LTXVideoBackendAttnProcessor, da.WanBackendAttnProcessor):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\(backend='flash'\)` is not valid"):
            cls("flash")
    with pytest.raises(ValueError, match=r"HunyuanVideoBackendAttnProcessor\(backend='flash'\)` is not valid"):
        da.HunyuanVideoBackendAttnProcessor("flash")


@pytest.mark.cuda
@pytest.mark.parametrize("name", FAMILIES[:3])
def test_fa4_in_hunyuan_cogvideox_and_ltx_matches_sdpa_on_gpu(name):
    module = _family_module(name).to("cuda", torch.bfloat16)
    heads, head_dim = module.attention_heads
    if reason := attn.fa4_unsupported_reason("cuda", torch.bfloat16, head_dim):
        pytest.skip(reason)
    batch = {k: v.to("cuda", torch.bfloat16) if v.is_floating_point() else v.to("cuda")
             for k, v in module.synthetic_batch(2, (3, 4, 4)).items() if isinstance(v, torch.Tensor)}
    want_loss, want = _loss_and_grads(module, batch)
    module._use_attention("fa4")
    calls = []
    real = da.attention
    da.attention = lambda q, k, v, backend: calls.append(backend) or real(q, k, v, backend)
    try:
        got_loss, got = _loss_and_grads(module, batch)
    finally:
        da.attention = real
    assert calls and set(calls) == {"fa4"}  # every attention of the model ran FA4
    assert abs(got_loss.float() - want_loss.float()) / want_loss.float().abs() < 2e-2
    for n, g in want.items():
        if g.float().norm() > 0:
            assert ((got[n].float() - g.float()).norm() / g.float().norm()).item() < 5e-2, n
