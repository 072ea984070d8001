"""Fused twins of diffusers' AdaLayerNormZero / AdaLayerNormZeroSingle / AdaLayerNormContinuous."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers.models.normalization import (  # noqa: E402
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
)
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformer3DModel  # noqa: E402

from lightning_adaptiveload.callbacks import fused_adaln as fa  # noqa: E402
from lightning_adaptiveload.callbacks.fused_adaln import (  # noqa: E402
    FusedAdaLNCallback,
    apply_fused_adaln,
    register_adaln_module,
    unregister_adaln_module,
)
from lightning_adaptiveload.integrations import diffusers_norms  # noqa: E402
from lightning_adaptiveload.integrations.diffusers_norms import (  # noqa: E402
    FusedAdaLayerNormContinuous,
    FusedAdaLayerNormZero,
    FusedAdaLayerNormZeroSingle,
    fused_twin,
)

pytestmark = pytest.mark.filterwarnings("ignore:adaln. using the PyTorch reference")
D = 24
HUNYUAN = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=1,
               num_single_layers=1, num_refiner_layers=1, text_embed_dim=8, pooled_projection_dim=6,
               rope_axes_dim=(4, 4, 4))


def _norms():
    torch.manual_seed(0)
    return {
        "zero": AdaLayerNormZero(D),
        "zero_fp32": AdaLayerNormZero(D, norm_type="fp32_layer_norm"),
        "zero_labels": AdaLayerNormZero(D, num_embeddings=10),
        "single": AdaLayerNormZeroSingle(D),
        "continuous": AdaLayerNormContinuous(D, 16, elementwise_affine=False, eps=1e-6),
        "continuous_affine": AdaLayerNormContinuous(D, 16),
    }


def _args(name, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, D, generator=gen).to(dtype).requires_grad_()
    if name == "zero_labels":
        return (x,), {"timestep": torch.tensor([1, 50, 999]), "class_labels": torch.tensor([1, 2, 3]),
                      "hidden_dtype": dtype}
    emb = torch.randn(3, 16 if name.startswith("continuous") else D, generator=gen).to(dtype).requires_grad_()
    return ((x, emb), {}) if name.startswith("continuous") or name == "single" else ((x,), {"emb": emb})


def _run(module, args, kwargs):
    out = module(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    weight = [torch.randn(o.shape, generator=torch.Generator().manual_seed(2 + i)).to(o.dtype) for i, o in enumerate(outs)]
    loss = sum((o.float() * w.float()).sum() for o, w in zip(outs, weight, strict=True))
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    params = list(module.parameters())
    grads = torch.autograd.grad(loss, inputs + params)
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("name", list(_norms()))
def test_twin_is_bit_exact_against_diffusers_in_fp32_forward_and_every_gradient(name):
    ref = _norms()[name]
    twin = fused_twin(copy.deepcopy(ref))
    assert isinstance(twin, type(ref)) and type(twin) is not type(ref)
    assert list(twin.state_dict()) == list(ref.state_dict())
    args, kwargs = _args(name)
    out_ref, grads_ref = _run(ref, args, kwargs)
    out, grads = _run(twin, args, kwargs)
    assert len(out) == len(out_ref) and all(torch.equal(a, b) for a, b in zip(out, out_ref, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))


@pytest.mark.parametrize("name", ["zero", "zero_fp32", "single", "continuous"])
def test_twin_under_bf16_autocast_has_diffusers_dtypes_and_agrees_to_bf16_rounding(name):
    ref = _norms()[name]
    twin = fused_twin(copy.deepcopy(ref))
    args, kwargs = _args(name, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, _ = _run(ref, args, kwargs)
        out, _ = _run(twin, args, kwargs)
    assert [o.dtype for o in out] == [o.dtype for o in out_ref]
    for a, b in zip(out, out_ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_the_twin_shares_the_modules_parameters():
    ref = AdaLayerNormZero(D)
    twin = fused_twin(ref)
    assert twin.linear is ref.linear and twin.norm is ref.norm
    assert all(a is b for a, b in zip(twin.parameters(), ref.parameters(), strict=True))


def test_norms_that_are_not_layernorm_plus_modulate_are_left_alone():
    rms = AdaLayerNormContinuous(D, 16, norm_type="rms_norm")
    assert fused_twin(rms) is None
    model = torch.nn.Sequential(rms, AdaLayerNormZeroSingle(D))
    assert apply_fused_adaln(model) == 1  # the RMSNorm one is neither swapped nor counted
    assert type(model[0]) is AdaLayerNormContinuous and type(model[1]) is FusedAdaLayerNormZeroSingle
    assert fused_twin(torch.nn.LayerNorm(D)) is None


def _hunyuan():
    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(**HUNYUAN).eval()


def _hunyuan_inputs():
    gen = torch.Generator().manual_seed(4)
    return (torch.randn(2, 4, 2, 4, 6, generator=gen), torch.tensor([10.0, 900.0]), torch.randn(2, 5, 8, generator=gen),
            torch.ones(2, 5, dtype=torch.long), torch.randn(2, 6, generator=gen), torch.tensor([6000.0, 6000.0]))


def test_apply_fuses_hunyuan_videos_four_sites_bit_exact_on_cpu():
    ref = _hunyuan()
    fused = copy.deepcopy(ref)
    # norm1 and norm1_context of the dual-stream block, norm of the single-stream block, the head's norm_out.
    assert apply_fused_adaln(fused) == 4 and apply_fused_adaln(fused) == 0
    assert type(fused.transformer_blocks[0].norm1) is FusedAdaLayerNormZero
    assert type(fused.single_transformer_blocks[0].norm) is FusedAdaLayerNormZeroSingle
    assert type(fused.norm_out) is FusedAdaLayerNormContinuous
    assert list(fused.state_dict()) == list(ref.state_dict())
    inputs = _hunyuan_inputs()
    out_ref = ref(*inputs, return_dict=False)[0]
    out = fused(*inputs, return_dict=False)[0]
    assert torch.equal(out, out_ref)
    grads_ref = torch.autograd.grad(out_ref.square().sum(), list(ref.parameters()), allow_unused=True)
    grads = torch.autograd.grad(out.square().sum(), list(fused.parameters()), allow_unused=True)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))


def test_callback_fuses_diffusers_adaln_zero_norms_by_default_and_they_can_be_unregistered(monkeypatch):
    from lightning_adaptiveload.integrations.diffusers import DiffusersVideoModule

    module = DiffusersVideoModule(_hunyuan(), text_len=5)
    unfused = module._fused_adaln_sites()
    cb = FusedAdaLNCallback(build=False)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    monkeypatch.setattr(type(trainer.strategy), "root_device", property(lambda self: torch.device("cuda", 0)))
    cb.setup(trainer, module, "fit")
    assert cb.patched == 4 and unfused == 0 and module._fused_adaln_sites() == 4  # the calibration key sees it
    monkeypatch.setattr(fa, "_UNREGISTERED_DIFFUSERS", set())
    assert unregister_adaln_module(AdaLayerNormZero) is diffusers_norms.fused_twin
    assert apply_fused_adaln(_hunyuan()) == 2  # the single-stream norm and the head
    monkeypatch.setattr(fa, "_REGISTRY", dict(fa._REGISTRY))
    register_adaln_module(AdaLayerNormZero, diffusers_norms.fused_twin)
    assert apply_fused_adaln(_hunyuan()) == 4


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_matches_diffusers_hunyuan_video_on_the_gpu(dtype):
    from lightning_adaptiveload.ops import load_adaln_extension

    assert load_adaln_extension()
    ref = _hunyuan().cuda()
    fused = copy.deepcopy(ref)
    assert apply_fused_adaln(fused) == 4
    inputs = [v.cuda() for v in _hunyuan_inputs()]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
        out_ref = ref(*inputs, return_dict=False)[0]
        out = fused(*inputs, return_dict=False)[0]
        grads_ref = torch.autograd.grad(out_ref.float().square().sum(), list(ref.parameters()), allow_unused=True)
        grads = torch.autograd.grad(out.float().square().sum(), list(fused.parameters()), allow_unused=True)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype is torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    assert out.dtype == out_ref.dtype
    torch.testing.assert_close(out.float(), out_ref.float(), **tol)
    for a, b in zip(grads, grads_ref, strict=True):
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), **{k: 10 * v for k, v in tol.items()})
