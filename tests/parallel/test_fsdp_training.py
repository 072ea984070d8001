"""FSDP2 and HSDP on gloo ranks through Lightning: each rank holds its shards only, pretrained
weights in both layouts load exactly, the losses (and weights) equal a single-process emulation of the
ranks (fp32, clipping on), and a distributed checkpoint resumes to the uninterrupted run's losses exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp2_script import CLIP, LR, SEED, fit_ranks
from gloo_ranks import spawn

from lightning_adaptiveload.models.flow_matching import draw_seed, rectified_flow_loss
from lightning_adaptiveload.models.wan import WanModel
from lightning_adaptiveload.models.wan_weights import load_wan_weights_


def _fit(out: Path, pretrained: Path, layout: str, ranks: int = 2, **kwargs) -> list[dict]:
    """``fsdp2_script.fit`` on ``ranks`` ranks forked from this process (no re-import of torch and Lightning)."""
    spawn(fit_ranks, ranks, str(out), dict(pretrained=str(pretrained), layout=layout, **kwargs), timeout=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def _reference_losses(pretrained: Path, ranks: list[dict], steps: int) -> list[list[float]]:
    return _reference(pretrained, ranks, steps)[0]


def _reference(pretrained: Path, ranks: list[dict], steps: int) -> tuple[list[list[float]], WanModel]:
    """One process plays every rank: each rank's batch and noise stream, the mean loss, one AdamW step.

    Returns the per-step losses of every rank and the model after the last step."""
    model = WanModel("tiny")
    load_wan_weights_(model, pretrained)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    out = []
    clipped = []
    for step in range(steps):
        losses = []
        for rank, record in enumerate(ranks):
            batch = record["steps"][step]
            assert batch["step"] == step
            gen = torch.Generator().manual_seed(draw_seed(SEED, step, rank))
            losses.append(rectified_flow_loss(model, batch, 5.0, 1000, gen))
        opt.zero_grad()
        (sum(losses) / len(losses)).backward()
        clipped.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)) > CLIP)
        opt.step()
        out.append([float(x.detach()) for x in losses])
    assert all(clipped), "the clip value must bite for the test to check clipping"
    return out, model


def _assert_clipped(ranks: list[dict]) -> None:
    """After Lightning's clipping hook the global gradient norm is the clip value (it bites every step)."""
    for record in ranks:
        norms = record["checks"]["clipped_norms"]
        assert norms and all(abs(n - CLIP) <= 1e-5 * CLIP for n in norms), norms


def _losses(ranks: list[dict]) -> list[list[float]]:
    steps = len(ranks[0]["steps"])
    return [[float(r["steps"][i]["loss"]) for r in ranks] for i in range(steps)]


