import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import lightning_adaptiveload.models.rectified_flow as rf
from lightning_adaptiveload.models.flow_matching import (
    FlowMatchingModule,
    draw_seed,
    shift_timesteps,
    wan_forward_flops,
)
from lightning_adaptiveload.models.wan import WAN_CONFIGS, WanConfig, WanModel


def _module(**kwargs):
    torch.manual_seed(0)
    module = FlowMatchingModule("tiny", **kwargs)
    module.configure_model()
    return module


def test_shift_timesteps_formula():
    u = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.9, 1.0], dtype=torch.float64)
    for shift in (1.0, 3.0, 5.0):
        expected = torch.tensor([shift * v / (1 + (shift - 1) * v) for v in u.tolist()], dtype=torch.float64)
        torch.testing.assert_close(shift_timesteps(u, shift), expected, rtol=0, atol=1e-15)
    # shift 5 at u = 0.5: 2.5 / 3.
    assert shift_timesteps(torch.tensor(0.5), 5.0).item() == pytest.approx(2.5 / 3)


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.calls = []

    def forward(self, x, t, context):
        self.calls.append((x.clone(), t.clone(), context))
        return x * self.scale


def test_compute_loss_is_rectified_flow():
    module = FlowMatchingModule("tiny", timestep_shift=5.0)
    module.model = _Recorder()
    batch = module.synthetic_batch(3, (2, 2, 3))
    x0 = batch["latents"]
    loss = module.compute_loss(batch, generator=torch.Generator().manual_seed(11))
    gen = torch.Generator().manual_seed(11)
    t = shift_timesteps(torch.rand(3, generator=gen), 5.0)
    noise = torch.randn(x0.shape, generator=gen)
    tb = t.view(3, 1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * noise
    (seen_x, seen_t, seen_ctx) = module.model.calls[0]
    torch.testing.assert_close(seen_x, x_t)
    torch.testing.assert_close(seen_t, t * 1000)
    assert seen_ctx is batch["context"]
    expected = ((0.5 * x_t - (noise - x0)) ** 2).mean()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)


def _fake_trainer(module, monkeypatch, step, rank):
    """Attach just enough of a Trainer for `training_step`: its step and rank; logging is a no-op."""
    monkeypatch.setattr(module, "_trainer", SimpleNamespace(global_step=step, global_rank=rank), raising=False)
    monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)


def _training_input(module, monkeypatch, step, rank, batch):
    _fake_trainer(module, monkeypatch, step, rank)
    module.model.calls.clear()
    module.training_step(batch, 0)
    return module.model.calls[0][0]  # x_t, which carries the timestep and the noise


def test_training_draws_are_a_function_of_seed_step_rank_and_micro_batch(monkeypatch):
    module = FlowMatchingModule("tiny", seed=3)
    module.model = _Recorder()
    batch = module.synthetic_batch(2, (1, 2, 2))
    global_state = torch.get_rng_state()
    first = _training_input(module, monkeypatch, step=5, rank=0, batch=batch)
    assert torch.equal(torch.get_rng_state(), global_state)  # the global RNG is not used
    # A second micro-batch of the same optimizer step (gradient accumulation) draws anew ...
    second = _training_input(module, monkeypatch, step=5, rank=0, batch=batch)
    assert not torch.equal(first, second)
    # ... and a fresh module (a resumed run) at the same step, rank and micro-batch draws the same.
    resumed = FlowMatchingModule("tiny", seed=3)
    resumed.model = _Recorder()
    torch.manual_seed(1234)  # whatever the global RNG holds
    assert torch.equal(_training_input(resumed, monkeypatch, step=5, rank=0, batch=batch), first)
    assert torch.equal(_training_input(resumed, monkeypatch, step=5, rank=0, batch=batch), second)
    # Another step or another seed: other draws.
    assert not torch.equal(_training_input(resumed, monkeypatch, step=6, rank=0, batch=batch), first)
    other_seed = FlowMatchingModule("tiny", seed=4)
    other_seed.model = _Recorder()
    assert not torch.equal(_training_input(other_seed, monkeypatch, step=5, rank=0, batch=batch), first)


