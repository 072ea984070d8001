"""Ulysses sequence parallelism composed with activation checkpointing chosen per batch, on CPU gloo ranks.

Both are exact transformations of the training step, so together they must be too: a DDP run in which
two ranks share every batch (degree 2) and each batch recomputes as its own mode says trains the losses
and gradients of one process without either (fp32; relative 1e-5, and 1e-5 of the largest entry near
zero, as tests/parallel/test_ulysses.py). A probe counts what each step ran (attention kernels,
all-to-alls), so a mode that was set but not applied fails too. Then the product path: the shape
benchmark's tiers choose each batch's mode while the planner gives the batches their SP degree.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from gloo_ranks import assert_close, init_rank, perturb_, spawn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_adaptiveload.callbacks.sequence_parallel import UlyssesSequenceParallel
from lightning_adaptiveload.models.flow_matching import FlowMatchingModule
from lightning_adaptiveload.models.wan import WanAttentionBlock

SEED = 13
LAYERS = 2  # the "tiny" preset
# (token grid, batch size, data seed, mode): 15 tokens split 8 + 7, 16 split 8 + 8, 10 split 5 + 5.
STEPS = [((1, 3, 5), 2, 20, "selective"), ((2, 2, 4), 1, 21, "full"), ((1, 2, 5), 2, 22, "none")]


def _trainer(world: int, callbacks: list, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=world, strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, **kwargs,
    )


class _Counts(TorchDispatchMode):
    """Counts the attention kernels and all-to-alls that run, forward, recomputation and backward alike.

    Selective checkpointing returns the saved attention outputs without running the kernel again, full
    checkpointing runs it again, and both repeat the forward's exchanges; so the counts tell the modes
    apart by what ran, not by what a flag says.
    """

    def __init__(self) -> None:
        super().__init__()
        self.attention = 0
        self.all_to_all = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "scaled_dot_product" in name and "backward" not in name:
            self.attention += 1
        elif "alltoall" in name:
            self.all_to_all += 1
        return func(*args, **(kwargs or {}))


def _expected_counts(mode: str, degree: int) -> tuple[int, int]:
    """Attention kernels (self + cross per layer) and all-to-alls (q/k/v in, output back, the same in the
    backward, and the forward's again when recomputing) of one step."""
    attention = 2 * LAYERS * (2 if mode == "full" else 1)
    all_to_all = 0 if degree == 1 else 2 * LAYERS * (3 if mode != "none" else 2)
    return attention, all_to_all


class _Probe(pl.Callback):
    """Per training batch: the modes the blocks ran in, the counts of :class:`_Counts` (forward and backward;
    not with ``count=False``: dynamo compiles nothing under a dispatch mode), the returned loss and the
    gradient the optimizer applies (after DDP's all-reduce)."""

    def __init__(self, count: bool = True) -> None:
        self.count = count
        self.rows: list[dict] = []
        self._counts: _Counts | None = None
        self._modes: set[str] = set()

    def on_fit_start(self, trainer, pl_module):
        def seen(block, args):
            self._modes.add(block.checkpointing)

        for block in pl_module.model.modules():
            if isinstance(block, WanAttentionBlock):
                block.register_forward_pre_hook(seen)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._modes = set()
        self._counts = _Counts() if self.count else None
        if self._counts is not None:
            self._counts.__enter__()

    def on_after_backward(self, trainer, pl_module):
        counts = self._counts
        if counts is not None:
            counts.__exit__(None, None, None)
        self.rows.append({
            "step": trainer.global_step, "modes": sorted(self._modes),
            "counts": None if counts is None else (counts.attention, counts.all_to_all),
            "grads": {n: p.grad.clone() for n, p in pl_module.model.named_parameters()},
        })

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        b, s = pl_module.batch_shape(batch)
        self.rows[-1].update(loss=outputs["loss"].detach(), seq_len=s, batch_size=b,
                             sp_degree=batch.get("sp_degree", 1), index=batch["index"].tolist())


# ------------------------------------------------------------------------ exactness, mode switched per batch


class _ModeOfStep(pl.Callback):
    """Sets each batch's mode before it trains, as ShapeBenchmarkCallback.on_train_batch_start does."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mode = STEPS[batch_idx][3]
        if pl_module.checkpointing != mode:
            pl_module.set_checkpointing(mode)


def _module() -> FlowMatchingModule:
    torch.manual_seed(0)
    module = FlowMatchingModule("tiny", seed=SEED, lr=1e-3, activation_checkpointing="full")
    module.configure_model()
    perturb_(module.model)
    return module


def _batches(module: FlowMatchingModule) -> list[dict]:
    return [module.synthetic_batch(b, grid, seed=seed) for grid, b, seed, _ in STEPS]


def _sp_ranks(rank: int, world: int, port: int, out: str, compiled: bool = False) -> None:
    init_rank(rank, world, port)
    module = _module()
    if compiled:
        from torch._dynamo.testing import CompileCounterWithBackend

        # aot_eager runs AOTAutograd's partitioner, where the checkpoint policy is honoured, without inductor's
        # C++ build; fullgraph: a graph break (dynamo would run that code eagerly) is an error.
        counter = CompileCounterWithBackend("aot_eager")
        module.model.compile_blocks(backend=counter, fullgraph=True)
    batches = [{**batch, "sp_degree": 2} for batch in _batches(module)]
    probe = _Probe(count=not compiled)
    trainer = _trainer(world, [UlyssesSequenceParallel(degrees=[2]), _ModeOfStep(), probe], max_steps=len(STEPS))
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    torch.save(probe.rows, Path(out) / f"rows{rank}.pt")
    if compiled:
        torch.save(counter.frame_count, Path(out) / f"graphs{rank}.pt")


def _check_against_one_process(out: Path, compiled: bool) -> None:
    """Each rank's rows against the same batches trained by one process without SP, in mode 'none', eager."""
    module = _module()
    module.set_checkpointing("none")
    optimizer = module.configure_optimizers()
    expected = []
    for step, batch in enumerate(_batches(module)):
        optimizer.zero_grad(set_to_none=True)
        # A group draws the timesteps and noise of its first rank (0).
        loss = module.compute_loss(batch, module.noise_generator(rank=0, step=step))
        loss.backward()
        expected.append((loss.detach(), {n: p.grad.clone() for n, p in module.model.named_parameters()}))
        optimizer.step()
    for rank in (0, 1):
        rows = torch.load(out / f"rows{rank}.pt")
        assert [r["step"] for r in rows] == list(range(len(STEPS)))
        for (_, _, _, mode), row, (loss, grads) in zip(STEPS, rows, expected, strict=True):
            what = f"rank {rank}, step {row['step']} ({mode}, S={row['seq_len']})"
            assert row["modes"] == [mode], what
            if not compiled:
                assert row["counts"] == _expected_counts(mode, 2), what
            # training_step returns k x loss: DDP's mean over W = k = 2 ranks is then the batch's gradient.
            assert_close(row["loss"], 2 * loss, f"{what}: loss")
            for name, g in grads.items():
                assert_close(row["grads"][name], g, f"{what}: grad of {name}")


@pytest.mark.slow  # 2 s on a 2-core CPU under load: off the quick path
def test_sp_and_per_batch_checkpointing_modes_train_what_one_process_trains(tmp_path):
    """Degree 2 on two ranks, each batch in its own mode (selective, full, none): every step's loss and
    every parameter's DDP-averaged gradient equal one process without SP and without checkpointing."""
    spawn(_sp_ranks, 2, str(tmp_path))
    _check_against_one_process(tmp_path, compiled=False)


@pytest.mark.slow  # 35-65 s on a 2-core CPU: three block graphs per rank
def test_compiled_blocks_with_sp_and_per_batch_modes_train_what_eager_one_process_trains(tmp_path):
    """The same run with compiled blocks (aot_eager, whole graphs): a checkpointed block meeting its second
    sequence length (16 after 15 tokens) compiles with symbolic split sizes, where the exchanges' backward
    once failed to compile. One graph per mode."""
    # Block graphs an earlier test compiled are not this run's. Reset here, not in the forks: what it frees
    # may hold that test's process group (see gloo_ranks.spawn).
    torch._dynamo.reset()
    spawn(_sp_ranks, 2, str(tmp_path), True)
    _check_against_one_process(tmp_path, compiled=True)
    # selective (static sizes), full (a new mode and symbolic sizes), none (a new mode).
    assert [torch.load(tmp_path / f"graphs{rank}.pt") for rank in (0, 1)] == [3, 3]


# ------------------------------------------------------------------- the product: tiers and the SP planner

M_MEM = 100  # tokens one rank holds: the 120-token clips fit no single rank
# The calibration's tiers: 'none' up to 64 tokens, 'selective' up to 72, 'full' up to M_MEM (and above it).
TIERS = [("none", 64, 1.0), ("selective", 72, 1.25), ("full", M_MEM, 1.4)]
# a + B·(c1·S + c2·S²): 64 tokens at B = 1 take 0.048 s, 16 tokens at B = 6 0.026 s.
COST = {"a": 0.001, "c1": 1e-4, "c2": 1e-5}
# Batches predicted above 0.035 s train on an SP group of 2 (the planner's time rule): 64 and 72 tokens
# by time, 120 by memory; 16 data parallel.
SP = {"degrees": [2], "num_heads": 4, "ranks_per_node": 2, "target_step_time": 0.035, "tolerance": 0.0,
      "patch_size": [1, 2, 2]}
NUM_SAMPLES = 24


def _write_calibration(path: Path) -> Path:
    from lightning_adaptiveload.calibration.costmodel import CostModel
    from lightning_adaptiveload.calibration.derive import ModeTier
    from lightning_adaptiveload.calibration.profile import Measurement
    from lightning_adaptiveload.calibration.record import Calibration

    cost = CostModel("quadratic", COST)
    measurements = [Measurement(1, (1, 4, 4), 16, float(cost.predict(1, 16)), None, "ok", 3, 0.1, mode="none")]
    extra = {"checkpointing": {"tiers": [ModeTier(m, s, scale).to_dict() for m, s, scale in TIERS],
                               "base_mode": "none", "modes": [m for m, _, _ in TIERS]}}
    path.write_text(Calibration({"model": "tiny"}, cost, measurements, extra=extra).to_json())
    return path


def _dataset():
    from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

    return SyntheticMixedDataset(NUM_SAMPLES, "tiny", text_len=16, text_dim=32, seed=1)


def _product_ranks(rank: int, world: int, port: int, out: str) -> None:
    from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
    from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

    init_rank(rank, world, port)
    torch.manual_seed(0)
    module = FlowMatchingModule("tiny", seed=SEED, activation_checkpointing="auto")
    # The shape benchmark replaces this policy with the calibration's tiered one.
    dm = AdaptiveLoadDataModule(_dataset(), DualConstraintPolicy(M_MEM, 1e9), seed=3, print_plan=False,
                                sequence_parallel=SP)
    bench = ShapeBenchmarkCallback(calibration=_write_calibration(Path(out) / f"pinned{rank}.json"), m_mem=M_MEM,
                                   save_dir=Path(out) / f"bench{rank}")
    probe = _Probe()
    trainer = _trainer(world, [bench, UlyssesSequenceParallel(degrees=[2]), probe], max_epochs=1,
                       default_root_dir=out)
    trainer.fit(module, datamodule=dm)
    for row in probe.rows:
        del row["grads"]
    torch.save({"rows": probe.rows, "tiers": [(m, s) for m, s, _ in dm.policy.tiers],
                "degrees": {row["seq_len"]: row["sp_degree"] for row in dm.bucket_table()}},
               Path(out) / f"product{rank}.pt")


@pytest.mark.slow  # 5 s on a 2-core CPU under load: off the quick path
def test_tiers_choose_each_batchs_mode_while_the_planner_gives_its_sp_degree(tmp_path):
    """Two ranks through the Trainer with ShapeBenchmarkCallback (a pinned calibration whose tiers give
    'none', 'selective' and 'full' to different buckets) and UlyssesSequenceParallel: every batch trains in
    its tier's mode and with the degree the planner gave its bucket, SP batches in each of the three modes."""
    spawn(_product_ranks, 2, str(tmp_path))
    got = [torch.load(tmp_path / f"product{rank}.pt") for rank in (0, 1)]
    seq = _dataset().token_grids().prod(axis=1)
    assert sorted(set(seq.tolist())) == [16, 64, 72, 120]
    mode_of = {16: "none", 64: "none", 72: "selective", 120: "full"}
    degree_of = {16: 1, 64: 2, 72: 2, 120: 2}
    for rank in (0, 1):
        assert got[rank]["tiers"] == [("none", 64), ("selective", 72), ("full", M_MEM)]
        assert got[rank]["degrees"] == degree_of  # the planner's bucket plan (S -> SP degree)
    rows0, rows1 = got[0]["rows"], got[1]["rows"]
    assert len(rows0) == len(rows1)
    trained, combos = [], set()
    for r0, r1 in zip(rows0, rows1, strict=True):
        assert r0["step"] == r1["step"] and r0["sp_degree"] == r1["sp_degree"]
        for row in (r0, r1):
            s, mode = row["seq_len"], mode_of[row["seq_len"]]
            what = f"step {row['step']}: S={s}, B={row['batch_size']}"
            assert row["sp_degree"] == degree_of[s], what
            assert row["modes"] == [mode], what
            assert row["counts"] == _expected_counts(mode, row["sp_degree"]), what
            combos.add((mode, row["sp_degree"]))
        if r0["sp_degree"] == 2:
            assert r0["index"] == r1["index"] and torch.equal(r0["loss"], r1["loss"])
            trained += r0["index"]
        else:
            trained += r0["index"] + r1["index"]
    assert combos == {("none", 1), ("none", 2), ("selective", 2), ("full", 2)}
    assert sorted(trained) == list(range(NUM_SAMPLES))  # every sample once in the epoch
