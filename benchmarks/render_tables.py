"""Print the markdown tables of docs/benchmarks.md from the result files in benchmarks/results/.

    python benchmarks/render_tables.py            # all tables
    python benchmarks/render_tables.py adaln      # one of: adaln, sampler, e2e
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _pct(v: float) -> str:
    return "failed" if math.isnan(v) else f"{v:.1%}"


def _ms(v: float) -> str:
    return "failed" if math.isnan(v) else f"{v:.3f}"


# bench_adaln.py's reference row is not a peer: say so where it appears.
PROVIDER_LABELS = {"same_bytes": "same bytes, no math (reference)"}


def adaln() -> str:
    meta = json.loads((RESULTS / "adaln_h200.json").read_text())["meta"]
    rows = list(csv.DictReader((RESULTS / "adaln_h200.csv").open()))
    out = [
        f"{meta['device']}, torch {meta['torch']}, copy bandwidth {meta['copy_bandwidth_gbps']:,.0f} GB/s "
        "(measured in the same run). Times in ms (CUDA-graph replay); % = fraction of copy bandwidth; "
        f"cold = every call's inputs evicted from L2 ({meta.get('l2_cache_mb', 0):.0f} MiB) first.",
        "",
        "| shape (B, N, D) | x | provider | fwd ms | fwd % | fwd+bwd ms | fwd+bwd % | fwd % cold | fwd+bwd % cold "
        "| activations kept (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # "-": not measured (result files from before the cold columns, or a run with --l2 warm / cold);
    # "failed": measured and failed.
    modes = meta.get("l2", "both" if "fwd_frac_copy_bw_cold" in (rows[0] if rows else {}) else "warm")
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
    d = json.loads((RESULTS / "sampler_cpu.json").read_text())
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


def e2e(name: str = "e2e_h200x2") -> str:
    d = json.loads((RESULTS / f"{name}.json").read_text())
    runs = d["runs"]
    base = runs["equal_token"]["tokens_per_s"]
    out = [
        "| run | steps | tokens/s | vs (1) | samples/s | step-time CV | compute CV (pred.) | bubble | peak GiB | profiling s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs.values():
        out.append(
            f"| {r['label']} | {r['measured_steps']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base - 1:+.1%} | "
            f"{r['samples_per_s']:.2f} | {r['step_time_cv']:.1%} | {r['compute_cv']:.1%} | {r['bubble']:.1%} | "
            f"{r['peak_memory_gib']:.1f} | {r['profiling_overhead_s']:.1f} |"
        )
    sb = d["shape_benchmark"]
    for key in ("cost_model", "power_model"):
        m = sb[key]
        q = m["quality"]
        params = ", ".join(f"{k}={v:.4g}" for k, v in m["params"].items())
        out.append(
            f"\n{key.replace('_', ' ')}: {m['form']} ({params}); R² {q['r2']:.4f}, median rel. error "
            f"{q['median_rel_error']:.1%}, held-out median {q['heldout_median_rel_error']:.1%}."
        )
    return "\n".join(out)


TABLES = {"adaln": adaln, "sampler": sampler, "e2e": e2e}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(TABLES):
        print(f"<!-- {name} -->\n{TABLES[name]()}\n")
