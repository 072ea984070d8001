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


def test_diffusers_wan_module_switches_its_processors_and_other_families_run_sdpa_only():
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
