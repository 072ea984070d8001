"""End-to-end benchmark of the plugin as users run it: ``adaptiveload-train``'s config, Trainer, callbacks.

Each configuration is one ``adaptiveload-train`` run (the Hydra config composed with overrides, then
``lightning_adaptiveload.train.build`` and ``Trainer.fit``), from the same seed, on the same
synthetic Wan corpus, for the same number of steps:

- ``equal_token``      ``bucketing=equal_token`` with ``max_tokens = M_mem``, batches dealt at random;
- ``dual``             the dual-constraint policy the shape benchmark derives, dealt at random
                       (the paper's sampler, ``bucketing.balance=none``);
- ``dual_cost``        the same with cost-balanced steps (``bucketing.balance=cost``);
- ``dual_cost_fused``  ``dual_cost`` with ``model.compile=true`` and the fused AdaLN callback
                       (``callbacks=gpu``).

Per-rank step, forward and compute times, tokens, model FLOPs and peak memory come from the
project's ``BalanceMonitor`` (its first ``--warmup`` steps are left out); the shape benchmark's
profiling time from its calibration record. The simulator's prediction for the same world size and
fitted cost model is stored next to each measurement.

The full depth of the preset (all 30 blocks of Wan 2.1 1.3B) is the default; ``--blocks N`` runs
fewer, and the output says so. Launch with the devices Lightning should use::

    python benchmarks/bench_e2e.py --devices 1       # appends a record to benchmarks/results/e2e.json
    python benchmarks/bench_e2e.py --model tiny --mixture tiny --accelerator cpu --devices 1 \\
        --steps 3 --warmup 1 --out /tmp/e2e_tiny.json                                    # CPU smoke

Appends a record (hardware, commit, date, result) to the JSON result file ``--out`` (on rank 0) and prints
a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "dual_cost": {"label": "(c) dual constraint + cost-balanced steps", "bucketing": "dual_constraint",
                  "balance": "cost", "fused": False},
    "dual": {"label": "(b) dual constraint, dealt at random (paper)", "bucketing": "dual_constraint",
             "balance": "none", "fused": False},
    "dual_cost_fused": {"label": "(d) (c) + compiled blocks + fused AdaLN", "bucketing": "dual_constraint",
                        "balance": "cost", "fused": True, "compile": True},
    "equal_token": {"label": "(a) equal-token, dealt at random", "bucketing": "equal_token", "balance": "none",
                    "fused": False},
}
# Order of the table; runs go in CONFIGS order (the first dual run profiles, equal_token needs its M_mem).
TABLE_ORDER = ("equal_token", "dual", "dual_cost", "dual_cost_fused")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="wan2_1_1_3b", help="conf/model choice")
    p.add_argument("--blocks", type=int, default=0,
                   help="run only this many transformer blocks (0: the preset's full depth); stated in the output")
    p.add_argument("--activation-checkpointing", choices=("true", "false"), default=None,
                   help="override model.activation_checkpointing (default: the model config's)")
    p.add_argument("--mixture", default="wan_480p", help="data.dataset.mixture")
    p.add_argument("--num-samples", type=int, default=20_000, help="data.dataset.num_samples")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {list(CONFIGS)}")
    p.add_argument("--steps", type=int, default=20, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=5, help="steps per configuration left out of the means")
    p.add_argument("--m-mem", type=int, default=65_520,
                   help="token budget per batch for every configuration (0: derived from measured memory)")
    p.add_argument("--accelerator", default="auto", help="trainer.accelerator")
    p.add_argument("--devices", type=int, default=1, help="trainer.devices")
    p.add_argument("--strategy", default=None, help="conf/strategy choice (default: auto, fsdp for >1 GPU)")
    p.add_argument("--profile-budget", type=float, default=120.0, help="shape benchmark time_budget_s")
    p.add_argument("--profile-repeats", type=int, default=2, help="shape benchmark repeats")
    p.add_argument("--calibration", default=None,
                   help="a calibration JSON to use instead of profiling (e.g. from an earlier run of this script)")
    p.add_argument("--workers", type=int, default=4, help="data.datamodule.num_workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--out", default=str(RESULTS / "e2e.json"), help="JSON result file (record appended)")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"--configs has unknown names {unknown}; expected a subset of {list(CONFIGS)}")
    for name in ("steps", "num_samples", "devices", "profile_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid; expected a positive integer")
    if args.warmup < 0 or args.blocks < 0 or args.m_mem < 0:
        p.error("--warmup, --blocks and --m-mem must be >= 0")
    return args


def _overrides(args: argparse.Namespace, name: str, out_dir: Path, m_mem: int | None,
               calibration: str | None) -> list[str]:
    c = CONFIGS[name]
    gpu = args.accelerator not in ("cpu",)
    ov = [
        f"model={args.model}", "data=synthetic_wan", f"data.dataset.mixture={args.mixture}",
        f"data.dataset.num_samples={args.num_samples}", f"data.datamodule.num_workers={args.workers}",
        f"data.datamodule.pin_memory={str(gpu).lower()}",
        f"trainer={'gpu' if gpu else 'cpu'}", f"trainer.accelerator={args.accelerator}",
        f"trainer.devices={args.devices}", f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false", "logger=none",
        f"seed={args.seed}", f"bucketing={c['bucketing']}", f"bucketing.balance={c['balance']}",
        f"callbacks={'gpu' if c['fused'] else 'default'}", "~callbacks.model_checkpoint",
        f"callbacks.balance_monitor.warmup_steps={args.warmup}", "callbacks.balance_monitor.log_every_n_steps=1000000",
        f"output_dir={out_dir / name}",
    ]
    if args.strategy:
        ov.append(f"strategy={args.strategy}")
    elif gpu and args.devices > 1:
        ov.append("strategy=fsdp")
    if not gpu:
        ov.append("trainer.precision=32-true")
    if args.blocks:
        ov.append(f"++model.model.num_layers={args.blocks}")
    if c.get("compile") and gpu:
        ov.append("model.compile=true")
    if args.activation_checkpointing is not None:
        ov.append(f"model.activation_checkpointing={args.activation_checkpointing}")
    if c["bucketing"] == "equal_token":
        ov.append(f"bucketing.policy.max_tokens={m_mem}")
    else:
        ov += [f"m_mem={m_mem if m_mem else 'null'}",  # the shape benchmark's budget (null: derived)
               f"callbacks.shape_benchmark.time_budget_s={args.profile_budget}",
               f"callbacks.shape_benchmark.repeats={args.profile_repeats}",
               f"callbacks.shape_benchmark.cache_dir={out_dir / 'calibration_cache'}",
               f"callbacks.shape_benchmark.save_dir={out_dir / name}"]
        if calibration:
            ov.append(f"callbacks.shape_benchmark.calibration={calibration}")
    return ov + list(args.override)


def _compose(overrides: list[str]):
    """The config ``adaptiveload-train <overrides>`` would run (``output_dir`` is among the overrides)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


