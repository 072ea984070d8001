"""The recipe beside the setups peers train with, measured the same way, from the same seed and corpus:

- ``recipe``       the given overrides as they are (the plugin: calibrated dual-constraint buckets, cost-balanced
                   steps, compiled blocks, attention chosen per bucket);
- ``batch1``       diffusers' ``WanTransformer3DModel`` eager, full activation recomputation, one sample per
                   step (``bucketing=fixed`` with ``default=1``; a DiffSynth-Studio-style setup);
- ``equal_token``  the same model and recomputation with equal-token batches of ``--max-tokens`` tokens
                   (``bucketing=equal_token``, batches dealt at random; a musubi-tuner / Open-Sora-style setup).

Each is one ``adaptiveload-train`` subprocess; figures are ``BalanceMonitor``'s means after its warm-up and
its epoch estimate (the measured per-shape step times over the epoch's plan); MFU = model FLOPs / the GPU's
peak (989 TFLOP/s dense bf16 on an H100/H200). The record stores every run and the recipe's ratio over each
peer (epoch tokens/s).

    python benchmarks/bench_peers.py -- experiment=wan2_1_1_3b_480p trainer.devices=1 trainer.max_steps=40
    python benchmarks/bench_peers.py --peer-model diffusers_wan2_1_tiny --max-tokens 4096 --out /tmp/peers.json \\
        -- model=tiny data=synthetic_tiny trainer.max_steps=6 callbacks.balance_monitor.warmup_steps=2   # CPU smoke
Appends one record to ``benchmarks/results/peers.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402
from bench_quickstart import run_train  # noqa: E402


def peer_overrides(peer: str, model: str, max_tokens: int) -> list[str]:
    """The overrides that turn the recipe into peer setup ``peer`` (``batch1`` or ``equal_token``)."""
    common = [f"model={model}", "model.compile=false", "model.activation_checkpointing=full",
              "model.attention=sdpa", "++callbacks.fused_adaln=null"]
    if peer == "batch1":
        return [*common, "bucketing=fixed", "bucketing.policy.batch_sizes={}", "bucketing.policy.default=1"]
    if peer == "equal_token":
        return [*common, "bucketing=equal_token", f"bucketing.policy.max_tokens={max_tokens}"]
    raise ValueError(f"peer {peer!r}: expected 'batch1' or 'equal_token'")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer-model", default="diffusers_wan2_1_1_3b", help="the peers' model= config")
    p.add_argument("--max-tokens", type=int, default=32_760, help="the equal-token peer's tokens per batch")
    p.add_argument("--peers", nargs="*", default=["batch1", "equal_token"], choices=["batch1", "equal_token"],
                   help="the peer setups to run beside the recipe")
    p.add_argument("--name", default="wan2_1_1_3b_480p", help="what the runs are, stored with the record")
    p.add_argument("--timeout", type=int, default=400, help="seconds per run")
    p.add_argument("--work", type=Path, default=None, help="keep the runs' output here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "peers.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of every run (the recipe's)")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens {args.max_tokens}: expected a positive number of tokens")
    run = run_info()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for setup in ("recipe", *args.peers):
            extra = [] if setup == "recipe" else peer_overrides(setup, args.peer_model, args.max_tokens)
            runs[setup] = run_train(f"peers_{setup}", [*args.overrides, *extra], work, work / f"cache_{setup}",
                                    args.timeout)
            r = runs[setup]
            print(f"{setup}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu'] or 0:.1%} (epoch "
                  f"{r['epoch_tokens_per_s'] or 0:,.0f}, {r['epoch_mfu'] or 0:.1%}); {r['wall_s']:.0f} s", flush=True)
    epoch = {k: r["epoch_tokens_per_s"] or r["tokens_per_s"] for k, r in runs.items()}
    result = {"what": "peers", "name": args.name, "overrides": args.overrides, "peer_model": args.peer_model,
              "max_tokens": args.max_tokens, **runs,
              "recipe_over": {peer: epoch["recipe"] / epoch[peer] for peer in args.peers},
              "how": "one adaptiveload-train subprocess per setup; BalanceMonitor means; ratios of epoch tokens/s"}
    append_record(args.out, "bench_peers.py", result, run)
    print({k: v for k, v in result.items() if k not in runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
