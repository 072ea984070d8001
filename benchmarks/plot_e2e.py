"""Plots of an end-to-end benchmark result (``bench_e2e.py`` JSON).

Four PNGs next to the JSON: tokens/s per run (measured and simulated), step-time distributions,
loss curves of the fidelity runs, and the cost-model fit of the shape benchmark.

    python benchmarks/plot_e2e.py benchmarks/results/e2e_h200x2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _short(label: str) -> str:
    return label.split(" ", 1)[0] + "\n" + label.split(" ", 1)[-1].replace(", ", "\n").replace(" + ", "\n+ ")


def plot_tokens_per_s(result: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    runs = result["runs"]
    names = list(runs)
    world = str(result["hardware"]["world_size"])
    meas = [runs[n]["tokens_per_s"] or 0.0 for n in names]
    step_only = [runs[n]["tokens_per_s_step"] or 0.0 for n in names]
    err = result["simulation"]["prediction_error_at_measured_world"]
    pred = [err.get(n, {}).get("predicted_tokens_per_s") or 0.0 for n in names]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(x - 0.27, meas, 0.27, label="measured (wall, incl. data + per-step sync)")
    ax.bar(x, step_only, 0.27, label="measured (device step time only)")
    ax.bar(x + 0.27, pred, 0.27, label=f"simulated ({world} ranks, fitted cost model)")
    for xi, v in zip(x, meas, strict=True):
        ax.text(xi - 0.27, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [_short(runs[n]["label"]) for n in names], fontsize=7)
    ax.set_ylabel("tokens / s (all ranks)")
    ax.set_title(f"Throughput, {world} × {result['hardware'].get('gpu', result['hardware']['device_type'])}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_step_times(result: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    runs = result["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    wall = [np.asarray(runs[n]["per_step"]["step_time_s"]).max(axis=0) * 1e3 for n in names]
    iso = [np.asarray(runs[n]["per_step"]["isolated_s"]).reshape(-1) * 1e3 for n in names]
    labels = [_short(runs[n]["label"]) for n in names]
    for ax, data, title in (
        (axes[0], wall, "FSDP step time (slowest rank), ms"),
        (axes[1], iso, "isolated compute per rank and step, ms"),
    ):
        keep = [i for i, v in enumerate(data) if v.size]
        if keep:
            ax.boxplot([data[i] for i in keep], tick_labels=[labels[i] for i in keep], showfliers=True)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=6)
    fig.suptitle("Step-time distributions", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
    if len(y) < k or k < 2:
        return y
    return np.convolve(y, np.ones(k) / k, mode="valid")


def plot_loss(result: dict[str, Any], path: Path) -> Path | None:
    plt = _plt()
    runs = {n: r for n, r in result["runs"].items() if n in ("equal_token", "dual_cost_fused")}
    if not runs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs.values():
        loss = np.asarray(run["per_step"]["loss"]).mean(axis=0)
        samples = np.cumsum(np.asarray(run["per_step"]["batch_size"]).sum(axis=0))
        k = max(1, min(10, len(loss) // 5))
        for ax, x in ((axes[0], np.arange(1, len(loss) + 1)), (axes[1], samples)):
            (line,) = ax.plot(x, loss, alpha=0.25, lw=0.8)
            ax.plot(x[k - 1:], _smooth(loss, k), color=line.get_color(), label=f"{run['label']} (mean of {k})")
    axes[0].set_xlabel("optimizer step (after warm-up)")
    axes[1].set_xlabel("samples seen (all ranks)")
    for ax in axes:
        ax.set_ylabel("flow-matching loss (mean over ranks)")
        ax.legend(fontsize=7)
    fid = result.get("fidelity") or {}
    if fid:
        fig.suptitle(f"Loss fidelity: tail difference {fid['tail_mean_diff']:+.4f} "
                     f"(2σ = {2 * (fid['tail_diff_stderr'] or 0):.4f})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_cost_fit(result: dict[str, Any], path: Path) -> Path:
    plt = _plt()
    from lightning_adaptiveload.costmodel import CostModel

    sb = result["shape_benchmark"]
    cm = CostModel.from_dict(sb["cost_model"])
    pts = [p for p in sb["points"] if p["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    s_all = np.array([p["seq_len"] for p in pts])
    s_line = np.geomspace(s_all.min() * 0.8, s_all.max() * 1.2, 100)
    for b in sorted({p["batch_size"] for p in pts}):
        mine = [p for p in pts if p["batch_size"] == b]
        (dots,) = ax.plot([p["seq_len"] for p in mine], [p["time_s"] * 1e3 for p in mine], "o", label=f"B={b}")
        ax.plot(s_line, np.asarray(cm.predict(b, s_line)) * 1e3, "-", color=dots.get_color(), alpha=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per sample S")
    ax.set_ylabel("forward + backward, ms")
    held = cm.quality.get("heldout_median_rel_error", float("nan"))
    ax.set_title(f"{cm.form} cost model (held-out median rel. error {held:.1%})", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_all(result: dict[str, Any], out_dir: Path | str, stem: str) -> list[Path]:
    """Write every plot as ``<out_dir>/<stem>_<kind>.png``; returns the paths written."""
    out_dir = Path(out_dir)
    paths = [
        plot_tokens_per_s(result, out_dir / f"{stem}_tokens_per_s.png"),
        plot_step_times(result, out_dir / f"{stem}_step_times.png"),
        plot_loss(result, out_dir / f"{stem}_loss.png"),
        plot_cost_fit(result, out_dir / f"{stem}_cost_fit.png"),
    ]
    return [p for p in paths if p is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot a bench_e2e.py result.")
    parser.add_argument("result", help="JSON written by bench_e2e.py")
    args = parser.parse_args(argv)
    path = Path(args.result)
    for p in plot_all(json.loads(path.read_text()), path.parent, path.stem):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
