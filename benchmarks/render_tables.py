"""Print the markdown tables of docs/benchmarks.md from the result files in benchmarks/results/.

    python benchmarks/render_tables.py            # all tables
    python benchmarks/render_tables.py adaln      # one of: adaln, sampler, breakdown
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, load_result  # noqa: E402


def _pct(v: float) -> str:
    return "failed" if math.isnan(v) else f"{v:.1%}"


def _ms(v: float) -> str:
    return "failed" if math.isnan(v) else f"{v:.3f}"


# bench_adaln.py's reference row is not a peer: say so where it appears.
PROVIDER_LABELS = {"same_bytes": "same bytes, no math (reference)"}


def adaln() -> str:
    """The latest run in ``adaln.csv`` (its rows share one commit and date)."""
    rows = list(csv.DictReader((RESULTS / "adaln.csv").open()))
    latest = max((r["date"], r["commit"]) for r in rows)
    rows = [r for r in rows if (r["date"], r["commit"]) == latest]
    meta = rows[0]
    out = [
        f"{meta['hardware']}, torch {meta['torch']}, copy bandwidth {float(meta['copy_bandwidth_gbps']):,.0f} GB/s "
        "(measured in the same run). Times in ms (CUDA-graph replay); % = fraction of copy bandwidth; "
        f"cold = every call's inputs evicted from L2 ({float(meta.get('l2_cache_mb') or 0):.0f} MiB) first.",
        "",
        "| shape (B, N, D) | x | provider | fwd ms | fwd % | fwd+bwd ms | fwd+bwd % | fwd % cold | fwd+bwd % cold "
        "| activations kept (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # "-": not measured (result files from before the cold columns, or a run with --l2 warm / cold);
    # "failed": measured and failed.
    modes = meta.get("l2") or ("both" if meta.get("fwd_frac_copy_bw_cold") else "warm")
    warm, cold = modes != "cold", modes != "warm"

    def cell(r: dict, key: str, fmt, measured: bool) -> str:
        return fmt(float(r[key])) if measured and r.get(key) else "-"

    for r in rows:
        act = float(r["activation_mb"])
        provider = PROVIDER_LABELS.get(r["provider"], r["provider"])
        out.append(
            f"| ({r['B']}, {r['N']}, {r['D']}) | {r['x_dtype']} | {provider} | "
            f"{cell(r, 'fwd_ms', _ms, warm)} | {cell(r, 'fwd_frac_copy_bw', _pct, warm)} | "
            f"{cell(r, 'fwd_bwd_ms', _ms, warm)} | {cell(r, 'fwd_bwd_frac_copy_bw', _pct, warm)} | "
            f"{cell(r, 'fwd_frac_copy_bw_cold', _pct, cold)} | {cell(r, 'fwd_bwd_frac_copy_bw_cold', _pct, cold)} | "
            f"{'-' if math.isnan(act) else f'{act:.1f}'} |"
        )
    return "\n".join(out)


def sampler() -> str:
    d = load_result(RESULTS / "sampler.json")
    out = [
        "| samples | ranks | build s | plan s | resume re-plan s | heap MB (plan / resume) | steps | predicted compute CV |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['samples']:,} | {r['world_size']} | {r['build_s']:.2f} | {r['plan_s']:.2f} | "
            f"{r['resume_replan_s']:.2f} | {r['peak_heap_plan_mb']:.0f} / {r['peak_heap_resume_mb']:.0f} | "
            f"{r['steps']:,} | {r['predicted_compute_cv']:.2%} |"
        )
    out.append(f"\nWhole process peak RSS: {d['process_peak_rss_mb']:,.0f} MB.")
    return "\n".join(out)


def breakdown() -> str:
    """The latest record of ``step_breakdown_h200x1.json`` (step_breakdown.py's own table)."""
    from step_breakdown import table

    return table(load_result(RESULTS / "step_breakdown_h200x1.json"))


TABLES = {"adaln": adaln, "sampler": sampler, "breakdown": breakdown}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(TABLES):
        print(f"<!-- {name} -->\n{TABLES[name]()}\n")
