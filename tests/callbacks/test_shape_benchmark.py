import importlib
import json
import random
import time
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_adaptiveload.bucketing.policy import CostModelPolicy, DualConstraintPolicy
from lightning_adaptiveload.calibration import derive_policy, plan_grid
from lightning_adaptiveload.calibration.costmodel import CostModel
from lightning_adaptiveload.calibration.record import Calibration
from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback


@pytest.fixture(autouse=True)
def _keep_tiny_cpu_profiles(monkeypatch):
    # TinyModule's sub-millisecond CPU steps are noise by design (held-out error 17-99% on a busy 2-core
    # machine); these tests are about reuse, the noisy-profile rule has its own (tests/calibration).
    conductor = importlib.import_module("lightning_adaptiveload.calibration.calibrate")
    monkeypatch.setattr(conductor, "NOISY_PROFILE_REL", float("inf"))


GRIDS = np.array([(1, 2, 2), (1, 4, 4), (2, 4, 4), (3, 4, 6), (5, 6, 6)] * 3, dtype=np.int64)  # S 4..180


class TinyModule(LightningModule):
    """Stand-in with the profiling interface: attention-like S² cost and a BatchNorm (buffers)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.proj = nn.Linear(4, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.out = nn.Linear(dim, 1)
        self.calls: list[tuple[int, int]] = []
        self.hook = None

    def synthetic_batch(self, batch_size, grid, device=None):
        s = int(np.prod(grid))
        return {"x": torch.randn(batch_size, s, 4, device=device)}

    def compute_loss(self, batch):
        x = batch["x"]
        b, s, _ = x.shape
        self.calls.append((b, s))
        if self.hook is not None:
            self.hook(b, s)
        h = self.norm(self.proj(x).reshape(b * s, -1)).reshape(b, s, -1)
        h = torch.softmax(h @ h.transpose(1, 2), dim=-1) @ h
        return self.out(h).pow(2).mean()

    def training_step(self, batch, batch_idx):
        return self.compute_loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class GridDataset:
    def __init__(self, grids=GRIDS):
        self.grids = np.asarray(grids, dtype=np.int64)

    def __len__(self):
        return len(self.grids)

    def token_grids(self):
        return self.grids

    def __getitem__(self, i):
        return {"x": torch.randn(6, 4)}


class TinyDataModule(LightningDataModule):
    def __init__(self, grids=GRIDS):
        super().__init__()
        self.dataset = GridDataset(grids)
        self.events: list[str] = []
        self.policy = None
        self.cost_model = None

    def set_policy(self, policy):
        self.events.append("set_policy")
        self.policy = policy

    def set_cost_model(self, cost_model):
        self.events.append("set_cost_model")
        self.cost_model = cost_model

    def train_dataloader(self):
        self.events.append("train_dataloader")
        return DataLoader(self.dataset, batch_size=2)


class Snapshot(Callback):
    """Records what profiling could disturb, at its place in the on_fit_start order."""

    def on_fit_start(self, trainer, pl_module):
        self.params = {k: v.detach().clone() for k, v in pl_module.named_parameters()}
        self.buffers = {k: v.detach().clone() for k, v in pl_module.named_buffers()}
        self.grads = [p.grad for p in pl_module.parameters()]
        self.training = [m.training for m in pl_module.modules()]
        self.torch_rng = torch.get_rng_state()
        self.np_rng = np.random.get_state()
        self.py_rng = random.getstate()
        self.optim = trainer.optimizers[0].state_dict()
        self.global_step = trainer.global_step
        self.calls = len(pl_module.calls)
        self.wrapped = trainer.strategy.model is not pl_module


def _trainer(tmp_path, *callbacks, max_steps=2, **kwargs):
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=list(callbacks),
        **kwargs,
    )


def _cb(tmp_path, **kwargs):
    kwargs.setdefault("repeats", 2)
    kwargs.setdefault("warmup", 1)
    kwargs.setdefault("converge_rel", 0.0)  # every planned shape runs unless a test says otherwise
    kwargs.setdefault("save_dir", tmp_path / "bench")
    return ShapeBenchmarkCallback(**kwargs)


class FakeClock:
    """``time.perf_counter`` plus simulated seconds, advanced by the model per step."""

    def __init__(self):
        self.real = time.perf_counter
        self.offset = 0.0

    def __call__(self):
        return self.real() + self.offset


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_sizes": [0, 2]}, "batch_sizes"),
        ({"batch_sizes": []}, "batch_sizes"),
        ({"max_shapes": 0}, "max_shapes=0"),
        ({"repeats": 0}, "repeats=0"),
        ({"warmup": -1}, "warmup=-1"),
        ({"time_budget_s": 0}, "time_budget_s=0"),
        ({"shape_time_s": -1}, "shape_time_s=-1"),
        ({"form": "cubic"}, "form='cubic'"),
        ({"memory_margin": 1.0}, "memory_margin=1.0"),
        ({"step_budget_s": -1.0}, "step_budget_s=-1.0"),
        ({"m_mem": 2.5}, "m_mem=2.5"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShapeBenchmarkCallback(**kwargs)


def test_profiles_sets_policy_before_dataloader_and_leaves_no_trace(tmp_path, monkeypatch):
    # Simulated step times growing with B·S (the tiny model's real CPU time is noise on a loaded machine,
    # and a profile that does not grow is, by design, trained at its memory cap instead).
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    before, after = Snapshot(), Snapshot()
    cb = _cb(tmp_path, shape_time_s=60.0, time_budget_s=1e9)
    logger = Mock()
    trainer = _trainer(tmp_path, before, cb, after, logger=logger)
    model, dm = TinyModule(), TinyDataModule()

    def advance(b, s):
        clock.offset += 0.5 + 2e-3 * b * s + 1e-5 * b * s * s

    model.hook = advance
    trainer.fit(model, datamodule=dm)

    assert cb.profiled
    assert dm.events[:3] == ["set_cost_model", "set_policy", "train_dataloader"]
    assert isinstance(dm.cost_model, CostModel) and dm.policy is cb.policy
    assert isinstance(dm.policy, (DualConstraintPolicy, CostModelPolicy))
    # The one rule: the policy is derive_policy's for this corpus; on CPU M_mem is the largest token count run.
    assert cb.derivation.m_mem == 360
    assert cb.derivation.budget_source == "max predicted throughput"
    assert repr(dm.policy) == repr(derive_policy(dm.cost_model, GRIDS, 360).policy)
    profiled = after.calls - before.calls
    assert profiled == len(plan_grid(GRIDS, None, 8)) * 3  # warm-up + repeats per shape

    for k, v in before.params.items():
        assert torch.equal(v, after.params[k]), k
    for k, v in before.buffers.items():
        assert torch.equal(v, after.buffers[k]), k  # BatchNorm statistics restored
    assert all(g is None for g in after.grads)
    assert after.training == before.training
    assert torch.equal(before.torch_rng, after.torch_rng)
    assert np.array_equal(before.np_rng[1], after.np_rng[1]) and before.np_rng[2:] == after.np_rng[2:]
    assert before.py_rng == after.py_rng
    assert before.optim == after.optim and before.global_step == after.global_step == 0
    assert trainer.global_step == 2

    record = json.loads((tmp_path / "bench" / "shape_benchmark.json").read_text())
    assert record["derived"]["m_mem"] == 360
    assert record["derived"]["predicted"]["tokens_per_s"] > 0 and record["derived"]["baseline"]["tokens_per_s"] > 0
    assert {m["status"] for m in record["measurements"]} == {"ok"}
    assert CostModel.from_dict(record["cost_model"]) == dm.cost_model
    assert (tmp_path / "bench" / "shape_benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = logger.log_metrics.call_args_list[0].args[0]
    assert logged["shape_benchmark/m_mem"] == 360
    assert "shape_benchmark/quality/heldout_median_rel_error" in logged


def test_recovers_known_cost_through_the_callback(tmp_path, monkeypatch):
    # The model "takes" a + b·B·S^p simulated seconds per step (large, so the real CPU time of the
    # tiny model, ~0.1 s on a busy machine, is noise below 0.5%); the fit must find p.
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = TinyModule()

    def advance(b, s):
        clock.offset += 50.0 + 2e-2 * b * s**1.6

    model.hook = advance
    cb = _cb(tmp_path, form="power", step_budget_s=200.0, m_mem=1000, time_budget_s=1e9)
    dm = TinyDataModule()
    _trainer(tmp_path, cb).fit(model, datamodule=dm)
    cm = dm.cost_model
    assert cm.form == "power"
    assert cm.params["p"] == pytest.approx(1.6, abs=0.01)
    assert cm.params["a"] == pytest.approx(50.0, rel=0.01)
    assert isinstance(dm.policy, DualConstraintPolicy)
    assert dm.policy.m_mem == 1000
    assert dm.policy.m_comp == pytest.approx((200.0 - cm.params["a"]) / cm.params["b"], rel=1e-12)


def test_time_budget_stops_after_first_pass(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = TinyModule()

    def advance(b, s):
        clock.offset += 10.0 * b * (1 + s / 50) ** 2

    model.hook = advance
    cb = _cb(tmp_path, time_budget_s=100.0, batch_sizes=[1, 2, 3])
    dm = TinyDataModule()
    with pytest.warns(UserWarning, match="time budget"):
        _trainer(tmp_path, cb).fit(model, datamodule=dm)
    ran = [m for m in cb.calibration.measurements if m.status != "skipped"]
    # Five sequence lengths at B = 1 (the first pass always completes), nothing more.
    assert [m.batch_size for m in ran] == [1] * 5
    assert dm.cost_model is not None


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_out_of_memory_shape_recorded_and_skipped(tmp_path):
    model = TinyModule()

    def oom(b, s):
        if b * s > 200:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    model.hook = oom
    cb, dm, after = _cb(tmp_path, batch_sizes=[1, 2, 4]), TinyDataModule(), Snapshot()
    _trainer(tmp_path, cb, after).fit(model, datamodule=dm)
    status = {(m.batch_size, m.seq_len): m.status for m in cb.calibration.measurements}
    assert status[(1, 180)] == "ok"
    assert status[(2, 180)] == "oom"
    assert status[(4, 180)] == "skipped"  # larger B at an S that ran out of memory is not tried
    assert status[(4, 72)] == "oom"
    assert status[(4, 32)] == "ok"
    # On CPU M_mem is the largest feasible token count (B·S = 180), below the smallest OOM (4·72).
    assert cb.derivation.m_mem == 180
    assert dm.policy.batch_size(72) <= 2
    assert all(g is None for g in after.grads)  # the failed steps' gradients are gone too


@pytest.mark.slow  # ~14 s on a 2-core CPU
def test_cache_reuse_and_force(tmp_path):
    cache = tmp_path / "cache"
    first = _cb(tmp_path, cache_dir=cache)
    _trainer(tmp_path, first).fit(TinyModule(), datamodule=TinyDataModule())
    assert first.profiled and len(list(cache.glob("calibration_*.json"))) == 1

    second, model, dm = _cb(tmp_path, cache_dir=cache), TinyModule(), TinyDataModule()
    probe = Snapshot()
    _trainer(tmp_path, second, probe).fit(model, datamodule=dm)
    assert not second.profiled and probe.calls == 0
    assert second.calibration.to_json() == first.calibration.to_json()
    assert dm.cost_model == first.cost_model and repr(dm.policy) == repr(first.policy)

    # Another model configuration is another key.
    other = _cb(tmp_path, cache_dir=cache)
    _trainer(tmp_path, other).fit(TinyModule(dim=12), datamodule=TinyDataModule())
    assert other.profiled and len(list(cache.glob("calibration_*.json"))) == 2

    forced = _cb(tmp_path, cache_dir=cache, force=True)
    _trainer(tmp_path, forced).fit(TinyModule(), datamodule=TinyDataModule())
    assert forced.profiled and forced.calibration.to_json() != first.calibration.to_json()


@pytest.mark.slow  # ~12 s on a 2-core CPU
def test_a_calibration_from_an_earlier_profiler_is_not_reused(tmp_path, monkeypatch):
    from lightning_adaptiveload.callbacks import shape_benchmark

    cache = tmp_path / "cache"
    monkeypatch.setattr(shape_benchmark, "PROFILE_VERSION", 1)
    old = _cb(tmp_path, cache_dir=cache)
    _trainer(tmp_path, old).fit(TinyModule(), datamodule=TinyDataModule())
    assert old.profiled and old.calibration.key["profile"] == 1
    monkeypatch.setattr(shape_benchmark, "PROFILE_VERSION", 2)
    new = _cb(tmp_path, cache_dir=cache)
    _trainer(tmp_path, new).fit(TinyModule(), datamodule=TinyDataModule())
    assert new.profiled and new.calibration.key["profile"] == 2  # profiled again, not read from the cache


@pytest.mark.slow  # 6 s on a 2-core CPU under load: off the quick path
def test_resume_from_checkpoint_does_not_profile(tmp_path):
    first, dm1 = _cb(tmp_path), TinyDataModule()
    trainer = _trainer(tmp_path, first)
    trainer.fit(TinyModule(), datamodule=dm1)
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["callbacks"]["ShapeBenchmarkCallback"]["calibration"]

    resumed, model, dm2 = _cb(tmp_path), TinyModule(), TinyDataModule()
    probe = Snapshot()
    trainer = _trainer(tmp_path, resumed, probe, max_steps=4)
    trainer.fit(model, datamodule=dm2, ckpt_path=ckpt)
    assert not resumed.profiled and probe.calls == 0
    assert resumed.calibration.to_json() == first.calibration.to_json()
    assert dm2.events[:3] == ["set_cost_model", "set_policy", "train_dataloader"]
    assert repr(dm2.policy) == repr(dm1.policy)
    assert trainer.global_step == 4


class LateRestoreStrategy(SingleDeviceStrategy):
    """Restores checkpoints after on_fit_start, as FSDP and DeepSpeed do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


