"""End-to-end training benchmark: equal-token buckets vs AdaptiveLoad on a Wan 2.1 DiT under FSDP.

Four configurations train the same model from the same seed on the same mixed image + video
corpus (synthetic tensors, real shape mix):

1. ``equal_token``      EqualTokenPolicy(max_tokens), batches dealt to ranks at random, eager AdaLN;
2. ``dual``             the dual-constraint policy derived from the fitted cost model, dealt at random
                        (the paper's sampler, ``balance="none"``);
3. ``dual_cost``        (2) with cost-balanced steps (``balance="cost"``);
4. ``dual_cost_fused``  (3) with the fused AdaLN kernel.

Before the runs, a shape benchmark times forward + backward of the real FSDP training step on a
small (B, S) grid, fits a :class:`~lightning_adaptiveload.costmodel.CostModel` (form "auto") and a
``MemoryModel``, and derives the dual-constraint policy with ``cost_model.policy(m_mem, step_budget)``.

Every step is timed on every rank (device synchronised, gathered at the end). Under FSDP the ranks
meet in a collective inside every block, so a rank with less work waits there and per-rank *wall*
step times come out nearly equal whatever the balance: the imbalance shows up as lower throughput,
not as spread. To measure the spread itself, a sample of steps is replayed afterwards on a local,
unsharded copy of the model (forward + backward, no collectives): each rank's *isolated compute
time* for its own batch. Step-time CV and the measured bubble come from those replays; the
predicted compute CV and bubble come from the cost model.

Launch (world size from the launcher; 1, 2 or 8 GPUs; CPU + gloo for smoke tests)::

    torchrun --nproc-per-node=2 benchmarks/bench_e2e.py --out benchmarks/results/e2e_h200x2.json
    torchrun --nproc-per-node=2 benchmarks/bench_e2e.py --model tiny --mixture tiny --steps 4 \\
        --warmup 1 --loss-steps 6 --solo-steps 2 --out /tmp/e2e_tiny.json   # CPU smoke

Writes the JSON given by ``--out``, PNGs next to it (see ``benchmarks/plot_e2e.py``) and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_adaptiveload.bucketing.balance import bubble_fraction, simulate, sync_overhead
from lightning_adaptiveload.bucketing.policy import EqualTokenPolicy
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler
from lightning_adaptiveload.costmodel import CostModel, MemoryModel
from lightning_adaptiveload.data.collate import collate_batch
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset
from lightning_adaptiveload.models import WAN_CONFIGS, FlowMatchingModule, WanAttentionBlock, WanModel

RUNS: dict[str, dict[str, Any]] = {
    "equal_token": {"policy": "equal_token", "balance": "none", "fused": False,
                    "label": "(1) equal-token, eager AdaLN"},
    "dual": {"policy": "dual", "balance": "none", "fused": False,
             "label": "(2) dual-constraint (paper, balance=none)"},
    "dual_cost": {"policy": "dual", "balance": "cost", "fused": False,
                  "label": "(3) dual-constraint + balance=cost"},
    "dual_cost_fused": {"policy": "dual", "balance": "cost", "fused": True,
                        "label": "(4) = (3) + fused AdaLN"},
}
# Runs whose loss curves are compared (fidelity): the baseline and the full AdaptiveLoad stack.
LOSS_RUNS = ("equal_token", "dual_cost_fused")

# Estimated seconds the script spends outside the timed runs after the shape benchmark
# (model builds, simulation, plots, JSON); the step allotment keeps this much in reserve.
_RESERVE_S = 25.0


# ----------------------------------------------------------------------------- arguments
def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="wan2_1_1_3b", choices=sorted(WAN_CONFIGS),
                   help="model dimensions (preset)")
    p.add_argument("--layers", type=int, default=2,
                   help="transformer blocks (the 1.3B preset has 30; fewer so four runs and two 200-step "
                        "loss curves fit one 9-minute run). 0 keeps the preset's count.")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute block activations in backward (needed for many layers at 1.3B dims)")
    p.add_argument("--mixture", default="wan_mixed_480p_720p", help="named shape mixture (data/mixtures.py)")
    p.add_argument("--num-samples", type=int, default=20_000, help="corpus size (shapes only matter)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {list(RUNS)}")
    p.add_argument("--steps", type=int, default=40, help="measured steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    p.add_argument("--loss-steps", type=int, default=200,
                   help=f"measured steps of the fidelity runs {LOSS_RUNS} (their loss curves are compared)")
    p.add_argument("--solo-steps", type=int, default=8,
                   help="steps per run replayed on an unsharded local copy to time each rank's compute alone")
    p.add_argument("--max-tokens", type=int, default=65_520,
                   help="equal-token budget B*S (the longest 480p clip, S=32,760, at B=2)")
    p.add_argument("--m-mem", type=int, default=0,
                   help="dual-constraint token budget; 0: from the memory fit (CUDA) capped at "
                        "--m-mem-cap, or the largest profiled B*S on CPU")
    p.add_argument("--m-mem-cap", type=int, default=2 * 75_600,
                   help="upper bound on the automatic m_mem (tokens)")
    p.add_argument("--memory-margin", type=float, default=0.25,
                   help="fraction of device memory held back when deriving m_mem")
    p.add_argument("--step-budget", type=float, default=0.0,
                   help="dual-constraint step budget in seconds; 0: predicted time of one sample of the "
                        "longest S (it runs at B=1, every other bucket is sized to take about as long)")
    p.add_argument("--profile-shapes", type=int, default=4, help="distinct S in the shape benchmark")
    p.add_argument("--profile-batches", type=int, default=3, help="batch sizes per S in the shape benchmark")
    p.add_argument("--profile-repeats", type=int, default=2, help="timed repeats per shape (median kept)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=("device", "loader"), default="device",
                   help="device: sample tensors generated on the accelerator from per-index seeds "
                        "(host data path excluded); loader: the dataset's __getitem__ through a DataLoader")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank (--data loader)")
    p.add_argument("--simulate-ranks", default="8,16", help="extra world sizes for the simulator")
    p.add_argument("--max-seconds", type=float, default=430.0,
                   help="wall-clock budget of the whole script; steps are cut to fit it")
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even if CUDA is available")
    p.add_argument("--out", default="benchmarks/results/e2e.json", help="result JSON; plots go next to it")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    args = p.parse_args(argv)
    unknown = [r for r in args.runs.split(",") if r not in RUNS]
    if unknown:
        p.error(f"--runs has unknown names {unknown}; expected a subset of {list(RUNS)}")
    for name in ("steps", "loss_steps", "num_samples", "max_tokens", "profile_shapes", "profile_batches",
                 "profile_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not valid; expected a positive integer")
    if args.warmup < 0 or args.solo_steps < 0 or args.layers < 0 or args.m_mem < 0:
        p.error("--warmup, --solo-steps, --layers and --m-mem must be >= 0")
    if not 0 <= args.memory_margin < 1:
        p.error(f"--memory-margin={args.memory_margin} is not valid; expected a fraction in [0, 1)")
    return args


# ----------------------------------------------------------------------------- distributed
@dataclasses.dataclass
class _Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_max(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """All-gather a float64 array of equal shape on every rank -> ``[world, *shape]``."""
        t = torch.as_tensor(np.ascontiguousarray(rows, dtype=np.float64), device=self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return torch.stack(out).cpu().numpy()

    def broadcast_obj(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _init_distributed(force_cpu: bool) -> _Dist:
    use_cuda = torch.cuda.is_available() and not force_cpu
    backend = "nccl" if use_cuda else "gloo"
    if "WORLD_SIZE" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    else:
        # Started without a launcher: a one-rank group so the same code path runs.
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return _Dist(dist.get_rank(), dist.get_world_size(), device)


def _log(d: _Dist, msg: str) -> None:
    if d.is_main:
        print(msg, flush=True)


# ----------------------------------------------------------------------------- model
def _model_config(args: argparse.Namespace):
    cfg = WAN_CONFIGS[args.model]
    if args.layers and args.layers != cfg.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    return cfg


def _adaln_ops_module():
    # The package re-exports the function `adaln` under the submodule's name: import the module.
    return importlib.import_module("lightning_adaptiveload.ops.adaln")


def _apply_fused(model: torch.nn.Module) -> dict[str, Any]:
    """Swap every AdaLayerNorm for its fused twin; returns what was done (for the JSON)."""
    from lightning_adaptiveload.callbacks.fused_adaln import apply_fused_adaln

    adaln_ops = _adaln_ops_module()
    return {"modules_swapped": apply_fused_adaln(model),
            "kernel_built": adaln_ops._extension is not None, "build_error": adaln_ops._build_error}


def _build_fused_kernel(d: _Dist) -> dict[str, Any]:
    """Build (JIT, cached) the fused AdaLN extension before any timing; rank 0 first, the others
    then load its cached build. Without CUDA the fused modules run the reference (and say so)."""
    adaln_ops = _adaln_ops_module()
    t0 = time.perf_counter()
    if d.device.type == "cuda":
        for turn in (0, 1):
            if (d.rank == 0) == (turn == 0):
                adaln_ops._load_extension()
            dist.barrier()
    # Built only if built on every rank: otherwise run (4) would mix kernels across ranks.
    built = d.all_max(0.0 if adaln_ops._extension is not None else 1.0) == 0
    return {"seconds": time.perf_counter() - t0, "kernel_built": built, "build_error": adaln_ops._build_error}


def _build_module(args: argparse.Namespace, cfg, fused: bool, d: _Dist) -> tuple[FlowMatchingModule, Any, dict]:
    """FlowMatchingModule with its Wan model sharded by FSDP2 per block, and its AdamW."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(args.seed)  # identical initial weights on every rank and in every run
    module = FlowMatchingModule(cfg, lr=args.lr, activation_checkpointing=args.activation_checkpointing)
    with torch.device(d.device):  # initialise on the device: seconds instead of minutes at 30 layers
        module.configure_model()
    info: dict[str, Any] = {}
    if fused:
        info = _apply_fused(module.model)
    module.to(d.device)
    # fp32 parameters and gradient reduction; compute in bf16 under autocast (Lightning's
    # "bf16-mixed"): the model keeps its residual stream and modulation in fp32 as Wan does.
    for block in module.model.modules():
        if isinstance(block, WanAttentionBlock):
            fully_shard(block)
    fully_shard(module.model)
    opt = module.configure_optimizers()
    if isinstance(opt, dict):
        opt = opt["optimizer"]
    return module, opt, info


