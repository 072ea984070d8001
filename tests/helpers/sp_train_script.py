"""``adaptiveload-train``'s own build on 2 CPU ranks (DDP over gloo) with sequence parallelism on; run as a
script by test_sequence_parallel_train.py.

The config is composed from ``conf/`` as the console script composes it; the run is ``train(cfg)``.
With ``m_mem=100`` the tiny mixture's 120-token clips fit no single rank, so the planner gives them
an SP group of degree 2. Every rank appends one JSON line per training batch to ``<record>.rank<r>``:
step, ``sp_degree``, dataset indices, the loss and how many all-to-alls the step ran.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback

import lightning_adaptiveload
from lightning_adaptiveload.train import train

CONF_DIR = Path(lightning_adaptiveload.__file__).parent.parent / "conf"
NUM_SAMPLES = 24
_calls = {"all_to_all": 0}
_all_to_all_single = dist.all_to_all_single


def _counting_all_to_all(*args, **kwargs):
    _calls["all_to_all"] += 1
    return _all_to_all_single(*args, **kwargs)


class Record(Callback):
    def __init__(self, record: str) -> None:
        self.record = record
        self._before = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = _calls["all_to_all"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = {"step": trainer.global_step, "sp_degree": batch["sp_degree"], "index": batch["index"].tolist(),
               "loss": float(outputs["loss"]), "all_to_all": _calls["all_to_all"] - self._before}
        with open(f"{self.record}.rank{trainer.global_rank}", "a") as fh:
            fh.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("record")
    parser.add_argument("--ckpt", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # The Ulysses exchanges call `torch.distributed.all_to_all_single` (looked up at call time). Patched here,
    # not on import: test_sequence_parallel_train.py imports this module for NUM_SAMPLES, and a patch in the
    # pytest process would reach every later test (compiled blocks would trace the counter).
    dist.all_to_all_single = _counting_all_to_all
    overrides = [
        f"output_dir={args.out}", f"data.dataset.num_samples={NUM_SAMPLES}", "data.dataset.seed=1",
        "data.sequence_parallel.enabled=true", "data.sequence_parallel.degrees=[2]",
        "data.sequence_parallel.ranks_per_node=2",
        "bucketing.fit_from_benchmark=false", "bucketing.policy.m_mem=100", "bucketing.policy.m_comp=1600",
        "trainer.devices=2", "trainer.max_steps=-1", "trainer.max_epochs=1", "trainer.enable_progress_bar=false",
        "++trainer.enable_model_summary=false", "logger=none", "print_plan=false",
        "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.balance_monitor.print_report=false",
        "+callbacks.record._target_=__main__.Record", f"+callbacks.record.record={args.record}",
    ]
    if args.ckpt:
        overrides.append(f"ckpt_path={args.ckpt}")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    metrics = train(cfg)
    if int(dist.get_rank()) == 0:
        Path(f"{args.record}.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    sys.exit(main())
