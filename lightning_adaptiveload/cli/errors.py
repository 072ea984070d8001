"""One readable error per failure of ``adaptiveload-train``, also when several ranks fail.

Why not only torch elastic's ``@record`` (per-rank error files): it writes a rank's error where
``TORCHELASTIC_ERROR_FILE`` points, which only torchrun's agent sets and reads, after every rank has
exited. ``trainer.devices=N`` without torchrun runs Lightning's own launcher, which reads no error
file, and rank 0 is itself a training rank: blocked in a collective when a peer dies, it learns
nothing until the backend's timeout, and Lightning's ``_ChildProcessObserver`` SIGKILLs it (within
5 s, without a word) once a child exits non-zero. So the failing rank writes its cause to
``<output_dir>/.adaptiveload_errors/rank<N>.txt`` and rank 0 watches that folder (the watch starts
with ``fit``); under torchrun the cause also goes to elastic's error file (:func:`exit_on_error`),
so the agent's summary names the root cause too.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from lightning_adaptiveload.cli.checks import ConfigError, user_error_types

if TYPE_CHECKING:
    import lightning.pytorch as pl


# The Trainer of the run in progress: its rank and world size are the truth once `fit` has started
# (Lightning's launcher gives its processes LOCAL_RANK / NODE_RANK only, no RANK or WORLD_SIZE).
_running: dict[str, Any] = {}


@contextlib.contextmanager
def watch_peers(cfg: DictConfig, trainer: pl.Trainer) -> Iterator[None]:
    """While ``fit`` runs: take rank and world size from ``trainer``, and on rank 0 of a multi-rank
    run print a peer's failure and exit (:class:`PeerErrorWatcher`)."""
    _running["trainer"] = trainer
    watcher = PeerErrorWatcher.start(cfg, trainer.world_size)
    try:
        yield
    finally:
        if watcher is not None:
            watcher.stop()


def forget_run() -> None:
    """An earlier run in this process must not lend its rank to this one's errors."""
    _running.clear()


def _world_size() -> int:
    trainer = _running.get("trainer")
    return int(trainer.world_size) if trainer is not None else int(os.environ.get("WORLD_SIZE", 1))


def global_rank() -> int:
    """This process's global rank: the Trainer's, the process group's, else the launcher's environment."""
    trainer = _running.get("trainer")
    if trainer is not None:
        return int(trainer.global_rank)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(local + 1, 1)
    return node * per_node + local


def _errors_dir(cfg: DictConfig | None) -> Path:
    out = cfg.get("output_dir") if cfg is not None else None
    return Path(out or ".") / ".adaptiveload_errors"


# Words of the errors a rank sees when a peer died in a collective: the cause is on the peer.
_PEER_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|NCCL|Gloo|gloo|DistBackendError|"
    r"ProcessGroup|collective",
)
_report_lock = threading.Lock()
_reported = threading.Event()


# Words of an allocator's refusal: CPU (DefaultCPUAllocator), CUDA (torch.OutOfMemoryError), Python's MemoryError.
_OUT_OF_MEMORY = re.compile(r"out of memory|DefaultCPUAllocator|can't allocate memory|Cannot allocate memory")


def _out_of_memory(err: BaseException, cfg: DictConfig | None) -> str | None:
    """One line with advice for an out-of-memory error, or None for any other error."""
    if not isinstance(err, (RuntimeError, MemoryError)) or not (
        isinstance(err, MemoryError) or _OUT_OF_MEMORY.search(str(err))
    ):
        return None
    text = " ".join(str(err).split())
    device = "GPU" if "CUDA" in text else "CPU"
    wanted = re.search(r"(?:tried to allocate|Tried to allocate) ([\d.]+) ?(bytes|[KMGT]iB)", text)
    if wanted and wanted[2] == "bytes":
        size = f"{int(wanted[1]) / 2**30:,.2f} GiB"
    else:
        size = f"{wanted[1]} {wanted[2]}" if wanted else None
    trainer = _running.get("trainer")
    at = f" at step {trainer.global_step}" if trainer is not None and trainer.global_step else ""
    m_mem = "m_mem"
    if cfg is not None and trainer is not None:
        from lightning_adaptiveload.cli.checks import live_m_mem

        m_mem = live_m_mem(cfg, trainer.callbacks)
    return (
        f"out of {device} memory{at}{f' (an allocation of {size} failed)' if size else ''}. Lower the tokens per "
        f"batch (`{m_mem}`; every batch size follows it) or give smaller batches, use fewer DataLoader workers "
        "(`data.datamodule.num_workers`), or a smaller model; `HYDRA_FULL_ERROR=1` shows the traceback."
    )


