"""What :class:`~lightning_adaptiveload.callbacks.balance_monitor.BalanceMonitor` makes of its totals at the
end: the per-shape "measured / predicted" rows, the epoch estimate of the DataModule's plan and the rank-0
console report. Functions of the totals the monitor hands them, with no state of their own and no collective
(everything here is one rank's, or what the per-step gather already gave every rank). Private to
:mod:`~lightning_adaptiveload.callbacks.balance_monitor`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from lightning_adaptiveload.bucketing.policy import CostPredictor


def wait_fraction(wait: Any, step_time: Any) -> np.ndarray:
    """Data wait as a fraction of the wall time of a step (wait + step), 0 where both are 0."""
    wait, total = np.asarray(wait, dtype=np.float64), np.asarray(wait, dtype=np.float64) + step_time
    return np.divide(wait, total, out=np.zeros_like(total), where=total > 0)


def per_shape(shape_sums: Mapping[tuple[int, int], np.ndarray],
              shape_cycles: Mapping[tuple[int, int], deque[float]], shape_counts: Mapping[tuple[int, int], int],
              sp_shapes: Collection[tuple[int, int]], cost_model: CostPredictor | None, peak_tflops: float | None,
              min_bound_steps: int = 3) -> list[dict[str, float]]:
    """The rows of :meth:`BalanceMonitor.per_shape
    <lightning_adaptiveload.callbacks.balance_monitor.BalanceMonitor.per_shape>` (see there), from the
    monitor's per-shape sums (``[steps, step time, predicted compute, FLOPs, device allocations, slowest
    step]``), step-plus-wait samples and their counts, its sequence-parallel shapes (never observed: priced by
    their mean predicted compute), the cost model it predicts with and the device's peak. With a cost model, a
    data-parallel shape that bounded fewer than ``min_bound_steps`` steps has no measured/predicted (NaN): its
    steps' times were the heavier batches' it waited for."""
    out = []
    for (b, s), (n, t, pred, flops, allocs, slowest) in sorted(shape_sums.items(),
                                                                key=lambda kv: (-kv[0][1], -kv[0][0])):
        bound = int(shape_counts.get((b, s), 0))
        row = {"B": b, "S": s, "steps": int(n), "bound_steps": bound, "step_s": t / n, "predicted": pred / n,
               "measured_over_predicted": t / pred if pred > 0 else float("nan"), "tokens_per_s": n * b * s / t,
               "slowest_step_s": slowest, "device_allocs": int(allocs)}
        cycles = shape_cycles.get((b, s))
        if cycles:
            row["cycle_s"] = float(np.median(cycles))
        if cost_model is not None and (b, s) not in sp_shapes:
            row["predicted"] = float(cost_model.predict(b, s))
            row["measured_over_predicted"] = (row["cycle_s"] / row["predicted"] if cycles and bound >= min_bound_steps
                                              else float("nan"))
        if flops > 0 and peak_tflops:
            row["mfu"] = flops / t / 1e12 / peak_tflops
        out.append(row)
    return out


def plan_batches(row: Mapping[str, Any]) -> list[tuple[int, int]]:
    """``(batch size, count)`` of the batches a ``bucket_table()`` row makes: its full batches and, where its
    ``samples`` do not fill the last one, that batch at its own size (the sampler fills each bucket's batches in
    order, so only the last holds fewer)."""
    b, n = int(row["batch_size"]), int(row["batches"])
    last = int(row["samples"]) - (n - 1) * b if "samples" in row else b
    if 0 < last < b:
        return [(b, n - 1), (last, 1)] if n > 1 else [(last, 1)]
    return [(b, n)]


def epoch_estimate(plan: Sequence[Mapping[str, Any]], shape_sums: Mapping[tuple[int, int], np.ndarray],
                   rank_sums: Mapping[tuple[int, int], np.ndarray], world: int, bubble: float,
                   predicted_compute: Callable[[int, int, int], float], flops_fn: Callable[[int], float] | None,
                   peak_tflops: float | None) -> dict[str, float] | None:
    """:meth:`BalanceMonitor.epoch_estimate
    <lightning_adaptiveload.callbacks.balance_monitor.BalanceMonitor.epoch_estimate>` (see there) from the
    monitor's per-shape sums of this rank (``shape_sums``) and of every rank's data-parallel batches
    (``rank_sums``: steps, step time, predicted compute), its world size and run bubble, its ``predicted_compute(B, S, degree)``,
    the module's ``flops_per_sample`` (``None``: no MFU) and the device's peak."""
    rows = [r for r in plan if int(r.get("batch_size", 0)) > 0 and int(r.get("batches", 0)) > 0]
    # Every rank's steps of a data-parallel shape where there are any, else this rank's (sequence parallel).
    measured = {key: sums for sums_of in (shape_sums, rank_sums) for key, sums in sums_of.items() if sums[0] > 0}
    full = [(int(r["batch_size"]), int(r["seq_len"])) for r in rows]
    hit = [key in measured for key in full]
    if not any(hit):
        return None
    world = max(1, world)
    # R over the buckets' full batches: a remainder batch often waits for a heavier one, its time not its own.
    seen = [measured[key] for key, h in zip(full, hit, strict=True) if h]
    pred_total = sum(float(v[2]) for v in seen)
    ratio = sum(float(v[1]) for v in seen) / pred_total if pred_total > 0 else float("nan")

    def step_time(b: int, s: int, k: int) -> tuple[float, bool]:
        sums = measured.get((b, s))
        if sums is None:
            return predicted_compute(b, s, k) * ratio, False
        return float(sums[1] / sums[0]), True

    time_total = time_measured = tokens = flops = 0.0
    for r in rows:
        s, k = int(r["seq_len"]), int(r.get("sp_degree", 1) or 1)
        for b, n in plan_batches(r):
            t, known = step_time(b, s, k)
            time_total += n * t * k
            time_measured += n * t * k if known else 0.0
        samples = int(r.get("samples", int(r["batches"]) * int(r["batch_size"])))
        tokens += samples * s
        if flops_fn is not None:
            flops += samples * float(flops_fn(s))
    seconds = time_total / world / max(1e-9, 1.0 - bubble)
    out = {"tokens_per_s": tokens / seconds, "measured_buckets": float(sum(hit)), "buckets": float(len(rows)),
           "measured_time_frac": time_measured / time_total, "ratio": ratio}
    if flops > 0 and peak_tflops:
        out["mfu"] = flops / seconds / world / 1e12 / peak_tflops
    return out


def print_report(*, steps: int, warmup_steps: int, per_rank_sum: np.ndarray, peak: np.ndarray,
                 summary: Mapping[str, float], shapes: Sequence[Mapping[str, Any]], has_cost_model: bool, p: float,
                 clock_error: str | None, nonfinite_steps: int, epoch: Mapping[str, float] | None) -> None:
    """Print the balance report (call on one rank): a row per rank of ``per_rank_sum`` (the monitor's
    per-rank sums over ``steps`` counted steps, columns :attr:`BalanceMonitor.FIELDS
    <lightning_adaptiveload.callbacks.balance_monitor.BalanceMonitor.FIELDS>`) with its ``peak`` memory, the
    per-shape table of ``shapes`` (:func:`per_shape`; with more than one shape or a cost model), the run means
    of ``summary``, the GPU clock and power (or ``clock_error``, why they were not read), the steps left out
    for a non-finite loss and the ``epoch`` estimate."""
    from rich.console import Console
    from rich.table import Table

    n = steps
    skipped = f", after {warmup_steps} warm-up steps" if warmup_steps else ""
    table = Table(title=f"Balance report ({n} steps{skipped})")
    for col in ("rank", "mean step s", "mean fwd s", "mean pred. compute", "tokens", "peak GiB", "data wait"):
        table.add_column(col, justify="right")
    for r, row in enumerate(per_rank_sum):
        table.add_row(str(r), f"{row[0] / n:.4f}", f"{row[1] / n:.4f}", f"{row[2] / n:.4g}",
                      f"{int(row[3]):,}", f"{peak[r] / 2**30:.2f}", f"{float(wait_fraction(row[6], row[0])):.2%}")
    s = summary
    console = Console()
    console.print(table)
    if len(shapes) > 1 or has_cost_model:
        unit = "s" if has_cost_model else f"B·S^{p:g}"
        by_shape = Table(title="Per batch shape (rank 0)")
        # "steps (bound)": rank 0's steps of the shape (the steps of any rank where it bounded the step)
        for col in ("B", "S", "steps (bound)", "mean step s", "step + wait s", f"predicted {unit}",
                    "measured / predicted", "tokens/s", "MFU"):
            by_shape.add_column(col, justify="right")
        for row in shapes:
            ratio = row["measured_over_predicted"] if has_cost_model else float("nan")
            by_shape.add_row(str(row["B"]), f"{row['S']:,}", f"{row['steps']} ({row['bound_steps']})",
                             f"{row['step_s']:.4f}",
                             f"{row['cycle_s']:.4f}" if "cycle_s" in row else "-", f"{row['predicted']:.4g}", "-" if np.isnan(ratio) else f"{ratio:.3f}",
                             f"{row['tokens_per_s']:,.0f}", f"{row['mfu']:.1%}" if "mfu" in row else "-")
        console.print(by_shape)
        # The shapes whose steps mapped device memory, with their slowest step: a one-off cost (the first
        # step of a shape growing the pool) or a shape that is slow throughout. A line, not columns: the
        # table already fills an 80-column log.
        allocs = [f"{row['B']} x {row['S']:,}: {row['device_allocs']} (slowest step {row['slowest_step_s']:.3f} s, "
                  f"mean {row['step_s']:.3f} s)" for row in shapes if row["device_allocs"]]
        if allocs:
            console.print("device allocations per shape: " + "; ".join(allocs))
    mfu = ""
    if "tflops_per_gpu" in s:
        mfu = f" | {s['tflops_per_gpu']:.3g} model TFLOP/s per GPU" + (f", MFU {s['mfu']:.1%}" if "mfu" in s else "")
    console.print(
        f"step-time CV {s['step_time_cv']:.2%} | forward CV {s['forward_time_cv']:.2%} | "
        f"compute CV {s['compute_cv']:.2%} | bubble {s['bubble']:.2%} | tokens/s {s['tokens_per_s']:,.0f} "
        f"({s['wall_tokens_per_s']:,.0f} with the waits between steps){mfu} | "
        f"data wait {s['data_wait_frac']:.2%} of step time"
        + (f" | allocator retries {int(s['alloc_retries'])}" if s.get("alloc_retries") else "")
        + (f" | device allocations {int(s['device_allocs'])}" if s.get("device_allocs") else "")
    )
    if "sm_clock_mhz" in s:
        console.print(f"GPU: SM clock {s['sm_clock_mhz']:,.0f} MHz, {s['power_w']:,.0f} W (means over the steps; "
                      "the lowest clock and the highest draw over ranks). A slower clock than while profiling, "
                      "e.g. under a power cap, makes steps longer than predicted.")
    elif clock_error:
        console.print(f"GPU clock and power: not recorded ({clock_error}; torch.cuda.clock_rate needs "
                      "the nvidia-ml-py package)")
    if nonfinite_steps:
        console.print(f"{nonfinite_steps} step(s) with a non-finite loss left out of these numbers "
                      "(they run faster than training; see the warning)")
    e = epoch
    if e is not None:
        rest = "" if e["measured_buckets"] == e["buckets"] else f"; the rest predicted x {e['ratio']:.2f}"
        console.print(
            f"epoch of this plan at these step times: tokens/s {e['tokens_per_s']:,.0f}"
            + (f", MFU {e['mfu']:.1%}" if "mfu" in e else "")
            + f" ({int(e['measured_buckets'])} of {int(e['buckets'])} buckets measured, "
            f"{e['measured_time_frac']:.0%} of the epoch's time{rest})"
        )
