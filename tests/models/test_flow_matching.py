import math

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_adaptiveload.models.flow_matching as fm
from lightning_adaptiveload.models.flow_matching import FlowMatchingModule, shift_timesteps
from lightning_adaptiveload.models.wan import WAN_CONFIGS, WanModel


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


def test_sample_timesteps_uses_shifted_uniform():
    module = _module(timestep_shift=3.0)
    torch.manual_seed(7)
    t = module.sample_timesteps(1000)
    torch.manual_seed(7)
    u = torch.rand(1000)
    torch.testing.assert_close(t, 3.0 * u / (1 + 2.0 * u), rtol=0, atol=0)
    # The shift pushes mass towards noise: median of t is shift(0.5) = 0.75.
    assert t.median().item() == pytest.approx(0.75, abs=0.05)


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
    torch.manual_seed(11)
    loss = module.compute_loss(batch)
    torch.manual_seed(11)
    t = shift_timesteps(torch.rand(3), 5.0)
    noise = torch.randn_like(x0)
    tb = t.view(3, 1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * noise
    (seen_x, seen_t, seen_ctx) = module.model.calls[0]
    torch.testing.assert_close(seen_x, x_t)
    torch.testing.assert_close(seen_t, t * 1000)
    assert seen_ctx is batch["context"]
    expected = ((0.5 * x_t - (noise - x0)) ** 2).mean()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)


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
    with pytest.raises(ValueError, match=r"`grid=\(3, 0, 7\)` is not valid"):
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


def test_adamw_steps_reduce_loss_on_fixed_batch():
    module = _module(lr=3e-3)
    optimizer = module.configure_optimizers()
    batch = module.synthetic_batch(2, (2, 2, 3))
    losses = []
    for _ in range(15):
        torch.manual_seed(0)  # same t and noise every step: a fixed regression problem
        loss = module.compute_loss(batch)
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
    monkeypatch.setattr(fm, "perf_counter", lambda: next(clock))
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
