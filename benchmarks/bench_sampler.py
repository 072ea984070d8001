"""Epoch-planning cost of AdaptiveBucketBatchSampler at corpus scale (CPU).

For 1M and 10M samples drawn from the ``wan_mixed_480p_720p`` mixture and world sizes 8 and 1024,
measures: building the sampler (bucketing the token grids), planning one epoch (``len()``), a
resume re-plan under another world size (half the epoch taken, world size halved), and the peak
Python-heap memory of each (tracemalloc: numpy arrays included) plus the process's peak RSS.

Usage: python benchmarks/bench_sampler.py [--sizes 1000000 10000000] [--world-sizes 8 1024]
Appends a record to benchmarks/results/sampler.json (``--out`` for another file).
"""

from __future__ import annotations

import argparse
import platform
import resource
import time
import tracemalloc
from functools import partial

import numpy as np
from _results import RESULTS, append_record

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler
from lightning_adaptiveload.calibration.simulate import mixture_token_grids
from lightning_adaptiveload.data.mixtures import get_mixture


def _measure(fn):
    tracemalloc.start()
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, dt, peak


def _resume(shapes: np.ndarray, policy: DualConstraintPolicy, world: int, state: dict) -> int:
    sampler = AdaptiveBucketBatchSampler(shapes, policy, num_replicas=world, rank=0, seed=0)
    sampler.load_state_dict(state)
    return len(sampler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 1024])
    parser.add_argument("--out", default=str(RESULTS / "sampler.json"), help="JSON result file (record appended)")
    args = parser.parse_args()

    mixture = get_mixture("wan_mixed_480p_720p")
    policy = DualConstraintPolicy(m_mem=75_600, m_comp=37_800.0**2, p=2.0)
    rows = []
    for n in args.sizes:
        shapes = mixture_token_grids(mixture, n)
        shapes = shapes[np.random.default_rng(0).permutation(n)]
        for world in args.world_sizes:
            sampler, t_build, m_build = _measure(
                partial(AdaptiveBucketBatchSampler, shapes, policy, num_replicas=world, rank=world - 1, seed=0))
            steps, t_plan, m_plan = _measure(sampler.__len__)
            _, t_first, _ = _measure(partial(next, iter(sampler)))
            state = sampler.state_dict(steps_taken=steps // 2)
            _, t_resume, m_resume = _measure(partial(_resume, shapes, policy, max(1, world // 2), state))
            stats = sampler.plan_stats
            rows.append({
                "samples": n, "world_size": world, "buckets": len(sampler.bucket_grids), "steps": steps,
                "build_s": t_build, "plan_s": t_plan, "first_batch_s": t_first, "resume_replan_s": t_resume,
                "peak_heap_build_mb": m_build / 2**20, "peak_heap_plan_mb": m_plan / 2**20,
                "peak_heap_resume_mb": m_resume / 2**20, "padded_samples": stats["padded_samples"],
                "predicted_compute_cv": stats["compute_cv"],
            })
            r = rows[-1]
            print(f"N={n:>10,} W={world:>5}  build {r['build_s']:6.2f}s  plan {r['plan_s']:6.2f}s  "
                  f"resume {r['resume_replan_s']:6.2f}s  heap(plan) {r['peak_heap_plan_mb']:7.0f} MB  "
                  f"heap(resume) {r['peak_heap_resume_mb']:7.0f} MB  steps {steps:>8,}  "
                  f"CV {r['predicted_compute_cv']:.2%}", flush=True)
            del sampler
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"process peak RSS {rss_mb:,.0f} MB (includes the input grids and the interpreter)")
    out = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
           "numpy": np.__version__, "policy": repr(policy), "mixture": "wan_mixed_480p_720p",
           "process_peak_rss_mb": rss_mb, "rows": rows}
    append_record(args.out, "bench_sampler.py", out)
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
