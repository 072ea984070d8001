"""``adaptiveload-train``'s own build on 2 CPU ranks (DDP over gloo) with sequence parallelism on; run on ranks
forked from the test process by test_sequence_parallel_train.py (``train_ranks`` through ``gloo_ranks.spawn``), or
by hand as a script (Lightning launches the other rank).

The config is composed from ``conf/`` as the console script composes it; the run is ``train(cfg)``.
With ``m_mem=100`` the tiny mixture's 120-token clips fit no single rank, so the planner gives them
an SP group of degree 2. Every rank appends one JSON line per training batch to ``<record>.rank<r>``:
step, ``sp_degree``, dataset indices, the loss and how many all-to-alls the step ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_ranks import init_rank
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
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


def run(out: str, record: str, ckpt: str | None = None) -> None:
    torch.set_num_threads(1)
    # The Ulysses exchanges call `torch.distributed.all_to_all_single` (looked up at call time). Patched here,
    # not on import: test_sequence_parallel_train.py imports this module for NUM_SAMPLES, and a patch in the
    # pytest process would reach every later test (compiled blocks would trace the counter).
    dist.all_to_all_single = _counting_all_to_all
    overrides = [
        f"output_dir={out}", f"data.dataset.num_samples={NUM_SAMPLES}", "data.dataset.seed=1",
        "data.sequence_parallel.enabled=true", "data.sequence_parallel.degrees=[2]",
        "data.sequence_parallel.ranks_per_node=2",
        "bucketing.fit_from_benchmark=false", "bucketing.policy.m_mem=100", "bucketing.policy.m_comp=1600",
        "trainer.devices=2", "trainer.max_steps=-1", "trainer.max_epochs=1", "trainer.enable_progress_bar=false",
        "++trainer.enable_model_summary=false", "logger=none", "print_plan=false",
        "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.balance_monitor.print_report=false",
        f"+callbacks.record._target_={__name__}.Record", f"+callbacks.record.record={record}",
    ]
    if ckpt:
        overrides.append(f"ckpt_path={ckpt}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    metrics = train(cfg)
    if int(dist.get_rank()) == 0:
        Path(f"{record}.json").write_text(json.dumps(metrics))


def train_ranks(rank: int, world: int, port: int, out: str, record: str, ckpt: str | None = None) -> None:
    """One of the 2 ranks of ``run`` forked from the test process (``gloo_ranks.spawn(train_ranks, 2, ...)``): it
    joins a gloo process group first, which the run's DDP strategy then uses as it is; it works in the folder of
    ``out`` (what the run may write to relative paths stays there)."""
    os.chdir(Path(out).parent)
    init_rank(rank, world, port)
    run(out, record, ckpt)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("record")
    parser.add_argument("--ckpt", default=None)
    run(**vars(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
