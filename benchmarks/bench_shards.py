"""Shape index at corpus scale, and data loading from shards at Wan 1.3B sizes (CPU).

1. Index scale: writes a synthetic ``index.parquet`` of N rows (token grids from the
   ``wan_mixed_480p_720p`` mixture, 1,000 samples per shard; the shard files themselves are not
   written), then in a FRESH process per size measures: opening it with
   ``ShardedLatentDataset(check_shards=False)``, ``token_grids()``, building
   ``AdaptiveBucketBatchSampler(grids, policy, num_replicas=64, rank=0)``, ``len(sampler)`` (plans the
   epoch) and the first ``next(iter(sampler))``; and that process's peak RSS, i.e. what one rank pays.
2. Loading: writes real shards of latents ``[16, 21, 60, 104]`` and context ``[512, 4096]`` (float16 on
   disk, as adaptiveload-prepare stores them; float32 out) and reads every sample once through
   ``AdaptiveLoadDataModule.train_dataloader()`` with 0 and 2 workers. The shards were just written, so
   they are in the page cache: this measures parse + conversion + collation, not a disk.

Usage: python benchmarks/bench_shards.py [--sizes 10000000 100000000] [--load-samples 48]
Appends a record to benchmarks/results/shards.json (``--out`` for another file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _results import RESULTS, append_record


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not getrusage: its maxrss survives exec, so a child started by a big
    parent would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


POLICY = {"m_mem": 75_600, "m_comp": 37_800.0**2, "p": 2.0}
PER_SHARD = 1000


def build_index(path: Path, n: int) -> float:
    """A synthetic index of n rows with real-looking offsets (what 1.3B-size members would have)."""
    import pyarrow as pa

    from lightning_adaptiveload.calibration.simulate import mixture_token_grids
    from lightning_adaptiveload.data.mixtures import get_mixture
    from lightning_adaptiveload.data.shards import INDEX_COLUMNS, write_index

    t = time.perf_counter()
    grids = mixture_token_grids(get_mixture("wan_mixed_480p_720p"), n)
    grids = grids[np.random.default_rng(0).permutation(n)].astype(np.int32)
    latent = grids * np.array([1, 2, 2], dtype=np.int32)
    lat_size = 128 + 2 * 16 * latent.prod(axis=1).astype(np.int64)
    ctx_len = np.full(n, 40, dtype=np.int32)
    ctx_size = 128 + 2 * 4096 * ctx_len.astype(np.int64)
    pad = lambda x: -(-x // 512) * 512  # noqa: E731
    stride = 512 + pad(lat_size) + 512 + pad(ctx_size) + 512 + 512  # three headers + padded payloads
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(stride[:-1], out=start[1:])
    start -= np.repeat(start[::PER_SHARD], PER_SHARD)[:n]  # offsets restart in every shard
    keys = pa.compute.cast(pa.array(np.arange(n, dtype=np.int64)), pa.string())
    shard_id = (np.arange(n, dtype=np.int64) // PER_SHARD).astype(np.int32)
    num_shards = int(shard_id[-1]) + 1
    shard_names = pa.array([f"shards/shard-{i:06d}.tar" for i in range(num_shards)])
    columns = {
        # In chunks: one Arrow string array holds at most 2 GiB, which 10^8 shard paths exceed.
        "shard": pa.chunked_array([
            pa.DictionaryArray.from_arrays(pa.array(shard_id[i:i + 10_000_000]), shard_names).cast(pa.string())
            for i in range(0, n, 10_000_000)
        ]),
        "shard_id": shard_id, "key": keys,
        "latents_offset": start + 512, "latents_size": lat_size,
        "context_offset": start + 512 + pad(lat_size) + 512, "context_size": ctx_size,
        "meta_offset": start + 512 + pad(lat_size) + 512 + pad(ctx_size) + 512, "meta_size": np.full(n, 400),
        "channels": np.full(n, 16, dtype=np.int32),
        "latent_f": latent[:, 0], "latent_h": latent[:, 1], "latent_w": latent[:, 2],
        "grid_f": grids[:, 0], "grid_h": grids[:, 1], "grid_w": grids[:, 2],
        "seq_len": grids.astype(np.int64).prod(axis=1), "context_len": ctx_len,
        "caption_hash": keys, "source": keys,
    }  # fmt: skip
    table = pa.table({k: pa.array(v) if isinstance(v, np.ndarray) else v for k, v in columns.items()})
    meta = {"shards": shard_names.to_pylist(), "text_len": 512, "text_dim": 4096, "dtype": "float16"}
    write_index(path, table.cast(pa.schema([pa.field(k, INDEX_COLUMNS[k]) for k in table.column_names])), meta)
    return time.perf_counter() - t


def measure_index(path: str) -> dict:
    """Runs in a fresh process: what one rank pays to open the index and plan an epoch of 64 ranks."""
    from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
    from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler
    from lightning_adaptiveload.data.shards import ShardedLatentDataset

    out = {"peak_rss_after_imports_mb": _peak_rss_mb()}
    t = time.perf_counter()
    ds = ShardedLatentDataset(path, check_shards=False)
    out["open_index_s"] = time.perf_counter() - t
    kept = [v for k, v in vars(ds).items() if k.startswith("_") and isinstance(v, np.ndarray)]
    out["dataset_bytes_per_sample"] = sum(a.nbytes for a in kept) / len(ds)
    out["peak_rss_after_open_mb"] = _peak_rss_mb()
    t = time.perf_counter()
    grids = ds.token_grids()
    out["token_grids_s"] = time.perf_counter() - t
    t = time.perf_counter()
    sampler = AdaptiveBucketBatchSampler(grids, DualConstraintPolicy(**POLICY), num_replicas=64, rank=0)
    out["sampler_build_s"] = time.perf_counter() - t
    out["peak_rss_after_sampler_mb"] = _peak_rss_mb()
    t = time.perf_counter()
    out["batches_per_rank"] = len(sampler)
    out["plan_len_s"] = time.perf_counter() - t
    t = time.perf_counter()
    first = next(iter(sampler))
    out["first_batch_s"] = time.perf_counter() - t
    out["first_batch_size"] = len(first)
    out["samples"] = len(ds)
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def write_corpus(root: Path, latents: list, context: np.ndarray, grid_hw: tuple[int, int], per_shard: int = 16,
                 evict: bool = False) -> dict:
    """Shards of ``latents[i]`` (``[C, F, H, W]``, token grid ``(F, *grid_hw)``) with ``context`` each, written
    with the package's ShardWriter, and their ``index.parquet``. ``evict``: drop each shard from the page
    cache after writing (``posix_fadvise`` DONTNEED, best effort), so reads go to the disk."""
    from lightning_adaptiveload.data.shards import ShardWriter, index_rows_to_table, write_index

    rows, shards = [], []
    t = time.perf_counter()
    for start in range(0, len(latents), per_shard):
        name = f"shards/shard-{len(shards):06d}.tar"
        shards.append(name)
        with ShardWriter(root / name) as w:
            for i in range(start, min(len(latents), start + per_shard)):
                c, f, h, wd = latents[i].shape
                where = w.add(f"{i:09d}", latents[i], context, {"i": i})
                rows.append({"shard": name, "shard_id": len(shards) - 1, "key": f"{i:09d}", **where, "channels": c,
                             "latent_f": f, "latent_h": h, "latent_w": wd, "grid_f": f, "grid_h": grid_hw[0],
                             "grid_w": grid_hw[1], "seq_len": f * grid_hw[0] * grid_hw[1],
                             "context_len": context.shape[0], "caption_hash": "0", "source": ""})  # fmt: skip
        if evict:
            fd = os.open(root / name, os.O_RDONLY)
            try:  # fsynced by ShardWriter.close: its clean pages can leave the cache
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    write_seconds = time.perf_counter() - t
    write_index(root / "index.parquet", index_rows_to_table(rows),
                {"shards": shards, "text_len": context.shape[0], "text_dim": context.shape[1], "dtype": "float16"})
    return {"shards": shards, "write_s": write_seconds, "shard_bytes": sum((root / s).stat().st_size for s in shards)}


def measure_loading(root: Path, num_samples: int, repeats: int = 3) -> dict:
    import torch

    from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.data.shards import ShardedLatentDataset

    rng = np.random.default_rng(0)
    latents = rng.standard_normal((16, 21, 60, 104)).astype(np.float16)
    context = rng.standard_normal((512, 4096)).astype(np.float16)
    written = write_corpus(root, [latents] * num_samples, context, grid_hw=(30, 52))
    write_seconds = written["write_s"]
    out = {"samples": num_samples, "latents": [16, 21, 60, 104], "context": [512, 4096], "stored": "float16",
           "returned": "float32", "write_s": write_seconds,
           "shard_bytes": written["shard_bytes"]}  # fmt: skip
    for workers in (0, 2):
        runs = []
        for _ in range(repeats):
            dm = AdaptiveLoadDataModule(ShardedLatentDataset(root / "index.parquet"), DualConstraintPolicy(**POLICY),
                                        num_workers=workers)  # fmt: skip
            seen = 0
            t = time.perf_counter()
            for batch in dm.train_dataloader():  # worker start-up included, as an epoch pays it
                seen += int(batch["latents"].shape[0])
                assert batch["latents"].dtype == torch.float32
            runs.append(seen / (time.perf_counter() - t))
            assert seen == num_samples
        out[f"workers_{workers}"] = {"samples_per_s_runs": runs, "samples_per_s_median": float(np.median(runs)),
                                     "mb_per_s_returned_median": float(np.median(runs)) * (latents.size + context.size)
                                     * 4 / 1e6}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument("--load-samples", type=int, default=48)
    parser.add_argument("--out", default=str(RESULTS / "shards.json"), help="JSON result file (record appended)")
    parser.add_argument("--measure-index", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_index:
        print(json.dumps(measure_index(args.measure_index)))
        return
    results = {"machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count(),
               "load_average_at_start": os.getloadavg(), "policy": POLICY, "num_replicas": 64,
               "mixture": "wan_mixed_480p_720p",
               "how": "index: one fresh process per size (python benchmarks/bench_shards.py), wall-clock "
                      "time.perf_counter() per call, peak RSS = VmHWM of that process (peak_rss_after_* read after "
                      "each phase); loading: samples/s of one pass through the DataModule's train_dataloader()",
               "index": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            path = Path(tmp) / f"index_{n}.parquet"
            build_s = build_index(path, n)
            proc = subprocess.run([sys.executable, __file__, "--measure-index", str(path)], capture_output=True,
                                  text=True, check=True)  # fmt: skip
            row = {"rows": n, "build_index_s": build_s, "index_bytes": path.stat().st_size,
                   **json.loads(proc.stdout.strip().splitlines()[-1])}  # fmt: skip
            results["index"].append(row)
            print(json.dumps(row), flush=True)
            path.unlink()
        results["loading"] = measure_loading(Path(tmp), args.load_samples)
        print(json.dumps(results["loading"]), flush=True)
    results["load_average_at_end"] = os.getloadavg()
    append_record(args.out, "bench_shards.py", results)
    print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
