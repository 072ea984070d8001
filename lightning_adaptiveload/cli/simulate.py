"""``adaptiveload-simulate``: predict load balance and throughput of bucketing policies on a cluster.

Compares, side by side for each world size: equal-token batches dealt at random (the common
baseline), the dual constraint dealt at random (the AdaptiveLoad paper) and the dual constraint with
cost-balanced steps (``balance="cost"``); with ``--sp-degrees`` also that plan with Ulysses
sequence parallelism for the longest buckets (which also trains samples above ``--m-mem``).

Examples::

    adaptiveload-simulate --mixture wan_mixed_480p_720p --world-sizes 8 16 1024
    adaptiveload-simulate --mixture my_mix.yaml --cost-model cost_model.json --m-mem 65520
    adaptiveload-simulate --mixture my_mix.yaml --cost-model outputs/.../shape_benchmark.json   # its M_mem
    adaptiveload-simulate --manifest train.jsonl --world-sizes 64 --json out.json
    adaptiveload-simulate --mixture wan_mixed_480p_720p --m-mem 65520 --sp-degrees 2,4 --ranks-per-node 8
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.bucketing.sequence_parallel import SequenceParallelConfig
from lightning_adaptiveload.calibration.derive import derive_policy
from lightning_adaptiveload.calibration.record import load_cost_model
from lightning_adaptiveload.calibration.sequence_parallel import (
    H200_NVLINK_BANDWIDTH,
    H200_NVLINK_LATENCY,
    UlyssesCommModel,
)
from lightning_adaptiveload.calibration.simulate import (
    SimulationResult,
    compare_policies,
    default_cost_model,
    mixture_token_grids,
)


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


def load_shapes(mixture: str | None, manifest: str | None, num_samples: int,
                vae_stride: Sequence[int] = (4, 8, 8), patch_size: Sequence[int] = (1, 2, 2)) -> np.ndarray:
    """Token grids from a mixture (``num_samples`` of them) or from a manifest's rows."""
    if (mixture is None) == (manifest is None):
        raise ValueError("Give exactly one of `--mixture` and `--manifest`.")
    if manifest is not None:
        from lightning_adaptiveload.data.manifest import read_manifest_shapes

        grids, report = read_manifest_shapes(manifest, vae_stride=vae_stride, patch_size=patch_size)
        if report.num_skipped:
            print(f"manifest {manifest}: skipped {report.num_skipped} bad rows {report.skipped}")
        return np.asarray(grids, dtype=np.int64)
    return mixture_token_grids(load_mixture(mixture), num_samples, vae_stride, patch_size)


