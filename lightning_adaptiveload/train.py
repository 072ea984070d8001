"""Training entry point: ``train(cfg)`` does the work, ``main()`` is the Hydra wrapper.

``adaptiveload-train`` with no arguments runs the CPU quickstart; any config group can be
overridden from the command line, e.g.
``adaptiveload-train model=wan2_1_1_3b trainer=gpu strategy=fsdp trainer.devices=8``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
from lightning_adaptiveload.reporting import print_bucket_plan


def _config_path() -> str:
    """``conf/`` ships inside the installed package; a source checkout on ``PYTHONPATH`` has it beside."""
    if importlib.util.find_spec("lightning_adaptiveload.conf") is not None:
        return "pkg://lightning_adaptiveload.conf"
    return str(Path(__file__).resolve().parent.parent / "conf")


def _instantiate_dataset(cfg: DictConfig, module: pl.LightningModule) -> Any:
    """Build the dataset; text length/dim left ``null`` in the data config are taken from the model."""
    overrides: dict[str, Any] = {}
    model_config = getattr(module, "config", None)
    for key in ("text_len", "text_dim"):
        if key in cfg and cfg[key] is None:
            if model_config is None:
                raise ValueError(f"`data.dataset.{key}` is null but the model has no `config.{key}`; set it.")
            overrides[key] = getattr(model_config, key)
    return instantiate(cfg, **overrides)


def _instantiate_callbacks(cfg: DictConfig | None) -> list[pl.Callback]:
    callbacks: list[pl.Callback] = []
    for name, cb_cfg in (cfg or {}).items():
        if cb_cfg is None:
            continue  # `~callbacks.<name>` or `callbacks.<name>=null` removes one
        if not isinstance(cb_cfg, DictConfig) or "_target_" not in cb_cfg:
            raise ValueError(f"`callbacks.{name}` must be a config with a `_target_`, got {cb_cfg!r}.")
        callbacks.append(instantiate(cb_cfg))
    return callbacks


class MissingSettingError(ValueError):
    """A required config value (``???`` in ``conf/``) was not given."""


# What a required value is and an example of it, for the error message.
_REQUIRED_HINTS = {
    "data.dataset.path": ("a JSONL / CSV / Parquet manifest", "/data/train.jsonl"),
    "bucketing.policy.cost_model_path": (
        "a CostModel JSON, or the shape benchmark's calibration JSON",
        "outputs/.../shape_benchmark.json",
    ),
}


def _missing_keys(node: DictConfig | ListConfig, prefix: str = "") -> list[str]:
    """Dotted keys whose value is ``???``, without resolving interpolations and without Hydra's own
    ``hydra`` node (present when the config was composed with ``return_hydra_config``).

    Not ``OmegaConf.missing_keys``: it resolves every interpolation on the way and raises on one
    that points at a missing value (``e: ${a}`` with ``a: ???``) instead of naming ``a``."""
    keys = (
        range(len(node))
        if isinstance(node, ListConfig)
        else [k for k in node.keys() if prefix or k != "hydra"]
    )
    found = []
    for key in keys:
        name = f"{prefix}[{key}]" if isinstance(node, ListConfig) else f"{prefix}{'.' if prefix else ''}{key}"
        if OmegaConf.is_missing(node, key):
            found.append(name)
        elif not OmegaConf.is_interpolation(node, key) and isinstance(node[key], (DictConfig, ListConfig)):
            found += _missing_keys(node[key], name)
    return found


def check_required(cfg: DictConfig) -> None:
    """Raise ``MissingSettingError`` naming every required value left unset, with the override to add.

    Checked before anything is built, so ``data=manifest`` without a path fails in one line instead
    of deep inside instantiation.
    """
    missing = sorted(_missing_keys(cfg))
    if not missing:
        return
    named = [f"{key} ({_REQUIRED_HINTS[key][0]})" if key in _REQUIRED_HINTS else key for key in missing]
    example = " ".join(f"{key}={_REQUIRED_HINTS.get(key, ('', '...'))[1]}" for key in missing)
    raise MissingSettingError(
        f"required setting{'s' if len(missing) > 1 else ''} not given: {', '.join(named)}. "
        f"Add {'them' if len(missing) > 1 else 'it'} to the command line, e.g. `adaptiveload-train ... {example}`."
    )


@dataclass
class Run:
    """Everything ``train`` builds from a config, before fitting."""

    module: pl.LightningModule
    datamodule: pl.LightningDataModule
    trainer: pl.Trainer


def build(cfg: DictConfig) -> Run:
    """Instantiate model, data, bucketing policy, callbacks, logger, strategy and Trainer."""
    check_required(cfg)
    if cfg.get("seed") is not None:
        pl.seed_everything(cfg.seed, workers=True)

    module = instantiate(cfg.model)
    dataset = _instantiate_dataset(cfg.data.dataset, module)
    policy = instantiate(cfg.bucketing.policy)
    datamodule = instantiate(
        cfg.data.datamodule,
        dataset=dataset,
        policy=policy,
        balance=cfg.bucketing.balance,
        seed=cfg.get("seed") or 0,
    )
    callbacks = _instantiate_callbacks(cfg.get("callbacks"))
    if not cfg.bucketing.get("fit_from_benchmark", True):
        # The chosen policy is the point of the run (e.g. the equal-token baseline): keep it.
        kept = [cb for cb in callbacks if not isinstance(cb, ShapeBenchmarkCallback)]
        if len(kept) < len(callbacks):
            rank_zero_info(
                "bucketing.fit_from_benchmark=false: ShapeBenchmarkCallback is off; the configured policy is kept."
            )
        callbacks = kept
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    strategy = instantiate(cfg.strategy)
    trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy, callbacks=callbacks, logger=logger)
    return Run(module, datamodule, trainer)


def train(cfg: DictConfig) -> dict[str, float]:
    """Build the run from ``cfg``, print the bucket plan, and fit.

    Returns:
        The Trainer's final callback metrics as floats.
    """
    run = build(cfg)
    if cfg.get("print_plan", True):
        # The plan before any shape benchmark; ShapeBenchmarkCallback prints the re-fitted one.
        print_bucket_plan(run.datamodule, world_size=run.trainer.world_size)

    run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=cfg.get("ckpt_path"))
    metrics = {k: float(v) for k, v in run.trainer.callback_metrics.items() if v.numel() == 1}
    rank_zero_info(f"Final metrics: {metrics}")
    return metrics


@hydra.main(version_base="1.3", config_path=_config_path(), config_name="train")
def main(cfg: DictConfig) -> None:
    """Console script ``adaptiveload-train``."""
    OmegaConf.resolve(cfg)
    try:
        train(cfg)  # build() checks the required settings before anything else
    except MissingSettingError as err:
        raise SystemExit(f"adaptiveload-train: {err}") from None  # one line, no traceback


if __name__ == "__main__":
    main()