@pytest.mark.slow  # ~8 s on a 2-core CPU (was ~40 s as three launched runs)
def test_fsdp2_two_ranks_shards_loads_trains_like_one_process_and_resumes_exactly(tmp_path, checkpoints):
    full = _fit(tmp_path / "full", checkpoints["diffusers"], "diffusers", max_steps=4)
    for rank, record in enumerate(full):
        checks = record["checks"]
        assert record["world_size"] == 2
        assert checks["all_sharded"] and checks["pretrained_equal"] and checks["init_equal"]
        # One unit per block, one per fp32 module, and the root.
        assert checks["fsdp_units"] == ["", "blocks.0", "blocks.1", "head", "time_embedding", "time_projection"]
        # Each rank holds its rows of every parameter (dim 0 in torch.chunk's split), nothing more.
        for name, shape in checks["full_shape"].items():
            first = -(-shape[0] // 2)
            rows = first if rank == 0 else shape[0] - first
            assert checks["local_shape"][name] == (rows, *shape[1:]), name

    _assert_clipped(full)
    want = _reference_losses(checkpoints["diffusers"], full, 4)
    torch.testing.assert_close(torch.tensor(_losses(full)), torch.tensor(want), rtol=1e-5, atol=0)

    # Resume from the distributed checkpoint of step 2 (loaded over the other layout's weights).
    ckpt = tmp_path / "full" / "ckpt" / "step=2.ckpt"
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    resumed = _fit(tmp_path / "resumed", checkpoints["wan"], "wan", max_steps=4, ckpt=str(ckpt))
    assert all(r["checks"]["pretrained_equal"] for r in resumed)
    assert [s["step"] for s in resumed[0]["steps"]] == [2, 3]
    for r in (0, 1):
        for got, ref in zip(resumed[r]["steps"], full[r]["steps"][2:], strict=True):
            assert torch.equal(got["latents"], ref["latents"])
            assert torch.equal(got["loss"], ref["loss"]), (r, got["step"], float(got["loss"]), float(ref["loss"]))

    # The same checkpoint on one rank: DCP reshards it; training starts from the same weights.
    single = _fit(tmp_path / "single", checkpoints["wan"], "wan", ranks=1, max_steps=3, ckpt=str(ckpt))
    assert single[0]["world_size"] == 1 and [s["step"] for s in single[0]["steps"]] == [2]
    assert resumed[0]["start"].keys() == single[0]["start"].keys()
    assert all(torch.equal(single[0]["start"][n], w) for n, w in resumed[0]["start"].items())


@pytest.mark.slow  # ~3 s on a 2-core CPU (was ~18 s launched)
def test_hsdp_two_replicas_train_like_one_process(tmp_path, checkpoints):
    hsdp = _fit(tmp_path / "hsdp", checkpoints["diffusers"], "diffusers", max_steps=2, shard_size=1)
    # shard_size=1: every rank holds a full replica.
    for record in hsdp:
        assert record["checks"]["local_shape"] == record["checks"]["full_shape"]
        assert record["checks"]["pretrained_equal"] and record["checks"]["init_equal"]
    _assert_clipped(hsdp)
    want = _reference_losses(checkpoints["diffusers"], hsdp, 2)
    torch.testing.assert_close(torch.tensor(_losses(hsdp)), torch.tensor(want), rtol=1e-5, atol=0)


@pytest.mark.slow  # ~6 s on a 2-core CPU (was ~23 s launched)
def test_hsdp_two_replicas_of_two_shards_train_like_one_process(tmp_path, checkpoints):
    """4 ranks as a (replicate=2, shard=2) mesh: real sharding inside each replica."""
    hsdp = _fit(tmp_path / "hsdp", checkpoints["diffusers"], "diffusers", ranks=4, max_steps=2, shard_size=2,
                no_checkpoints=True)
    for rank, record in enumerate(hsdp):
        assert record["world_size"] == 4 and record["mesh_dims"] == ("replicate", "shard")
        # Replicas are the rank blocks [0, 1] and [2, 3]; a rank's shard index is its place in its block.
        replica, shard = divmod(rank, 2)
        assert tuple(record["mesh_coordinate"]) == (replica, shard)
        checks = record["checks"]
        # Every parameter: replicated across the replicas, dim 0 sharded inside one.
        assert checks["placements"] == [("Replicate()", "Shard(dim=0)")]
        assert checks["pretrained_equal"] and checks["init_equal"]
        for name, shape in checks["full_shape"].items():
            first = -(-shape[0] // 2)
            rows = slice(0, first) if shard == 0 else slice(first, shape[0])
            assert checks["local_shape"][name] == (rows.stop - rows.start, *shape[1:]), name
            assert record["final"][name]["slices"][0] == rows, name
    _assert_clipped(hsdp)
    want, model = _reference(checkpoints["diffusers"], hsdp, 2)
    torch.testing.assert_close(torch.tensor(_losses(hsdp)), torch.tensor(want), rtol=1e-5, atol=0)
    reference = dict(model.named_parameters())
    for rank, record in enumerate(hsdp):
        for name, got in record["final"].items():
            # Each rank's half of the trained weights is the emulation's half. atol = LR / 1000: AdamW scales
            # every update to ~LR, so where an element's gradient is near zero or its two steps' gradients
            # nearly cancel, the ~1e-7 relative difference of the other fp32 summation order becomes a
            # small fraction of one update (measured: 9e-10 on one CPU, 1.5e-7 = LR / 6,800 on another, one
            # element of 2,048). A wrong gradient (a missed reduction, a wrong shard) moves weights by up to ~LR.
            torch.testing.assert_close(got["local"], reference[name].detach()[got["slices"]], rtol=1e-5, atol=LR / 1000,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")
            # The two replicas hold identical shards (same reduced gradients, same optimizer step).
            if rank >= 2:
                assert torch.equal(got["local"], hsdp[rank - 2]["final"][name]["local"]), (rank, name)


@pytest.mark.parametrize("shard_size", [3, 0])
def test_hsdp_shard_size_must_divide_the_world(shard_size):
    from lightning_adaptiveload.parallel.fsdp import check_shard_size

    with pytest.raises(ValueError, match=f"shard_size={shard_size}"):
        check_shard_size(4, shard_size)
