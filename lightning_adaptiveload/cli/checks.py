"""What ``adaptiveload-train`` checks before it builds anything, and how it words errors for the command line.

A library error speaks Python (``` `ManifestDataset(on_bad_row='skp')` ```); :func:`as_overrides` rewrites it as
the override that fixes it (``` `data.dataset.on_bad_row=skp` ```). Imports only Hydra and OmegaConf at the
top, so ``--help`` and config typos are answered before torch is loaded.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ConfigError(ValueError):
    """A setting of the run is wrong or missing; the message names the override that fixes it.

    ``adaptiveload-train`` prints it as one line, without a traceback.
    """


class MissingSettingError(ConfigError):
    """A required config value (``???`` in ``conf/``) was not given."""


# ---------------------------------------------------------------------------------------------
# Errors in the form of the command line: `Cls(arg='x')` → `node.arg=x`.

_VALUE = r"""'[^']*'|"[^"]*"|\([^()]*\)|\[[^\[\]]*\]|\{[^{}]*\}|[^\s,;:`)]+"""


def _override_value(text: str) -> str:
    """A Python literal as it is written in a Hydra override (``'skip'`` → ``skip``, ``None`` → ``null``)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        # A dict with placeholders ({16: 8, 64: <B>}): quoted, as the shell needs a value with spaces.
        return f"'{text}'" if text.startswith("{") else text
    return _format_override(value)


def _format_override(value: Any) -> str:
    if value is None:
        return "null"
    if value is Ellipsis:  # a message's `arg=...`: the value to fill in, not Python's Ellipsis
        return "..."
    if isinstance(value, dict):
        return "'{" + ", ".join(f"{_format_override(k)}: {_format_override(v)}" for k, v in value.items()) + "}'"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format_override(v) for v in value) + "]"
    if isinstance(value, str) and not re.fullmatch(r"[\w./\-+~]*", value):
        return repr(value)
    return str(value)


def as_overrides(
    message: str, path: str, keys: Any, class_name: str | None = None, bare: bool = True
) -> str:
    """Rewrite the Python arguments a message mentions as the overrides of config node ``path``.

    ``keys`` are the node's argument names: ``` `ManifestDataset(on_bad_row='skp')` ``` becomes
    ``` `data.dataset.on_bad_row=skp` ``` and, with ``bare``, a bare ``on_bad_row='skip'`` becomes
    ``data.dataset.on_bad_row=skip``; names that are not keys of the node are left alone.
    """
    names = "|".join(re.escape(str(k)) for k in sorted(keys, key=lambda k: -len(str(k))))
    if not names:
        return message
    prefix = f"{path}." if path else ""
    callee = re.escape(class_name) if class_name else r"[A-Za-z_][\w.]*"
    call = re.compile(rf"`{callee}\(\s*({names})=({_VALUE})\s*\)`")
    message = call.sub(lambda m: f"`{prefix}{m[1]}={_override_value(m[2])}`", message)
    if not bare:
        return message
    argument = re.compile(rf"(?<![\w.])({names})=({_VALUE})")
    return argument.sub(lambda m: f"{prefix}{m[1]}={_override_value(m[2])}", message)


def node_keys(node: DictConfig) -> list[str]:
    return [str(k) for k in node.keys() if not str(k).startswith("_")]


def as_cli_error(
    err: BaseException, nodes: dict[str, tuple[str, list[str]]], m_mem: str | None = None
) -> ConfigError | None:
    """A setting error raised after building (in ``fit``), with ``` `Cls(arg=x)` ``` rewritten as the
    override of the node that built ``Cls`` (``nodes``: class name → (path, keys)) and a bare ``` `m_mem` ```
    as the setting ``m_mem`` names (:func:`live_m_mem`); ``None`` if none applies."""
    if not isinstance(err, user_error_types()):
        return None
    message = str(err)
    for class_name, (path, keys) in nodes.items():
        message = as_overrides(message, path, keys, class_name, bare=False)
    if m_mem is not None:
        message = message.replace("`m_mem`", f"`{m_mem}`")
        # The DataModule's policy keeps the oversize rule, also when the shape benchmark refits the policy.
        message = message.replace("`oversize='skip'` on the policy", "`bucketing.policy.oversize=skip`")
    return ConfigError(message) if message != str(err) else None


def _benchmark_keys(cfg: DictConfig) -> list[str]:
    """Keys of the ``callbacks`` nodes that build a ``ShapeBenchmarkCallback`` (enabled or not)."""
    return [
        str(key) for key, node in (cfg.get("callbacks") or {}).items()
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).endswith(".ShapeBenchmarkCallback")
    ]


def _task_overrides(cfg: DictConfig) -> list[str] | None:
    """The command line's overrides: the composed config's ``hydra.overrides.task``, else those of the running
    Hydra app (``adaptiveload-train`` resolves the config before building it); ``None`` outside Hydra."""
    task = OmegaConf.select(cfg, "hydra.overrides.task", default=None) if "hydra" in cfg else None
    if task is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        task = HydraConfig.get().overrides.task
    return [str(o) for o in task]


def set_directly(cfg: DictConfig, path: str) -> bool:
    """Whether the ``m_mem`` at ``path`` (e.g. ``bucketing.policy.m_mem``) was set itself rather than taken from
    the top-level ``m_mem`` the shipped configs interpolate: a plain value (not that interpolation; a resolved
    config keeps none) that an override of the command line names, or, where there are no Hydra overrides to
    read (a config composed without its ``hydra`` node), one other than the top-level ``m_mem`` given."""
    parent, _, leaf = path.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if not isinstance(node, DictConfig) or leaf not in node or OmegaConf.is_interpolation(node, leaf):
        return False
    overrides = _task_overrides(cfg)
    if overrides is not None:
        return path in {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    top = cfg.get("m_mem")
    return top is not None and node[leaf] != top


def check_m_mem(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` when ``bucketing.policy.m_mem`` is set while a shape benchmark replaces the policy
    (``bucketing.fit_from_benchmark`` true): that value would never be used; the top-level ``m_mem`` is the
    budget both read."""
    if not cfg.get("bucketing") or not cfg.bucketing.get("fit_from_benchmark", True):
        return
    key = next((k for k in _benchmark_keys(cfg) if cfg.callbacks[k].get("enabled", True)), None)
    if key is None or not set_directly(cfg, "bucketing.policy.m_mem"):
        return
    value = _format_override(cfg.bucketing.policy.m_mem)
    raise ConfigError(
        f"`bucketing.policy.m_mem={value}` is never used: callbacks.{key} (ShapeBenchmarkCallback) replaces the "
        f"policy with the one it fits, with the budget of the top-level `m_mem`; set `m_mem={value}` instead "
        "(or `bucketing.fit_from_benchmark=false` to keep this policy)."
    )


