from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_adaptiveload.callbacks import balance_monitor
from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor


class TinyModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.patch_size = (1, 2, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch["latents"].mean(dim=(2, 3, 4))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(n_batches=6):
    # B=3 samples of latent [4, 2, 4, 6] -> token grid (2, 2, 3), S = 12
    data = [{"latents": torch.randn(3, 4, 2, 4, 6)} for _ in range(n_batches)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def _fake_clock(monkeypatch):
    """Each step reads the clock three times: start, before backward, end -> 1 s forward, 3 s step."""
    values = iter([10.0 * step + dt for step in range(100) for dt in (0.0, 1.0, 3.0)])
    monkeypatch.setattr(balance_monitor, "time", SimpleNamespace(perf_counter=lambda: next(values)))


def test_single_device_metrics_and_report(tmp_path, monkeypatch, capsys):
    _fake_clock(monkeypatch)
    monitor = BalanceMonitor(log_every_n_steps=2)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=6, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[monitor])
    trainer.fit(TinyModule(), train_dataloaders=_loader())
    tokens = 3 * 12
    assert monitor.last_metrics["balance/tokens_per_s"] == pytest.approx(tokens / 3.0)
    assert monitor.last_metrics["balance/step_time_cv"] == 0.0
    assert monitor.last_metrics["balance/bubble"] == 0.0
    assert trainer.callback_metrics["balance/tokens_per_s"].item() == pytest.approx(12.0)
    s = monitor.summary()
    assert s["steps"] == 6 and s["tokens_per_s"] == pytest.approx(12.0)
    out = capsys.readouterr().out
    assert "Balance report (6 steps)" in out and "3.0000" in out and "1.0000" in out


def test_gathered_rows_give_paper_metrics():
    monitor = BalanceMonitor(cost_model=SimpleNamespace(predict=lambda b, s: b * s * 1e-3))
    # two ranks: step times 1 s and 3 s, predicted compute 2 and 6, tokens 10 and 30, no FLOPs counted
    monitor._accumulate(np.array([[1.0, 0.5, 2.0, 10.0, 0.0, 0.0], [3.0, 1.5, 6.0, 30.0, 2**30, 0.0]]))
    m = monitor.last_metrics
    assert m["balance/step_time_cv"] == pytest.approx(0.5)
    assert m["balance/forward_time_cv"] == pytest.approx(0.5)
    assert m["balance/compute_cv"] == pytest.approx(0.5)
    assert m["balance/bubble"] == pytest.approx(1 - 2.0 / 3.0)
    assert m["balance/tokens_per_s"] == pytest.approx(40.0 / 3.0)
    assert m["balance/peak_mem_gb"] == pytest.approx(1.0)
    assert monitor._predicted_compute(2, 100) == pytest.approx(0.2)
    assert "balance/tflops_per_gpu" not in m


@pytest.mark.parametrize("kwargs, msg", [({"log_every_n_steps": 0}, "log_every_n_steps=0"), ({"p": -1}, "p=-1")])
def test_invalid_arguments(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        BalanceMonitor(**kwargs)


class FlopsModule(TinyModule):
    def flops_per_sample(self, seq_len):
        return 1e12 * seq_len  # 12 TFLOP a sample of S = 12


def test_mfu_warmup_and_the_datamodule_cost_model(tmp_path, monkeypatch):
    _fake_clock(monkeypatch)
    monitor = BalanceMonitor(log_every_n_steps=1, warmup_steps=2, peak_tflops=100.0)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=6, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[monitor])
    trainer.fit(FlopsModule(), train_dataloaders=_loader())
    s = monitor.summary()
    assert s["steps"] == 4 and len(monitor.history) == 4  # two warm-up steps left out
    # 3 samples x 12 TFLOP in 3 s on one GPU.
    assert s["tflops_per_gpu"] == pytest.approx(12.0)
    assert s["mfu"] == pytest.approx(0.12)
    assert monitor.last_metrics["balance/mfu"] == pytest.approx(0.12)


def test_compute_cv_uses_the_datamodule_cost_model(tmp_path):
    from lightning.pytorch import LightningDataModule

    class DM(LightningDataModule):
        cost_model = SimpleNamespace(predict=lambda b, s: 7.0 * b * s)

        def train_dataloader(self):
            return _loader(2)

    monitor = BalanceMonitor(log_every_n_steps=1)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=2, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[monitor])
    trainer.fit(TinyModule(), datamodule=DM())
    assert monitor.history[0][0][2] == pytest.approx(7.0 * 3 * 12)


def test_tokens_need_batch_shape_or_patch_size(tmp_path):
    class NoPatch(TinyModule):
        def __init__(self):
            super().__init__()
            del self.patch_size

    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[BalanceMonitor()])
    with pytest.raises(AttributeError, match="neither `batch_shape"):
        trainer.fit(NoPatch(), train_dataloaders=_loader())

    class ForgotPatch(TinyModule):
        def __init__(self):
            super().__init__()
            self.patch_size = (1, 4, 4)  # the latents are 4x6: not a multiple

    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[BalanceMonitor()])
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        trainer.fit(ForgotPatch(), train_dataloaders=_loader())
