"""The data side of per-bucket sequence parallelism: the configuration and the batch's ``sp_degree``.

Every collated training batch of a DataModule with sequence parallelism carries
``batch["sp_degree"] = k`` (a Python int; 1: plain data parallel), looked up from the batch's latent
grid in a table the sampler planned. The k ranks ``[g·k, (g+1)·k)`` of an SP group receive the same
batch at the same step and process it together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_adaptiveload.bucketing.sequence_parallel import SequenceParallelConfig
from lightning_adaptiveload.calibration.sequence_parallel import UlyssesCommModel
from lightning_adaptiveload.geometry import latent_of_grid

_CONFIG_KEYS = ("enabled", "degrees", "num_heads", "ranks_per_node", "target_step_time", "tolerance", "patch_size",
                "comm")
_COMM_KEYS = ("hidden_dim", "num_layers", "bytes_per_element", "bandwidth", "latency", "alltoalls_per_layer")


def sequence_parallel_from_config(
    config: Mapping[str, Any] | None, where: str = "sequence_parallel"
) -> tuple[SequenceParallelConfig | None, UlyssesCommModel | None, tuple[int, int, int] | None]:
    """``(SequenceParallelConfig, UlyssesCommModel or None, patch_size or None)`` from a config mapping,
    or ``(None, None, None)`` when it is absent or ``enabled`` is false.

    Keys: ``enabled``, ``degrees``, ``num_heads``, ``ranks_per_node``, ``target_step_time``,
    ``tolerance``, ``patch_size`` and ``comm`` (``hidden_dim``, ``num_layers``, ``bytes_per_element``,
    ``bandwidth``, ``latency``, ``alltoalls_per_layer``; null or absent: no all-to-all cost).

    Raises:
        ValueError: an unknown key, a missing value, or a degree the heads or the node do not allow
            (the message names the key and the allowed degrees).
    """
    if config is None:
        return None, None, None
    if not isinstance(config, Mapping):
        raise ValueError(f"`{where}={config!r}` is not valid. Expected a mapping with `enabled`, `degrees`, ...")
    unknown = sorted(set(config) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"`{where}` has unknown keys {unknown}; expected some of {list(_CONFIG_KEYS)}.")
    if not config.get("enabled", True):
        return None, None, None
    for key in ("degrees", "num_heads", "ranks_per_node"):
        if config.get(key) is None:
            raise ValueError(f"`{where}.{key}` is not set; sequence parallelism needs it (e.g. {where}.{key}=...).")
    degrees = config["degrees"]
    degrees = [degrees] if isinstance(degrees, int) else list(degrees)
    try:
        sp = SequenceParallelConfig(tuple(degrees), num_heads=config["num_heads"],
                                    ranks_per_node=config["ranks_per_node"],
                                    target_step_time=config.get("target_step_time"),
                                    tolerance=config.get("tolerance", 0.25))
    except ValueError as err:
        raise ValueError(f"`{where}`: {err}") from None
    comm_cfg = config.get("comm")
    comm = None
    if comm_cfg is not None:
        unknown = sorted(set(comm_cfg) - set(_COMM_KEYS))
        if unknown:
            raise ValueError(f"`{where}.comm` has unknown keys {unknown}; expected some of {list(_COMM_KEYS)}.")
        args = {k: v for k, v in comm_cfg.items() if v is not None}
        missing = [k for k in ("hidden_dim", "num_layers") if k not in args]
        if missing:
            raise ValueError(f"`{where}.comm.{missing[0]}` is not set; the all-to-all time needs the model's size.")
        try:
            comm = UlyssesCommModel(**args)
        except ValueError as err:
            raise ValueError(f"`{where}.comm`: {err}") from None
    patch = config.get("patch_size")
    return sp, comm, (tuple(int(v) for v in patch) if patch is not None else None)  # type: ignore[return-value]


class SequenceParallelCollate:
    """Wraps a collate function: adds ``batch["sp_degree"]`` from the batch's latent grid.

    Plain attributes only, so it pickles into DataLoader workers.

    Args:
        collate_fn: the collate function whose batch has ``"latents"`` ``[B, C, F, H, W]``.
        degree_by_grid: token grid (f, h, w) → SP degree, e.g. ``sampler.degree_by_grid()``.
        patch_size: the model's patch (t, h, w), mapping a token grid to its latent shape.

    Raises:
        ValueError: (on call) the batch has no ``latents`` or a latent grid the plan does not know.
    """

    def __init__(self, collate_fn: Callable[[list[dict]], dict], degree_by_grid: Mapping[tuple[int, int, int], int],
                 patch_size: Sequence[int]) -> None:
        self.collate_fn = collate_fn
        self.patch_size = tuple(int(v) for v in patch_size)
        self.degree_by_latent = {latent_of_grid(g, self.patch_size): int(k) for g, k in degree_by_grid.items()}

    def __call__(self, samples: list[dict]) -> dict:
        batch = self.collate_fn(samples)
        latents = batch.get("latents") if isinstance(batch, Mapping) else None
        if latents is None or len(latents.shape) != 5:
            raise ValueError(
                "Sequence parallelism needs the collated batch's `latents` [B, C, F, H, W] to find its SP degree; the "
                f"collate function returned {type(batch).__name__} without them."
            )
        key = tuple(int(v) for v in latents.shape[-3:])
        degree = self.degree_by_latent.get(key)
        if degree is None:
            raise ValueError(
                f"A batch has latent grid {key}, which no planned bucket has (patch_size {self.patch_size}; planned "
                f"{sorted(self.degree_by_latent)[:8]}...). The dataset's `token_grids()` and its latents disagree, or "
                "`patch_size` is not the model's."
            )
        batch["sp_degree"] = degree
        return batch