def render(results: Sequence[SimulationResult], title: str) -> None:
    """Print the comparison as a rich table (one row per world size and configuration)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("ranks", "configuration", "compute CV", "bubble", "steps", "samples", "tokens/s", "vs equal-token",
                "padded"):
        table.add_column(col, justify="left" if col == "configuration" else "right", no_wrap=True)
    base: dict[int, float] = {}
    for r in results:
        if r.name == "equal-token":
            base[r.world_size] = r.tokens_per_s
        ref = base.get(r.world_size)
        gain = f"{r.tokens_per_s / ref - 1:+.1%}" if ref else "-"
        table.add_row(str(r.world_size), r.name, f"{r.compute_cv:.1%}", f"{r.bubble:.1%}", str(r.num_steps),
                      f"{r.samples:,}", f"{r.tokens_per_s:,.0f}", gain, str(r.padded_samples))
    console = Console()
    # Off a terminal rich assumes 80 columns, too narrow for nine columns.
    console.width = max(console.width, 125)
    console.print(table)
    for r in results:
        if r.sp_buckets:
            layout = ", ".join(f"S={s:,}: k={k}, B={b}" for s, b, k in r.sp_buckets)
            console.print(f"{r.world_size} ranks, SP buckets: {layout}; skipped oversize: {r.skipped_samples}")


def _triple(text: str) -> tuple[int, int, int]:
    parts = text.replace("x", ",").split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not three positive integers, e.g. 1,2,2")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def _degrees(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of degrees > 1, e.g. 2,4")
    return tuple(int(p) for p in parts)


def calibrated_m_mem(path: str) -> int | None:
    """The token budget M_mem a calibration record's run derived (``derived.m_mem`` of the
    ``shape_benchmark.json`` a run writes); ``None`` for a plain CostModel file or a record without it.

    Raises:
        ValueError: ``derived.m_mem`` is there but not a positive integer.
    """
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError):
        return None  # load_cost_model has named the file already
    derived = data.get("derived") if isinstance(data, dict) else None
    value = derived.get("m_mem") if isinstance(derived, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`--cost-model {path}`: derived.m_mem={value!r}; expected a positive integer. "
                         "Pass `--m-mem` to set the token budget yourself.")
    return value


def calibrated_tiers(path: str) -> tuple[list[Any], list[int]] | None:
    """The per-bucket activation-checkpointing tiers of a calibration record and the M_mem its run
    derived for each (``derived.tiers``); ``None`` for a record without them (one mode)."""
    from lightning_adaptiveload.calibration.derive import tiers_from_record

    try:
        data = json.loads(Path(path).expanduser().read_text())
        tiers = tiers_from_record(data.get("extra") or {})
        budgets = [int(t["m_mem"]) for t in (data.get("derived") or {}).get("tiers") or []]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # load_cost_model has named the file already; a malformed tier list is one mode
    if not tiers or len(budgets) != len(tiers):
        return None
    return tiers, budgets


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
    parser.add_argument("--patch-size", type=_triple, default=(1, 2, 2), help="DiT patch t,h,w (default 1,2,2)")
    parser.add_argument("--vae-stride", type=_triple, default=(4, 8, 8), help="VAE stride t,h,w (default 4,8,8)")
    parser.add_argument("--cost-model", help="CostModel or calibration JSON; default: a documented H200-like "
                                             "quadratic model for Wan 2.1 1.3B")
    parser.add_argument("--m-mem", type=int, default=None,
                        help="token budget per batch (default: the --cost-model calibration's derived M_mem, else "
                             "max(65520, the data's longest S); printed)")
    parser.add_argument("--m-comp", type=float, default=None,
                        help="fixed compute budget of the dual constraint; default: derived from the cost model "
                             "(the budget of highest predicted throughput)")
    parser.add_argument("--p", type=float, default=2.0, help="exponent of S in the compute constraint (with --m-comp)")
    parser.add_argument("--seed", type=int, default=0)
    sp = parser.add_argument_group("sequence parallelism (Ulysses; with --sp-degrees)")
    sp.add_argument("--sp-degrees", type=_degrees, default=None,
                    help="SP degrees the planner may give the longest buckets, e.g. 2,4; adds a '+ SP' row")
    sp.add_argument("--ranks-per-node", type=int, default=8, help="GPUs per node (default 8)")
    sp.add_argument("--sp-target-step-time", type=float, default=None,
                    help="seconds an SP batch aims at (default: the policy's step budget)")
    sp.add_argument("--num-heads", type=int, default=12, help="attention heads (default 12: Wan 2.1 1.3B)")
    sp.add_argument("--hidden-dim", type=int, default=1536, help="model width (default 1536: Wan 2.1 1.3B)")
    sp.add_argument("--num-layers", type=int, default=30, help="transformer blocks (default 30: Wan 2.1 1.3B)")
    sp.add_argument("--sp-bandwidth", type=float, default=H200_NVLINK_BANDWIDTH,
                    help="all-to-all bytes/s per rank (default: H200 NVLink per direction, 450e9)")
    sp.add_argument("--sp-latency", type=float, default=H200_NVLINK_LATENCY,
                    help="seconds per all-to-all (default 25e-6, an assumption)")
    sp.add_argument("--sp-alltoalls-per-layer", type=int, default=8,
                    help="all-to-alls per layer per step (8; 12 with activation checkpointing)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    try:
        shapes = load_shapes(args.mixture, args.manifest, args.num_samples, args.vae_stride, args.patch_size)
        cost_model = load_cost_model(args.cost_model, argument="--cost-model") if args.cost_model else None
        seq = shapes.prod(axis=1)
        calibrated = calibrated_m_mem(args.cost_model) if args.cost_model and args.m_mem is None else None
        tiered = calibrated_tiers(args.cost_model) if calibrated is not None and args.m_comp is None else None
        if args.m_mem is not None:
            m_mem, source = args.m_mem, "--m-mem"
        elif calibrated is not None:
            m_mem, source = calibrated, f"derived.m_mem of --cost-model {args.cost_model}"
        else:
            m_mem, source = max(65_520, int(seq.max())), "default: max(65520, longest S)"
        cm = cost_model if cost_model is not None else default_cost_model()
        if tiered is not None:
            # Activation checkpointing per bucket, as the calibrated run trained: each tier's own budget and cost.
            tiers, budgets = tiered
            derivation = derive_policy(cm, shapes, budgets, world_size=max(args.world_sizes), oversize="skip",
                                       seed=args.seed, tiers=tiers)
            dual, m_mem = derivation.policy, budgets[-1]
            cm = derivation.cost_model or cm
            source += "; checkpointing per bucket: " + ", ".join(
                f"'{t.mode}' up to S={t.max_seq_len:,} (M_mem {b:,})" for t, b in zip(tiers, budgets, strict=True))
        elif args.m_comp is not None:
            dual = DualConstraintPolicy(m_mem, args.m_comp, args.p, oversize="skip")
        else:
            dual = derive_policy(cm, shapes, m_mem, world_size=max(args.world_sizes), oversize="skip",
                                 seed=args.seed).policy
        sp_config = sp_comm = None
        if args.sp_degrees is not None:
            sp_config = SequenceParallelConfig(args.sp_degrees, num_heads=args.num_heads,
                                               ranks_per_node=args.ranks_per_node,
                                               target_step_time=args.sp_target_step_time)
            sp_comm = UlyssesCommModel(args.hidden_dim, args.num_layers, bandwidth=args.sp_bandwidth,
                                       latency=args.sp_latency, alltoalls_per_layer=args.sp_alltoalls_per_layer)
        results = compare_policies(shapes, args.world_sizes, dual=dual, m_mem=m_mem, cost_model=cm, seed=args.seed,
                                   sequence_parallel=sp_config, sp_comm=sp_comm)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    units = "your cost model" if cost_model is not None else "the default H200-like cost model"
    above = int((seq > m_mem).sum())
    where = "left out of the data-parallel rows" if sp_config is not None else "left out"
    print(f"M_mem = {m_mem:,} tokens ({source}); {above} samples above it {where}")
    if sp_config is not None:
        print(f"sequence parallelism: degrees {list(sp_config.degrees)}, {args.ranks_per_node} ranks per node; "
              f"{sp_comm}")
    print(f"equal-token: EqualTokenPolicy(max_tokens={m_mem}); dual constraint: {dual!r}")
    for r in results:
        if r.num_steps < 20:
            print(f"warning: {r.world_size} ranks plan only {r.num_steps} steps for {r.samples} samples; "
                  "padding and the last steps dominate, so the comparison says little. Simulate more samples.")
            break
    render(results, f"{len(shapes):,} samples, {units}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