def test_two_ranks_draw_different_noise(monkeypatch):
    module = FlowMatchingModule("tiny", seed=0)
    module.model = _Recorder()
    batch = module.synthetic_batch(2, (1, 2, 2))
    rank0 = _training_input(module, monkeypatch, step=0, rank=0, batch=batch)
    module._micro_batch = (-1, 0)
    rank1 = _training_input(module, monkeypatch, step=0, rank=1, batch=batch)
    assert not torch.equal(rank0, rank1)
    assert draw_seed(0, 0, 0) != draw_seed(0, 0, 1) != draw_seed(0, 1, 0)


def test_seed_defaults_to_the_seed_everything_seed(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "17")
    assert FlowMatchingModule("tiny").draw_seed == 17
    assert FlowMatchingModule("tiny", seed=2).draw_seed == 2
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert FlowMatchingModule("tiny").draw_seed == 0
    with pytest.raises(ValueError, match=r"FlowMatchingModule\(seed=-1\)"):
        FlowMatchingModule("tiny", seed=-1)


def test_compute_loss_outside_training_leaves_every_training_stream_alone(monkeypatch):
    module = FlowMatchingModule("tiny", seed=0)
    module.model = _Recorder()
    batch = module.synthetic_batch(2, (1, 2, 2))
    state = torch.get_rng_state()
    module.compute_loss(batch)
    module.compute_loss(batch)
    assert torch.equal(torch.get_rng_state(), state)
    profiled = [c[0] for c in module.model.calls]
    assert torch.equal(profiled[0], profiled[1])  # repeatable: profiling repeats measure the same work
    # Not the draws of training step 0 on this rank, which it would otherwise replay or shift.
    assert not torch.equal(_training_input(module, monkeypatch, step=0, rank=0, batch=batch), profiled[0])


class _LossTape(pl.Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()


def _fit_tiny(tmp_path, max_steps, ckpt_path=None, checkpoint_every=None, accelerator="cpu", attention="auto",
              **trainer_kwargs):
    """Fit the tiny model on a mixed image + video dataset through the adaptive DataModule."""
    from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

    pl.seed_everything(0)
    module = FlowMatchingModule("tiny", lr=1e-3, seed=0, attention=attention)
    data = AdaptiveLoadDataModule(
        SyntheticMixedDataset(48, "tiny", text_len=16, text_dim=32), DualConstraintPolicy(512, 28800, 2.0)
    )
    tape = _LossTape()
    callbacks = [tape]
    if checkpoint_every:
        callbacks.append(
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=checkpoint_every, save_top_k=-1, filename="{step}")
        )
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=bool(checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return tape.losses


@pytest.mark.slow  # 4 s on a 2-core CPU under load: off the quick path
def test_resumed_run_has_the_uninterrupted_loss_at_every_step(tmp_path):
    full = _fit_tiny(tmp_path / "full", max_steps=8, checkpoint_every=4)
    assert len(full) == 8
    # Re-seeding at the start of the resumed run must not matter: the draws are keyed by step.
    torch.manual_seed(99)
    resumed = _fit_tiny(tmp_path / "resumed", max_steps=8, ckpt_path=tmp_path / "full" / "step=4.ckpt")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert {s: full[s] for s in resumed} == resumed  # exactly equal, not close


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["fa4", "sdpa"])
def test_deterministic_gpu_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path, attention):
    """``Trainer(deterministic=True)``: the backends' deterministic backward (FA4's own; cuDNN's under
    torch's deterministic mode), so a resumed bf16 GPU run has the uninterrupted run's losses exactly."""
    from lightning_adaptiveload.ops.attention import fa4_unsupported_reason

    if attention == "fa4" and (reason := fa4_unsupported_reason("cuda", torch.bfloat16, 16)):
        pytest.skip(reason)
    kw = dict(accelerator="gpu", attention=attention, precision="bf16-mixed", deterministic=True)
    full = _fit_tiny(tmp_path / "full", max_steps=8, checkpoint_every=4, **kw)
    resumed = _fit_tiny(tmp_path / "resumed", max_steps=8, ckpt_path=tmp_path / "full" / "step=4.ckpt", **kw)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert {s: full[s] for s in resumed} == resumed


