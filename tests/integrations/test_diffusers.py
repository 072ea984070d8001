"""diffusers integration: fused AdaLN patch of WanTransformer3DModel and the DiffusersWanModule adapter."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from op_counts import CountOps, attention_calls

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


@pytest.mark.slow  # 5 s on a 2-core CPU under load: off the quick path
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


@pytest.mark.slow  # 2 s on a 2-core CPU under load: off the quick path
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


@pytest.mark.slow  # 4 s on a 2-core CPU under load: off the quick path
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


@pytest.mark.slow  # ~28 s on a 2-core CPU (without the fused op)
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


@pytest.mark.slow  # 10-13 s on a 2-core CPU
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


# ---------------------------------------------------------------------- activation checkpointing



def _loss_and_grads(module, batch):
    module.zero_grad(set_to_none=True)
    loss = module.compute_loss(batch, torch.Generator().manual_seed(3))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def _double(batch):
    return {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
@pytest.mark.parametrize("patched", [False, True], ids=["diffusers_forward", "fused_adaln"])
def test_checkpointing_modes_give_the_gradients_of_none_and_recompute_what_they_say(patched):
    torch.manual_seed(0)
    module = DiffusersWanModule(dict(TINY), text_len=3)
    module.configure_model()
    module.double()
    if patched:
        assert patch_wan_transformer(module) == SITES
    blocks = list(module.transformer.blocks)
    forwards = [b.forward for b in blocks]
    batch = _double(module.synthetic_batch(2, (2, 2, 3)))
    want_loss, want_grads = _loss_and_grads(module, batch)
    layers = TINY["num_layers"]
    # Switching back and forth between steps, as the shape benchmark does per bucket.
    for mode, attention_runs, ffn_runs in (("selective", 1, 2), ("full", 2, 2), ("none", 1, 1), ("selective", 1, 2)):
        module.set_checkpointing(mode)
        assert module.checkpointing == mode and {b.checkpointing for b in blocks} == {mode}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), CountOps() as ops:
            loss, grads = _loss_and_grads(module, batch)
        # Self- and cross-attention per block; selective keeps their outputs, full runs them again.
        assert attention_calls(ops.counts) == attention_runs * 2 * layers, mode
        # gelu: once per block forward and once more per recompute, plus the text embedder's.
        assert ops.counts["gelu"] == ffn_runs * layers + 1, mode
        assert torch.equal(loss, want_loss), mode
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], rtol=1e-12, atol=1e-14, msg=f"{mode} {name}")
    # Switching sets an attribute: the blocks keep the forward they had (nothing is re-wrapped).
    assert all(b.forward is f for b, f in zip(blocks, forwards, strict=True))
    with pytest.raises(ValueError, match=r"set_checkpointing\('some'\)` is not valid"):
        module.set_checkpointing("some")


@pytest.mark.slow  # ~18 s on CPU: three modes through AOTAutograd
def test_compiled_blocks_compile_one_graph_per_checkpointing_mode(monkeypatch):
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    module = _compiled_module(monkeypatch, counter, activation_checkpointing="none")
    ref = DiffusersWanModule(dict(TINY), text_len=3)
    ref.configure_model()
    ref.transformer.load_state_dict(module.transformer.state_dict())
    plan = [("none", (2, 2, 3)), ("selective", (1, 4, 4)), ("full", (2, 2, 3)), ("none", (3, 2, 3)),
            ("selective", (2, 2, 3)), ("full", (1, 4, 4)), ("none", (1, 4, 4))]
    for mode, grid in plan:
        module.set_checkpointing(mode)
        ref.set_checkpointing(mode)
        batch = module.synthetic_batch(2, grid)
        loss, grads = _loss_and_grads(module, batch)
        want_loss, want_grads = _loss_and_grads(ref, batch)
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-7, msg=f"{mode} {name}")
    # One graph per mode, shared by both blocks and every token count, images (F = 1) included;
    # switching back reuses it.
    assert counter.frame_count == 3


def test_auto_checkpointing_without_the_shape_benchmark_trains_full_and_warns(tmp_path):
    dataset = SyntheticMixedDataset(8, "tiny", latent_channels=4, text_len=3, text_dim=8, seed=0)
    dm = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(m_mem=128, m_comp=128 * 64, p=2), seed=0)
    module = DiffusersWanModule(dict(TINY), text_len=3, activation_checkpointing="auto")
    assert module.checkpointing == "auto"
    module.configure_model()
    assert module.checkpointing == "auto" and {b.checkpointing for b in module.transformer.blocks} == {"full"}
    with pytest.warns(UserWarning, match=r"DiffusersWanModule\(activation_checkpointing='auto'\)` needs ShapeBenchmark"):
        _trainer(tmp_path, max_steps=1).fit(module, datamodule=dm)
    assert module.checkpointing == "full"


def test_gradient_checkpointing_is_a_deprecated_alias_of_full():
    from lightning.pytorch.utilities.rank_zero import LightningDeprecationWarning

    with pytest.warns(LightningDeprecationWarning, match="use `activation_checkpointing='full'`"):
        module = DiffusersWanModule(dict(TINY), gradient_checkpointing=True)
    assert module.checkpointing == "full" and module.hparams.activation_checkpointing == "full"
    assert module.hparams.gradient_checkpointing is None
    assert DiffusersWanModule(**module.hparams).checkpointing == "full"  # hparams rebuild it without the alias
    assert DiffusersWanModule(dict(TINY), gradient_checkpointing=False).checkpointing == "none"  # old hparams
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True, activation_checkpointing='none'\)` disagree"):
        DiffusersWanModule(dict(TINY), gradient_checkpointing=True, activation_checkpointing="none")
    # A model with diffusers' own checkpointing on: full inside the blocks, the model-level pass off
    # (it would recompute every block twice).
    model = _tiny()
    model.enable_gradient_checkpointing()
    module = DiffusersWanModule(model, text_len=3)
    assert module.checkpointing == "full" and not model.gradient_checkpointing
    assert {b.checkpointing for b in model.blocks} == {"full"}
    assert DiffusersWanModule(_tiny(), activation_checkpointing="selective").checkpointing == "selective"
    with pytest.raises(ValueError, match=r"activation_checkpointing='some'\)` is not valid. Expected one of"):
        DiffusersWanModule(dict(TINY), activation_checkpointing="some")


# ---------------------------------------------------------------------- resume, data checks, calibration key
class _LossTape(pl.Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()


class _Profiled(pl.Callback):
    """Stands in for the shape benchmark: records that fit reached ``on_fit_start`` (where it profiles)."""

    def __init__(self):
        self.reached = False

    def on_fit_start(self, trainer, pl_module):
        self.reached = True


def _trainer(tmp_path, max_steps, callbacks=(), checkpoint_every=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = list(callbacks)
    if checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=checkpoint_every, save_top_k=-1,
                                         filename="{step}"))
    return pl.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_checkpointing=bool(checkpoint_every), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )


def _datamodule(dataset=None, **kwargs):
    dataset = dataset or SyntheticMixedDataset(24, "tiny", latent_channels=4, text_len=3, text_dim=8, seed=0)
    return AdaptiveLoadDataModule(dataset, DualConstraintPolicy(m_mem=128, m_comp=128 * 64, p=2), seed=0, **kwargs)


def _fit_losses(tmp_path, max_steps, ckpt_path=None, checkpoint_every=None):
    module = DiffusersWanModule(dict(TINY), text_len=3, lr=1e-3, seed=0, activation_checkpointing="selective")
    tape = _LossTape()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, max_steps, [tape], checkpoint_every).fit(module, datamodule=_datamodule(),
                                                                    ckpt_path=ckpt_path)
    return tape.losses


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_resumed_run_has_the_uninterrupted_loss_at_every_step(tmp_path):
    pl.seed_everything(0)
    full = _fit_losses(tmp_path / "full", max_steps=8, checkpoint_every=4)
    assert len(full) == 8
    # Another global RNG state in the resumed run: the draws are keyed by (seed, step, rank), not by it.
    torch.manual_seed(99)
    resumed = _fit_losses(tmp_path / "resumed", max_steps=8, ckpt_path=tmp_path / "full" / "step=4.ckpt")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert {s: full[s] for s in resumed} == resumed  # exactly equal, not close


class _Wrapped(torch.utils.data.Dataset):
    """A dataset whose samples are changed by ``edit(index, sample)``; everything else is the base's."""

    def __init__(self, base, edit):
        self.base, self.edit = base, edit

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        return self.edit(index, dict(self.base[index]))

    def __getattr__(self, name):
        return getattr(self.__dict__["base"], name)