def _autocast(d: _Dist):
    return torch.autocast(d.device.type, dtype=torch.bfloat16)


def _forward_backward(module: FlowMatchingModule, batch: dict, d: _Dist) -> torch.Tensor:
    with _autocast(d):
        loss = module.compute_loss(batch)
    loss.backward()
    return loss.detach()


# ----------------------------------------------------------------------------- data
class _DeviceBatches:
    """Batches generated on the device, each sample from a seed of (corpus seed, index).

    The content of sample ``i`` is the same in every run and on every rank, like a dataset read
    from disk; only the host path (decode, pin, copy) is left out of the timing.
    """

    def __init__(self, dataset: SyntheticMixedDataset, d: _Dist) -> None:
        self.ds = dataset
        self.grids = dataset.token_grids()
        self.d = d

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        ds, dev = self.ds, self.d.device
        lat = ds.latent_grid(indices[0])
        b = len(indices)
        latents = torch.empty((b, ds.latent_channels, *lat), device=dev)
        context = torch.empty((b, ds.text_len, ds.text_dim), device=dev)
        gen = torch.Generator(device=dev)
        for j, i in enumerate(indices):
            if ds.latent_grid(i) != lat:
                raise ValueError(f"batch mixes token grids: index {i} has latent {ds.latent_grid(i)}, "
                                 f"index {indices[0]} has {lat}; the sampler must group one grid per batch")
            gen.manual_seed((ds.seed * 1_000_003 + int(i)) % (2**63))
            torch.randn(latents.shape[1:], generator=gen, device=dev, out=latents[j])
            torch.randn(context.shape[1:], generator=gen, device=dev, out=context[j])
        return {"latents": latents, "context": context,
                "index": torch.tensor(indices, dtype=torch.long, device=dev)}


