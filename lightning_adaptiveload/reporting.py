"""Console tables shared by the entry point and the callbacks (rich, rank zero only)."""

from __future__ import annotations

from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console
from rich.table import Table

from lightning_adaptiveload.bucketing.sampler import batch_costs


def bucket_plan_table(datamodule: Any, world_size: int = 1) -> tuple[Table, dict[str, Any]]:
    """Build the bucket-plan table of an ``AdaptiveLoadDataModule`` for ``world_size`` ranks.

    Returns the rich table (one row per token grid: S, samples, B, batches, relative compute per
    batch) and the epoch plan's statistics (steps, padding, predicted compute CV, bubble).
    """
    sampler = datamodule.make_sampler(world_size, 0)
    stats = sampler.plan_stats
    rows = sampler.bucket_table()
    # The same per-batch cost the sampler balances on (B = 0 marks a skipped bucket).
    costs = batch_costs(
        np.array([max(r["batch_size"], 1) for r in rows]),
        np.array([r["seq_len"] for r in rows]),
        datamodule.cost_model,
        datamodule.policy.cost_exponent,
    )
    top = float(costs.max()) if len(costs) else 1.0
    table = Table(
        title=f"Bucket plan: {datamodule.policy!r}, balance={datamodule.balance!r}, {world_size} rank(s)",
        title_justify="left",
    )
    for col in ("token grid (f,h,w)", "S", "samples", "B", "batches", "cost/batch"):
        table.add_column(col, justify="right")
    for r, c in zip(rows, costs, strict=True):
        b = r["batch_size"]
        table.add_row(
            "x".join(map(str, r["grid"])),
            f"{r['seq_len']:,}",
            f"{r['samples']:,}",
            str(b) if b else "skipped",
            f"{r['batches']:,}",
            f"{c / top:.2f}" if b else "-",
        )
    table.caption = (
        f"{stats['num_steps']:,} steps/epoch x {world_size} rank(s); padded {stats['padded_samples']} "
        f"samples, dropped {stats['dropped_samples']}, skipped oversize {stats['skipped_oversize']}; "
        f"predicted compute CV {stats['compute_cv']:.1%}, bubble {stats['bubble']:.1%}"
    )
    return table, stats


@rank_zero_only
def print_bucket_plan(datamodule: Any, world_size: int = 1, console: Console | None = None) -> None:
    """Print :func:`bucket_plan_table` on rank zero."""
    table, _ = bucket_plan_table(datamodule, world_size)
    (console or Console()).print(table)
