"""diffusers integration: fused AdaLN patch of WanTransformer3DModel and the DiffusersWanModule adapter."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("diffusers")

import lightning.pytorch as pl  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy  # noqa: E402
from lightning_adaptiveload.callbacks.fused_adaln import FusedAdaLNCallback, apply_fused_adaln  # noqa: E402
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset  # noqa: E402
from lightning_adaptiveload.integrations import diffusers as integ  # noqa: E402
from lightning_adaptiveload.integrations.diffusers import (  # noqa: E402
    DiffusersWanModule,
    patch_wan_transformer,
    unpatch_wan_transformer,
)
from lightning_adaptiveload.models.protocol import (  # noqa: E402
    OPTIONAL_MEMBERS,
    REQUIRED_MEMBERS,
    check_module,
    validate_synthetic_batch,
)

TINY = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 8,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "rope_max_seq_len": 32,
}
SITES = 2 * TINY["num_layers"] + 1

pytestmark = pytest.mark.filterwarnings("ignore:adaln. using the PyTorch reference")


def _tiny(seed: int = 0, **overrides) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(**{**TINY, **overrides}).eval()


def _inputs(per_token: bool, grid=(2, 2, 3), batch: int = 2, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(batch, TINY["in_channels"], f, 2 * h, 2 * w, generator=gen)
    context = torch.randn(batch, 3, TINY["text_dim"], generator=gen)
    shape = (batch, f * h * w) if per_token else (batch,)
    t = torch.rand(shape, generator=gen) * 1000
    return x, t, context


def _forward_backward(model, x, t, context):
    out = model(x, t, context, return_dict=False)[0]
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)  # all outputs count
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * weight).sum(), params)
    return out.detach(), dict(zip([n for n, p in model.named_parameters() if p.requires_grad], grads, strict=True))


class _CountAdaLN:
    def __init__(self, monkeypatch):
        self.calls = []
        original = integ.adaln

        def counting(x, scale, shift, *args):
            self.calls.append(tuple(scale.shape))
            return original(x, scale, shift, *args)

        monkeypatch.setattr(integ, "adaln", counting)


def _bf16_like_from_pretrained(model: WanTransformer3DModel) -> WanTransformer3DModel:
    """bf16 weights except what diffusers keeps in fp32 when loading with ``torch_dtype=torch.bfloat16``."""
    model.to(torch.bfloat16)
    keep = model._keep_in_fp32_modules
    for name, module in model.named_modules():
        if any(k in name.split(".") for k in keep):
            module.float()
    for name, p in model.named_parameters():
        if name.split(".")[-1] in keep:
            p.data = p.data.float()
    return model


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("mode", ["fp32", "fp32_checkpointed", "bf16"])
def test_patched_model_matches_diffusers_forward_and_every_gradient(monkeypatch, per_token, mode):
    checkpointing = mode == "fp32_checkpointed"
    ref = _bf16_like_from_pretrained(_tiny()) if mode == "bf16" else _tiny()
    fused = copy.deepcopy(ref)
    assert patch_wan_transformer(fused) == SITES
    if checkpointing:
        ref.enable_gradient_checkpointing()
        fused.enable_gradient_checkpointing()
    count = _CountAdaLN(monkeypatch)
    x, t, context = _inputs(per_token)
    if mode == "bf16":
        x, context = x.bfloat16(), context.bfloat16()
    out_ref, grads_ref = _forward_backward(ref, x, t, context)
    assert count.calls == []
    out, grads = _forward_backward(fused, x, t, context)
    n = 2 * 2 * 3
    recomputed = 2 * TINY["num_layers"] if checkpointing else 0  # the blocks' sites run again in backward
    assert count.calls == [(2, n, 24) if per_token else (2, 1, 24)] * (SITES + recomputed)
    assert out.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
    assert torch.equal(out, out_ref)  # the CPU path runs the same ops in the same dtypes: bit for bit
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(ref.parameters()))
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name


def test_patch_is_per_instance_reversible_and_keeps_the_state_dict(monkeypatch):
    model = _tiny()
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    assert patch_wan_transformer(model) == SITES
    assert patch_wan_transformer(model) == 0  # never twice
    assert type(model.blocks[0]).__name__ == "WanTransformerBlock"  # diffusers finds blocks by name
    assert list(model.state_dict()) == keys and all(p is params[n] for n, p in model.named_parameters())
    clone = copy.deepcopy(model)  # stays patched, bound to the copy
    assert clone.blocks[1].forward.__self__ is clone.blocks[1] and clone.forward.__self__ is clone
    assert patch_wan_transformer(_tiny()) == SITES  # another instance is not patched yet

    count = _CountAdaLN(monkeypatch)
    x, t, context = _inputs(False)
    model(x, t, context)
    assert len(count.calls) == SITES
    assert unpatch_wan_transformer(model) == SITES and unpatch_wan_transformer(model) == 0
    assert all("forward" not in m.__dict__ for m in model.modules())
    count.calls.clear()
    model(x, t, context)
    assert count.calls == []


def test_patch_follows_fully_shard_class_swaps_but_not_subclasses(monkeypatch):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    from torch.distributed.fsdp import FSDPModule

    model = _tiny()
    # What fully_shard does to a module's class (without the process group it needs).
    model.blocks[0].__class__ = type("FSDPWanTransformerBlock", (FSDPModule, WanTransformerBlock), {})
    model.blocks[1].__class__ = type("MyBlock", (WanTransformerBlock,), {})
    assert patch_wan_transformer(model) == 2 + 1
    assert "forward" in model.blocks[0].__dict__ and "forward" not in model.blocks[1].__dict__
    count = _CountAdaLN(monkeypatch)
    model(*_inputs(False))
    assert len(count.calls) == 3
    assert unpatch_wan_transformer(model) == 3 and "forward" not in model.blocks[0].__dict__


def test_patch_leaves_replaced_forwards_and_other_diffusers_sources_alone(monkeypatch):
    model = _tiny()
    hooked = model.blocks[0]
    hooked.forward = hooked.forward  # what a diffusers hook (cache, offloading, CP) leaves behind
    with pytest.warns(UserWarning, match=r"left 1 module\(s\) unfused: WanTransformerBlock: its forward is already"):
        assert patch_wan_transformer(model) == SITES - 2
    assert "forward" in hooked.__dict__ and unpatch_wan_transformer(model) == SITES - 2
    assert "forward" in hooked.__dict__  # not ours: unpatch keeps it

    monkeypatch.setitem(integ._VERIFIED_SOURCES, WanTransformer3DModel, "0" * 16)
    integ._source_matches.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"WanTransformer3DModel.forward` differs from the 0.42.1"):
            assert patch_wan_transformer(_tiny()) == SITES - 1
        assert patch_wan_transformer(_tiny(), strict=False) == SITES
    finally:
        integ._source_matches.cache_clear()


def test_callback_patches_diffusers_models_by_default(monkeypatch):
    module = DiffusersWanModule(_tiny(), text_len=3)
    assert apply_fused_adaln(module) == SITES
    assert unpatch_wan_transformer(module) == SITES
    cb = FusedAdaLNCallback(build=False)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    monkeypatch.setattr(type(trainer.strategy), "root_device", property(lambda self: torch.device("cuda", 0)))
    cb.setup(trainer, module, "fit")
    assert cb.patched == SITES and "forward" in module.transformer.blocks[0].__dict__


def test_adapter_provides_the_protocol():
    module = DiffusersWanModule(dict(TINY), text_len=3)
    assert module.patch_size == (1, 2, 2)
    with pytest.raises(RuntimeError, match="configure_model"):
        module.compute_loss(module.synthetic_batch(1, (1, 1, 1)))
    module.configure_model()
    check_module(module, REQUIRED_MEMBERS + OPTIONAL_MEMBERS)
    batch = validate_synthetic_batch(module, (2, 2, 3), device="cpu")
    assert batch["latents"].shape == (2, 4, 2, 4, 6) and batch["context"].shape == (2, 3, 8)
    assert torch.equal(batch["latents"], module.synthetic_batch(2, (2, 2, 3))["latents"])  # own generator
    assert module.batch_shape(batch) == (2, 12)
    loss = module.compute_loss(batch)
    assert loss.dtype == torch.float32 and loss.ndim == 0 and torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"synthetic_batch\(grid=\(1, 0, 1\)\)` is not valid"):
        module.synthetic_batch(1, (1, 0, 1))
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        DiffusersWanModule("Wan-AI/Wan2.1-T2V-1.3B")
    with pytest.raises(ValueError, match=r"DiffusersWanModule\(lr=0\)` is not valid. Expected a positive float"):
        DiffusersWanModule(dict(TINY), lr=0)


def test_compute_loss_is_wans_rectified_flow():
    module = DiffusersWanModule(_tiny(), text_len=3, timestep_shift=3.0)
    batch = module.synthetic_batch(2, (1, 2, 2))
    loss = module.compute_loss(batch, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    x0 = batch["latents"]
    u = torch.rand(2, generator=gen)
    t = 3.0 * u / (1 + 2.0 * u)
    noise = torch.randn(x0.shape, generator=gen)
    x_t = (1 - t.view(2, 1, 1, 1, 1)) * x0 + t.view(2, 1, 1, 1, 1) * noise
    pred = module.transformer(x_t, t * 1000, batch["context"], return_dict=False)[0]
    assert torch.equal(loss, ((pred - (noise - x0)) ** 2).mean())
    # Without a generator: the stream kept apart from training, never the global RNG.
    state = torch.get_rng_state()
    assert torch.equal(module.compute_loss(batch), module.compute_loss(batch))
    assert torch.equal(torch.get_rng_state(), state)


def test_flops_per_sample_is_three_times_the_counted_forward():
    module = DiffusersWanModule(_tiny(), text_len=3)
    batch = module.synthetic_batch(2, (2, 2, 3))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:  # the math path is counted as matmuls
        module(batch["latents"], torch.tensor([500.0, 10.0]), batch["context"])
    assert module.flops_per_sample(12) == 3 * counter.get_total_flops() / 2


def test_adapter_trains_with_the_datamodule_on_cpu(tmp_path):
    dataset = SyntheticMixedDataset(24, "tiny", latent_channels=4, text_len=3, text_dim=8, seed=0)
    dm = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(m_mem=128, m_comp=128 * 64, p=2), seed=0)
    torch.manual_seed(0)
    module = DiffusersWanModule(dict(TINY), text_len=3, lr=1e-3)
    trainer = pl.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[FusedAdaLNCallback()],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    fresh = DiffusersWanModule(dict(TINY), text_len=3)
    torch.manual_seed(0)
    fresh.configure_model()
    assert any(not torch.equal(a, b) for a, b in zip(module.parameters(), fresh.parameters(), strict=True))
    reloaded = DiffusersWanModule(**module.hparams)  # hparams rebuild the same architecture
    reloaded.configure_model()
    reloaded.load_state_dict(module.state_dict())


def test_adapter_trains_with_fused_adamw_and_clipping_under_bf16(tmp_path):
    # Lightning's mixed-precision plugin alone would refuse to clip for the fused optimizer.
    dataset = SyntheticMixedDataset(24, "tiny", latent_channels=4, text_len=3, text_dim=8, seed=0)
    dm = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(m_mem=128, m_comp=128 * 64, p=2), seed=0)
    module = DiffusersWanModule(dict(TINY), text_len=3, lr=1e-3, optimizer_impl="fused")
    trainer = pl.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        precision="bf16-mixed", gradient_clip_val=1e-4,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=dm)
    (opt,) = trainer.optimizers
    assert opt.defaults["fused"] is True and trainer.global_step == 2
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters() if p.grad is not None]))
    assert float(norm) == pytest.approx(1e-4, rel=1e-3)  # the last step's gradients were clipped
    with pytest.raises(ValueError, match="optimizer_impl='sgd'"):
        DiffusersWanModule(dict(TINY), optimizer_impl="sgd")


@pytest.mark.cuda
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_fused_kernel_matches_unpatched_model_in_bf16(per_token):
    config = {**TINY, "num_attention_heads": 2, "attention_head_dim": 64, "ffn_dim": 256}
    ref = _bf16_like_from_pretrained(_tiny(**config).cuda())
    fused = copy.deepcopy(ref)
    assert patch_wan_transformer(fused) == SITES
    x, t, context = (v.cuda() for v in _inputs(per_token, grid=(3, 4, 6)))
    x, context = x.bfloat16(), context.bfloat16()
    out_ref, grads_ref = _forward_backward(ref, x, t, context)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads = _forward_backward(fused, x, t, context)
    assert not [w for w in caught if "using the PyTorch reference" in str(w.message)]
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)
    for name, g in grads.items():
        ref_g = grads_ref[name].float()
        err = (g.float() - ref_g).norm() / ref_g.norm().clamp_min(1e-6)
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


def _compiled_module(monkeypatch, counter, config=None, **kwargs) -> DiffusersWanModule:
    """A DiffusersWanModule(compile=True) whose blocks compile with ``counter`` as the backend."""
    import torch._dynamo

    torch._dynamo.reset()
    real = integ.compile_blocks
    monkeypatch.setattr(integ, "compile_blocks", lambda blocks, mark, **kw: real(blocks, mark, backend=counter))
    module = DiffusersWanModule(dict(config or TINY), text_len=3, compile=True, **kwargs)
    module.configure_model()
    return module


@pytest.mark.parametrize("patched", [False, True])
def test_compiled_blocks_match_eager_with_one_graph_for_every_bucket(monkeypatch, patched):
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    module = _compiled_module(monkeypatch, counter)
    ref = copy.deepcopy(module.transformer)
    module.configure_model()  # a second call compiles nothing again
    blocks = list(module.transformer.blocks)
    assert all(b._compiled_call_impl is not None for b in blocks) and len(blocks[0]._forward_pre_hooks) == 1
    if patched:  # the fused-AdaLN forwards are what gets traced (compilation is lazy)
        patch_wan_transformer(module.transformer)
        patch_wan_transformer(ref)
    for grid in [(2, 2, 3), (3, 2, 3), (1, 4, 4)]:  # three token counts, B = 2
        x, t, context = _inputs(False, grid)
        want = ref(x, t, context, return_dict=False)[0]
        got = module(x, t, context)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        got.square().mean().backward()
        want.square().mean().backward()
        for (name, p), (_, q) in zip(module.transformer.named_parameters(), ref.named_parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    # Sizes are symbolic from the first graph on: one graph for every token count.
    assert counter.frame_count == 1


def test_compiled_blocks_under_ddp_compile_one_graph_each(monkeypatch):
    import socket

    import torch._dynamo.testing
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    # ~3 MB of parameters a block: several 1 MB buckets, which the DDP optimizer would cut it at.
    config = {**TINY, "num_attention_heads": 4, "attention_head_dim": 64, "ffn_dim": 512}
    module = _compiled_module(monkeypatch, counter, config)
    ddp = DistributedDataParallel(module, bucket_cap_mb=1.0)
    x, t, context = _inputs(False, (2, 2, 3))
    context = torch.randn(2, 3, config["text_dim"])
    ddp(x, t, context).square().mean().backward()
    assert counter.frame_count == 1
    assert torch._dynamo.config.optimize_ddp is True


def test_compile_arguments_are_checked():
    with pytest.raises(ValueError, match=r"DiffusersWanModule\(compile='yes'\)"):
        DiffusersWanModule(dict(TINY), compile="yes")
    with pytest.raises(ValueError, match=r"DiffusersWanModule\(compile_options=.*needs `compile=True`"):
        DiffusersWanModule(dict(TINY), compile_options={"max_autotune": True})
    with pytest.raises(ValueError, match="'max_autotun' is not an inductor option"):
        DiffusersWanModule(dict(TINY), compile=True, compile_options={"max_autotun": True})
