"""``adaptiveload-train``: ``train(cfg)`` builds the run and fits; ``main()`` is the Hydra wrapper.

With no arguments it runs the CPU quickstart; any config group can be overridden from the command
line, e.g. ``adaptiveload-train model=wan2_1_1_3b trainer=gpu strategy=fsdp trainer.devices=8``.
Only Hydra and OmegaConf are imported at the top (``--help`` answers before torch loads). Checks and
error wording live in :mod:`.checks`, node helpers in :mod:`.components`, multi-rank errors in :mod:`.errors`.
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_adaptiveload.cli import checks, components, errors, interrupt
from lightning_adaptiveload.cli.checks import instantiate_node, node_keys

if TYPE_CHECKING:
    import lightning.pytorch as pl


def _config_path() -> str:
    """``conf/`` ships inside the installed package; a source checkout has it beside the package
    (found from this file, not ``find_spec``, which would import torch before Hydra parses the line)."""
    package = Path(__file__).resolve().parent.parent
    return str(package / "conf" if (package / "conf").is_dir() else package.parent / "conf")


@dataclass
class Run:
    """Everything ``train`` builds from a config, before fitting."""

    module: pl.LightningModule
    datamodule: pl.LightningDataModule
    trainer: pl.Trainer
    # Class name → (config path, argument keys) of what was built, to word later errors as overrides.
    nodes: dict[str, tuple[str, list[str]]] = field(default_factory=dict)


def build(cfg: DictConfig) -> Run:
    """Check the settings, then instantiate model, data, bucketing policy, callbacks, logger, strategy and Trainer."""
    checks.check_required(cfg)
    checks.check_m_mem(cfg)
    checks.check_ckpt_path(cfg)
    import lightning.pytorch as pl

    from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback

    checks.check_resume_has_steps_left(cfg)
    checks.check_accelerator(cfg)
    if cfg.get("seed") is not None:  # also the seed of the timestep and noise draws (read from here)
        pl.seed_everything(cfg.seed, workers=True)

    module = instantiate_node(cfg.model, "model")
    dataset = components.instantiate_dataset(cfg.data.dataset, module)
    policy = instantiate_node(cfg.bucketing.policy, "bucketing.policy")
    sp_settings = components.sequence_parallel_settings(cfg.data.get("sequence_parallel"), module)
    sp = {"sequence_parallel": sp_settings} if sp_settings is not None else {}
    datamodule = instantiate_node(
        cfg.data.datamodule, "data.datamodule", dataset=dataset, policy=policy,
        balance=cfg.bucketing.balance, seed=cfg.get("seed") or 0, **sp,
    )
    if hasattr(datamodule, "print_plan"):  # the DataModule prints the plan it trains, once
        datamodule.print_plan = bool(cfg.get("print_plan", True))
    # With fit_from_benchmark=false the chosen policy is the point of the run (e.g. the equal-token baseline):
    # keep it, and never build the shape benchmark that would refit it.
    keep_policy = not cfg.bucketing.get("fit_from_benchmark", True)
    skip = {ShapeBenchmarkCallback: "bucketing.fit_from_benchmark=false: ShapeBenchmarkCallback is off; "
            "the configured policy is kept."} if keep_policy else None
    callbacks = components.instantiate_callbacks(cfg.get("callbacks"), skip=skip)
    if sp_settings is not None:
        callbacks = components.with_sequence_parallel_callback(callbacks, datamodule)
    logger = instantiate_node(cfg.logger, "logger") if cfg.get("logger") else False
    strategy = instantiate_node(cfg.strategy, "strategy")
    trainer: pl.Trainer = instantiate_node(cfg.trainer, "trainer", strategy=strategy, callbacks=callbacks, logger=logger)
    checks.warn_about_world_size(trainer, datamodule)
    built = {"model": module, "data.dataset": dataset, "data.datamodule": datamodule,
             "bucketing.policy": policy, "strategy": strategy, "trainer": trainer}
    nodes = {
        type(obj).__name__: (path, node_keys(OmegaConf.select(cfg, path)))
        for path, obj in built.items()
        if not isinstance(obj, (str, int, float, bool))  # e.g. strategy "auto"
    }
    nodes["Trainer"] = ("trainer", node_keys(cfg.trainer))  # also a subclass's messages say `Trainer(...)`
    return Run(module, datamodule, trainer, nodes)


def train(cfg: DictConfig) -> dict[str, float]:
    """Build the run from ``cfg`` and fit (CUDA's allocator uses expandable segments unless the
    environment says otherwise: :func:`~.components.configure_cuda_allocator`).

    Returns:
        The Trainer's final callback metrics as floats (``train/loss`` is the last logged step's).
        With a ``BalanceMonitor`` callback, its run means replace the last step's ``balance/*``
        values, so they agree with the balance report.
    """
    errors.forget_run()
    components.configure_cuda_allocator()
    run = build(cfg)
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor

    with errors.watch_peers(cfg, run.trainer):
        try:
            run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=cfg.get("ckpt_path"))
        except Exception as err:
            cli_error = checks.as_cli_error(err, run.nodes, checks.live_m_mem(cfg, run.trainer.callbacks))
            if cli_error is None:
                raise
            raise cli_error from err
    metrics = {k: float(v) for k, v in run.trainer.callback_metrics.items() if v.numel() == 1}
    interrupted = interrupt.interrupt_of(run.trainer)
    if interrupted is not None:  # a signal stopped the run after a step: main() exits 128 + its number
        metrics["interrupted_by_signal"] = float(interrupted[0])
    if run.trainer.global_step == 0:
        rank_zero_warn("trained 0 steps: check trainer.max_steps, trainer.max_epochs and the data size.")

    lines = []
    if "train/loss" in metrics:
        lines.append(f"  train/loss at step {run.trainer.global_step} (the last logged value): {metrics['train/loss']:.6g}")
    monitor = next((cb for cb in run.trainer.callbacks if isinstance(cb, BalanceMonitor)), None)
    summary = monitor.summary() if monitor is not None else {}
    if summary:
        metrics.update({f"balance/{k}": float(v) for k, v in summary.items()})
        lines.append(f"  balance, means over {int(summary.get('steps', 0))} steps: {components.format_summary(summary)}")
    else:
        lines.append(f"  last logged values: {metrics}")
    if interrupted is not None:
        lines.append(interrupt.resume_hint(cfg, run.trainer, *interrupted))
    rank_zero_info("Final metrics\n" + "\n".join(lines))
    out_dir = cfg.get("output_dir")
    if out_dir and run.trainer.is_global_zero:  # the same numbers for scripts (benchmarks/bench_quickstart.py)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        per_shape = monitor.per_shape() if monitor is not None else []
        if monitor is not None and (monitor.cost_model or getattr(run.datamodule, "cost_model", None)) is None:
            # No cost model (e.g. the equal-token baseline): "predicted" is B·S^p, not seconds, and a ratio of
            # seconds to it means nothing; named as what it is.
            per_shape = [{**{k: v for k, v in row.items() if k not in ("predicted", "measured_over_predicted")},
                          f"predicted_B_S^{monitor.p:g}": row["predicted"]} for row in per_shape]
        steps = monitor.step_rows() if monitor is not None else []
        (Path(out_dir) / "metrics.json").write_text(json.dumps({**metrics, "per_shape": per_shape, "steps": steps},
                                                               indent=1, sort_keys=True, default=float))
    return metrics


#: FutureWarnings torch raises about Lightning's own calls (Lightning 2.6 on torch 2.13: its pytree helper builds
#: ``LeafSpec``s, its ``all_gather`` calls ``torch.distributed.nn.functional.all_gather``): printed by every rank of
#: every run, about code a user does not write and cannot change. The console script leaves them out; the library
#: does not filter warnings.
UPSTREAM_DEPRECATIONS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
)


def quiet_upstream_deprecations() -> None:
    """Leave out :data:`UPSTREAM_DEPRECATIONS` (only those FutureWarnings; every other warning still shows)."""
    for message in UPSTREAM_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def main() -> None:
    """Console script ``adaptiveload-train``: overrides of keys the config lacks are answered with the fix
    (:func:`~.checks.check_overrides`), the rest is Hydra's app (:func:`_hydra_main`)."""
    quiet_upstream_deprecations()
    try:
        checks.check_overrides(sys.argv[1:], _config_path())
    except checks.ConfigError as err:
        print(f"adaptiveload-train: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    _hydra_main()


@hydra.main(version_base="1.3", config_path=_config_path(), config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        OmegaConf.resolve(cfg)
        metrics = train(cfg)  # build() checks the required settings and ckpt_path before anything else
    except Exception as err:
        errors.exit_on_error(err, cfg)
    release_process_group()
    interrupt.exit_if_interrupted(metrics, errors.global_rank())


def release_process_group() -> None:
    """Destroy the process group of a run that finished, as torch asks of every script that created one.

    Lightning's strategies leave it alive after ``fit``; one destroyed only by the interpreter's exit can
    abort a rank after training succeeded (a gloo rank's exit ended in "terminate called without an active
    exception", exit code -6, once in a CPU test run). Not on the error path: a failed run exits at once.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