@pytest.mark.slow  # 16 s on a 2-core CPU under load: off the quick path
@pytest.mark.parametrize("use_cache", [False, True])
def test_resume_with_late_restoring_strategy(tmp_path, use_cache):
    cache = tmp_path / "cache" if use_cache else None
    first, dm1 = _cb(tmp_path, cache_dir=cache), TinyDataModule()
    trainer = _trainer(tmp_path, first, strategy=LateRestoreStrategy(torch.device("cpu")))
    trainer.fit(TinyModule(), datamodule=dm1)
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed, dm2 = _cb(tmp_path, cache_dir=cache), TinyDataModule()
    trainer = _trainer(tmp_path, resumed, strategy=LateRestoreStrategy(torch.device("cpu")), max_steps=4)
    trainer.fit(TinyModule(), datamodule=dm2, ckpt_path=ckpt)
    # Without a cache Lightning's hook order forces a profile, but the checkpoint's calibration
    # is what the dataloader is built with.
    assert resumed.profiled is (not use_cache)
    assert resumed.calibration.to_json() == first.calibration.to_json()
    assert dm2.cost_model.to_json() == first.cost_model.to_json()
    last_policy = dm2.events.index("train_dataloader") - 1
    assert dm2.events[last_policy] == "set_policy"
    assert repr(dm2.policy) == repr(dm1.policy)