def _fit_refused(tmp_path, module, datamodule, match):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    profiled = _Profiled()
    with pytest.raises(MisconfigurationException, match=match):
        _trainer(tmp_path, 1, [profiled]).fit(module, datamodule=datamodule)
    assert not profiled.reached  # refused before the shape benchmark would profile


def test_text_len_is_checked_against_the_data_before_profiling_and_in_every_batch(tmp_path):
    module = DiffusersWanModule(dict(TINY), text_len=5)  # the data has 3 context tokens
    _fit_refused(tmp_path, module, _datamodule(),
                 r"context of dataset\[0\] has L=3 tokens, but the model is set up for text_len=5.*"
                 r"Set `DiffusersWanModule\(text_len=3\)`")
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    module = DiffusersWanModule(dict(TINY), text_len=3)
    batch = module.synthetic_batch(2, (1, 2, 2))
    batch["context"] = torch.zeros(2, 4, TINY["text_dim"])
    with pytest.raises(MisconfigurationException, match=r"a training batch has L=4 tokens, but .*text_len=3"):
        module.training_step(batch, 0)
    batch["context"] = torch.zeros(2, 3, TINY["text_dim"] + 1)
    with pytest.raises(MisconfigurationException, match=r"shape \[2, 3, 9\]; expected \[..., L, text_dim=8\]"):
        module.training_step(batch, 0)