def _describe(err: BaseException, cfg: DictConfig | None = None) -> str:
    oom = _out_of_memory(err, cfg)
    if oom is not None:
        return oom
    if isinstance(err, user_error_types()):
        return " ".join(str(err).split("\n")) if isinstance(err, ConfigError) else str(err)
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()


def _report(text: str) -> bool:
    """Print the failure once per process (the main thread and the peer watcher race for it)."""
    with _report_lock:
        if _reported.is_set():
            return False
        _reported.set()
    sys.stdout.flush()
    print(f"adaptiveload-train: {text}", file=sys.stderr, flush=True)
    return True


def _peer_errors(errors: Path, since: float) -> list[tuple[int, str]]:
    found = []
    for path in sorted(errors.glob("rank*.txt")) if errors.is_dir() else []:
        try:
            if path.stat().st_mtime >= since:
                found.append((int(path.stem[4:]), path.read_text()))
        except (OSError, ValueError):
            continue
    return [(r, t) for r, t in found if r != 0]


class PeerErrorWatcher:
    """On rank 0 of a multi-rank run: print a peer's failure (written by ``main`` on that rank) and exit.

    Rank 0 may be blocked in a collective (NCCL waits for its timeout), so it cannot rely on an
    exception of its own to learn that a peer failed.
    """

    def __init__(self, errors: Path) -> None:
        self.errors = errors
        self.since = time.time() - 5.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="adaptiveload-peer-errors")

    @classmethod
    def start(cls, cfg: DictConfig, world_size: int) -> PeerErrorWatcher | None:
        if world_size < 2 or global_rank() != 0:
            return None
        watcher = cls(_errors_dir(cfg))
        for stale in watcher.errors.glob("*.txt") if watcher.errors.is_dir() else []:
            stale.unlink(missing_ok=True)
        watcher._thread.start()
        return watcher

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            peers = _peer_errors(self.errors, self.since)
            if not peers:
                continue
            # A failure on every rank reaches rank 0's own handler at about the same time: let it speak.
            if self._stop.wait(1.0) or _reported.is_set():
                return
            rank, text = peers[0]
            if _report(f"rank {rank}: {text}"):
                (self.errors / "reported").touch()
                os._exit(1)


def exit_on_error(err: BaseException, cfg: DictConfig | None) -> None:
    """Print one readable error for the run and exit 1.

    Rank 0 prints the cause last (its own, or a peer's when its own error only says that a peer
    went away); other ranks write their cause for rank 0 and exit quietly (printing it themselves
    only if rank 0 did not within a few seconds). ``HYDRA_FULL_ERROR=1`` re-raises with the traceback.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun: its agent's summary names the root cause
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)
    rank = global_rank()
    text = _describe(err, cfg)
    errors = _errors_dir(cfg)
    multi = _world_size() > 1
    if rank != 0 and multi:
        try:
            errors.mkdir(parents=True, exist_ok=True)
            (errors / f"rank{rank}.txt").write_text(text)
        except OSError:
            _report(f"rank {rank}: {text}")
            raise SystemExit(1) from None
        deadline = time.time() + 10.0
        parent = os.getppid()
        while time.time() < deadline:
            if (errors / "reported").exists() or os.getppid() != parent:
                raise SystemExit(1) from None
            time.sleep(0.2)
        _report(f"rank {rank}: {text}")
        raise SystemExit(1) from None
    if multi and _PEER_FAILURE.search(str(err)):
        # This rank only saw a peer go away; the cause is the peer's.
        text = f"rank {rank} lost a peer: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        deadline = time.time() + 5.0
        while time.time() < deadline:
            peers = _peer_errors(errors, time.time() - 600)
            if peers:
                text = f"rank {peers[0][0]}: {peers[0][1]}"
                break
            time.sleep(0.2)
    if _report(text) and multi:
        try:
            errors.mkdir(parents=True, exist_ok=True)
            (errors / "reported").touch()
        except OSError:
            pass
    raise SystemExit(1) from None