def test_disabled_is_a_noop(tmp_path):
    cb, dm, probe = _cb(tmp_path, enabled=False), TinyDataModule(), Snapshot()
    _trainer(tmp_path, cb, probe).fit(TinyModule(), datamodule=dm)
    assert not cb.profiled and probe.calls == 0 and "set_policy" not in dm.events


def test_setup_checks_module_and_datamodule(tmp_path):
    class NoLoss(TinyModule):
        compute_loss = None

    with pytest.raises(Exception, match="compute_loss"):
        _trainer(tmp_path, _cb(tmp_path)).fit(NoLoss(), datamodule=TinyDataModule())

    class PlainDM(LightningDataModule):
        def train_dataloader(self):
            return DataLoader(GridDataset(), batch_size=2)

    with pytest.raises(Exception, match="token_grids"):
        _trainer(tmp_path, _cb(tmp_path)).fit(TinyModule(), datamodule=PlainDM())


def _real_parts(num_samples=64, **module_kwargs):
    datamodule = pytest.importorskip("lightning_adaptiveload.data.datamodule")
    from lightning_adaptiveload.bucketing.policy import EqualTokenPolicy
    from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset
    from lightning_adaptiveload.models.flow_matching import FlowMatchingModule

    mixture = [
        {"num_frames": 1, "height": 64, "width": 64, "weight": 2.0},
        {"num_frames": 5, "height": 64, "width": 96, "weight": 1.0},
        {"num_frames": 9, "height": 96, "width": 96, "weight": 1.0},
    ]
    dataset = SyntheticMixedDataset(num_samples, mixture, text_len=16, text_dim=32)
    dm = datamodule.AdaptiveLoadDataModule(dataset, EqualTokenPolicy(4096))
    return FlowMatchingModule("tiny", **module_kwargs), dm


