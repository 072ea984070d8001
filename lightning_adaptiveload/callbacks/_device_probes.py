"""What :class:`~lightning_adaptiveload.callbacks.balance_monitor.BalanceMonitor` reads from the device: each
step, the peak memory, the caching allocator's counters and the GPU's SM clock and power; at the start of fit,
the device's dense bf16 peak for MFU. Every probe is local (no collective) and answers something neutral off
CUDA. Private to :mod:`~lightning_adaptiveload.callbacks.balance_monitor`."""

from __future__ import annotations

import torch
from lightning.fabric.utilities.throughput import get_available_flops

# Dense bf16 peaks (TFLOP/s) of GPUs that Lightning's `get_available_flops` does not give (Lightning 2.6):
# for the name "NVIDIA H200" it warns "FLOPs not found" and returns None (it knows only "h200 sxm1" /
# "h200 nvl1", and their bf16 entries, 2,000 / 1,700 TFLOP/s, are the with-sparsity figures). The H200 has
# the H100 SXM's tensor cores: 989 TFLOP/s dense bf16 (Lightning's H100 SXM entry: 989.4).
DENSE_BF16_TFLOPS: dict[str, float] = {"H200": 989.0}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`peak_memory` (a step's own peak, not the run's); nothing off CUDA."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """Bytes allocated at the most since the last :func:`reset_peak_memory`; 0 off CUDA."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def allocator_counts(device: torch.device) -> tuple[int, int]:
    """CUDA's cumulative (allocations that freed the cache and retried, cudaMalloc + cudaFree calls);
    zeros off CUDA."""
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats(device)
    return (int(stats.get("num_alloc_retries", 0)),
            int(stats.get("num_device_alloc", 0)) + int(stats.get("num_device_free", 0)))


def clock_and_power(device: torch.device) -> tuple[float, float]:
    """The GPU's SM clock (MHz) and power draw (W) over NVML's last sample period (1/6 s to 1 s), through
    ``torch.cuda.clock_rate`` / ``power_draw`` (they need the ``nvidia-ml-py`` package). Raises what
    they raise; NaNs off CUDA."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    return float(torch.cuda.clock_rate(device)), float(torch.cuda.power_draw(device)) / 1000.0


def device_peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of ``device`` in TFLOP/s: Lightning's ``get_available_flops``, or
    :data:`DENSE_BF16_TFLOPS` where it has none; ``None`` off CUDA (then no MFU is logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    known = next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), None)
    if known is not None:
        return known
    flops = get_available_flops(device, torch.bfloat16)
    return None if flops is None else flops / 1e12
