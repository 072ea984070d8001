"""FusedAdaLNCallback / apply_fused_adaln: module swapping, registry, Lightning hook timing."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_adaptiveload.callbacks import fused_adaln as fa
from lightning_adaptiveload.callbacks.fused_adaln import (
    FusedAdaLNCallback,
    apply_fused_adaln,
    register_adaln_module,
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
    """With build=True on a CUDA device, setup asks ops.adaln to build; a failed build patches nothing."""
    import contextlib
    import importlib

    ops = importlib.import_module("lightning_adaptiveload.ops.adaln")
    calls = []
    monkeypatch.setattr(ops, "_load_extension", lambda: calls.append(1))  # returns None: build failed
    monkeypatch.setattr(ops, "_build_error", "nvcc not found", raising=False)
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