def _batches(args, dataset, sampler, d: _Dist) -> Iterator[tuple[list[int], dict]]:
    """Endless (indices, batch) stream of this rank, over epochs."""
    epoch = 0
    if args.data == "device":
        make = _DeviceBatches(dataset, d)
        while True:
            sampler.set_epoch(epoch)
            for indices in sampler:
                yield indices, make(indices)
            epoch += 1
    else:
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_batch, num_workers=args.workers,
            pin_memory=d.device.type == "cuda", persistent_workers=args.workers > 0)
        while True:
            sampler.set_epoch(epoch)
            for batch in loader:
                idx = batch["index"].tolist()
                yield idx, {k: v.to(d.device, non_blocking=True) for k, v in batch.items()}
            epoch += 1


# ----------------------------------------------------------------------------- shape benchmark
def _profile_plan(grids: np.ndarray, args: argparse.Namespace) -> list[tuple[int, tuple[int, int, int]]]:
    """(B, grid) points: up to ``profile_shapes`` S spread over the corpus' range, B geometric
    from 1 to about ``m_mem_cap / S`` (so the memory fit sees the token counts the policy will use)."""
    seq = grids.prod(axis=1)
    uniq, first = np.unique(seq, return_index=True)
    pick = np.unique(np.round(np.linspace(0, len(uniq) - 1, min(args.profile_shapes, len(uniq)))).astype(int))
    cap = args.m_mem if args.m_mem else args.m_mem_cap
    plan = []
    for k in pick:
        s, grid = int(uniq[k]), tuple(int(v) for v in grids[first[k]])
        b_max = max(1, cap // s)
        bs = sorted({int(round(b)) for b in np.geomspace(1, b_max, args.profile_batches)})
        plan += [(b, grid) for b in bs]
    if len(uniq) == 1 or len({b * int(np.prod(g)) for b, g in plan}) < 2:
        raise ValueError(f"mixture {args.mixture!r} gives too few distinct shapes to fit a cost model")
    return plan


def _shape_benchmark(module, args, grids: np.ndarray, d: _Dist) -> dict[str, Any]:
    """Time forward + backward of the FSDP step on a (B, S) grid, fit the cost and memory models.

    The optimizer never steps and gradients are dropped, so the weights are untouched; the RNG
    state is restored so the run that follows draws the same numbers as without profiling.
    """
    start = time.perf_counter()
    rng_cpu = torch.get_rng_state()
    rng_dev = torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None
    points = []
    for b, grid in _profile_plan(grids, args):
        batch = module.synthetic_batch(b, grid, device=d.device, seed=args.seed)
        times, peak, status = [], None, "ok"
        if d.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d.device)
        try:
            for r in range(1 + args.profile_repeats):
                dist.barrier()
                d.sync()
                t0 = time.perf_counter()
                _forward_backward(module, batch, d)
                d.sync()
                if r:  # the first repeat warms up kernels and allocator
                    times.append(time.perf_counter() - t0)
                module.model.zero_grad(set_to_none=True)
        except torch.OutOfMemoryError:
            status = "oom"
            module.model.zero_grad(set_to_none=True)
        if d.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(d.device)
        del batch
        # Agree on the status and take the slowest rank's time: the step lasts that long.
        oom = d.all_max(1.0 if status == "oom" else 0.0) > 0
        t = d.all_max(float(np.median(times))) if not oom else None
        pk = d.all_max(float(peak)) if peak is not None else None
        points.append({"batch_size": b, "grid": list(grid), "seq_len": int(np.prod(grid)),
                       "time_s": t, "peak_bytes": pk, "status": "oom" if oom else "ok"})
        _log(d, f"  profile B={b:4d} S={int(np.prod(grid)):6d}: "
                + ("out of memory" if oom else f"{t * 1e3:8.1f} ms" + (f", peak {pk / 2**30:.1f} GiB" if pk else "")))
    torch.set_rng_state(rng_cpu)
    if rng_dev is not None:
        torch.cuda.set_rng_state(rng_dev, d.device)
    ok = [p for p in points if p["status"] == "ok"]
    b = np.array([p["batch_size"] for p in ok])
    s = np.array([p["seq_len"] for p in ok])
    fit_payload = None
    if d.is_main:
        times = np.array([p["time_s"] for p in ok])
        cm = CostModel.fit(b, s, times, form="auto")
        # The paper's policy needs the power form; "auto" may prefer the quadratic one, which
        # then only drives the cost balancing and the simulator.
        power = cm if cm.form == "power" else CostModel.fit(b, s, times, form="power")
        mm = None
        if d.device.type == "cuda" and len(np.unique(b * s)) >= 2:
            with contextlib.suppress(ValueError):
                mm = MemoryModel.fit(b, s, np.array([p["peak_bytes"] for p in ok]))
        fit_payload = (cm.to_json(), power.to_json(), None if mm is None else mm.to_dict())
    # Invariant: every rank plans with rank 0's fit.
    cm_json, power_json, mm_dict = d.broadcast_obj(fit_payload)
    cost_model = CostModel.from_json(cm_json)
    memory_model = None if mm_dict is None else MemoryModel.from_dict(mm_dict)
    oom_tokens = [p["batch_size"] * p["seq_len"] for p in points if p["status"] == "oom"]
    return {"points": points, "cost_model": cost_model, "power_model": CostModel.from_json(power_json),
            "memory_model": memory_model,
            "oom_tokens": oom_tokens, "overhead_s": time.perf_counter() - start}