@pytest.mark.slow  # 11 s on a 2-core CPU under load: off the quick path
def test_real_tiny_model_and_datamodule(tmp_path):
    model, dm = _real_parts()
    cb = _cb(tmp_path, max_shapes=3)
    trainer = _trainer(tmp_path, cb, use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm)
    assert cb.profiled and dm.policy is cb.policy
    assert cb.derivation.predicted["tokens_per_s"] >= 0.99 * cb.derivation.baseline["tokens_per_s"]
    assert trainer.global_step == 2


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_real_tiny_model_on_gpu(tmp_path, compile):
    model, dm = _real_parts(activation_checkpointing="auto", compile=compile)
    cb = _cb(tmp_path, max_shapes=3, repeats=3)
    trainer = Trainer(accelerator="cuda", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=tmp_path, callbacks=[cb],
                      use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm)
    cal = cb.calibration
    # Compiled, the tiny model's peak is its fixed memory at every shape (no B·S slope to fit).
    assert cal.device_memory > 0 and (cal.memory_model is not None or compile)
    assert all(m.peak_bytes > 0 for m in cal.measurements if m.status == "ok")
    assert cb.derivation.m_mem >= int(dm.dataset.token_grids().prod(axis=1).max())
    assert (tmp_path / "bench" / "shape_benchmark.png").exists()
    # The tiny model fits without checkpointing: one tier, every shape profiled in 'none' with its peak.
    s_max = int(dm.dataset.token_grids().prod(axis=1).max())
    assert _tiers(cb) == [("none", s_max)] and {m.mode for m in cal.measurements} == {"none"}
    assert model.checkpointing == "none"
    if compile:
        assert cal.extra["compile_seconds"] > 0
        assert all(m.timed_steps >= 1 for m in cal.measurements if m.status == "ok")


