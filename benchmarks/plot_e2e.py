"""Plots of an end-to-end benchmark result (``bench_e2e.py`` JSON), into ``--out-dir`` (default: the temporary
folder; plots are drawn from the record, not kept in ``benchmarks/results/``):

- ``<stem>_tokens_per_s.png``: tokens/s of every configuration, measured and simulated;
- ``<stem>_step_times.png``: the per-step time of the slowest rank, per configuration;
- ``<stem>_loss.png``: ``train/loss`` per step of every configuration (same seed).

    python benchmarks/plot_e2e.py benchmarks/results/e2e.json [--record N] [--out-dir DIR]   # default: the last record
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import load_result  # noqa: E402

ORDER = ("equal_token", "dual", "dual_cost", "dual_cost_fused")


def _figure(width: float = 7.0, height: float = 4.5):
    # Figure + Agg canvas directly: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig, ax, title: str, path: Path) -> Path:
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot(result: dict[str, Any], stem: Path) -> list[Path]:
    runs = {k: result["runs"][k] for k in ORDER if k in result["runs"] and "error" not in result["runs"][k]}
    meta = result["meta"]
    title = f"{meta['model']} ({meta['blocks']} blocks), {meta['mixture']}, {meta['world_size']} x {meta['device']}"
    paths = []

    fig, ax = _figure()
    x = np.arange(len(runs))
    ax.bar(x - 0.2, [r["summary"].get("tokens_per_s", 0) for r in runs.values()], 0.4, label="measured")
    ax.bar(x + 0.2, [r["simulated_tokens_per_s"] for r in runs.values()], 0.4, label="simulated")
    ax.set_xticks(x, [r["label"].split(" ", 1)[0] for r in runs.values()])
    ax.set_ylabel("tokens/s")
    paths.append(_save(fig, ax, title, stem.with_name(stem.name + "_tokens_per_s.png")))

    fig, ax = _figure()
    for r in runs.values():
        steps = np.asarray(r["per_step"])
        if steps.size:
            ax.plot(steps[:, :, 0].max(axis=1), ".-", label=r["label"])
    ax.set_xlabel("measured step")
    ax.set_ylabel("step time of the slowest rank (s)")
    paths.append(_save(fig, ax, title, stem.with_name(stem.name + "_step_times.png")))

    fig, ax = _figure()
    for r in runs.values():
        ax.plot(r["losses"], label=r["label"], linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("train/loss")
    paths.append(_save(fig, ax, title, stem.with_name(stem.name + "_loss.png")))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("result", help="bench_e2e.py result file")
    p.add_argument("--record", type=int, default=-1, help="which record of the file (default: the last)")
    p.add_argument("--out-dir", default=tempfile.gettempdir(), help="where the pngs go (default: the temporary folder)")
    args = p.parse_args(argv)
    path = Path(args.result)
    for out in plot(load_result(path, args.record), Path(args.out_dir) / path.stem):
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
