"""A small CPU fit the world-size tests run on ranks forked from the test process (``fit_ranks`` through
``gloo_ranks.spawn``: DDP over gloo for 2 devices), or by hand as a script (Lightning launches the other ranks).

Every rank appends the dataset indices of each trained batch to ``<record>.rank<r>``; rank 0 writes
``<record>.json`` at the end: the shape benchmark's calibration source, the sampler's plan counts and
the balance summary. ``--model diffusers`` trains diffusers' WanTransformer3DModel (tiny config)
through the project's adapter.
"""

from __future__ import annotations

import argparse
import json

import torch
from gloo_ranks import init_rank
from lightning.pytorch import Callback, Trainer

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor
from lightning_adaptiveload.callbacks.checkpoint import LastStateCheckpoint
from lightning_adaptiveload.callbacks.fused_adaln import FusedAdaLNCallback
from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

NUM_SAMPLES = 48


class _Record(Callback):
    def __init__(self, record: str) -> None:
        self.record = record

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        assert torch.isfinite(outputs["loss"])
        with open(f"{self.record}.rank{trainer.global_rank}", "a") as fh:
            fh.write(json.dumps(batch["index"].tolist()) + "\n")

    def on_train_end(self, trainer, pl_module) -> None:
        bench = next(cb for cb in trainer.callbacks if isinstance(cb, ShapeBenchmarkCallback))
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, BalanceMonitor))
        if trainer.is_global_zero:
            sampler = trainer.datamodule.sampler
            out = {"source": bench.source, "profiled": bench.profiled, "policy": repr(trainer.datamodule.policy),
                   "plan": sampler.plan_stats, "summary": monitor.summary(), "world_size": trainer.world_size,
                   "global_step": trainer.global_step}
            with open(f"{self.record}.json", "w") as fh:
                json.dump(out, fh, default=str)


def _module(kind: str):
    if kind == "diffusers":
        from lightning_adaptiveload.integrations.diffusers import DiffusersWanModule

        config = dict(num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16, text_dim=8,
                      freq_dim=16, ffn_dim=32, num_layers=2)
        return DiffusersWanModule(config, text_len=4, lr=1e-3), 4, 8
    from lightning_adaptiveload.models.flow_matching import FlowMatchingModule

    module = FlowMatchingModule("tiny", lr=1e-3)
    return module, module.config.text_len, module.config.text_dim


def fit(out: str, record: str, devices: int = 1, max_steps: int = -1, max_epochs: int = 1, ckpt: str | None = None,
        model: str = "tiny") -> None:
    torch.set_num_threads(1)
    module, text_len, text_dim = _module(model)
    dataset = SyntheticMixedDataset(NUM_SAMPLES, "tiny", text_len=text_len, text_dim=text_dim)
    datamodule = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(4096, 4096 * 64, 2.0), seed=1)
    trainer = Trainer(
        default_root_dir=out, accelerator="cpu", devices=devices,
        strategy="ddp" if devices > 1 else "auto", use_distributed_sampler=False, max_epochs=max_epochs,
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[
            ShapeBenchmarkCallback(max_shapes=2, batch_sizes=[1, 8], repeats=1, warmup=0, m_mem=480,
                                   save_dir=out),
            BalanceMonitor(log_every_n_steps=1000),
            FusedAdaLNCallback(),
            LastStateCheckpoint(dirpath=f"{out}/ckpt", every_n_train_steps=2, save_top_k=-1, save_last=True,
                                filename="step={step}", auto_insert_metric_name=False),
            _Record(record),
        ],
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)


def fit_ranks(rank: int, world: int, port: int, out: str, record: str, kwargs: dict) -> None:
    """One forked rank of ``fit(out, record, devices=world, **kwargs)`` (``gloo_ranks.spawn(fit_ranks, world,
    ...)``): two or more join a gloo process group first, which Lightning's DDP strategy then uses as it is."""
    if world > 1:
        init_rank(rank, world, port)
    fit(out, record, devices=world, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("record")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=1)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--model", default="tiny", choices=("tiny", "diffusers"))
    fit(**vars(parser.parse_args()))


if __name__ == "__main__":
    main()