def test_runs_through_a_wrapping_strategy(tmp_path):
    # DDP (one CPU process, gloo) wraps the module: profiling must go through the wrapper's forward
    # and the collective reduce/broadcast paths, and training must run normally afterwards.
    cb, dm, after = _cb(tmp_path, max_shapes=3, batch_sizes=[1, 2]), TinyDataModule(), Snapshot()
    trainer = _trainer(tmp_path, cb, after, strategy="ddp", use_distributed_sampler=False)
    trainer.fit(TinyModule(), datamodule=dm)
    assert after.wrapped
    assert cb.profiled and after.calls == 6 * 3
    assert all(g is None for g in after.grads)
    assert trainer.global_step == 2


class ZeroHeadModule(TinyModule):
    """A zero-initialised output layer, as Wan's head: at init every gradient before it is zero."""

    def __init__(self) -> None:
        super().__init__()
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        self.proj_grads: list[float] = []
        self.proj.weight.register_hook(lambda g: self.proj_grads.append(float(g.abs().sum())))


def test_a_zero_layer_holds_noise_while_profiling_and_is_zero_again_after(tmp_path, monkeypatch):
    # A profiled backward through a zero head would multiply zeros (a GPU runs that faster and cooler than
    # training, whose first optimizer step makes the head non-zero); the weights, RNG and gradients are restored.
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    before, after = Snapshot(), Snapshot()
    cb = _cb(tmp_path, shape_time_s=60.0, time_budget_s=1e9)
    trainer = _trainer(tmp_path, before, cb, after, max_steps=1)
    model, dm = ZeroHeadModule(), TinyDataModule()

    def advance(b, s):
        clock.offset += 0.5 + 2e-3 * b * s + 1e-5 * b * s * s

    model.hook = advance
    trainer.fit(model, datamodule=dm)
    profiled = after.calls - before.calls
    assert cb.profiled and profiled > 0
    # Every profiled backward reached the first layer; training's first step (head still zero) does not.
    assert len(model.proj_grads) == profiled + 1
    assert all(g > 0 for g in model.proj_grads[:profiled]) and model.proj_grads[-1] == 0.0
    for k, v in before.params.items():
        assert torch.equal(v, after.params[k]), k
    assert not after.params["out.weight"].any() and not after.params["out.bias"].any()
    assert torch.equal(before.torch_rng, after.torch_rng)
    assert all(g is None for g in after.grads)