def _derive_policy(profile: dict, grids: np.ndarray, args: argparse.Namespace, d: _Dist) -> dict[str, Any]:
    """``m_mem`` and the step budget, then the paper's ``DualConstraintPolicy`` from the power-law fit."""
    seq = grids.prod(axis=1)
    s_max = int(seq.max())
    mm: MemoryModel | None = profile["memory_model"]
    if args.m_mem:
        m_mem, source = args.m_mem, "--m-mem"
    elif mm is not None:
        total = torch.cuda.get_device_properties(d.device).total_memory
        fit = mm.max_tokens(total, margin=args.memory_margin, oom_tokens=profile["oom_tokens"] or None)
        m_mem, source = min(fit, args.m_mem_cap), f"memory fit ({fit} tokens) capped at --m-mem-cap"
    else:
        profiled = max(p["batch_size"] * p["seq_len"] for p in profile["points"] if p["status"] == "ok")
        m_mem, source = profiled, "largest profiled B*S (no memory fit on this device)"
    if m_mem < s_max:
        raise ValueError(f"m_mem={m_mem} tokens is below the longest sample (S={s_max}) of mixture "
                         f"{args.mixture!r}; lower --layers, add --activation-checkpointing or pass --m-mem")
    power: CostModel = profile["power_model"]
    budget = args.step_budget or float(power.predict(1, s_max))
    policy = power.policy(m_mem, budget)
    return {"policy": policy, "m_mem": int(m_mem), "m_mem_source": source, "step_budget_s": budget,
            "step_budget_source": "--step-budget" if args.step_budget else f"predicted time of B=1, S={s_max}"}


# ----------------------------------------------------------------------------- runs
def _warm_shapes(module, policies: dict, grids: np.ndarray, args, d: _Dist) -> dict[str, Any]:
    """One untimed forward + backward of every (B, S) the runs' policies produce.

    Attention and GEMM back ends pick (and some build) kernels per shape on first use; without
    this, the run that meets a shape first would pay for it inside its measured steps. Weights,
    optimizer and RNG stream are left as they were (as in the shape benchmark).
    """
    start = time.perf_counter()
    seq, first = np.unique(grids.prod(axis=1), return_index=True)
    pairs = sorted({(int(b), tuple(int(v) for v in grids[i]))
                    for pol in policies.values() for b, i in zip(pol.batch_sizes(seq), first, strict=True)})
    rng_cpu = torch.get_rng_state()
    rng_dev = torch.cuda.get_rng_state(d.device) if d.device.type == "cuda" else None
    for b, grid in pairs:
        _forward_backward(module, module.synthetic_batch(b, grid, device=d.device, seed=args.seed), d)
        module.model.zero_grad(set_to_none=True)
    d.sync()
    torch.set_rng_state(rng_cpu)
    if rng_dev is not None:
        torch.cuda.set_rng_state(rng_dev, d.device)
    return {"shapes": len(pairs), "seconds": time.perf_counter() - start}


def _sampler(grids, policy, balance, cost_model, args, d: _Dist, rank: int | None = None):
    return AdaptiveBucketBatchSampler(grids, policy, num_replicas=d.world, rank=d.rank if rank is None else rank,
                                      seed=args.seed, shuffle=True, balance=balance, cost_model=cost_model)


def _predicted_step_seconds(grids, policy, balance, cost_model, args, d: _Dist, n: int) -> float:
    """Predicted wall seconds of the first ``n`` steps of a run's plan (slowest rank per step)."""
    sampler = _sampler(grids, policy, balance, cost_model, args, d)
    plan = sampler._active_plan()
    steps = plan.steps[:n]
    return float(plan.batch_cost[steps].max(axis=1).sum() * (n / max(1, len(steps))))