def test_batch_shape_and_tokens_in_batch():
    module = FlowMatchingModule("tiny")
    batch = module.synthetic_batch(3, (2, 3, 5))
    assert module.batch_shape(batch) == (3, 30)
    assert module.tokens_in_batch(batch) == 90
    # Positional use, as the protocol calls it: synthetic_batch(batch_size, token_grid, device).
    assert module.batch_shape(module.synthetic_batch(1, (1, 1, 2), "cpu")) == (1, 2)
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        module.batch_shape({"latents": torch.zeros(1, 16, 1, 3, 4)})


@pytest.mark.parametrize(
    "config",
    [
        WAN_CONFIGS["tiny"],
        WanConfig(dim=48, ffn_dim=80, num_heads=2, num_layers=3, in_dim=4, out_dim=8, text_dim=24, text_len=5,
                  freq_dim=32, patch_size=(2, 1, 2)),
    ],
)
@pytest.mark.parametrize("grid", [(1, 3, 4), (3, 2, 5)])
def test_flops_per_sample_counts_every_matmul_of_the_forward(config, grid):
    torch.manual_seed(0)
    module = FlowMatchingModule(config)
    module.configure_model()
    batch_size = 2
    batch = module.synthetic_batch(batch_size, grid)
    # The math backend runs attention as bmm, which the counter sees (CPU's fused SDPA kernel has no
    # FLOP formula registered and would count as zero).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        module.model(batch["latents"], torch.tensor([10.0, 900.0]), batch["context"])
    seq_len = math.prod(grid)
    assert counter.get_total_flops() == batch_size * wan_forward_flops(config, seq_len)  # exact
    assert module.flops_per_sample(seq_len) == 3 * wan_forward_flops(config, seq_len)


def test_flops_per_sample_of_wan_1_3b_grows_quadratically():
    module = FlowMatchingModule("wan2_1_1_3b")
    # 1.3B: ~2 × 1.3e9 FLOPs per token forward, plus attention 4·S²·D per layer.
    small, large = module.flops_per_sample(1560), module.flops_per_sample(32760)
    linear_part = 3 * 2 * 30 * (6 * 1536**2 + 2 * 1536 * 8960) * 32760
    attention = 3 * 30 * 4 * 32760**2 * 1536
    assert large > attention + linear_part
    assert large / small > 32760 / 1560