class TinyModuleLR(TinyModule):
    def __init__(self, lr: float = 1e-2, log_dir: str = "a") -> None:
        super().__init__()
        self.save_hyperparameters()


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_resume_with_other_hparams_and_world_size_keeps_the_calibration(tmp_path):
    first, dm1 = _cb(tmp_path), TinyDataModule()
    trainer = _trainer(tmp_path, first)
    trainer.fit(TinyModuleLR(), datamodule=dm1)
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)
    cb_state = state["callbacks"]["ShapeBenchmarkCallback"]
    assert "world_size" not in Calibration.from_json(cb_state["calibration"]).key
    # The budgets the checkpoint trained with are applied as they are, whatever derive_policy would
    # pick now (another world size picks another budget): edit them to see that they are used.
    a = Calibration.from_json(cb_state["calibration"]).cost_model.params["a"]
    edited = a + 0.5 * (cb_state["derived"]["step_budget_s"] - a)
    cb_state["derived"]["step_budget_s"] = edited
    torch.save(state, ckpt)

    resumed, dm2, probe = _cb(tmp_path), TinyDataModule(), Snapshot()
    trainer = _trainer(tmp_path, resumed, probe, max_steps=4)
    trainer.fit(TinyModuleLR(lr=1e-3, log_dir="b"), datamodule=dm2, ckpt_path=ckpt)
    assert not resumed.profiled and probe.calls == 0 and resumed.source == "checkpoint"
    assert resumed.derivation.step_budget_s == pytest.approx(edited)
    assert resumed.derivation.budget_source == "given"


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_checkpoint_of_another_model_is_not_reused_and_says_why(tmp_path):
    first = _cb(tmp_path)
    trainer = _trainer(tmp_path, first)
    trainer.fit(TinyModule(), datamodule=TinyDataModule())
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)
    resumed = _cb(tmp_path)
    resumed.load_state_dict(state["callbacks"]["ShapeBenchmarkCallback"])
    with pytest.warns(UserWarning, match="another setup \\(hparams, model architecture differ\\)"):
        _trainer(tmp_path, resumed).fit(TinyModule(dim=12), datamodule=TinyDataModule())
    assert resumed.profiled


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_pinned_calibration_file_is_used(tmp_path):
    first = _cb(tmp_path)
    _trainer(tmp_path, first).fit(TinyModule(), datamodule=TinyDataModule())
    pinned, dm, probe = _cb(tmp_path, calibration=tmp_path / "bench" / "shape_benchmark.json"), TinyDataModule(), Snapshot()
    _trainer(tmp_path, pinned, probe).fit(TinyModule(), datamodule=dm)
    assert not pinned.profiled and probe.calls == 0
    assert dm.cost_model.to_json() == first.cost_model.to_json()


def test_mislabelled_synthetic_batch_is_caught_before_profiling(tmp_path):
    class Mislabelled(TinyModule):
        def synthetic_batch(self, batch_size, grid, device=None):
            # Builds S·4 tokens, as a model that forgot the patch would.
            return super().synthetic_batch(batch_size, (grid[0], grid[1] * 2, grid[2] * 2), device)

        def batch_shape(self, batch):
            return batch["x"].shape[0], batch["x"].shape[1]

    with pytest.raises(Exception, match=r"returned a batch whose batch_shape is \(1, 16\); expected \(1, 4\)"):
        _trainer(tmp_path, _cb(tmp_path)).fit(Mislabelled(), datamodule=TinyDataModule())


def test_fixed_m_mem_skip_never_profiles_oversize_and_error_fails_first(tmp_path):
    dm = TinyDataModule()
    dm.policy = DualConstraintPolicy(64, 1e4, 2.0, oversize="skip")
    model = TinyModule()
    cb = _cb(tmp_path, m_mem=100)
    _trainer(tmp_path, cb).fit(model, datamodule=dm)
    assert max(m.seq_len for m in cb.calibration.measurements) <= 100
    assert all(s <= 100 for _, s in model.calls[: len(cb.calibration.measurements) * 3])
    assert dm.policy.oversize == "skip" and dm.policy.batch_size(180) == 0

    dm, model = TinyDataModule(), TinyModule()
    with pytest.raises(ValueError, match=r"sample 4: S=180 tokens \(token grid \(5, 6, 6\)\) is above the memory budget of 100 tokens \(m_mem=100\).*3 samples"):
        _trainer(tmp_path, _cb(tmp_path, m_mem=100)).fit(model, datamodule=dm)
    assert model.calls == []  # before any profiling


