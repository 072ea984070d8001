"""FusedAdaLNCallback / apply_fused_adaln: module swapping, registry, Lightning hook timing."""

from __future__ import annotations

import copy
import importlib.util
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_adaptiveload.callbacks import fused_adaln as fa
from lightning_adaptiveload.callbacks.fused_adaln import (
    FusedAdaLNCallback,
    apply_fused_adaln,
    register_adaln_module,
    register_adaln_patcher,
    unregister_adaln_module,
    unregister_adaln_patcher,
)
from lightning_adaptiveload.models.flow_matching import FlowMatchingModule
from lightning_adaptiveload.models.wan import WAN_CONFIGS, WanModel
from lightning_adaptiveload.modules.adaln import AdaLayerNorm, FusedAdaLayerNorm


def _count(model: nn.Module, cls: type) -> int:
    return sum(type(m) is cls for m in model.modules())


def test_apply_on_tiny_wan_counts_every_site_and_keeps_state_dict():
    model = WanModel(WAN_CONFIGS["tiny"])
    sites = _count(model, AdaLayerNorm)
    assert sites == 2 * WAN_CONFIGS["tiny"].num_layers + 1  # norm1, norm2 per block + head
    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    assert apply_fused_adaln(model) == sites
    assert _count(model, AdaLayerNorm) == 0 and _count(model, FusedAdaLayerNorm) == sites
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert apply_fused_adaln(model) == 0  # never patched twice


def test_fused_twin_shares_affine_parameters():
    m = AdaLayerNorm(16, elementwise_affine=True, out_dtype=torch.bfloat16)
    f = FusedAdaLayerNorm.from_module(m)
    assert f.weight is m.weight and f.bias is m.bias and f.out_dtype is torch.bfloat16
    with pytest.raises(TypeError, match="Expected an AdaLayerNorm"):
        FusedAdaLayerNorm.from_module(nn.LayerNorm(4))


def test_registry_maps_user_classes(monkeypatch):
    monkeypatch.setattr(fa, "_REGISTRY", dict(fa._REGISTRY))

    class MyNorm(nn.Module):
        def forward(self, x):
            return x

    class MyFused(MyNorm):
        pass

    register_adaln_module(MyNorm, lambda m: MyFused())
    model = nn.Sequential(MyNorm(), nn.Sequential(MyNorm(), nn.Linear(2, 2)), AdaLayerNorm(4))
    assert apply_fused_adaln(model) == 3
    assert type(model[0]) is MyFused and type(model[1][0]) is MyFused
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_adaln_module(int, lambda m: m)
    with pytest.raises(TypeError, match="Expected a callable"):
        register_adaln_module(MyNorm, "nope")
    unregister_adaln_module(MyNorm)
    assert apply_fused_adaln(nn.Sequential(MyNorm())) == 0
    # (diffusers' AdaLN-Zero norms are listed too once diffusers is imported)
    with pytest.raises(ValueError, match=r"unregister_adaln_module\(.*MyNorm.*Registered: \[.*'AdaLayerNorm'\]"):
        unregister_adaln_module(MyNorm)


class _Inline(nn.Module):
    """Modulates inline in forward, like diffusers' Wan blocks: only a patcher can fuse it."""

    def forward(self, x, scale, shift):
        return nn.functional.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift


def _patch_inline(model: nn.Module) -> int:
    found = [m for m in model.modules() if type(m) is _Inline and not getattr(m, "fused", False)]
    for m in found:
        m.fused = True
    return len(found)


def test_patchers_are_called_counted_and_unregistered(monkeypatch):
    monkeypatch.setattr(fa, "_PATCHERS", dict(fa._PATCHERS))
    register_adaln_patcher("inline", _patch_inline)
    model = nn.Sequential(_Inline(), AdaLayerNorm(4), nn.Sequential(_Inline()))
    assert apply_fused_adaln(model) == 3  # one swap + two patched sites
    assert all(m.fused for m in model.modules() if type(m) is _Inline)
    assert apply_fused_adaln(model) == 0
    assert unregister_adaln_patcher("inline") is _patch_inline
    assert apply_fused_adaln(nn.Sequential(_Inline())) == 0
    with pytest.raises(ValueError, match=r"unregister_adaln_patcher\('inline'\)` is not valid"):
        unregister_adaln_patcher("inline")
    with pytest.raises(TypeError, match="non-empty string"):
        register_adaln_patcher("", _patch_inline)
    with pytest.raises(TypeError, match="callable model -> int"):
        register_adaln_patcher("x", 3)


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="diffusers is not installed")
def test_diffusers_patcher_is_registered_and_imports_nothing_for_other_models(monkeypatch):
    assert fa._PATCHERS["diffusers_wan"] is fa._patch_diffusers_wan
    for name in [n for n in sys.modules if n.split(".")[0] == "diffusers" or n.endswith("integrations.diffusers")]:
        monkeypatch.delitem(sys.modules, name)
    assert apply_fused_adaln(nn.Sequential(nn.Linear(2, 2), AdaLayerNorm(2))) == 1
    assert not [n for n in sys.modules if n.split(".")[0] == "diffusers"]