def test_tokens_and_synthetic_batch():
    module = FlowMatchingModule("tiny")
    state = torch.get_rng_state()
    batch = module.synthetic_batch(4, (3, 5, 7), seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert batch["latents"].shape == (4, 16, 3, 10, 14)
    assert batch["context"].shape == (4, 16, 32)
    assert batch["index"].dtype == torch.long and (batch["index"] == -1).all()
    assert module.tokens_in_batch(batch) == 4 * 3 * 5 * 7
    assert module.patch_size == (1, 2, 2)
    again = module.synthetic_batch(4, (3, 5, 7), seed=3)
    assert torch.equal(again["latents"], batch["latents"])
    with pytest.raises(ValueError, match=r"synthetic_batch\(grid=\(3, 0, 7\)\)` is not valid"):
        module.synthetic_batch(4, (3, 0, 7))


def test_configure_model_is_idempotent_and_required():
    module = FlowMatchingModule("tiny", activation_checkpointing=True)
    with pytest.raises(RuntimeError, match=r"Call `configure_model\(\)` first"):
        module.compute_loss(module.synthetic_batch(1, (1, 1, 1)))
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model and isinstance(model, WanModel)
    assert all(block.gradient_checkpointing for block in model.blocks)
    assert module.model.config == WAN_CONFIGS["tiny"]


def test_checkpointing_settings():
    for setting, mode in ((False, "none"), (True, "full"), ("selective", "selective"), ("none", "none")):
        module = FlowMatchingModule("tiny", activation_checkpointing=setting)
        module.configure_model()
        assert module.checkpointing == mode
        assert {block.checkpointing for block in module.model.blocks} == {mode}
    auto = FlowMatchingModule("tiny", activation_checkpointing="auto")
    auto.configure_model()
    assert auto.checkpointing == "auto" and auto.model.blocks[0].checkpointing == "full"  # safe until chosen
    auto.set_checkpointing("selective")
    assert auto.checkpointing == "selective" and auto.checkpointing_modes == ("none", "selective", "full")
    with pytest.raises(ValueError, match=r"activation_checkpointing='some'.*'auto'"):
        FlowMatchingModule("tiny", activation_checkpointing="some")


def test_auto_checkpointing_without_the_shape_benchmark_trains_full_and_warns(tmp_path):
    import lightning

    from lightning_adaptiveload.bucketing.policy import EqualTokenPolicy
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

    dataset = SyntheticMixedDataset(8, [{"num_frames": 1, "height": 64, "width": 64, "weight": 1.0}],
                                    text_len=16, text_dim=32)
    module = FlowMatchingModule("tiny", activation_checkpointing="auto")
    trainer = lightning.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="needs ShapeBenchmarkCallback"):
        trainer.fit(module, datamodule=AdaptiveLoadDataModule(dataset, EqualTokenPolicy(64)))
    assert module.checkpointing == "full"


def test_accepts_config_and_dict_and_saves_plain_hparams():
    cfg = WAN_CONFIGS["tiny"]
    a = FlowMatchingModule(cfg)
    b = FlowMatchingModule(
        {"dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 2, "text_dim": 32, "text_len": 16}
    )
    assert a.config == b.config == cfg
    assert isinstance(a.hparams.model, dict) and a.hparams.model["dim"] == 64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, r"FlowMatchingModule\(lr=0.0\)"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"timestep_shift": -1.0}, "timestep_shift"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"model": "wan_2b"}, "Unknown Wan model preset"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlowMatchingModule(**kwargs)


