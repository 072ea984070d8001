"""Plot a bench_speed.py result: per-shape tokens/s and MFU per setting, and the loss curves.

    python benchmarks/plot_speed.py benchmarks/results/speed.json [OUT_DIR]     # the file's last record
Writes ``<stem>_shapes.png`` and, when the result has loss curves, ``<stem>_loss.png`` into ``OUT_DIR``
(default: the temporary folder; plots are drawn from the record, not kept in ``benchmarks/results/``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _results import load_result


def main(path: str, out_dir: str | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = Path(path)
    result = load_result(src, benchmark="bench_speed.py")
    dest = Path(out_dir or tempfile.gettempdir()) / src.stem
    settings = {k: v for k, v in result["settings"].items() if "per_shape" in v}
    shapes = list(next(iter(settings.values()))["per_shape"]) if settings else []
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(settings))
    for i, (name, entry) in enumerate(settings.items()):
        xs = [j + i * width for j in range(len(shapes))]
        ax[0].bar(xs, [entry["per_shape"][s].get("tokens_per_s", 0) for s in shapes], width, label=name)
        ax[1].bar(xs, [100 * entry["per_shape"][s].get("mfu", 0) for s in shapes], width, label=name)
    for a, label in zip(ax, ("tokens/s", "MFU (%)"), strict=True):
        a.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
        a.set_xlabel("B x S")
        a.set_ylabel(label)
    ax[0].legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"{meta['model']} ({meta['blocks']} blocks), {meta['device']}")
    fig.tight_layout()
    fig.savefig(dest.with_name(dest.name + "_shapes.png"), dpi=120)
    print(f"wrote {dest}_shapes.png")
    curves = result.get("loss_curves")
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, losses in curves["curves"].items():
            if isinstance(losses, list):
                ax.plot(range(1, len(losses) + 1), losses, label=name, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("train/loss")
        ax.set_title(f"one seed, B x grid {curves['shape']}, {curves['blocks']} blocks; "
                     f"median |rel diff| {curves.get('median_rel_diff', float('nan')):.2e}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(dest.with_name(dest.name + "_loss.png"), dpi=120)
        print(f"wrote {dest}_loss.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
