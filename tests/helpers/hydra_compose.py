"""The training config composed as ``adaptiveload-train`` composes it, for the tests that build or run it in
process: one device (a multi-process launch would re-run pytest itself), and the run's outputs and the shape
benchmark's cache under the test's ``tmp_path``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

import lightning_adaptiveload

#: This checkout's conf/ (also where an editable install of another checkout would resolve
#: ``lightning_adaptiveload.conf`` elsewhere).
CONF_DIR = Path(lightning_adaptiveload.__file__).resolve().parent.parent / "conf"


def compose_train(overrides: Sequence[str], tmp_path: Path, devices: int | None = 1, *,
                  from_package: bool = False) -> DictConfig:
    """``train.yaml`` with ``overrides`` and Hydra's own node; ``devices=None`` keeps the config's device count,
    ``from_package`` composes the installed ``lightning_adaptiveload.conf`` (what the console script reads)."""
    GlobalHydra.instance().clear()
    init = (initialize_config_module(config_module="lightning_adaptiveload.conf", version_base="1.3") if from_package
            else initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"))
    with init:
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        if devices is not None:
            cfg.trainer.devices = devices
        cfg.output_dir = str(tmp_path)
        cfg.hydra.runtime.output_dir = str(tmp_path)
        if cfg.get("callbacks") and "shape_benchmark" in cfg.callbacks:
            cfg.callbacks.shape_benchmark.cache_dir = str(tmp_path / "cache")
            cfg.callbacks.shape_benchmark.save_dir = str(tmp_path)
    return cfg