class _LossRecorder:
    """Collects ``train/loss`` of every step (rank 0's)."""

    def __new__(cls):
        from lightning.pytorch import Callback

        class LossRecorder(Callback):
            def __init__(self):
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                self.losses.append(float(loss.detach().float().cpu()))

        return LossRecorder()


def _run(args: argparse.Namespace, name: str, out_dir: Path, m_mem: int | None, calibration: str | None,
         cost_model: Any) -> tuple[dict[str, Any], Any, Any]:
    import numpy as np

    from lightning_adaptiveload.calibration.simulate import simulate
    from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor
    from lightning_adaptiveload.callbacks.fused_adaln import FusedAdaLNCallback
    from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
    from lightning_adaptiveload.train import build

    overrides = _overrides(args, name, out_dir, m_mem, calibration)
    cfg = _compose(overrides)
    run = build(cfg)
    recorder = _LossRecorder()
    run.trainer.callbacks.append(recorder)
    if cost_model is not None and not any(isinstance(cb, ShapeBenchmarkCallback) for cb in run.trainer.callbacks):
        # The baseline keeps its own policy; its predicted compute uses the fitted model too.
        run.datamodule.set_cost_model(cost_model)
    t0 = time.perf_counter()
    run.trainer.fit(run.module, datamodule=run.datamodule)
    wall = time.perf_counter() - t0
    monitor = next(cb for cb in run.trainer.callbacks if isinstance(cb, BalanceMonitor))
    bench = next((cb for cb in run.trainer.callbacks if isinstance(cb, ShapeBenchmarkCallback)), None)
    fused = next((cb for cb in run.trainer.callbacks if isinstance(cb, FusedAdaLNCallback)), None)
    summary = monitor.summary()
    history = np.stack(monitor.history) if monitor.history else np.zeros((0, run.trainer.world_size, len(BalanceMonitor.FIELDS)))
    dm = run.datamodule
    world = run.trainer.world_size
    sim = simulate(dm.shapes, dm.policy, world, cost_model=dm.cost_model, balance=dm.balance, seed=args.seed)
    measured = summary.get("tokens_per_s", 0.0)
    out = {
        "label": CONFIGS[name]["label"],
        "overrides": overrides,
        "policy": repr(dm.policy),
        "balance": dm.balance,
        "summary": summary,
        "wall_s": wall,
        "profile_seconds": None if bench is None or not bench.profiled else bench.calibration.profile_seconds,
        "calibration_source": None if bench is None else bench.source,
        "m_mem": None if bench is None else bench.derivation.m_mem,
        "fused_modules": None if fused is None else fused.patched,
        "losses": recorder.losses,
        # [step, rank, field]: step_time, forward_time, compute, tokens, peak_mem, flops, data_wait.
        "per_step": history.tolist(),
        "simulated_tokens_per_s": sim.tokens_per_s,
        "simulation_error": (sim.tokens_per_s / measured - 1.0) if measured else None,
        "bucket_table": dm.sampler.bucket_table(),
    }
    return out, run, bench