def _run(name: str, spec: dict, n_steps: int, deadline: float, ctx: dict, args, d: _Dist) -> dict[str, Any]:
    """Train one configuration; returns per-step, per-rank records and summary metrics."""
    grids, cm, cfg = ctx["grids"], ctx["cost_model"], ctx["model_config"]
    policy = ctx["policies"][spec["policy"]]
    module, opt, fused_info = ctx.pop("prebuilt", None) or _build_module(args, cfg, spec["fused"], d)
    sampler = _sampler(grids, policy, spec["balance"], cm, args, d)
    stream = _batches(args, ctx["dataset"], sampler, d)
    # Same training RNG stream in every run; ranks differ so each draws its own noise/timesteps.
    torch.manual_seed(args.seed + 1 + d.rank)
    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)
    rows, replay, total = [], [], args.warmup + n_steps
    wall_start = wall_end = None
    stop = torch.zeros(1, device=d.device)
    for step in range(total):
        if step == args.warmup:
            wall_start = time.perf_counter()
        indices, batch = next(stream)
        b, s = len(indices), int(np.prod(grids[indices[0]]))
        # The all-reduce is the per-step barrier (ranks start together) and the shared stop vote.
        stop.fill_(1.0 if time.perf_counter() > deadline and step >= args.warmup + 2 else 0.0)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        d.sync()
        if stop.item() > 0:
            break
        t0 = time.perf_counter()
        loss = _forward_backward(module, batch, d)
        opt.step()
        opt.zero_grad(set_to_none=True)
        d.sync()
        t1 = time.perf_counter()
        if step >= args.warmup:
            wall_end = t1
            rows.append([t1 - t0, b * s, b, s, float(cm.predict(b, s)), float(loss.item())])
            replay.append(indices)
        del batch
    d.sync()
    # Wall time of the measured steps: data generation, the per-step barrier and the step itself.
    wall = wall_end - wall_start if wall_end is not None else 0.0
    # Every rank took the same number of steps (shared stop vote), so the arrays line up.
    peak = torch.cuda.max_memory_allocated(d.device) if d.device.type == "cuda" else 0
    del stream, module, opt
    gc.collect()
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    solo = _replay_isolated(replay, spec, ctx, args, d)
    arr = d.gather(np.asarray(rows, dtype=np.float64).reshape(len(rows), 6))  # [world, steps, 6]
    peak_all = d.gather(np.array([float(peak)]))[:, 0]
    wall = d.all_max(wall)
    return _summarize(name, spec, arr, solo, wall, peak_all, fused_info, policy, n_steps)


def _replay_isolated(replay: list[list[int]], spec: dict, ctx: dict, args, d: _Dist) -> np.ndarray:
    """Each rank's forward + backward time for its own batches on a local unsharded model.

    No collectives run inside the timed region, so a rank's time is its own compute alone (the
    FSDP wall time hides it: ranks wait for each other inside every block). Same model class,
    dtype policy and AdaLN variant as the run; weights do not affect the time.
    """
    k = min(args.solo_steps, len(replay))
    if k == 0:
        return np.zeros((d.world, 0))
    pick = np.unique(np.linspace(0, len(replay) - 1, k).round().astype(int))
    torch.manual_seed(args.seed)
    local = FlowMatchingModule(ctx["model_config"], activation_checkpointing=args.activation_checkpointing)
    with torch.device(d.device):
        local.model = WanModel(ctx["model_config"])
    local.model.set_gradient_checkpointing(args.activation_checkpointing)
    if spec["fused"]:
        _apply_fused(local.model)
    local.to(d.device)
    make = _DeviceBatches(ctx["dataset"], d)
    times = []
    for n, i in enumerate([int(v) for v in pick] + [int(pick[0])]):
        batch = make(replay[i])
        dist.barrier()
        d.sync()
        t0 = time.perf_counter()
        _forward_backward(local, batch, d)
        d.sync()
        if n:  # the first replay warms up this copy; its step is replayed again at the end
            times.append(time.perf_counter() - t0)
        local.model.zero_grad(set_to_none=True)
        del batch
    del local
    gc.collect()
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    # Re-order so column j is replayed step pick[j] on every rank.
    times = times[-1:] + times[:-1]
    return d.gather(np.asarray(times))  # [world, k]


def _cv_over_steps(per_rank: np.ndarray) -> float:
    """Mean over steps of the per-step CV across ranks; ``per_rank`` is ``[world, steps]``."""
    if per_rank.size == 0:
        return float("nan")
    return float(np.mean(sync_overhead(per_rank.T)))


def _bubble(per_rank: np.ndarray) -> float:
    if per_rank.size == 0:
        return float("nan")
    return float(np.mean(bubble_fraction(per_rank.T)))


