"""Config nodes that need more than ``hydra.utils.instantiate``: values taken from the model, the
sequence-parallel callback, the callbacks dict; and the CUDA allocator setting of the run."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lightning_adaptiveload.cli.checks import ConfigError, instantiate_node

if TYPE_CHECKING:
    import lightning.pytorch as pl


def instantiate_dataset(cfg: DictConfig, module: pl.LightningModule) -> Any:
    """Build the dataset; token geometry and text shape left ``null`` in the data config (``patch_size``,
    ``vae_stride``, ``text_len``, ``text_dim``) are taken from the model, so they are set in one place, and so
    are the latents' channels (``latent_channels``: the model's ``in_dim``) and the extra per-sample inputs a
    model reads (``extra_inputs``, e.g. a pooled text embedding; none when the model's config names none)."""
    overrides: dict[str, Any] = {}
    model_config = getattr(module, "config", None)
    for key in ("text_len", "text_dim", "patch_size", "vae_stride"):
        if key in cfg and cfg[key] is None:
            if model_config is None:
                raise ConfigError(f"data.dataset.{key} is null but the model has no `config.{key}`; set it.")
            overrides[key] = getattr(model_config, key)
    if "extra_inputs" in cfg and cfg["extra_inputs"] is None:
        overrides["extra_inputs"] = getattr(model_config, "extra_inputs", None)
    if "latent_channels" in cfg and cfg["latent_channels"] is None:
        if getattr(model_config, "in_dim", None) is None:
            raise ConfigError("data.dataset.latent_channels is null but the model has no `config.in_dim`; set it.")
        overrides["latent_channels"] = model_config.in_dim
    return instantiate_node(cfg, "data.dataset", **overrides)


def alltoalls_per_layer(module: pl.LightningModule) -> int:
    """All-to-alls per layer and step of Ulysses attention: 4 in forward (q, k, v and the output, both ways)
    and 4 in backward; 12 when backward recomputes the forward's (``selective`` and ``full`` checkpointing
    recompute everything but the attention kernels' outputs, and ``auto`` checkpoints the long buckets,
    the ones sequence parallelism trains). Read from the module's ``checkpointing`` (the protocol's)."""
    return 8 if getattr(module, "checkpointing", "none") == "none" else 12


def sequence_parallel_settings(cfg: DictConfig | None, module: pl.LightningModule) -> dict[str, Any] | None:
    """``data.sequence_parallel`` as a plain dict with its null model sizes taken from the model, or None when off."""
    if cfg is None or not cfg.get("enabled", False):
        return None
    settings: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    model_config = getattr(module, "config", None)

    def _from_model(node: dict[str, Any], key: str, attr: str, path: str) -> None:
        if key in node and node[key] is None:
            if model_config is None or getattr(model_config, attr, None) is None:
                raise ConfigError(f"{path} is null but the model has no `config.{attr}`; set it.")
            value = getattr(model_config, attr)
            node[key] = list(value) if isinstance(value, tuple) else value

    _from_model(settings, "num_heads", "num_heads", "data.sequence_parallel.num_heads")
    _from_model(settings, "patch_size", "patch_size", "data.sequence_parallel.patch_size")
    comm = settings.get("comm")
    if isinstance(comm, dict):
        _from_model(comm, "hidden_dim", "dim", "data.sequence_parallel.comm.hidden_dim")
        _from_model(comm, "num_layers", "num_layers", "data.sequence_parallel.comm.num_layers")
        if comm.get("alltoalls_per_layer", 0) is None:
            comm["alltoalls_per_layer"] = alltoalls_per_layer(module)
    from lightning_adaptiveload.data.sequence_parallel import sequence_parallel_from_config

    try:  # checked here, so the message names the config node rather than the DataModule's argument
        sequence_parallel_from_config(settings, where="data.sequence_parallel")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return settings


def with_sequence_parallel_callback(callbacks: list[pl.Callback], datamodule: Any) -> list[pl.Callback]:
    """With ``data.sequence_parallel`` on: the callback that creates the SP groups of the planned degrees.

    Added when the run lists none; one the run lists must create the degrees the planner plans
    (``degrees: null`` creates every allowed degree, so it does).
    """
    from lightning_adaptiveload.callbacks.sequence_parallel import UlyssesSequenceParallel

    config = getattr(datamodule, "sp_config", None)
    if config is None:
        raise ConfigError(
            f"data.sequence_parallel.enabled=true, but data.datamodule ({type(datamodule).__name__}) has no "
            "`sp_config`: it plans no sequence-parallel batches. Use "
            "lightning_adaptiveload.data.datamodule.AdaptiveLoadDataModule, or set data.sequence_parallel.enabled=false."
        )
    planned = sorted(config.degrees)
    given = [cb for cb in callbacks if isinstance(cb, UlyssesSequenceParallel)]
    for cb in given:
        if cb.degrees is not None and sorted({k for k in cb.degrees if k > 1}) != planned:
            raise ConfigError(
                f"callbacks: UlyssesSequenceParallel(degrees={list(cb.degrees)}) does not create the groups the "
                f"planner plans: data.sequence_parallel.degrees={planned}. Give both the same degrees, or leave the "
                "callback out: adaptiveload-train adds it with data.sequence_parallel.degrees."
            )
    return callbacks if given else [*callbacks, UlyssesSequenceParallel(planned)]


def instantiate_callbacks(cfg: DictConfig | None, skip: dict[type, str] | None = None) -> list[pl.Callback]:
    """Build the callbacks of ``cfg``, except the nodes whose ``_target_`` is a class in ``skip`` (or a subclass):
    those are never instantiated, and the message ``skip`` maps their class to is logged once."""
    from lightning.pytorch.utilities import rank_zero_info

    callbacks: list[pl.Callback] = []
    skipped: set[type] = set()
    for name, cb_cfg in (cfg or {}).items():
        if cb_cfg is None:
            continue  # `~callbacks.<name>` or `callbacks.<name>=null` removes one
        if not isinstance(cb_cfg, DictConfig) or "_target_" not in cb_cfg:
            raise ConfigError(f"callbacks.{name} must be a config with a `_target_`, got {cb_cfg!r}.")
        cls = _skipped_class(cb_cfg, skip)
        if cls is not None:
            skipped.add(cls)
            continue
        callbacks.append(instantiate_node(cb_cfg, f"callbacks.{name}"))
    for cls in skipped:
        rank_zero_info(skip[cls])  # type: ignore[index]
    return callbacks


def _skipped_class(cb_cfg: DictConfig, skip: dict[type, str] | None) -> type | None:
    """The class in ``skip`` that the node's ``_target_`` is (or subclasses); ``None`` when it builds. A target that
    does not resolve to a class is left to ``instantiate_node``, whose error names the node."""
    if not skip:
        return None
    from hydra.utils import get_object

    try:
        target = get_object(str(cb_cfg._target_))
    except Exception:  # noqa: BLE001 - reported by instantiate_node
        return None
    return next((cls for cls in skip if isinstance(target, type) and issubclass(target, cls)), None)


#: The CUDA allocator setting ``adaptiveload-train`` uses unless the environment sets one: expandable
#: segments keep varying batch shapes from fragmenting the cache (without them a 1.3B run that fits by
#: the memory model can fail with 10 GiB reserved but unallocated).
CUDA_ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator() -> bool:
    """Set ``PYTORCH_ALLOC_CONF`` to :data:`CUDA_ALLOC_CONF` unless it (or the older
    ``PYTORCH_CUDA_ALLOC_CONF``) is set or CUDA is already in use; returns whether it did."""
    import torch

    if any(k in os.environ for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")) or torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_ALLOC_CONF"] = CUDA_ALLOC_CONF
    return True
def format_summary(summary: dict[str, float]) -> str:
    """The balance means of the final metrics, one line (percentages, tokens/s, counts)."""
    parts = []
    for key, value in summary.items():
        if key == "steps":
            continue
        if key.endswith("_cv") or key in ("bubble", "mfu", "epoch_mfu", "data_wait_frac"):
            parts.append(f"{key} {value:.2%}")
        elif key in ("tokens_per_s", "epoch_tokens_per_s"):
            parts.append(f"{key} {value:,.0f}")
        elif key in ("alloc_retries", "device_allocs"):
            parts.append(f"{key} {int(value)} in total")
        else:
            parts.append(f"{key} {value:.4g}")
    return ", ".join(parts)