class ModalModule(TinyModule):
    """TinyModule with activation-checkpointing modes; ``oom_modes`` run out of memory at the longest S."""

    checkpointing_modes = ("none", "selective", "full")

    def __init__(self, oom_modes=("none",), dim: int = 8) -> None:
        super().__init__(dim)
        # A simulated device's memory, not a model setting: kept out of the hparams the calibration key reads.
        self.hparams.pop("oom_modes", None)
        self.checkpointing = "auto"
        self.modes_seen: list[tuple[str, int]] = []
        s_max = int(GRIDS.prod(axis=1).max())

        def hook(b, s):
            self.modes_seen.append((self.checkpointing, s))
            if self.checkpointing in oom_modes and b * s >= s_max:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

        self.hook = hook

    def batch_shape(self, batch):
        return tuple(batch["x"].shape[:2])

    def set_checkpointing(self, mode):
        assert mode in self.checkpointing_modes
        self.checkpointing = mode


class BucketDataModule(TinyDataModule):
    """Training batches of one sample each, with the sample's own token count (S of its grid)."""

    def train_dataloader(self):
        self.events.append("train_dataloader")
        seq = self.dataset.grids.prod(axis=1)
        order = np.argsort(-seq, kind="stable")  # the longest bucket first, so short runs still train it
        return DataLoader([{"x": torch.randn(int(seq[i]), 4)} for i in order], batch_size=1)


def _tiers(cb):
    return [(t["mode"], t["max_seq_len"]) for t in cb.calibration.extra["checkpointing"]["tiers"]]


@pytest.mark.slow  # 9-16 s on a 2-core CPU
def test_auto_checkpointing_is_chosen_per_bucket_and_reapplied(tmp_path):
    from lightning_adaptiveload.bucketing.policy import TieredPolicy

    cache = tmp_path / "cache"
    cb, model, dm = _cb(tmp_path, cache_dir=cache), ModalModule(oom_modes=("none",)), BucketDataModule()
    _trainer(tmp_path, cb, max_steps=8).fit(model, datamodule=dm)
    # S <= 72 fits without recomputation; only the S = 180 bucket needs 'selective'; 'full' never runs.
    assert _tiers(cb) == [("none", 72), ("selective", 180)]
    assert isinstance(dm.policy, TieredPolicy)
    assert [dm.policy.mode_for(s) for s in (4, 72, 180)] == ["none", "none", "selective"]
    profiled = [m for m in cb.calibration.measurements if m.status == "ok"]
    assert {m.mode for m in profiled if m.seq_len < 180} == {"none"}
    assert {(m.mode, m.batch_size) for m in profiled if m.seq_len == 180} == {("selective", 1)}
    assert all(mode != "full" for mode, _ in model.modes_seen)
    # Training: every batch ran in its bucket's mode (the callback switches it per batch).
    trained = model.modes_seen[-8:]
    assert {s for _, s in trained} >= {180} and any(s < 180 for _, s in trained)
    assert all(mode == ("selective" if s == 180 else "none") for mode, s in trained)
    assert cb.calibration.key["checkpointing"] == "auto"

    # The cached record carries the tiers: a new "auto" run takes them without profiling.
    again, model2 = _cb(tmp_path, cache_dir=cache), ModalModule(oom_modes=("none",))
    _trainer(tmp_path, again, max_steps=8).fit(model2, datamodule=BucketDataModule())
    assert again.source == "cache" and len(model2.modes_seen) == 8
    assert all(mode == ("selective" if s == 180 else "none") for mode, s in model2.modes_seen)

    # Resume: the checkpoint's calibration gives the tiers back ('full' for S = 180 this time).
    trainer = _trainer(tmp_path, first := _cb(tmp_path))
    trainer.fit(ModalModule(oom_modes=("none", "selective")), datamodule=BucketDataModule())
    assert _tiers(first) == [("none", 72), ("full", 180)]
    trainer.save_checkpoint(tmp_path / "auto.ckpt")
    resumed, model3 = _cb(tmp_path), ModalModule(oom_modes=())
    _trainer(tmp_path, resumed, max_steps=10).fit(model3, datamodule=BucketDataModule(), ckpt_path=tmp_path / "auto.ckpt")
    assert resumed.source == "checkpoint" and not resumed.profiled
    assert all(mode == ("full" if s == 180 else "none") for mode, s in model3.modes_seen)


