"""``adaptiveload-simulate``: predict load balance and throughput of bucketing policies on a cluster.

Compares, side by side for each world size: equal-token batches dealt at random (the common
baseline), the dual constraint dealt at random (the AdaptiveLoad paper) and the dual constraint with
cost-balanced steps (``balance="cost"``).

Examples::

    adaptiveload-simulate --mixture wan_mixed_480p_720p --world-sizes 8 16 1024
    adaptiveload-simulate --mixture my_mix.yaml --cost-model cost_model.json --m-mem 65520
    adaptiveload-simulate --manifest train.jsonl --world-sizes 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_adaptiveload.bucketing.balance import SimulationResult, compare_policies, mixture_token_grids
from lightning_adaptiveload.factories import load_cost_model


def load_mixture(spec: str) -> list[dict[str, Any]]:
    """A mixture from a name in ``data.mixtures.MIXTURES`` or a YAML/JSON file.

    The file holds a list of ``{num_frames, height, width, weight}`` (pixels), or a mapping with
    that list under ``mixture`` (as in a data config).

    Raises:
        ValueError: the spec is neither a known name nor a readable file with such a list.
    """
    path = Path(spec)
    if not path.exists():
        from lightning_adaptiveload.data.mixtures import MIXTURES, get_mixture

        if spec in MIXTURES:
            return get_mixture(spec)
        raise ValueError(f"`--mixture {spec}`: no such file and not one of {sorted(MIXTURES)}.")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if isinstance(data, dict):
        data = data.get("mixture")
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ValueError(
            f"`--mixture {spec}`: expected a list of {{num_frames, height, width, weight}} entries "
            "(or a mapping with that list under `mixture`)."
        )
    return data


def load_shapes(mixture: str | None, manifest: str | None, num_samples: int) -> np.ndarray:
    """Token grids from a mixture (``num_samples`` of them) or from a manifest's rows."""
    if (mixture is None) == (manifest is None):
        raise ValueError("Give exactly one of `--mixture` and `--manifest`.")
    if manifest is not None:
        from lightning_adaptiveload.data.manifest import read_manifest_shapes

        grids, report = read_manifest_shapes(manifest)
        if report.num_skipped:
            print(f"manifest {manifest}: skipped {report.num_skipped} bad rows {report.skipped}")
        return np.asarray(grids, dtype=np.int64)
    return mixture_token_grids(load_mixture(mixture), num_samples)


def render(results: Sequence[SimulationResult], title: str) -> None:
    """Print the comparison as a rich table (one row per world size and configuration)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("ranks", "configuration", "compute CV", "bubble", "steps", "tokens/s", "vs equal-token", "padded"):
        table.add_column(col, justify="left" if col == "configuration" else "right", no_wrap=True)
    base: dict[int, float] = {}
    for r in results:
        if r.name == "equal-token":
            base[r.world_size] = r.tokens_per_s
        ref = base.get(r.world_size)
        gain = f"{r.tokens_per_s / ref - 1:+.1%}" if ref else "-"
        table.add_row(str(r.world_size), r.name, f"{r.compute_cv:.1%}", f"{r.bubble:.1%}", str(r.num_steps),
                      f"{r.tokens_per_s:,.0f}", gain, str(r.padded_samples))
    console = Console()
    # Off a terminal rich assumes 80 columns, too narrow for eight columns.
    console.width = max(console.width, 110)
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``adaptiveload-simulate``)."""
    parser = argparse.ArgumentParser(
        prog="adaptiveload-simulate",
        description="Predict compute CV, bubble fraction and tokens/s of equal-token vs dual-constraint "
                    "vs dual-constraint + cost-balanced bucketing on N ranks.")
    src = parser.add_argument_group("data (one of)")
    src.add_argument("--mixture", help="mixture name (e.g. wan_mixed_480p_720p) or YAML/JSON file")
    src.add_argument("--manifest", help="manifest file (JSONL/CSV/Parquet) whose shapes are simulated")
    parser.add_argument("--num-samples", type=int, default=200_000, help="samples drawn from a mixture")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 1024])
    parser.add_argument("--cost-model", help="CostModel JSON; default: a documented H200-like quadratic model")
    parser.add_argument("--m-mem", type=int, default=None,
                        help="token budget per batch (default max(65520, longest S))")
    parser.add_argument("--m-comp", type=float, default=None, help="compute budget; default: fitted from the cost model (B=1 at the longest S)")
    parser.add_argument("--p", type=float, default=2.0, help="exponent of S in the compute constraint (with --m-comp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    try:
        shapes = load_shapes(args.mixture, args.manifest, args.num_samples)
        cost_model = load_cost_model(args.cost_model, argument="--cost-model") if args.cost_model else None
        results = compare_policies(shapes, args.world_sizes, m_mem=args.m_mem, m_comp=args.m_comp, p=args.p,
                                   cost_model=cost_model, seed=args.seed)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    units = "CostModel" if cost_model is not None else "default H200-like cost model"
    render(results, f"{len(shapes):,} samples, {units}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
