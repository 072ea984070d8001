"""The data side of sequence parallelism: config checks, batch["sp_degree"] and identical batches per SP group."""

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.data.collate import collate_batch
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.sequence_parallel import (
    SequenceParallelCollate,
    sequence_parallel_from_config,
)
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

# "tiny" mixture: S = 16, 64, 72, 120; with m_mem=100 the 120-token clips need an SP group.
POLICY = DualConstraintPolicy(m_mem=100, m_comp=100 * 16, p=2)
SP = {"enabled": True, "degrees": [2], "num_heads": 4, "ranks_per_node": 2,
      "comm": {"hidden_dim": 64, "num_layers": 2}}


def test_config_is_checked_with_the_allowed_degrees():
    assert sequence_parallel_from_config(None) == (None, None, None)
    assert sequence_parallel_from_config({**SP, "enabled": False}) == (None, None, None)
    sp, comm, patch = sequence_parallel_from_config({**SP, "patch_size": [1, 2, 2]})
    assert sp.degrees == (2,) and comm.hidden_dim == 64 and patch == (1, 2, 2)
    with pytest.raises(ValueError, match=r"`sequence_parallel`.*degree=3.*Expected one of \[2\]"):
        sequence_parallel_from_config({**SP, "degrees": [3]})
    with pytest.raises(ValueError, match=r"`sequence_parallel`.*degree=8.*ranks of a node.*Expected one of \[2, 4\]"):
        sequence_parallel_from_config({**SP, "num_heads": 8, "degrees": [8], "ranks_per_node": 4})
    with pytest.raises(ValueError, match=r"unknown keys \['degree'\]"):
        sequence_parallel_from_config({**SP, "degree": 2})
    with pytest.raises(ValueError, match=r"`sequence_parallel.num_heads` is not set"):
        sequence_parallel_from_config({**SP, "num_heads": None})
    with pytest.raises(ValueError, match=r"comm.num_layers` is not set"):
        sequence_parallel_from_config({**SP, "comm": {"hidden_dim": 64}})


def _sample(index, latent_grid):
    return {"latents": torch.zeros(16, *latent_grid), "context": torch.zeros(4, 8), "index": index}


def test_collate_adds_the_degree_of_the_latent_grid_and_pickles():
    collate = pickle.loads(pickle.dumps(SequenceParallelCollate(collate_batch, {(5, 4, 6): 2, (1, 4, 4): 1}, (1, 2, 2))))
    batch = collate([_sample(0, (5, 8, 12))])
    assert batch["sp_degree"] == 2 and type(batch["sp_degree"]) is int
    assert collate([_sample(1, (1, 8, 8)), _sample(2, (1, 8, 8))])["sp_degree"] == 1
    with pytest.raises(ValueError, match=r"latent grid \(1, 8, 10\), which no planned bucket has"):
        collate([_sample(3, (1, 8, 10))])


def _loader(dm, world, rank):
    dm.trainer = SimpleNamespace(
        world_size=world, global_rank=rank, training=False,
        fit_loop=SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0))),
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=False))
    dm.setup("fit")
    return dm.train_dataloader()


def test_ranks_of_a_group_get_the_same_batch_with_its_degree():
    ds = SyntheticMixedDataset(60, "tiny", text_len=4, text_dim=8, seed=1)
    seq = ds.token_grids().prod(axis=1)
    assert (seq == 120).any()
    batches = []
    for rank in (0, 1):
        dm = AdaptiveLoadDataModule(ds, POLICY, sequence_parallel=SP, print_plan=False, seed=3)
        batches.append(list(_loader(dm, 2, rank)))
    degree_of = {r["seq_len"]: r["sp_degree"] for r in dm.sampler.bucket_table()}
    assert degree_of[120] == 2 and degree_of[16] == 1  # above m_mem: SP; short images: data parallel
    assert len(batches[0]) == len(batches[1])
    seen = []
    for b0, b1 in zip(*batches, strict=True):
        s = {int(np.prod(b["latents"].shape[-3:])) // 4 for b in (b0, b1)}
        if b0["sp_degree"] == 2:
            assert b1["sp_degree"] == 2 and torch.equal(b0["index"], b1["index"])
            assert all(degree_of[v] == 2 for v in s)
            seen += b0["index"].tolist()
        else:
            assert all(degree_of[v] == 1 for v in s)
            assert b0["sp_degree"] == b1["sp_degree"] == 1 and max(s) <= 100
            seen += b0["index"].tolist() + b1["index"].tolist()
    assert set(seen) == set(range(len(ds)))


def test_datamodule_checks_sp_before_training():
    ds = SyntheticMixedDataset(8, "tiny", text_len=4, text_dim=8)
    with pytest.raises(ValueError, match=r"degree=3.*Expected one of \[2\]"):
        AdaptiveLoadDataModule(ds, POLICY, sequence_parallel={**SP, "degrees": [3]})
    dm = AdaptiveLoadDataModule(ds, POLICY, sequence_parallel=SP)
    with pytest.raises(ValueError, match=r"world_size=3.*groups of 2"):
        _loader(dm, 3, 0)
    nopatch = SimpleNamespace(token_grids=ds.token_grids, __len__=ds.__len__)
    with pytest.raises(ValueError, match="patch_size"):
        AdaptiveLoadDataModule(nopatch, POLICY, sequence_parallel=SP)