def _summarize(name, spec, arr, solo, wall, peak_all, fused_info, policy, n_planned) -> dict[str, Any]:
    step_t, tokens, samples, seq, pred, loss = (arr[..., j] for j in range(6))
    n = arr.shape[1]
    step_max = step_t.max(axis=0) if n else np.zeros(0)
    total_tokens = float(tokens.sum())
    total_samples = float(samples.sum())
    return {
        "label": spec["label"], "policy": repr(policy), "balance": spec["balance"], "fused_adaln": spec["fused"],
        "fused_adaln_info": fused_info, "planned_steps": n_planned, "measured_steps": n,
        "wall_s": wall,
        "tokens_per_s": total_tokens / wall if wall > 0 else float("nan"),
        "samples_per_s": total_samples / wall if wall > 0 else float("nan"),
        # Throughput from device step time only (no data generation, no per-step barrier).
        "tokens_per_s_step": total_tokens / float(step_max.sum()) if n else float("nan"),
        "tokens_per_step_mean": total_tokens / max(1, n),
        "step_time_median_s": float(np.median(step_max)) if n else float("nan"),
        "step_time_p90_s": float(np.percentile(step_max, 90)) if n else float("nan"),
        "step_time_cv": _cv_over_steps(solo),
        "bubble": _bubble(solo),
        "compute_cv": _cv_over_steps(pred),
        "bubble_predicted": _bubble(pred),
        "fsdp_wall_step_time_cv": _cv_over_steps(step_t),
        "fsdp_wall_bubble": _bubble(step_t),
        "isolated_steps": int(solo.shape[1]),
        "peak_memory_gib": float(peak_all.max()) / 2**30,
        "per_step": {
            "step_time_s": step_t.tolist(), "tokens": tokens.astype(int).tolist(),
            "batch_size": samples.astype(int).tolist(), "seq_len": seq.astype(int).tolist(),
            "predicted_s": pred.tolist(), "loss": loss.tolist(), "isolated_s": solo.tolist(),
        },
    }


# ----------------------------------------------------------------------------- budget
def _allot_steps(names: list[str], ctx: dict, args, d: _Dist, remaining: float) -> dict[str, int]:
    """Measured steps per run so the predicted total fits ``remaining`` seconds.

    Per-step cost is predicted from the fitted cost model on each run's own plan, plus the
    measured per-step overhead ratio of the profiling phase; fidelity runs keep ``--loss-steps``
    as long as possible and the others are cut first.
    """
    want = {n: args.loss_steps if n in LOSS_RUNS else args.steps for n in names}
    want = {n: max(v, args.steps) for n, v in want.items()}
    per_step = {}
    for n in names:
        spec = RUNS[n]
        pol = ctx["policies"][spec["policy"]]
        per_step[n] = _predicted_step_seconds(ctx["grids"], pol, spec["balance"], ctx["cost_model"], args, d,
                                              200) / 200 * 1.15 + 0.01
    solo = {n: per_step[n] * (args.solo_steps + 1) for n in names}

    def total(steps: dict[str, int]) -> float:
        return sum(per_step[n] * (args.warmup + steps[n]) + solo[n] + 5.0 for n in names)

    steps = dict(want)
    while total(steps) > remaining:
        others = [n for n in names if n not in LOSS_RUNS and steps[n] > 10]
        cut = others or [n for n in names if steps[n] > 10]
        if not cut:
            break
        for n in cut:
            steps[n] = max(10, int(steps[n] * 0.85))
    ctx["predicted_step_s"] = per_step
    return steps