def test_contexts_of_different_lengths_are_refused_before_profiling(tmp_path):
    base = SyntheticMixedDataset(24, "tiny", latent_channels=4, text_len=3, text_dim=8, seed=0)
    varying = _Wrapped(base, lambda i, s: {**s, "context": s["context"][: 2 + i % 2]})
    _fit_refused(tmp_path, DiffusersWanModule(dict(TINY), text_len=3), _datamodule(varying),
                 r"contexts have different lengths \(L=2 at dataset\[0, .*\]; L=3 at dataset\[.*\]\).*"
                 r"Pad every context to text_len=3")


def _renamed(samples):
    from lightning_adaptiveload.data.collate import collate_batch

    batch = collate_batch(samples)
    return {"hidden_states": batch["latents"], "encoder_hidden_states": batch["context"], "index": batch["index"]}


def test_batch_keys_are_configurable_and_other_keys_are_refused_before_profiling(tmp_path):
    _fit_refused(tmp_path / "refused", DiffusersWanModule(dict(TINY), text_len=3), _datamodule(collate_fn=_renamed),
                 r"dataset\[0\] \(collated\) has no 'latents' \(the latents\); it has \['encoder_hidden_states', "
                 r"'hidden_states', 'index'\]. Name the batch's keys: `DiffusersWanModule\(batch_keys=")
    keys = {"latents": "hidden_states", "context": "encoder_hidden_states"}
    module = DiffusersWanModule(dict(TINY), text_len=3, batch_keys=keys)
    assert sorted(module.synthetic_batch(1, (1, 1, 1))) == ["encoder_hidden_states", "hidden_states", "index"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path / "trained", 2).fit(module, datamodule=_datamodule(collate_fn=_renamed))
    assert module.trainer.global_step == 2
    with pytest.raises(ValueError, match=r"batch_keys=\{'noise': 'x'\}\)` is not valid"):
        DiffusersWanModule(dict(TINY), batch_keys={"noise": "x"})


def test_calibration_key_changes_with_every_setting_that_changes_the_timed_step():
    import json

    import numpy as np
    from lightning.pytorch import Trainer

    from lightning_adaptiveload.calibration.calibrate import ProfileSettings
    from lightning_adaptiveload.callbacks._trainee import calibration_key

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)

    def key(**kwargs):
        module = DiffusersWanModule(dict(TINY), **{"text_len": 3, **kwargs})
        return calibration_key(trainer, module, ProfileSettings(), np.array([(1, 2, 2), (1, 2, 4)]), 3)

    base = key()
    assert json.loads(json.dumps(base)) == base  # plain JSON values
    changes = [{"text_len": 4}, {"compile": True}, {"compile": True, "compile_options": {"max_autotune": True}},
               {"activation_checkpointing": "selective"}, {"activation_checkpointing": "auto"}]
    keys = [key(**kwargs) for kwargs in changes]
    assert all(k != base for k in keys) and len({json.dumps(k, sort_keys=True) for k in keys}) == len(keys)
    assert key(text_len=4)["batch"]["context"] != base["batch"]["context"]
    # Settings that do not change the timed step leave it alone.
    assert key(lr=1e-2, seed=3, timestep_shift=1.0, optimizer_impl="foreach") == base
    # The fused AdaLN patch (FusedAdaLNCallback) changes the step: the module adds it to the derived key.
    module = DiffusersWanModule(_tiny(), text_len=3, activation_checkpointing="auto")
    unfused = module.calibration_key()
    patch_wan_transformer(module)
    assert module.calibration_key()["fused_adaln_sites"] == SITES != unfused["fused_adaln_sites"]


def test_from_pretrained_works_with_the_diffusers_extra(tmp_path):
    # `pip install ".[diffusers]"` brings accelerate, which from_pretrained's default low-memory load needs.
    pytest.importorskip("accelerate")
    _tiny().save_pretrained(tmp_path)
    module = DiffusersWanModule(WanTransformer3DModel.from_pretrained(tmp_path), text_len=3)
    assert module.compute_loss(module.synthetic_batch(1, (1, 2, 2))).isfinite()