def test_callback_warns_when_it_finds_nothing_to_fuse_on_cuda(monkeypatch):
    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 2)

    cb = FusedAdaLNCallback(build=False)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    monkeypatch.setattr(type(trainer.strategy), "root_device", property(lambda self: torch.device("cuda", 0)))
    with pytest.warns(UserWarning, match=r"found no AdaLN site to fuse in Plain; .*register_adaln_patcher"):
        cb.setup(trainer, Plain(), "fit")
    module = FlowMatchingModule("tiny")  # builds its model in configure_model: the verdict waits for it
    with pytest.warns(UserWarning, match="found no AdaLN site") as rec:
        monkeypatch.setattr(fa, "_REGISTRY", {})
        cb.setup(trainer, module, "fit")
        assert not [w for w in rec if "found no AdaLN site" in str(w.message)]
        module.configure_model()
    cb.teardown(trainer, module, "fit")


def test_callback_is_a_noop_with_one_warning_on_cpu():
    module = FlowMatchingModule("tiny")
    cb = FusedAdaLNCallback()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, callbacks=[cb], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="not patching the model: the training device is cpu") as rec:
        cb.setup(trainer, module, "fit")
    assert len([w for w in rec if "FusedAdaLNCallback" in str(w.message)]) == 1
    module.configure_model()
    assert cb.patched == 0 and _count(module, FusedAdaLayerNorm) == 0


def test_callback_patches_modules_built_in_configure_model(monkeypatch):
    """With a CUDA decision forced, setup wraps configure_model and patches before any wrapping."""
    module = FlowMatchingModule("tiny")
    cb = FusedAdaLNCallback(build=False)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    monkeypatch.setattr(type(trainer.strategy), "root_device", property(lambda self: torch.device("cuda", 0)))
    cb.setup(trainer, module, "fit")
    module.configure_model()  # Lightning calls this after setup, before the strategy wraps the model
    sites = 2 * WAN_CONFIGS["tiny"].num_layers + 1
    assert cb.patched == sites and _count(module, FusedAdaLayerNorm) == sites
    cb.teardown(trainer, module, "fit")
    assert "configure_model" not in module.__dict__


def test_callback_builds_the_extension_and_reports_a_failed_build(monkeypatch):
    """With build=True on a CUDA device, setup asks ops to build; a failed build patches nothing."""
    import contextlib

    calls = []
    monkeypatch.setattr(fa, "load_adaln_extension", lambda: calls.append(1) or False)  # the build failed
    monkeypatch.setattr(fa, "adaln_build_error", lambda: "nvcc not found")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    module = FlowMatchingModule("tiny")
    module.configure_model()
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    monkeypatch.setattr(type(trainer.strategy), "root_device", property(lambda self: torch.device("cuda", 0)))
    cb = FusedAdaLNCallback(build=True)
    with pytest.warns(UserWarning, match=r"did not build \(nvcc not found\)"):
        cb.setup(trainer, module, "fit")
    assert calls == [1]
    assert cb.patched == 0 and _count(module, FusedAdaLayerNorm) == 0


@pytest.mark.cuda
def test_patched_tiny_wan_matches_unpatched():
    torch.manual_seed(0)
    ref = FlowMatchingModule("tiny")
    ref.configure_model()
    ref = ref.cuda()
    fused = copy.deepcopy(ref)
    assert apply_fused_adaln(fused) == 2 * WAN_CONFIGS["tiny"].num_layers + 1
    batch = ref.synthetic_batch(2, (3, 4, 6), device="cuda")
    losses, grads = [], []
    for m in (ref, fused):
        torch.manual_seed(1)
        loss = m.compute_loss(batch)
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad], allow_unused=True))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for a, b in zip(*grads, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.cuda
def test_patched_tiny_wan_with_a_bf16_residual_stream_matches_unpatched():
    # `residual_fp32=False` under bf16 autocast: the fused op gets bf16 rows and writes bf16 (the stream's
    # dtype); loss and gradients agree with the reference path to bf16 rounding.
    torch.manual_seed(0)
    ref = FlowMatchingModule({"preset": "tiny", "residual_fp32": False})
    ref.configure_model()
    ref = ref.cuda()
    fused = copy.deepcopy(ref)
    assert apply_fused_adaln(fused) == 2 * WAN_CONFIGS["tiny"].num_layers + 1
    batch = ref.synthetic_batch(2, (3, 4, 6), device="cuda")
    losses, grads, dtypes = [], [], []
    for m in (ref, fused):
        hook = m.model.blocks[0].norm1.register_forward_hook(lambda mod, args, out: dtypes.append((args[0].dtype, out.dtype)))
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m.compute_loss(batch)
        hook.remove()
        losses.append(loss.detach().float())
        grads.append(torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad], allow_unused=True))
    assert dtypes == [(torch.bfloat16, torch.bfloat16)] * 2
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=1e-3)
    for a, b in zip(*grads, strict=True):
        if a is not None:
            assert (a.float() - b.float()).norm() <= 0.05 * a.float().norm() + 1e-6