def live_m_mem(cfg: DictConfig, callbacks: list[Any]) -> str:
    """The setting that holds the run's memory budget: ``m_mem`` (the shape benchmark's when it runs, it refits
    the policy; else the policy's), or the node's own ``m_mem`` where that was set directly (:func:`set_directly`)."""
    for key in _benchmark_keys(cfg):
        if any(type(cb).__name__ == "ShapeBenchmarkCallback" and getattr(cb, "enabled", True) for cb in callbacks):
            path = f"callbacks.{key}.m_mem"
            return path if set_directly(cfg, path) else "m_mem"
    return "bucketing.policy.m_mem" if set_directly(cfg, "bucketing.policy.m_mem") else "m_mem"


def user_error_types() -> tuple[type[BaseException], ...]:
    """Errors that describe a setting (one line on the command line); anything else keeps its traceback."""
    types: list[type[BaseException]] = [ValueError, FileNotFoundError]
    if "lightning.fabric" in sys.modules:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        types.append(MisconfigurationException)
    return tuple(types)


def instantiate_node(node: DictConfig, path: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` whose argument errors name the node's overrides (``data.dataset.x=...``)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if not isinstance(cause, (*user_error_types(), TypeError)):
            raise
        target = str(node.get("_target_", "")).rsplit(".", 1)[-1]
        message = as_overrides(str(cause), path, node_keys(node), target or None)
        if message == str(cause):  # nothing to rewrite: say which node it came from
            message = f"{path} ({target}): {message}"
        raise ConfigError(message) from cause


# ---------------------------------------------------------------------------------------------
# Overrides of keys the config does not have.


def check_overrides(argv: list[str], config_dir: str, config_name: str = "train") -> None:
    """Raise ``ConfigError`` when an override sets a key the config does not have, with the fix.

    Hydra's own answer, "To append to your config use +trainer.max_step=3", leads to the next error when the
    key is a typo (the Trainer has no ``max_step``); this says ``did you mean `trainer.max_steps=3`?``, and
    suggests ``+`` only for an argument the node's target takes. Composes the config once more (~0.3 s) when
    an override sets an existing key's value; other composition errors are left to Hydra.
    """
    # A sweep, or another config (--config-name / --config-path / --config-dir): left to Hydra.
    if any(a in ("-m", "--multirun", "-cn", "-cp", "-cd") or a.startswith("--config") for a in argv):
        return
    overrides = [a for a in argv if not a.startswith("-") and "=" in a]
    if not any(o[0] not in "+~" for o in overrides):
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException

    def _compose(items: list[str]) -> DictConfig:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
                return compose(config_name, overrides=items, return_hydra_config=True)
        finally:
            GlobalHydra.instance().clear()

    try:
        _compose(overrides)
        return
    except ConfigCompositionException as err:
        unknown = re.match(r"Could not override '([^']+)'", str(err))
        if unknown is None:
            return
        key = unknown[1]
    except Exception:  # noqa: BLE001 - anything else: Hydra reports it as usual
        return
    value = next(o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key)
    try:
        cfg = _compose([o for o in overrides if o.split("=", 1)[0] != key])
    except Exception:  # noqa: BLE001
        return
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    keys = [str(k) for k in node.keys() if str(k) != "hydra"] if isinstance(node, DictConfig) else []
    where = parent or "the config"
    keys = [k for k in keys if not k.startswith("_")]

    def _did_you_mean(names: list[str], cutoff: float = 0.6) -> None:
        close = difflib.get_close_matches(leaf, names, n=1, cutoff=cutoff)
        if close:
            name = f"{parent}.{close[0]}" if parent else close[0]
            raise ConfigError(f"`{key}` is not a setting of {where}; did you mean `{name}={value}`?")

    _did_you_mean(keys, cutoff=0.8)  # a clear typo of a listed key: answered before torch is imported
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if target:  # the arguments the node's target takes (imports it: this is the error path)
        from hydra.utils import get_object

        try:
            params = [n for n in inspect.signature(get_object(str(target))).parameters if n not in ("self", "kwargs")]
        except Exception:  # noqa: BLE001 - a target that does not import: keys only
            params = []
        if leaf in params:  # an argument the config does not list: Hydra's hint is right
            raise ConfigError(f"`{key}` is not in the config of {where}; add it with `+{key}={value}`.")
        _did_you_mean(params)
    _did_you_mean(keys)
    raise ConfigError(f"`{key}` is not a setting of {where} (its settings: {', '.join(keys)}); check the name.")


# ---------------------------------------------------------------------------------------------
# Checks before anything is built.

# What a required value is and an example of it, for the error message.
_REQUIRED_HINTS = {
    "data.dataset.path": ("a JSONL / CSV / Parquet manifest", "/data/train.jsonl"),
    "bucketing.policy.batch_sizes": ("{S: B}, the batch size of each sequence length", "'{1560: 16, 7800: 4}'"),
    "bucketing.policy.cost_model_path": (
        "a CostModel JSON, or the shape benchmark's calibration JSON",
        "outputs/.../shape_benchmark.json",
    ),
}


def missing_keys(node: DictConfig | ListConfig, prefix: str = "") -> list[str]:
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
            found += missing_keys(node[key], name)
    return found


def check_required(cfg: DictConfig) -> None:
    """Raise ``MissingSettingError`` naming every required value left unset, with the override to add.

    Checked before anything is built, so ``data=manifest`` without a path fails in one line instead
    of deep inside instantiation.
    """
    missing = sorted(missing_keys(cfg))
    if not missing:
        return
    named = [f"{key} ({_REQUIRED_HINTS[key][0]})" if key in _REQUIRED_HINTS else key for key in missing]
    example = " ".join(f"{key}={_REQUIRED_HINTS.get(key, ('', '...'))[1]}" for key in missing)
    raise MissingSettingError(
        f"required setting{'s' if len(missing) > 1 else ''} not given: {', '.join(named)}. "
        f"Add {'them' if len(missing) > 1 else 'it'} to the command line, e.g. `adaptiveload-train ... {example}`."
    )


# `Trainer.fit(ckpt_path=...)` values Lightning resolves itself.
_SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")


def _local_ckpt_path(cfg: DictConfig) -> Path | None:
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is None:
        return None
    text = str(ckpt_path)
    if text in _SPECIAL_CKPT_PATHS or text.startswith("registry:") or "://" in text:
        return None
    return Path(text)


def check_ckpt_path(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` when ``ckpt_path`` names a file that does not exist (before building)."""
    path = _local_ckpt_path(cfg)
    if path is None or path.exists():
        return
    raise ConfigError(
        f"ckpt_path={path}: no such file or directory. Give the path of a saved checkpoint, e.g. "
        "`ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt`, or leave ckpt_path out to start a new run."
    )


def _checkpoint_step(path: Path) -> int | None:
    """The ``global_step`` a Lightning checkpoint was saved at (memory-mapped: tensors are not read)."""
    import torch

    given = path
    if path.is_dir():  # a sharded checkpoint keeps the loop state in meta.pt
        path = path / "meta.pt"
        if not path.is_file():
            return None
    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except RuntimeError as err:
            if "mmap can only be used" not in str(err):
                raise
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # not the zip format mmap needs
    except Exception as err:  # noqa: BLE001 - truncated, corrupt or not a checkpoint: one line naming the file
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"ckpt_path={given}: cannot read the checkpoint ({type(err).__name__}: {cause.split('. ')[0]}); the file is "
            "truncated or corrupt (e.g. the run was killed while saving it). Resume from another checkpoint, e.g. "
            f"an earlier one in {given.parent}, or leave ckpt_path out to start a new run."
        ) from None
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    return None if step is None else int(step)


def check_resume_has_steps_left(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` when the checkpoint cannot be read, or already reached ``trainer.max_steps``
    (0 steps would run)."""
    path = _local_ckpt_path(cfg)
    if path is None:
        return
    step = _checkpoint_step(path)
    max_steps = cfg.get("trainer", {}).get("max_steps", -1)
    if step is None or max_steps is None or max_steps < 0 or step < max_steps:
        return
    raise ConfigError(
        f"ckpt_path={path} was saved at step {step} and trainer.max_steps={max_steps}: that run is finished "
        f"and resuming it would train 0 steps. To train on, raise the limit, e.g. "
        f"`adaptiveload-train ckpt_path={path} trainer.max_steps={step + max(max_steps, 1)}`."
    )


def check_accelerator(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` when the run asks for a GPU that this machine does not have (before the
    model is built: a GPU recipe's model takes minutes and tens of GB to build on a CPU)."""
    accelerator = str((cfg.get("trainer") or {}).get("accelerator", "auto"))
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    if torch.cuda.is_available() or (accelerator == "gpu" and torch.backends.mps.is_available()):
        return
    raise ConfigError(
        f"trainer.accelerator={accelerator}, but this machine has no GPU that torch {torch.__version__} can use "
        "(torch.cuda.is_available() is False). To run on CPU add `trainer=cpu` (with a model that fits a CPU, "
        "e.g. `trainer=cpu model=tiny strategy=auto`), or run on a machine with a GPU and a CUDA build of torch."
    )


def warn_about_world_size(trainer: pl.Trainer, datamodule: Any) -> None:
    """Warn when ranks outnumber the CPU cores (CPU runs) or the samples."""
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.utilities import rank_zero_warn

    world_size = int(trainer.world_size)
    cores = os.cpu_count() or 1
    if isinstance(trainer.accelerator, CPUAccelerator) and trainer.num_devices > cores:
        rank_zero_warn(
            f"trainer.devices={trainer.num_devices} CPU processes on {cores} core(s): the ranks share cores, "
            f"so every step waits for the slowest. Use trainer.devices={cores} or fewer."
        )
    dataset = getattr(datamodule, "dataset", None)
    try:
        samples = len(dataset) if dataset is not None else None
    except TypeError:
        samples = None
    if samples is not None and world_size > samples:
        rank_zero_warn(
            f"{world_size} ranks for {samples} sample(s): {world_size - samples} rank(s) get no sample of their "
            "own each step and train on padded repeats. Use fewer ranks (trainer.devices / trainer.num_nodes) "
            "or more data."
        )