@pytest.mark.slow  # 10 s on a 2-core CPU under load: off the quick path
def test_auto_checkpointing_that_fits_nowhere_names_the_samples(tmp_path):
    model = ModalModule(oom_modes=("none", "selective", "full"))
    with pytest.raises(ValueError, match=r"S=180 tokens .* above the memory budget of 72 tokens that fit one device even with 'full' activation checkpointing"):
        _trainer(tmp_path, _cb(tmp_path)).fit(model, datamodule=BucketDataModule())
    assert [m for m, s in model.modes_seen if s == 180] == ["none", "selective", "full"]  # one try per mode

    # With oversize="skip" the run trains the rest without recomputation.
    dm = TinyDataModule()
    dm.policy = DualConstraintPolicy(64, 1e4, 2.0, oversize="skip")
    cb = _cb(tmp_path)
    _trainer(tmp_path, cb).fit(ModalModule(oom_modes=("none", "selective", "full")), datamodule=dm)
    assert _tiers(cb) == [("none", 72)] and dm.policy.batch_size(180) == 0


@pytest.mark.slow  # 12 s on a 2-core CPU under load: off the quick path
def test_a_fixed_mode_is_part_of_the_key_and_never_probed(tmp_path):
    model = ModalModule(oom_modes=())
    model.checkpointing = "full"
    cb = _cb(tmp_path)
    _trainer(tmp_path, cb).fit(model, datamodule=BucketDataModule())
    assert cb.calibration.key["checkpointing"] == "full" and "checkpointing" not in cb.calibration.extra
    assert model.checkpointing == "full" and {m for m, _ in model.modes_seen} == {"full"}


@pytest.mark.slow  # 4 s on a 2-core CPU under load: off the quick path
def test_late_restoring_strategy_gets_the_checkpoints_checkpointing_modes(tmp_path):
    # Such strategies restore after on_fit_start: the run profiles first (here all in 'none'), then the
    # checkpoint's calibration replaces it, and its tiers must replace the profiled ones too.
    first = _cb(tmp_path)
    trainer = _trainer(tmp_path, first, strategy=LateRestoreStrategy(torch.device("cpu")))
    trainer.fit(ModalModule(oom_modes=("none", "selective")), datamodule=BucketDataModule())
    assert _tiers(first) == [("none", 72), ("full", 180)]
    trainer.save_checkpoint(tmp_path / "late.ckpt")
    resumed, model = _cb(tmp_path), ModalModule(oom_modes=())
    trainer = _trainer(tmp_path, resumed, strategy=LateRestoreStrategy(torch.device("cpu")), max_steps=10)
    trainer.fit(model, datamodule=BucketDataModule(), ckpt_path=tmp_path / "late.ckpt")
    assert resumed.profiled and resumed.source == "checkpoint"
    assert _tiers(resumed) == [("none", 72), ("full", 180)]
    trained = model.modes_seen[-(10 - 2):]  # the steps after the checkpoint's 2
    assert any(s == 180 for _, s in trained)
    assert all(mode == ("full" if s == 180 else "none") for mode, s in trained)


def test_out_of_memory_in_training_says_what_was_predicted_and_what_to_change(tmp_path):
    from lightning_adaptiveload.calibration.costmodel import MemoryModel

    class ShapedModule(TinyModule):
        def batch_shape(self, batch):
            return tuple(batch["x"].shape[:2])

    model, cb, seen = ShapedModule(), _cb(tmp_path), []

    def oom_from_the_second_training_step(b, s):
        if model.trainer.global_step >= 1:
            seen.append((b, s))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    class FakeMemory(Callback):  # a CUDA calibration has a memory model; give the CPU one the same
        def on_train_start(self, trainer, pl_module):
            cb.calibration.memory_model = MemoryModel(2 * 2**30, 2**20)
            cb.calibration.device_memory, cb.calibration.optimizer_bytes = 16 * 2**30, 2**30
            model.hook = oom_from_the_second_training_step

    trainer = _trainer(tmp_path, cb, FakeMemory())
    with pytest.warns(UserWarning, match="training step 1 ran out of memory") as record:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            trainer.fit(model, datamodule=TinyDataModule())
    (b, s), = seen
    want = (2 * 2**30 + 2**20 * b * s + 2**30) / 2**30
    (message,) = [str(w.message) for w in record if "ran out of memory" in str(w.message)]
    assert f"on a B={b} S={s:,} batch; the calibration's memory model predicted {want:.1f} GiB of 16.0 GiB" in message
    assert "ShapeBenchmarkCallback(memory_margin=0.1), e.g. to 0.2" in message
    assert "expandable_segments:True" in message