def _table(result: dict[str, Any]) -> str:
    rows = ["| configuration | tokens/s | vs (a) | TFLOP/s per GPU | MFU | step-time CV | fwd CV | compute CV | "
            "bubble | peak GiB | simulated tokens/s (error) |", "|" + "---|" * 11]
    runs = result["runs"]
    base = runs.get("equal_token", {}).get("summary", {}).get("tokens_per_s")  # absent if it failed
    for name in TABLE_ORDER:
        if name not in runs:
            continue
        r = runs[name]
        if "error" in r:
            rows.append(f"| {r['label']} | failed: {r['error'][:120]} |" + " |" * 9)
            continue
        s = r["summary"]
        tps = s.get("tokens_per_s", 0.0)
        gain = f"{tps / base - 1:+.1%}" if base else "-"
        mfu = f"{s['mfu']:.1%}" if "mfu" in s else "-"
        tfl = f"{s['tflops_per_gpu']:.3g}" if "tflops_per_gpu" in s else "-"
        err = r["simulation_error"]
        rows.append(
            f"| {r['label']} | {tps:,.0f} | {gain} | {tfl} | {mfu} | {s.get('step_time_cv', 0):.1%} | "
            f"{s.get('forward_time_cv', 0):.1%} | {s.get('compute_cv', 0):.1%} | {s.get('bubble', 0):.1%} | "
            f"{s.get('peak_mem_gb', 0):.1f} | {r['simulated_tokens_per_s']:,.0f} "
            f"({'-' if err is None else f'{err:+.1%}'}) |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    out = Path(args.out)
    # Lightning's run folders and the shared calibration are raw output: a temporary folder, not benchmarks/results/.
    out_dir = Path(tempfile.mkdtemp(prefix=f"adaptiveload_{out.stem}_runs_"))
    print(f"run folders (logs, checkpoints): {out_dir}", flush=True)
    names = [c for c in CONFIGS if c in args.configs.split(",")]
    m_mem = args.m_mem or None
    calibration = args.calibration
    cost_model = None
    if calibration:
        from lightning_adaptiveload.calibration.record import load_calibration

        cost_model = load_calibration(calibration).cost_model
    runs: dict[str, Any] = {}
    trainer = None
    for name in names:
        if name == "equal_token" and m_mem is None:
            raise SystemExit("equal_token needs a token budget: pass --m-mem, or run a dual configuration first")
        try:
            result, run, bench = _run(args, name, out_dir, m_mem, calibration, cost_model)
        except Exception as err:  # noqa: BLE001 - one failing configuration must not lose the others
            import traceback

            traceback.print_exc()
            runs[name] = {"label": CONFIGS[name]["label"], "error": f"{type(err).__name__}: {err}"[:2000]}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        trainer = run.trainer
        if bench is not None and bench.calibration is not None:
            cost_model = bench.calibration.cost_model
            m_mem = m_mem or bench.derivation.m_mem
            if calibration is None and trainer.is_global_zero:
                # Later configurations reuse this calibration (also across invocations, via the file).
                calibration = str(out_dir / "calibration.json")
                Path(calibration).parent.mkdir(parents=True, exist_ok=True)
                Path(calibration).write_text(bench.calibration.to_json())
            calibration = trainer.strategy.broadcast(calibration)
        runs[name] = result
        del run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if trainer is None:
        print(json.dumps(runs, indent=1))
        return 1
    if not trainer.is_global_zero:
        return 0
    blocks = args.blocks or None
    result = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "how": "adaptiveload-train configs (Hydra compose + train.build + Trainer.fit) with BalanceMonitor; "
                   f"{args.warmup} warm-up steps left out, {args.steps} measured steps per configuration, "
                   f"seed {args.seed}",
            "model": args.model, "blocks": blocks if blocks else "all (preset depth)",
            "full_depth": blocks is None, "mixture": args.mixture, "num_samples": args.num_samples,
            "m_mem": m_mem, "world_size": trainer.world_size,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "calibration": calibration,
        },
        "runs": runs,
    }
    append_record(out, "bench_e2e.py", result)
    depth = "full depth" if blocks is None else f"{blocks} blocks only (not the full model)"
    print(f"\n{args.model}, {depth}, {args.mixture}, {trainer.world_size} device(s)\n")
    print(_table(result))
    print(f"\nappended to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