# ----------------------------------------------------------------------------- fidelity & simulation
def _fidelity(runs: dict[str, dict]) -> dict[str, Any] | None:
    if not all(n in runs for n in LOSS_RUNS):
        return None
    curves = {n: np.asarray(runs[n]["per_step"]["loss"]).mean(axis=0) for n in LOSS_RUNS}
    n = min(len(c) for c in curves.values())
    tail = min(n, max(2, min(50, n // 4)))
    out: dict[str, Any] = {"steps_compared": n, "tail_steps": tail}
    means, ses = [], []
    for name, c in curves.items():
        t = c[n - tail: n]
        means.append(float(t.mean()))
        ses.append(float(t.std(ddof=1) / math.sqrt(tail)) if tail > 1 else float("nan"))
        out[f"{name}_tail_mean"] = means[-1]
        out[f"{name}_tail_stderr"] = ses[-1]
    diff = means[1] - means[0]
    noise = math.sqrt(ses[0] ** 2 + ses[1] ** 2)
    out.update({"tail_mean_diff": diff, "tail_diff_stderr": noise,
                "within_noise": bool(abs(diff) <= 2 * noise) if math.isfinite(noise) else None,
                "note": "Same corpus (sample i has identical tensors in both runs) and the same seed for "
                        "weights and the noise/timestep stream; the data order and the batch sizes differ "
                        "by design, so per-step values differ and the curves are compared by level."})
    return out


def _simulation(ctx: dict, runs: dict[str, dict], args, d: _Dist) -> dict[str, Any]:
    grids, cm = ctx["grids"], ctx["cost_model"]
    worlds = sorted({d.world, *(int(w) for w in args.simulate_ranks.split(",") if w)})
    out: dict[str, Any] = {"cost_model": cm.to_dict(), "world_sizes": worlds, "results": {}}
    seen = set()
    for name, spec in RUNS.items():
        # Fused AdaLN changes kernels, not the plan: the simulator sees (3) and (4) alike.
        key = (spec["policy"], spec["balance"])
        if key in seen:
            continue
        seen.add(key)
        pol = ctx["policies"][spec["policy"]]
        for w in worlds:
            r = simulate(grids, pol, w, cost_model=cm, balance=spec["balance"], seed=args.seed, name=name)
            out["results"].setdefault(name, {})[str(w)] = {k: v for k, v in r.to_dict().items()}
    base = out["results"].get("equal_token", {})
    for per_world in out["results"].values():
        for w, r in per_world.items():
            if w in base and base[w]["tokens_per_s"] > 0:
                r["tokens_per_s_gain_vs_equal_token"] = r["tokens_per_s"] / base[w]["tokens_per_s"] - 1
    # Prediction error at the measured world size: predicted vs measured, per run.
    err = {}
    for name, run in runs.items():
        spec = RUNS[name]
        sim_name = next(n for n, s in RUNS.items() if (s["policy"], s["balance"]) == (spec["policy"], spec["balance"]))
        sim = out["results"][sim_name][str(d.world)]
        # Compare against device step time (the simulator has no data generation or barrier).
        meas_tps = run["tokens_per_s_step"]
        # The same comparison on exactly the measured steps (the epoch simulation covers the whole plan).
        pred = np.asarray(run["per_step"]["predicted_s"])
        same = float(np.sum(run["per_step"]["tokens"]) / pred.max(axis=0).sum()) if pred.size else float("nan")
        err[name] = {
            "predicted_tokens_per_s_same_steps": same,
            "same_steps_rel_error": same / meas_tps - 1 if meas_tps > 0 else float("nan"),
            "predicted_tokens_per_s": sim["tokens_per_s"], "measured_tokens_per_s": meas_tps,
            "tokens_per_s_rel_error": sim["tokens_per_s"] / meas_tps - 1 if meas_tps > 0 else float("nan"),
            "predicted_bubble": sim["bubble"], "measured_bubble": run["bubble"],
            "bubble_abs_error": sim["bubble"] - run["bubble"] if math.isfinite(run["bubble"]) else float("nan"),
        }
    out["prediction_error_at_measured_world"] = err
    return out


# ----------------------------------------------------------------------------- output
def _table(runs: dict[str, dict]) -> str:
    base = runs.get("equal_token", {}).get("tokens_per_s")
    head = ("| run | tokens/s | vs (1) | samples/s | step-time CV | compute CV (pred.) | bubble | "
            "FSDP wall CV | peak mem (GiB) | profiling (s) | steps |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs.values():
        gain = f"{r['tokens_per_s'] / base - 1:+.1%}" if base else "–"
        lines.append(
            f"| {r['label']} | {r['tokens_per_s']:,.0f} | {gain} | {r['samples_per_s']:.2f} | "
            f"{r['step_time_cv']:.1%} | {r['compute_cv']:.1%} | {r['bubble']:.1%} | "
            f"{r['fsdp_wall_step_time_cv']:.1%} | {r['peak_memory_gib']:.1f} | {r['profiling_overhead_s']:.1f} | "
            f"{r['measured_steps']} |")
    return "\n".join(lines)


def _sim_table(sim: dict) -> str:
    lines = ["| plan | ranks | tokens/s (pred.) | vs equal-token | compute CV | bubble |", "|---|---|---|---|---|---|"]
    for name, per_world in sim["results"].items():
        for w, r in per_world.items():
            g = r.get("tokens_per_s_gain_vs_equal_token")
            lines.append(f"| {name} | {w} | {r['tokens_per_s']:,.0f} | {'–' if g is None else f'{g:+.1%}'} | "
                         f"{r['compute_cv']:.1%} | {r['bubble']:.1%} |")
    return "\n".join(lines)


def _hardware(d: _Dist) -> dict[str, Any]:
    hw = {"device_type": d.device.type, "world_size": d.world, "torch": torch.__version__,
          "python": platform.python_version(), "host": platform.node()}
    if d.device.type == "cuda":
        props = torch.cuda.get_device_properties(d.device)
        hw.update({"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30,
                   "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    return hw


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = _parse_args(argv)
    d = _init_distributed(args.cpu)
    try:
        return _main(args, d, t_start)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _main(args: argparse.Namespace, d: _Dist, t_start: float) -> dict[str, Any]:
    deadline_all = t_start + args.max_seconds
    cfg = _model_config(args)
    preset_layers = WAN_CONFIGS[args.model].num_layers
    names = args.runs.split(",")
    dataset = SyntheticMixedDataset(args.num_samples, args.mixture, latent_channels=cfg.in_dim,
                                    text_len=cfg.text_len, text_dim=cfg.text_dim, seed=args.seed)
    grids = dataset.token_grids()
    _log(d, f"# bench_e2e: {d.world} rank(s) on {d.device.type}, model {args.model} "
            f"(dim {cfg.dim}, ffn {cfg.ffn_dim}, {cfg.num_heads} heads), {cfg.num_layers} layers"
            + (f" (reduced from {preset_layers} to fit the time budget; per-block costs are unchanged, "
               f"the fixed per-step overhead weighs more)" if cfg.num_layers != preset_layers else "")
            + f", activation checkpointing {'on' if args.activation_checkpointing else 'off'}, bf16 autocast, "
            f"FSDP2 per WanAttentionBlock; mixture {args.mixture!r}, {args.num_samples} samples, seed {args.seed}")

    ctx: dict[str, Any] = {"grids": grids, "dataset": dataset, "model_config": cfg, "policies": {}}
    if any(RUNS[n]["fused"] for n in names):
        # Build the fused kernel now (a JIT compile on a fresh machine) so no run times it.
        ctx["fused_build"] = _build_fused_kernel(d)
        _log(d, f"fused AdaLN kernel: {ctx['fused_build']}")

    # Shape benchmark on the first run's model (eager AdaLN); profiling leaves weights untouched.
    first = names[0]
    prebuilt = _build_module(args, cfg, RUNS[first]["fused"], d)
    _log(d, "shape benchmark (forward + backward of the FSDP step):")
    profile = _shape_benchmark(prebuilt[0], args, grids, d)
    ctx["prebuilt"] = prebuilt
    cm: CostModel = profile["cost_model"]
    ctx["cost_model"] = cm
    derived = _derive_policy(profile, grids, args, d)
    ctx["policies"] = {"equal_token": EqualTokenPolicy(args.max_tokens), "dual": derived["policy"]}
    _log(d, f"{cm}\nprofiling overhead {profile['overhead_s']:.1f} s; m_mem={derived['m_mem']} "
            f"({derived['m_mem_source']}), step budget {derived['step_budget_s'] * 1e3:.1f} ms "
            f"({derived['step_budget_source']})\nequal-token: {ctx['policies']['equal_token']!r}\n"
            f"dual-constraint: {derived['policy']!r}")

    ctx["shape_warmup"] = _warm_shapes(prebuilt[0], ctx["policies"], grids, args, d)
    _log(d, f"warmed {ctx['shape_warmup']['shapes']} (B, S) shapes in {ctx['shape_warmup']['seconds']:.1f} s")

    remaining = deadline_all - time.perf_counter() - _RESERVE_S
    steps = _allot_steps(names, ctx, args, d, remaining)
    cut = {n: s for n, s in steps.items() if s < (args.loss_steps if n in LOSS_RUNS else args.steps)}
    _log(d, f"steps per run: {steps}" + (f" (cut to fit --max-seconds={args.max_seconds:g}: {cut})" if cut else ""))

    runs: dict[str, dict] = {}
    # Share the time left between the runs in proportion to their predicted cost; each run stops
    # at its own deadline (a shared vote, so ranks stop on the same step).
    cost = {n: ctx["predicted_step_s"][n] * (args.warmup + steps[n] + args.solo_steps + 1) + 5.0 for n in names}
    for i, name in enumerate(names):
        left = deadline_all - time.perf_counter() - _RESERVE_S
        share = cost[name] / sum(cost[n] for n in names[i:])
        deadline = time.perf_counter() + max(0.0, left * share - ctx["predicted_step_s"][name] * (args.solo_steps + 1))
        _log(d, f"run {RUNS[name]['label']}: {steps[name]} steps")
        run = _run(name, RUNS[name], steps[name], deadline, ctx, args, d)
        run["profiling_overhead_s"] = 0.0 if RUNS[name]["policy"] == "equal_token" else profile["overhead_s"]
        runs[name] = run
        _log(d, f"  {run['measured_steps']} steps, {run['tokens_per_s']:,.0f} tokens/s, "
                f"step-time CV {run['step_time_cv']:.1%}, compute CV {run['compute_cv']:.1%}, "
                f"bubble {run['bubble']:.1%}, peak {run['peak_memory_gib']:.1f} GiB")

    sim = _simulation(ctx, runs, args, d)
    result = {
        "benchmark": "bench_e2e",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "args": vars(args),
        "hardware": _hardware(d),
        "model": {**dataclasses.asdict(cfg), "preset": args.model, "preset_layers": preset_layers,
                  "layers_reduced": cfg.num_layers != preset_layers,
                  "activation_checkpointing": args.activation_checkpointing, "precision": "bf16 autocast, fp32 params",
                  "parallelism": "FSDP2 fully_shard per WanAttentionBlock + root"},
        "data": {"mixture": args.mixture, "num_samples": args.num_samples, "source": args.data,
                 "buckets": dataset.describe()},
        "fused_build": ctx.get("fused_build"),
        "shape_warmup": ctx["shape_warmup"],
        "shape_benchmark": {"points": profile["points"], "cost_model": cm.to_dict(),
                            "power_model": profile["power_model"].to_dict(),
                            "memory_model": None if profile["memory_model"] is None else profile["memory_model"].to_dict(),
                            "overhead_s": profile["overhead_s"]},
        "policies": {"equal_token": ctx["policies"]["equal_token"].to_dict(),
                     "dual": derived["policy"].to_dict(),
                     **{k: v for k, v in derived.items() if k != "policy"}},
        "runs": runs,
        "simulation": sim,
        "fidelity": _fidelity(runs),
        "total_seconds": time.perf_counter() - t_start,
    }
    if d.is_main:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = _jsonable(result)
        out.write_text(json.dumps(result, indent=1))
        print("\n" + _table(runs) + "\n\nSimulator (fitted cost model):\n" + _sim_table(sim))
        for name, e in sim["prediction_error_at_measured_world"].items():
            print(f"  {name}: predicted {e['predicted_tokens_per_s']:,.0f} (epoch) / "
                  f"{e['predicted_tokens_per_s_same_steps']:,.0f} (same steps) vs measured "
                  f"{e['measured_tokens_per_s']:,.0f} tokens/s ({e['tokens_per_s_rel_error']:+.1%} / "
                  f"{e['same_steps_rel_error']:+.1%}); bubble "
                  f"predicted {e['predicted_bubble']:.1%} vs measured {e['measured_bubble']:.1%}")
        if result["fidelity"]:
            f = result["fidelity"]
            noise = "n/a" if f["tail_diff_stderr"] is None else f"{2 * f['tail_diff_stderr']:.4f}"
            print(f"fidelity: last {f['tail_steps']} steps mean loss {f['equal_token_tail_mean']:.4f} vs "
                  f"{f['dual_cost_fused_tail_mean']:.4f} (diff {f['tail_mean_diff']:+.4f}, 2σ {noise}, "
                  f"within noise: {f['within_noise']})")
        if not args.no_plots:
            from plot_e2e import plot_all  # noqa: PLC0415 (matplotlib only where plots are wanted)

            for path in plot_all(result, out.parent, out.stem):
                print(f"wrote {path}")
        print(f"wrote {out} in {result['total_seconds']:.0f} s")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
