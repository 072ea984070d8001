"""The closed loop through a real Trainer: training's step times correct the calibration and re-plan.

The module's step sleeps a known time t(B, S) = a + b·B·S, so the profile measures exactly that;
training then pays more (``extra``: an optimizer step the profiled forward + backward does not see) or a uniform factor (``scale``: a power cap). Sleeps keep the timings far above
the CPU's noise.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset

from lightning_adaptiveload.bucketing.buckets import count_buckets
from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy, EqualTokenPolicy
from lightning_adaptiveload.calibration import record
from lightning_adaptiveload.calibration.derive import predict_policy
from lightning_adaptiveload.calibration.feedback import REPLAN_GAIN
from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor
from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

A, B_S = 0.0005, 4e-5  # profiled: 0.5 ms per step + 40 µs per token (the 1% rule stops below the memory cap)
GRIDS = np.array([(1, 4, 4), (1, 8, 8), (3, 8, 8), (5, 8, 8)])
SEQ = np.unique(GRIDS.prod(axis=1))
N = 300
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")


class Grids(Dataset):
    def __init__(self) -> None:
        self.grids = GRIDS[np.random.default_rng(0).integers(0, len(GRIDS), N)]

    def __len__(self) -> int:
        return N

    def token_grids(self) -> np.ndarray:
        return self.grids

    def __getitem__(self, i: int) -> dict:
        f, h, w = (int(v) for v in self.grids[i])
        return {"latents": torch.zeros(2, f, h, w), "context": torch.zeros(1, 2), "index": i}


class SleepModule(LightningModule):
    def __init__(self, extra: float = 0.0, scale: float = 1.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.extra, self.scale = extra, scale

    def batch_shape(self, batch) -> tuple[int, int]:
        b, _, f, h, w = batch["latents"].shape
        return b, f * h * w

    def synthetic_batch(self, batch_size, grid, device=None):
        return {"latents": torch.zeros(batch_size, 2, *grid, device=device)}

    def compute_loss(self, batch, scale: float = 1.0):
        b, s = self.batch_shape(batch)
        time.sleep((A + B_S * b * s) * scale)
        return self.layer(batch["latents"].mean(dim=(2, 3, 4))).pow(2).mean()

    def training_step(self, batch, batch_idx):
        return self.compute_loss(batch, self.scale)

    def configure_optimizers(self):
        return SlowSGD(self.parameters(), lr=0.01, extra=self.extra)


class SlowStart(SleepModule):
    """Optimizer steps before training step ``until`` take ``extra`` seconds more (time the profile does not
    see, as :class:`SlowSGD`, but a transient: a noisy neighbour, a cold cache)."""

    def __init__(self, extra: float, until: int) -> None:
        super().__init__()
        self.slow, self.until = extra, until

    def configure_optimizers(self):
        module = self

        class TransientSGD(torch.optim.SGD):
            def step(self, closure=None):
                loss = super().step(closure)
                if module.trainer.global_step < module.until:
                    time.sleep(module.slow)
                return loss

        return TransientSGD(self.parameters(), lr=0.01)


class SlowSGD(torch.optim.SGD):
    """An optimizer step that takes ``extra`` seconds (a large model's AdamW): time the profile does not see."""

    def __init__(self, params, lr: float, extra: float) -> None:
        super().__init__(params, lr=lr)
        self.extra = extra

    def step(self, closure=None):
        loss = super().step(closure)
        time.sleep(self.extra)
        return loss


class Seen(Callback):
    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append((trainer.datamodule.sampler.epoch, batch["index"].tolist()))


def _fit(tmp_path, module, *, ckpt=None, every=10, confirm=1, callbacks=(), **limits):
    """A fit with the closed loop; ``confirm=1`` (not the default 2) re-plans at the first check that calls
    for it, so the re-plan mechanics (resume, kill, world size) are tested at a known step."""
    seen = Seen()
    bench = ShapeBenchmarkCallback(max_shapes=4, batch_sizes=[1, 16], repeats=3, warmup=1, m_mem=2048,
                                   save_dir=tmp_path, closed_loop_every_n_steps=every, closed_loop_min_steps=3,
                                   closed_loop_confirm=confirm, cache_dir=tmp_path / "cache")
    monitor = BalanceMonitor(print_report=False, synchronize=False)
    dm = AdaptiveLoadDataModule(Grids(), DualConstraintPolicy(2048, 1.0, 1.0), seed=2, print_plan=False)
    limits.setdefault("devices", 1)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", logger=False, use_distributed_sampler=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[bench, monitor, seen, *callbacks], enable_checkpointing=bool(callbacks), **limits)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    return bench, monitor, seen, dm


def _per_epoch(*runs: Seen) -> dict[int, Counter]:
    out: dict[int, Counter] = defaultdict(Counter)
    for seen in runs:
        for epoch, batch in seen.batches:
            out[epoch].update(batch)
    return out


@pytest.mark.slow  # 9 s on a 2-core CPU under load: off the quick path
def test_an_overhead_the_profile_did_not_see_re_plans_to_larger_batches(tmp_path):
    bench, monitor, seen, dm = _fit(tmp_path, SleepModule(extra=0.03), confirm=2, max_epochs=2)
    replans = [(step, d, at) for step, d, at in bench.decisions if at is not None]
    assert replans, [d.summary() for _, d, _ in bench.decisions]
    step, decision, at = replans[0]
    # The default closed_loop_confirm=2: the re-plan comes at the second of two checks that both call for it.
    wanted = [i for i, (_, d, _) in enumerate(bench.decisions) if d.replan]
    first = next(i for i, (s, _, _) in enumerate(bench.decisions) if s == step)
    assert first >= 1 and first - 1 in wanted and bench.decisions[first - 1][2] is None
    assert decision.gain >= 0.03 and all(new > old for old, new in decision.batch_changes.values())
    assert bench.source.startswith("corrected from")
    # After correction the model predicts training's steps.
    ratios = [r["measured_over_predicted"] for r in monitor.per_shape() if r["steps"] >= 3 and "cycle_s" in r]
    assert ratios and all(0.85 < r < 1.15 for r in ratios), ratios
    # Every sample exactly once in each epoch, the re-planned one included.
    for epoch, counts in _per_epoch(seen).items():
        assert set(counts) == set(range(N)) and sum(counts.values()) == N, epoch
    # The corrected calibration replaced the cache entry, marked with where it came from.
    cached = list((tmp_path / "cache").rglob("*.json"))
    assert cached and '"corrected"' in cached[0].read_text()


@pytest.mark.slow  # 2 x 3 s on a 2-core CPU: off the quick path
def test_a_transient_slow_start_is_not_re_planned_on_unless_the_next_check_agrees(tmp_path):
    # Steps 0-11 pay 30 ms more: the check at step 16 sees mostly slow steps and calls for larger batches;
    # by step 32 most steps were fast and the call is gone, so with the default confirm=2 nothing re-plans.
    # Real sleeps on a shared CPU: a later check's call near the 3% threshold is noise one run in several (seen
    # once in a whole-suite run), so the run gets a second try; with the rule broken (one call re-plans) the
    # first check's call re-plans in both.
    for attempt in range(2):
        bench, _, seen, dm = _fit(tmp_path / f"two{attempt}", SlowStart(extra=0.03, until=12), every=16, confirm=2,
                                  max_steps=64)
        assert bench.decisions[0][1].replan, [d.summary() for _, d, _ in bench.decisions]
        if not any(d.replan for _, d, _ in bench.decisions[1:]):
            break
    assert not any(d.replan for _, d, _ in bench.decisions[1:]), [d.summary() for _, d, _ in bench.decisions]
    assert all(at is None for _, _, at in bench.decisions) and not dm.sampler.replans
    # One check's call alone re-plans with confirm=1: what the default guards against.
    one, _, _, dm1 = _fit(tmp_path / "one", SlowStart(extra=0.03, until=12), every=16, confirm=1, max_steps=32)
    assert one.decisions[0][2] is not None and dm1.sampler.replans


def test_the_check_is_computed_off_the_training_thread_and_applied_at_the_next_step(tmp_path, monkeypatch, caplog):
    # The comparison waits until training has taken another step: on the training thread that never happens
    # (the step cannot advance while its own hook runs) and the wait times out.
    import threading

    from lightning_adaptiveload.calibration import feedback

    compare, trainers, seen = feedback.compare, [], []

    def slow_compare(*args, **kwargs):
        # Until training has gone past the check's step (10). Not "past the step seen here": on a slow machine the
        # thread can start after step 11 was taken, and training then waits for the check at step 12.
        trainer = trainers[0]
        taken = trainer.global_step
        deadline = time.monotonic() + 3.0
        while trainer.global_step <= 10 and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append((threading.current_thread() is threading.main_thread(), taken, trainer.global_step))
        return compare(*args, **kwargs)

    class Grab(Callback):
        def on_fit_start(self, trainer, pl_module):
            trainers.append(trainer)

    monkeypatch.setattr(feedback, "compare", slow_compare)
    with caplog.at_level(logging.INFO):
        # One check (step 10), inside epoch 0: at an epoch's end training waits for a check (the next test).
        bench, _, _, dm = _fit(tmp_path, SleepModule(), every=10, max_steps=15, callbacks=[Grab()])
    assert dm.sampler.epoch == 0
    assert seen and all(not main and after > 10 for main, _, after in seen), seen
    assert [step for step, _, _ in bench.decisions] == [10]
    lines = [r.getMessage() for r in caplog.records if "on a background thread" in r.getMessage()]
    assert [line.split("applied at step ")[1].split(";")[0] for line in lines] == ["11"], lines


@pytest.mark.parametrize("hook", ["on_train_epoch_end", "on_validation_start"])
def test_a_check_still_computing_is_waited_for_before_dataloaders_fork(hook):
    # A new epoch or a validation run forks the DataLoader's workers; the background computation must not be
    # inside numpy or scipy then. The decision itself is still applied at the next training step.
    from concurrent.futures import ThreadPoolExecutor

    bench = ShapeBenchmarkCallback()
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(time.sleep, 0.3)
        bench._pending = (7, future)
        getattr(bench, hook)(None, None)
        assert future.done() and bench._pending == (7, future)


def test_closed_loop_confirm_must_be_a_positive_integer():
    with pytest.raises(ValueError, match=r"closed_loop_confirm=0.*positive integer"):
        ShapeBenchmarkCallback(closed_loop_confirm=0)


@pytest.mark.slow  # 4 s on a 2-core CPU under load: off the quick path
def test_a_uniform_slowdown_corrects_predictions_but_changes_no_batch_size(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        bench, monitor, _, dm = _fit(tmp_path, SleepModule(scale=1.3), max_steps=60)
    assert bench.decisions and all(at is None and not d.replan for _, d, at in bench.decisions), [
        d.summary() for _, d, _ in bench.decisions]
    assert not dm.sampler.replans and not bench.source.startswith("corrected")
    step, decision, _ = bench.decisions[-1]
    before, after = decision.ratio_before, decision.ratio_after
    assert np.median(before) > 1.2 and 0.9 < np.median(after) < 1.1, (before, after)
    # The gain over equal-token batches under the corrected model: the equal-token epoch (B = m_mem // S,
    # dealt at random) simulated under the corrected cost model, beside the running plan's.
    corrected = decision.corrected.cost_model
    grids, counts = count_buckets(Grids().token_grids())
    base = predict_policy(EqualTokenPolicy(decision.derivation.m_mem), corrected, grids, counts,
                          decision.derivation.m_mem, world_size=1, balance="none", seed=dm.seed)
    assert decision.gain_over_baseline(replanned=False) == pytest.approx(decision.old_tokens_per_s / base["tokens_per_s"] - 1, rel=1e-9)
    # A uniform slowdown scales both epochs alike: the gain stays the one the profile predicted, up to the
    # sleeps' timing noise (well within the re-plan threshold).
    start = bench.derivation.predicted["tokens_per_s"] / bench.derivation.baseline["tokens_per_s"] - 1
    assert decision.gain_over_baseline(replanned=False) == pytest.approx(start, abs=REPLAN_GAIN)
    line = next(r.getMessage() for r in caplog.records if "against equal-token batches" in r.getMessage())
    assert f"this plan trains at {decision.gain_over_baseline(replanned=False):+.1%} tokens/s" in line
    assert f"corrected at step {step}" in line and f"started with predicted {start:+.1%}" in line
    # The cache keeps the correction with the plan that ran; the next run trains that plan again (no batch
    # size changes to weigh), from its calibration, and predicts its steps with the correction from step 1.
    cached = record.read_cache(tmp_path / "cache", bench.calibration.key)
    assert cached.extra["provenance"]["source"] == "corrected"
    assert cached.extra["feedback"]["trained"]["calibration"] == bench.calibration.to_json()
    again, monitor, _, dm = _fit(tmp_path, SleepModule(scale=1.3), every=1000, max_steps=15)
    assert again.source == "cache" and again.calibration.to_json() == bench.calibration.to_json()
    assert np.array_equal(dm.policy.batch_sizes(SEQ), bench.policy.batch_sizes(SEQ))
    ratios = [r["measured_over_predicted"] for r in monitor.per_shape() if r["steps"] >= 3 and "cycle_s" in r]
    assert ratios and all(0.9 < r < 1.1 for r in ratios), ratios


@pytest.mark.slow  # 9 s on a 2-core CPU under load: off the quick path
def test_resume_after_a_re_plan_continues_it_exactly(tmp_path):
    every, stop = 10, 14  # the re-plan at step 10, the checkpoint inside the same epoch
    saver = ModelCheckpoint(dirpath=tmp_path / "c", filename="{step}", every_n_train_steps=stop, save_top_k=-1)
    bench, _, first, _ = _fit(tmp_path / "a", SleepModule(extra=0.03), every=every, callbacks=[saver],
                              max_steps=stop)
    assert any(at is not None for _, _, at in bench.decisions)
    ckpt = torch.load(tmp_path / f"c/step={stop}.ckpt", weights_only=False)
    assert any(len(seg) == 3 for seg in ckpt["AdaptiveLoadDataModule"]["sampler"]["segments"])
    resumed_bench, _, rest, resumed_dm = _fit(tmp_path / "b", SleepModule(extra=0.03), every=every,
                                              ckpt=tmp_path / f"c/step={stop}.ckpt", max_epochs=2)
    # The checkpoint's corrected calibration and policy, not a new profile: the plan continues as saved.
    assert resumed_bench.source == "checkpoint" or resumed_bench.source.startswith("corrected")
    assert resumed_bench.calibration.extra["provenance"]["source"] == "corrected"
    # Every sample once in the re-planned epoch 0 across the two runs, and once in epoch 1.
    for epoch, counts in _per_epoch(first, rest).items():
        assert set(counts) == set(range(N)) and sum(counts.values()) == N, epoch


_KILLED_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from test_closed_loop import SleepModule, _fit

class Tape(Callback):  # every batch with its step, on disk before the next step starts
    def __init__(self, path):
        self.file = open(path, "a")
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.file.write(json.dumps([trainer.global_step, trainer.datamodule.sampler.epoch,
                                    batch["index"].tolist()]) + "\\n")
        self.file.flush()

saver = ModelCheckpoint(dirpath={ckpts!r}, filename="{{step}}", every_n_train_steps={save}, save_top_k=-1)
_fit(__import__("pathlib").Path({work!r}), SleepModule(extra=0.03), every=10, callbacks=[saver, Tape({tape!r})],
     max_epochs=2)
"""


@pytest.mark.slow  # ~20 s on a 2-core CPU: a training process killed after its re-plan, then the resume
def test_sigkill_after_a_re_plan_then_resume_keeps_every_sample_once(tmp_path):
    # A real kill -9 (no handler runs, nothing is flushed): the resume from the last checkpoint written after
    # the re-plan repeats the steps after it, and the samples of those steps are drawn again, exactly once.
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    save, tape, ckpts = 13, tmp_path / "tape.jsonl", tmp_path / "c"
    script = _KILLED_RUN.format(tests=str(Path(__file__).parent), ckpts=str(ckpts), save=save, work=str(tmp_path / "a"),
                                tape=str(tape))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            rows = [json.loads(line) for line in tape.read_text().splitlines()] if tape.exists() else []
            if (ckpts / f"step={save}.ckpt").exists() and rows and rows[-1][0] >= save + 4:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    rows = [json.loads(line) for line in tape.read_text().splitlines() if line.endswith("]")]
    assert rows[-1][0] > save  # it trained past the checkpoint: those steps are lost with the process
    ckpt = torch.load(ckpts / f"step={save}.ckpt", weights_only=False)
    assert any(len(seg) == 3 for seg in ckpt["AdaptiveLoadDataModule"]["sampler"]["segments"])  # re-planned before
    _, _, rest, _ = _fit(tmp_path / "b", SleepModule(extra=0.03), every=10, ckpt=ckpts / f"step={save}.ckpt",
                         max_epochs=2)
    before = Seen()
    before.batches = [(epoch, batch) for step, epoch, batch in rows if step <= save]
    for epoch, counts in _per_epoch(before, rest).items():
        assert set(counts) == set(range(N)) and sum(counts.values()) == N, epoch
    assert set(_per_epoch(before, rest)) == {0, 1}


_KILLED_RUN_2_RANKS = """
import dataclasses, json, os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from test_closed_loop import SleepModule, _fit
from lightning_adaptiveload.calibration import feedback
compare = feedback.compare  # re-plan at step 10 whatever the machine's timings (its batch sizes may or may not change:
feedback.compare = lambda *a, **k: dataclasses.replace(compare(*a, **k), replan=True)  # the plan is dealt again)

class Tape(Callback):  # every batch of this rank with its step, on disk before the next step starts
    def __init__(self, path):
        self.path, self.file = path, None
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.file is None:
            self.file = open(f"{{self.path}}.{{trainer.global_rank}}", "a")
            Path(f"{{self.path}}.{{trainer.global_rank}}.pid").write_text(str(os.getpid()))
        self.file.write(json.dumps([trainer.global_step, trainer.datamodule.sampler.epoch,
                                    batch["index"].tolist()]) + "\\n")
        self.file.flush()
        if trainer.global_step > {save}:  # wait here, one step after the checkpoint, for the kill (a busy
            time.sleep(30)                # machine's poller can be late by more than the epoch's last steps)

saver = ModelCheckpoint(dirpath={ckpts!r}, filename="{{step}}", every_n_train_steps={save}, save_top_k=-1)
_fit(Path({work!r}), SleepModule(extra=0.03), every=10, callbacks=[saver, Tape({tape!r})], max_epochs=2,
     devices=2, strategy="ddp")
"""


@pytest.mark.slow  # ~25 s on a 2-core CPU: two gloo ranks killed after their re-plan, then a resume on one process
def test_two_ranks_killed_after_a_re_plan_resume_on_one_process_and_keep_every_sample_once(tmp_path):
    # torchrun starts 2 CPU ranks (DDP over gloo). The closed loop re-plans both at step 10 (applied from step 11),
    # a checkpoint follows at step 12, and the whole process group is killed with SIGKILL one step later. Epoch 0
    # is 14-17 steps at W = 2 after the re-plan, depending on the machine's timings (the corrected batch sizes
    # depend on them), so the checkpoint is inside epoch 0. The resume runs on ONE process (another world size):
    # the samples the two ranks drew up to step 12 plus those the resume draws are every sample once, in epoch 0
    # and in epoch 1, apart from the planner's counted padding at W = 2 (drop_last=False).
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    save, tape, ckpts = 12, tmp_path / "tape", tmp_path / "c"
    script = tmp_path / "run.py"
    script.write_text(_KILLED_RUN_2_RANKS.format(tests=str(Path(__file__).parent), ckpts=str(ckpts), save=save,
                                                 work=str(tmp_path / "a"), tape=str(tape)))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                            "WORLD_SIZE", "NODE_RANK")}  # fmt: skip
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own process group (torchrun's ranks start their own)

    def rows(rank: int) -> list:
        path = Path(f"{tape}.{rank}")
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("]")] if path.exists() else []

    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (ckpts / f"step={save}.ckpt").exists() and all(rows(r) and rows(r)[-1][0] > save for r in (0, 1)):
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-3000:]}"
    finally:
        # torchrun starts each rank in a session of its own: a SIGKILL to torchrun alone would leave them training.
        for pid in [int(p.read_text()) for p in tmp_path.glob("tape.*.pid")] + [-proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    tapes = {r: rows(r) for r in (0, 1)}
    seen = {r: [(step, epoch) for step, epoch, _ in t] for r, t in tapes.items()}
    assert all(t[-1][0] > save and (save, 0) in seen[r] for r, t in tapes.items()), f"killed after a checkpoint inside epoch 0: {seen}"
    ckpt = torch.load(ckpts / f"step={save}.ckpt", weights_only=False)
    segments = ckpt["AdaptiveLoadDataModule"]["sampler"]["segments"]
    said = [line for line in proc.stderr.read().decode().splitlines() if "step 10" in line]
    assert any(len(seg) == 3 and seg[0] == 2 for seg in segments), said  # re-planned at W = 2 before the checkpoint
    bench, _, rest, dm = _fit(tmp_path / "b", SleepModule(extra=0.03), every=10, ckpt=ckpts / f"step={save}.ckpt",
                              max_epochs=2)
    assert dm.sampler.num_replicas == 1 and bench.calibration.extra["provenance"]["source"] == "corrected"
    drawn = [(epoch, batch) for r in (0, 1) for step, epoch, batch in tapes[r] if step <= save] + rest.batches
    assert {epoch for epoch, _ in drawn} == {0, 1} and any(epoch == 0 for epoch, _ in rest.batches)  # resumed mid-epoch 0
    for epoch in (0, 1):
        batches = Counter(tuple(sorted(b)) for e, b in drawn if e == epoch)
        counts = Counter(i for b, n in batches.items() for i in b * n)
        assert set(counts) == set(range(N)), epoch  # every sample drawn
        # Repeats are the planner's counted padding only: a whole batch dealt twice so that both ranks of a
        # W = 2 plan take the same number of steps (at most one per W = 2 plan: the old one and the re-plan).
        copies = {b: n - 1 for b, n in batches.items() if n > 1}
        assert sum(copies.values()) <= 2, (epoch, copies)
        assert sum(counts.values()) - N == sum(len(b) * k for b, k in copies.items()), epoch


_TWO_RANKS = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
from test_closed_loop import SleepModule, _fit

calls = []
decide = ShapeBenchmarkCallback._decide
ShapeBenchmarkCallback._decide = staticmethod(lambda *a, **k: calls.append(1) or decide(*a, **k))
bench, _, _, dm = _fit(Path({work!r}), SleepModule(extra=0.03), every=10, max_steps=24, devices=2, strategy="ddp")
rank = dm.trainer.global_rank
Path({out!r} + f".{{rank}}").write_text(json.dumps(
    {{"computed": len(calls), "decisions": [[step, d.replan, at] for step, d, at in bench.decisions],
      "source": bench.source, "segments": dm.sampler.state_dict()["segments"]}}, default=str))
from lightning_adaptiveload.cli.train import release_process_group
release_process_group()
"""


@pytest.mark.slow  # ~20 s on a 2-core CPU: two gloo ranks through a re-plan
def test_two_ranks_apply_rank_0s_decision_and_only_rank_0_computes_it(tmp_path):
    # The refit and comparison run on rank 0 alone (on a CPU job the ranks share the cores a second
    # computation would take); every rank applies the same broadcast decision at the same step.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "rank"
    script = tmp_path / "run.py"
    script.write_text(_TWO_RANKS.format(tests=str(Path(__file__).parent), work=str(tmp_path / "a"), out=str(out)))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                            "WORLD_SIZE", "NODE_RANK")}  # fmt: skip
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    # (Whether a check re-plans depends on the machine's timings; the 2-rank killed run covers a re-plan.)
    assert ranks[0]["computed"] == len(ranks[0]["decisions"]) >= 1 and ranks[1]["computed"] == 0
    assert ranks[0]["decisions"] == ranks[1]["decisions"]
    assert ranks[0]["source"] == ranks[1]["source"] and ranks[0]["segments"] == ranks[1]["segments"]


def test_a_failure_on_rank_0_is_raised_on_every_rank_not_skipped(tmp_path, monkeypatch):
    # A bug in the check (not a fit that cannot correct) must not pass silently, nor leave the other ranks
    # waiting: the broadcast outcome makes every rank raise with the cause.
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(ShapeBenchmarkCallback, "_decide", staticmethod(broken))
    with pytest.raises(RuntimeError, match=r"closed loop failed on rank 0 \(KeyError: 'boom'\).*closed_loop=false"):
        _fit(tmp_path, SleepModule(extra=0.03), every=10, max_steps=14)