@pytest.mark.slow  # 20 s on a 2-core CPU under load: off the quick path
def test_adamw_steps_reduce_loss_on_fixed_batch():
    module = _module(lr=3e-3)
    optimizer = module.configure_optimizers()
    batch = module.synthetic_batch(2, (2, 2, 3))
    losses = []
    for _ in range(15):
        # Same t and noise every step: a fixed regression problem.
        loss = module.compute_loss(batch, generator=torch.Generator().manual_seed(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_linear_warmup_schedule():
    module = _module(lr=1e-3, warmup_steps=4, betas=(0.8, 0.95), weight_decay=0.1)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1
    lrs = []
    for _ in range(6):
        lrs.append(group["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


class _MetricsTape(pl.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_trainer_fit_with_changing_grids(monkeypatch, tmp_path):
    clock = iter(float(i) * 0.5 for i in range(1000))
    monkeypatch.setattr(rf, "perf_counter", lambda: next(clock))
    module = FlowMatchingModule("tiny", lr=1e-3)
    # Pre-collated batches (batch_size=None): an image batch and a video batch, alternating.
    grids = [(2, (1, 3, 4)), (1, (3, 2, 2))]
    batches = [module.synthetic_batch(b, g, seed=i) for i, (b, g) in enumerate(grids * 2)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    tape = _MetricsTape()
    trainer = pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tape],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, loader)
    assert trainer.global_step == 3
    assert [set(s) for s in tape.steps] == [
        {"train/loss"},
        {"train/loss", "train/tokens_per_s", "train/samples_per_s"},
        {"train/loss", "train/tokens_per_s", "train/samples_per_s"},
    ]
    # Each step logs the previous step's work over the 0.5 s the fake clock advances.
    assert tape.steps[1]["train/tokens_per_s"] == 2 * 12 / 0.5
    assert tape.steps[1]["train/samples_per_s"] == 2 / 0.5
    assert tape.steps[2]["train/tokens_per_s"] == 1 * 12 / 0.5
    assert all(math.isfinite(s["train/loss"]) for s in tape.steps)

    path = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(path)
    restored = FlowMatchingModule.load_from_checkpoint(path)
    for (name, p), q in zip(module.named_parameters(), restored.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_gradient_clipping_under_fsdp_goes_through_the_wrapper(monkeypatch):
    """Lightning's FSDP precision plugin refuses norm clipping; the module clips via the FSDP wrapper."""
    from unittest.mock import MagicMock

    from torch.distributed.fsdp import FullyShardedDataParallel

    module = FlowMatchingModule("tiny")
    wrapper = MagicMock(spec=FullyShardedDataParallel)
    monkeypatch.setattr(type(module), "trainer", property(lambda self: MagicMock(model=wrapper)))
    module.configure_gradient_clipping(MagicMock(), gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    wrapper.clip_grad_norm_.assert_called_once_with(1.0)
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        module.configure_gradient_clipping(MagicMock(), gradient_clip_val=1.0, gradient_clip_algorithm="value")


class _GradNorms(pl.Callback):
    """The global gradient norm the optimizer stepped with (gradients are still there before zero_grad)."""

    def __init__(self):
        self.norms = []

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def _fit_bf16(tmp_path, optimizer_impl, clip, steps):
    from lightning_adaptiveload.bucketing.policy import EqualTokenPolicy
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

    pl.seed_everything(0)
    dataset = SyntheticMixedDataset(8, [{"num_frames": 1, "height": 64, "width": 64, "weight": 1.0}],
                                    text_len=16, text_dim=32)
    module = FlowMatchingModule("tiny", lr=1e-2, seed=0, optimizer_impl=optimizer_impl)
    norms = _GradNorms()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         precision="bf16-mixed", gradient_clip_val=clip, callbacks=[norms])
    trainer.fit(module, datamodule=AdaptiveLoadDataModule(dataset, EqualTokenPolicy(128)))
    (opt,) = trainer.optimizers
    assert bool(opt.defaults.get("fused")) == (optimizer_impl == "fused")
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, norms.norms


@pytest.mark.slow  # 7 s on a 2-core CPU under load: off the quick path
def test_fused_adamw_clips_under_bf16_like_foreach(tmp_path):
    # Lightning's mixed-precision plugin refuses to clip for fused optimizers (an fp16-scaler rule);
    # with bf16 the module clips itself, as Lightning clips for the foreach optimizer.
    from lightning.pytorch.plugins.precision import MixedPrecision

    clip = 1e-3
    fused, fused_norms = _fit_bf16(tmp_path / "fused", "fused", clip, steps=2)
    foreach, foreach_norms = _fit_bf16(tmp_path / "foreach", "foreach", clip, steps=1)
    _, raw_norms = _fit_bf16(tmp_path / "unclipped", "fused", None, steps=2)
    assert all(n == pytest.approx(clip, rel=1e-3) for n in fused_norms + foreach_norms)  # clipped to the norm
    assert min(raw_norms) > 10 * clip
    one, _ = _fit_bf16(tmp_path / "fused1", "fused", clip, steps=1)
    for name, p in one.items():  # the same update as foreach's (later steps go through bf16 rounding)
        torch.testing.assert_close(p, foreach[name], rtol=0, atol=1e-7, msg=name)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], fused=True)
        MixedPrecision("bf16-mixed", "cpu").clip_gradients(opt, 1.0)


def test_optimizer_impl_auto_picks_fused_only_on_cuda_and_rejects_bad_names(monkeypatch):
    module = FlowMatchingModule("tiny", optimizer_impl="auto")
    module.configure_model()
    assert module.fused_optimizer is False  # parameters on the CPU
    assert FlowMatchingModule("tiny", optimizer_impl="fused").fused_optimizer is True
    with pytest.raises(ValueError, match="optimizer_impl='adam'.*Expected one of"):
        FlowMatchingModule("tiny", optimizer_impl="adam")


def test_calibration_key_adds_what_the_derived_key_cannot_see():
    import json

    from lightning_adaptiveload.callbacks.fused_adaln import apply_fused_adaln

    # The derived key (tests/callbacks/test_calibration_key.py) sees the config, hparams and batch shapes; the
    # module adds the kernels swapped in by FusedAdaLNCallback.
    key = FlowMatchingModule("tiny").calibration_key()
    assert json.loads(json.dumps(key)) == key  # plain JSON values
    module = FlowMatchingModule("tiny", activation_checkpointing="auto")
    module.configure_model()
    assert module.calibration_key()["fused_adaln_sites"] == 0
    sites = apply_fused_adaln(module)
    assert sites > 0 and module.calibration_key()["fused_adaln_sites"] == sites
    # The mode chosen at run time is not a setting: "auto" stays "auto" in the derived key's hyperparameters.
    module.set_checkpointing("none")
    assert module.hparams.activation_checkpointing == "auto"


def test_set_checkpointing_switches_blocks_without_rewrapping_and_before_the_model_exists():
    module = FlowMatchingModule("tiny", activation_checkpointing="auto")
    module.set_checkpointing("selective")  # before configure_model: the blocks are built with it
    module.configure_model()
    assert {b.checkpointing for b in module.model.blocks} == {"selective"}
    forwards = [b.forward for b in module.model.blocks]
    for mode in ("none", "full", "none"):
        module.set_checkpointing(mode)
        assert module.checkpointing == mode and {b.checkpointing for b in module.model.blocks} == {mode}
    assert [b.forward for b in module.model.blocks] == forwards
    with pytest.raises(ValueError, match=r"FlowMatchingModule.set_checkpointing\('some'\)` is not valid"):
        module.set_checkpointing("some")


def test_contexts_longer_than_text_len_are_refused_before_profiling(tmp_path):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning_adaptiveload.bucketing.policy import EqualTokenPolicy
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

    class Profiled(pl.Callback):
        reached = False

        def on_fit_start(self, trainer, pl_module):
            Profiled.reached = True

    dataset = SyntheticMixedDataset(8, [{"num_frames": 1, "height": 64, "width": 64, "weight": 1.0}],
                                    text_len=20, text_dim=32)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[Profiled()])
    with pytest.raises(MisconfigurationException, match=r"dataset\[0\] has L=20 tokens, but the model takes at most "
                                                        r"text_len=16.*`WanConfig\(text_len=20\)`"):
        trainer.fit(FlowMatchingModule("tiny"), datamodule=AdaptiveLoadDataModule(dataset, EqualTokenPolicy(64)))
    assert not Profiled.reached
    # Shorter contexts are zero-padded by the model: accepted.
    module = FlowMatchingModule("tiny")
    module.check_batch({"latents": torch.zeros(1, 16, 1, 2, 2), "context": torch.zeros(1, 5, 32)})


@pytest.mark.cuda
def test_the_progress_bar_shows_the_newest_loss_on_the_host_without_waiting_for_the_device():
    module = FlowMatchingModule("tiny")
    assert module._arrived_loss(torch.tensor(1.0, device="cuda")) in (None, 1.0)
    torch.cuda.synchronize()
    # The first copy has arrived by now; the second may or may not have.
    assert float(module._arrived_loss(torch.tensor(2.0, device="cuda"))) in (1.0, 2.0)
    torch.cuda.synchronize()
    shown = module._arrived_loss(torch.tensor(3.0, device="cuda"))
    assert shown.device.type == "cpu" and float(shown) in (2.0, 3.0)
    torch.cuda.synchronize()
    assert float(module._arrived_loss(torch.tensor(4.0, device="cuda"))) in (3.0, 4.0)
    assert len(module._loss_copies) <= 1
