"""Train the tiny Wan DiT from prepared shards on 2 CPU ranks (DDP over gloo); run as a script by the tests.

Every rank appends the dataset indices of each trained batch to ``<record>.rank<r>``; with ``--kill-at``
both ranks end the process hard (``os._exit``) when that optimizer step is about to run, after the
step checkpoint before it was written, as a crash would.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.shards import ShardedLatentDataset
from lightning_adaptiveload.models.flow_matching import FlowMatchingModule

POLICY = {"m_mem": 96, "m_comp": 96 * 48, "p": 2.0}


class _Record(Callback):
    def __init__(self, record: str, kill_at: int | None) -> None:
        self.record, self.kill_at = record, kill_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kill_at is not None and trainer.global_step == self.kill_at:
            os._exit(3)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        assert torch.isfinite(outputs["loss"])
        with open(f"{self.record}.rank{trainer.global_rank}", "a") as fh:
            fh.write(json.dumps(batch["index"].tolist()) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("index")
    parser.add_argument("out")
    parser.add_argument("record")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    module = FlowMatchingModule("tiny", lr=1e-3)
    dataset = ShardedLatentDataset(args.index, text_len=module.config.text_len, text_dim=module.config.text_dim)
    datamodule = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(**POLICY), seed=1, num_workers=0)
    trainer = Trainer(
        default_root_dir=args.out,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        use_distributed_sampler=False,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            _Record(args.record, args.kill_at),
            ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=1, save_top_k=-1,
                            filename="{step}"),  # fmt: skip
        ],
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=args.ckpt)


if __name__ == "__main__":
    main()
