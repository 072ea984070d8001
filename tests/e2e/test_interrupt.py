"""Interrupt and preemption through `adaptiveload-train` with real signals: SIGINT, SIGTERM and SLURM's requeue
signal stop the run after the step in progress with its state saved, and resuming from it trains the same
batches (sample ids) with the same losses as a run that was never stopped, on one rank and on two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gloo_ranks import init_rank, spawn

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
MAX_STEPS = 6


def _command(out: Path, record: Path, devices: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "lightning_adaptiveload.train", f"++trainer.max_steps={MAX_STEPS}",
        f"trainer.devices={devices}", "trainer.enable_progress_bar=false", "logger=none", "print_plan=false",
        "~callbacks.shape_benchmark", "~callbacks.balance_monitor",
        "+callbacks.record._target_=step_record.StepRecord", f"+callbacks.record.path={record}",
        "+callbacks.record.slow_s=0.3", f"hydra.run.dir={out}", *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(HELPERS), str(ROOT)]), **extra}


def _rows(record: Path, rank: int = 0) -> list[dict]:
    path = Path(f"{record}.rank{rank}")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train_here(out: Path, record: Path, *extra: str, devices: int = 1) -> None:
    """The same run as `_command`, in this process at one rank and on ranks forked from it at two (its imports are
    loaded: seconds, not ~10 s a rank). No signal comes, so no step is slowed down for one to land mid-run."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from lightning_adaptiveload.cli.train import train

    overrides = [o for o in _command(out, record, devices, *extra)[3:]
                 if not o.startswith(("hydra.run.dir=", "+callbacks.record.slow_s="))]
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_adaptiveload.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    GlobalHydra.instance().clear()
    with open_dict(cfg):
        cfg.output_dir = cfg.hydra.runtime.output_dir = str(out)
    if devices == 1:
        train(cfg)
    else:
        spawn(_train_rank, devices, cfg, timeout=240)


def _train_rank(rank: int, world: int, port: int, cfg) -> None:
    """One forked rank of `_train_here`, started as `_interrupt` starts a run (no SLURM environment, in the folder
    above the run's), in a gloo process group that the run's DDP strategy uses as it is."""
    from lightning_adaptiveload.cli.train import train

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        del os.environ[key]
    os.chdir(Path(cfg.output_dir).parent)
    init_rank(rank, world, port)
    train(cfg)


def _interrupt(out: Path, record: Path, devices: int, signum: int, *extra: str, env: dict | None = None,
               after_step: int = 2) -> tuple[int, str]:
    """Start a run, send ``signum`` to its process once rank 0 has trained ``after_step`` steps; (rc, stderr)."""
    proc = subprocess.Popen(_command(out, record, devices, *extra), env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=out.parent)
    deadline = time.time() + 240
    while not any(row["step"] >= after_step for row in _rows(record)) and proc.poll() is None:
        assert time.time() < deadline, "no step marker in time"
        time.sleep(0.05)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=240)
    return proc.returncode, stdout + stderr


def _steps(*records: Path, rank: int = 0) -> list[tuple[int, list[int], float]]:
    return [(row["step"], row["ids"], row["loss"]) for record in records for row in _rows(record, rank)]


def _saved_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


@pytest.mark.slow  # ~20-30 s on a 2-core CPU: two one-rank runs of adaptiveload-train, two in this process
def test_sigint_then_slurm_requeue_resume_exactly_on_one_rank(tmp_path, monkeypatch):
    _train_here(tmp_path / "ref", tmp_path / "ref")
    reference = _steps(tmp_path / "ref")
    assert [s for s, _, _ in reference] == list(range(1, MAX_STEPS + 1))

    # Ctrl-C: last.ckpt at the step boundary, exit 130, the resume command printed.
    rc, out = _interrupt(tmp_path / "a", tmp_path / "a", 1, signal.SIGINT)
    assert rc == 130, out[-3000:]
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    stopped = _steps(tmp_path / "a")
    assert _saved_step(last) == stopped[-1][0] < MAX_STEPS - 1
    assert f"stopped by SIGINT after step {stopped[-1][0]}" in out and f"ckpt_path={last}`" in out
    assert "Traceback" not in out

    # Under SLURM (faked environment, `scontrol` recording its arguments): Lightning's auto-requeue saves
    # hpc_ckpt_1.ckpt at the step boundary, requeues the job and the run exits 138 (128 + SIGUSR1).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.args"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    slurm = dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_JOB_ID="4242", SLURM_JOB_NAME="train",
                 SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost")
    env = _env(**slurm, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    rc, out = _interrupt(tmp_path / "b", tmp_path / "b", 1, signal.SIGUSR1, f"ckpt_path={last}", env=env,
                         after_step=stopped[-1][0] + 1)
    assert rc == 128 + signal.SIGUSR1, out[-3000:]
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    hpc = tmp_path / "b" / "hpc_ckpt_1.ckpt"
    requeued = _steps(tmp_path / "b")
    assert _saved_step(hpc) == requeued[-1][0] < MAX_STEPS

    # The requeued job: same environment and output dir, no ckpt_path; Lightning resumes from the hpc checkpoint.
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    _train_here(tmp_path / "b", tmp_path / "c")
    assert _steps(tmp_path / "a", tmp_path / "b", tmp_path / "c") == reference


@pytest.mark.slow  # ~15-25 s on a 2-core CPU: a two-rank run of adaptiveload-train, two on ranks forked from this process
def test_sigterm_on_two_ranks_stops_both_after_the_same_step_and_resumes_exactly(tmp_path):
    _train_here(tmp_path / "ref", tmp_path / "ref", devices=2)
    # One intra-op thread a rank, as the forked ranks (what Lightning's launcher sets on 2 cores).
    rc, out = _interrupt(tmp_path / "a", tmp_path / "a", 2, signal.SIGTERM,  # to rank 0's process only
                         env=_env(OMP_NUM_THREADS="1"))
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    step = _saved_step(last)
    assert [s for s, _, _ in _steps(tmp_path / "a", rank=1)][-1] == step == _steps(tmp_path / "a")[-1][0] < MAX_STEPS
    _train_here(tmp_path / "b", tmp_path / "b", f"ckpt_path={last}", devices=2)
    for rank in (0, 1):
        assert _steps(tmp_path / "a", tmp_path / "b", rank=rank) == _steps(tmp_path / "ref", rank=rank)
