"""CPU process groups for the multi-rank tests: fork ``world`` gloo ranks in the test process, and the fp32
tolerance every sequence-parallel numerics check uses."""

from __future__ import annotations

import functools
import gc
import os
import socket
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int) -> None:
    """The gloo process group of a forked rank, and what a launcher exports (Lightning's DDP strategy then
    uses this process group as it is)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def _one_thread(fn: Callable[..., None], rank: int, *args: Any) -> None:
    """A forked rank computes on one intra-op thread, whatever a strategy's launcher would set (Lightning's sets
    cores / processes unless ``OMP_NUM_THREADS`` is given): the OpenMP pool of this process is not in the fork,
    and a parallel region of two or more threads there waits for it forever."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    fn(rank, *args)


def spawn(fn: Callable[..., None], world: int, *args: Any, timeout: float | None = None) -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` forked ranks; a rank's exception fails the test, and
    so do ranks still running after ``timeout`` seconds (they are killed).

    fork: the workers start with this process's imports (a spawned one re-imports torch and Lightning,
    ~9 s of CPU each on a two-core machine); no process group is alive here to be inherited.
    """
    assert not dist.is_initialized()
    # A process group an earlier test destroyed can still be held by its garbage (a module and its hooks):
    # freed in a fork, its destructor would join the parent's gloo threads, which the fork does not have,
    # and that rank would hang mid-step. Free such garbage here, where the threads exist.
    gc.collect()
    context = mp.start_processes(functools.partial(_one_thread, fn), args=(world, free_port(), *args), nprocs=world,
                                 join=False, start_method="fork")
    deadline = None if timeout is None else time.monotonic() + timeout
    while not context.join(None if deadline is None else max(deadline - time.monotonic(), 0.0)):
        if deadline is not None and time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            raise TimeoutError(f"{world} forked rank(s) of {fn.__name__} still running after {timeout} s")


def perturb_(model: torch.nn.Module, seed: int = 1) -> None:
    """Add noise to every parameter: Wan zero-initialises the output projection, which would zero every
    other gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 agreement of a sequence-parallel result with one process: relative 1e-5, and 1e-5 of the
    largest entry for entries near zero."""
    atol = 1e-5 * float(expected.abs().max()) + 1e-12
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")
