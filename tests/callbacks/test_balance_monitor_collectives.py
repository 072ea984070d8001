"""BalanceMonitor's cost to a distributed step: exactly one collective per training step (the all-gather of
every rank's row), none anywhere else in fit, on two CPU gloo ranks under DDP. Only what runs inside the
monitor's hooks is counted: DDP's gradient all-reduce runs between them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from gloo_ranks import init_rank, spawn
from test_balance_monitor import TinyModule
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor

STEPS = 4


class _Collectives(TorchDispatchMode):
    """Records the collectives that run under it: every entry point (``torch.distributed``, its autograd and
    functional collectives, Lightning's gather helpers) reaches the process group through a ``c10d`` op."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.calls.append(func.name())
        return func(*args, **(kwargs or {}))


def _count_in_hooks(monitor: BalanceMonitor) -> tuple[list[list[str]], list[str]]:
    """Wrap every hook of ``monitor`` to record the collectives it runs: per training batch (from its
    ``on_train_batch_start`` to its ``on_train_batch_end``, backward and optimizer hooks included) and
    outside the batches (fit start and end, the report, the epoch estimate)."""
    per_step: list[list[str]] = []
    outside: list[str] = []
    in_batch = [False]
    names = [n for n in dir(pl.Callback) if n.startswith(("on_", "setup", "teardown", "state_dict", "load_state"))]
    for name in names:
        hook = getattr(monitor, name)

        def counted(*args, _hook=hook, _name=name, **kwargs):
            if _name == "on_train_batch_start":
                per_step.append([])
                in_batch[0] = True
            with _Collectives(per_step[-1] if in_batch[0] else outside):
                out = _hook(*args, **kwargs)
            if _name == "on_train_batch_end":
                in_batch[0] = False
            return out

        setattr(monitor, name, counted)
    return per_step, outside


class _Plan(pl.LightningDataModule):
    """Two ranks' loaders of different batch shapes, and a plan for the monitor's epoch estimate."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def train_dataloader(self):
        # Rank 0: B=3 of token grid (2, 2, 3), S = 12; rank 1: B=1 of grid (4, 2, 3), S = 24.
        shape = (3, 4, 2, 4, 6) if self.rank == 0 else (1, 4, 4, 4, 6)
        return torch.utils.data.DataLoader([{"latents": torch.randn(shape)} for _ in range(STEPS)], batch_size=None)

    def bucket_table(self):
        return [{"seq_len": 12, "batch_size": 3, "batches": 4}, {"seq_len": 24, "batch_size": 1, "batches": 4}]


def _fit(rank: int, world: int, port: int, out: str, timing: str = "synchronize") -> None:
    init_rank(rank, world, port)
    monitor = BalanceMonitor(log_every_n_steps=1, warmup_steps=1, timing=timing)
    per_step, outside = _count_in_hooks(monitor)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
        max_steps=STEPS, callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(TinyModule(), datamodule=_Plan(rank))
    torch.save({"per_step": per_step, "outside": outside, "rows": [r.tolist() for r in monitor.history],
                "epoch_buckets": monitor.epoch and float(monitor.epoch["measured_buckets"]),
                "epoch_tokens_per_s": monitor.epoch and float(monitor.epoch["tokens_per_s"])},
               Path(out) / f"rank{rank}.pt")


def test_one_collective_per_training_step_and_none_elsewhere(tmp_path):
    spawn(_fit, 2, str(tmp_path))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # One all-gather a step, warm-up steps included; nothing else, on either rank.
        assert got["per_step"] == [["c10d::allgather_"]] * STEPS, rank
        assert got["outside"] == [], rank
        # ... and it carried both ranks' rows: each rank's batch shape, on every rank.
        rows = got["rows"]
        assert len(rows) == STEPS - 1 and all(len(r) == 2 for r in rows)
        assert {(r[0][12], r[0][13]) for r in rows} == {(3.0, 12.0)}
        assert {(r[1][12], r[1][13]) for r in rows} == {(1.0, 24.0)}
        # The estimate reads the gathered rows, no collective of its own: both shapes on both ranks, one answer.
        assert got["epoch_buckets"] == 2.0
    assert torch.load(tmp_path / "rank0.pt")["epoch_tokens_per_s"] == torch.load(tmp_path / "rank1.pt")[
        "epoch_tokens_per_s"]


def test_events_timing_gathers_each_step_once_a_step_late(tmp_path):
    # With events each step's rows are gathered at the end of the next step (over the CPU group: here the
    # gloo default group) and the last step's where training ends: still one all-gather per step.
    spawn(_fit, 2, str(tmp_path), "events")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["per_step"] == [[]] + [["c10d::allgather_"]] * (STEPS - 1), rank
        assert got["outside"] == ["c10d::allgather_"], rank
        rows = got["rows"]
        assert len(rows) == STEPS - 1 and all(len(r) == 2 for r in rows)
        assert {(r[0][12], r[0][13]) for r in rows} == {(3.0, 12.0)}
        assert {(r[1][12], r[1][13]) for r in rows} == {(1.0, 24.0)}


class _SlowOnRank1(TinyModule):
    """A forward that takes 60 ms on rank 1 and 10 ms on rank 0."""

    def training_step(self, batch, batch_idx):
        import time

        time.sleep(0.06 if self.global_rank == 1 else 0.01)
        return super().training_step(batch, batch_idx)


def _fit_forward(rank: int, world: int, port: int, out: str) -> None:
    init_rank(rank, world, port)
    # Both ranks' batches predicted alike: by prediction both bound every step.
    monitor = BalanceMonitor(warmup_steps=1, timing="synchronize", print_report=False,
                             cost_model=SimpleNamespace(predict=lambda b, s: 0.05))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
        max_steps=STEPS, callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(_SlowOnRank1(), datamodule=_Plan(rank))
    torch.save({"observed": [(b, s, n) for b, s, _, n in monitor.observations(min_steps=1)]},
               Path(out) / f"rank{rank}.pt")


def test_under_ddp_only_the_rank_whose_forward_was_slowest_observes_a_step(tmp_path):
    # Rank 0's batch (3 x 12) waits for rank 1's (1 x 24) at the gradient all-reduce every step: its step time is
    # rank 1's, so only 1 x 24 is observed, on both ranks.
    spawn(_fit_forward, 2, str(tmp_path))
    for rank in (0, 1):
        assert torch.load(tmp_path / f"rank{rank}.pt")["observed"] == [(1, 24, STEPS - 1)], rank
