"""Console tables and plots (rich and matplotlib, rank zero only): the bucket plan, the calibration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console
from rich.table import Table

from lightning_adaptiveload.bucketing.buckets import batch_costs
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler
from lightning_adaptiveload.bucketing.sequence_parallel import sp_cost_function


def _console() -> Console:
    console = Console()
    # Off a terminal rich assumes 80 columns, too narrow for the wider tables.
    console.width = max(console.width, 110)
    return console


def bucket_plan_table(sampler: AdaptiveBucketBatchSampler) -> tuple[Table, dict[str, Any]]:
    """The bucket-plan table of a sampler's current plan, and the plan's statistics.

    One row per token grid: S, samples, B, batches, cost per batch relative to the costliest (from
    the sampler's cost model, the one it balances on), and with per-bucket activation checkpointing
    (a policy with ``mode_for``) the bucket's mode. The caption gives steps, padding, drops and the
    predicted compute CV and bubble.
    """
    stats = sampler.plan_stats
    rows = sampler.bucket_table()
    costs = batch_costs(
        np.array([max(r["batch_size"], 1) for r in rows]),
        np.array([r["seq_len"] for r in rows]),
        sampler.cost_model,
        float(getattr(sampler.policy, "cost_exponent", 2.0)),
    )
    sp = "sp_degree" in rows[0] if rows else False
    if sp:  # an SP batch's cost is its time on each of its k ranks
        _, sp_cost = sp_cost_function(sampler.cost_model, float(getattr(sampler.policy, "cost_exponent", 2.0)))
        for i, r in enumerate(rows):
            if r["sp_degree"] > 1:
                costs[i] = float(sp_cost(np.array([r["batch_size"]]), np.array([r["seq_len"]]), r["sp_degree"])[0])
    top = float(costs.max()) if len(costs) else 1.0
    mode_for = getattr(sampler.policy, "mode_for", None)
    world = stats["num_replicas"]
    table = Table(
        title=f"Bucket plan: {sampler.policy!r}, balance={sampler.balance!r}, {world} rank(s)",
        title_justify="left",
    )
    extra = (("SP ranks",) if sp else ()) + (("checkpointing",) if mode_for else ())
    for col in ("token grid (f,h,w)", "S", "samples", "B", "batches", "cost/batch") + extra:
        table.add_column(col, justify="right")
    for r, c in zip(rows, costs, strict=True):
        b = r["batch_size"]
        table.add_row("x".join(map(str, r["grid"])), f"{r['seq_len']:,}", f"{r['samples']:,}",
                      str(b) if b else "skipped", f"{r['batches']:,}", f"{c / top:.2f}" if b else "-",
                      *((str(r["sp_degree"]) if b else "-",) if sp else ()),
                      *(((mode_for(r["seq_len"]) or "-") if b else "-",) if mode_for else ()))
    table.caption = (
        f"{stats['num_steps']:,} steps/epoch x {world} rank(s); padded {stats['padded_samples']} "
        f"samples, dropped {stats['dropped_samples']}, skipped oversize {stats['skipped_oversize']}; "
        f"predicted compute CV {stats['compute_cv']:.1%}, bubble {stats['bubble']:.1%}"
    )
    return table, stats


@rank_zero_only
def print_bucket_plan(sampler: AdaptiveBucketBatchSampler, console: Console | None = None) -> None:
    """Print :func:`bucket_plan_table` on rank zero."""
    table, _ = bucket_plan_table(sampler)
    (console or _console()).print(table)


def calibration_table(calibration: Any, derivation: Any, source: str) -> Table:
    """Measured vs fitted step time of every profiled shape, with the derived constants as title."""
    from lightning_adaptiveload.calibration.derive import tiers_from_record

    cm, base_mm = calibration.cost_model, calibration.memory_model
    tiers = tiers_from_record(calibration.extra) or []
    p = derivation.policy.to_dict()
    p.pop("cost_model", None)
    if derivation.tiers:
        shown = "; ".join(f"'{t['mode']}' up to S={t['max_seq_len']:,} (x{t['scale']:.2f}, M_mem={t['m_mem']:,})"
                          for t in derivation.tiers)
    else:
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in p.items() if k != "type")
    table = Table(
        title=(f"Shape benchmark ({source}; profiled in {calibration.profile_seconds:.0f} s) — {cm}\n"
               f"{p['type']}: {shown}; step budget {derivation.step_budget_s * 1e3:.1f} ms "
               f"({derivation.budget_source})\n{derivation.summary()}"),
        title_justify="left",
    )
    modes = any(m.mode for m in calibration.measurements)
    for col in ("B", "S") + (("mode",) if modes else ()) + ("status", "measured ms", "fitted ms", "error", "peak GiB",
                                                          "pred. GiB"):
        table.add_column(col, justify="right")
    scale = {t.mode: t.scale for t in tiers}  # a mode's steps are the cost model times its scale
    for m in calibration.measurements:
        pred = float(cm.predict(m.batch_size, m.seq_len)) * scale.get(m.mode, 1.0)
        mm = next((t.memory_model for t in tiers if t.mode == m.mode and t.memory_model is not None), base_mm)
        ok = m.status == "ok"
        table.add_row(
            str(m.batch_size), f"{m.seq_len:,}", *((m.mode or "-",) if modes else ()), m.status,
            f"{m.time_s * 1e3:.1f}" if ok else "-",
            f"{pred * 1e3:.1f}", f"{pred / m.time_s - 1:+.1%}" if ok else "-",
            f"{m.peak_bytes / 2**30:.1f}" if m.peak_bytes else "-",
            f"{mm.predict(m.batch_size, m.seq_len) / 2**30:.1f}" if mm is not None else "-",
        )
    return table


@rank_zero_only
def print_calibration(calibration: Any, derivation: Any, source: str, console: Console | None = None) -> None:
    """Print :func:`calibration_table` on rank zero."""
    (console or _console()).print(calibration_table(calibration, derivation, source))


def save_calibration(calibration: Any, derivation: Any, save_dir: str | Path) -> None:
    """Write ``shape_benchmark.json`` (the calibration and the derivation; a pinnable calibration file) and
    ``shape_benchmark.png`` (:func:`plot_calibration`) to ``save_dir``."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    out = calibration.to_dict()
    out["derived"] = derivation.to_dict()
    (save_dir / "shape_benchmark.json").write_text(json.dumps(out, indent=2, sort_keys=True))
    plot_calibration(calibration, save_dir / "shape_benchmark.png")


def plot_calibration(calibration: Any, path: str | Path) -> None:
    """Measured step times (points) and the fitted model (lines, one per batch size) on log axes."""
    # Figure + Agg canvas directly: no pyplot global state, no display needed.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cost_model = calibration.cost_model
    meas = calibration.measurements
    ok = [m for m in meas if m.status == "ok"]
    oom = [m for m in meas if m.status == "oom"]
    fig = Figure(figsize=(7, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    s_all = [m.seq_len for m in meas]
    s_line = np.geomspace(min(s_all), max(s_all), 100)
    batch_values = sorted({m.batch_size for m in meas})
    max_tokens = max(m.batch_size * m.seq_len for m in ok + oom)
    for i, b in enumerate(batch_values):
        color = colormaps["viridis"](i / max(1, len(batch_values) - 1))
        pts = [m for m in ok if m.batch_size == b]
        # Each curve stops where its batch exceeds the largest token count profiled: beyond that
        # is extrapolation no policy uses.
        s_b = s_line[b * s_line <= max_tokens * (1 + 1e-9)]
        ax.plot(s_b, np.asarray(cost_model.predict(b, s_b)) * 1e3, "-", color=color, label=f"B={b}")
        if pts:
            ax.plot([m.seq_len for m in pts], [m.time_s * 1e3 for m in pts], "o", color=color)
    if oom:
        ax.plot([m.seq_len for m in oom], [cost_model.predict(m.batch_size, m.seq_len) * 1e3 for m in oom],
                "x", color="red", markersize=9, label="out of memory")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per sample S")
    ax.set_ylabel("step time (ms): points measured, lines fitted")
    ax.set_title(str(cost_model), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
