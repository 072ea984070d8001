"""Training entry point: ``train(cfg)`` does the work, ``main()`` is the Hydra wrapper.

``adaptiveload-train`` with no arguments runs the CPU quickstart; any config group can be
overridden from the command line, e.g.
``adaptiveload-train model=wan2_1_1_3b trainer=gpu strategy=fsdp trainer.devices=8``.

This module imports only Hydra and OmegaConf at the top: ``--help`` and config typos are answered
by Hydra before torch and Lightning are loaded. Everything heavy is imported inside ``build``.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

if TYPE_CHECKING:
    import lightning.pytorch as pl


def _config_path() -> str:
    """``conf/`` ships inside the installed package; a source checkout has it beside the package.

    Found from this file's location, not with ``importlib.util.find_spec("lightning_adaptiveload.conf")``,
    which would import the package (and torch with it) before Hydra parses the command line.
    """
    here = Path(__file__).resolve().parent
    installed = here / "conf"
    return str(installed if installed.is_dir() else here.parent / "conf")


class ConfigError(ValueError):
    """A setting of the run is wrong or missing; the message names the override that fixes it.

    ``adaptiveload-train`` prints it as one line, without a traceback.
    """


class MissingSettingError(ConfigError):
    """A required config value (``???`` in ``conf/``) was not given."""


# ---------------------------------------------------------------------------------------------
# Errors in the form of the command line: `Cls(arg='x')` → `node.arg=x`.

_VALUE = r"""'[^']*'|"[^"]*"|\([^()]*\)|\[[^\[\]]*\]|[^\s,;:`)]+"""


def _override_value(text: str) -> str:
    """A Python literal as it is written in a Hydra override (``'skip'`` → ``skip``, ``None`` → ``null``)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return _format_override(value)


def _format_override(value: Any) -> str:
    if value is None:
        return "null"
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


def _node_keys(node: DictConfig) -> list[str]:
    return [str(k) for k in node.keys() if not str(k).startswith("_")]


def _as_cli_error(err: BaseException, nodes: dict[str, tuple[str, list[str]]]) -> ConfigError | None:
    """A setting error raised after building (in ``fit``), with ``` `Cls(arg=x)` ``` rewritten as the
    override of the node that built ``Cls`` (``nodes``: class name → (path, keys)); ``None`` if none applies."""
    if not isinstance(err, _user_error_types()):
        return None
    message = str(err)
    for class_name, (path, keys) in nodes.items():
        message = as_overrides(message, path, keys, class_name, bare=False)
    return ConfigError(message) if message != str(err) else None


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Errors that describe a setting (one line on the command line); anything else keeps its traceback."""
    types: list[type[BaseException]] = [ValueError, FileNotFoundError]
    if "lightning.fabric" in sys.modules:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        types.append(MisconfigurationException)
    return tuple(types)


def _instantiate(node: DictConfig, path: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` whose argument errors name the node's overrides (``data.dataset.x=...``)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if not isinstance(cause, (*_user_error_types(), TypeError)):
            raise
        target = str(node.get("_target_", "")).rsplit(".", 1)[-1]
        message = as_overrides(str(cause), path, _node_keys(node), target or None)
        if message == str(cause):  # nothing to rewrite: say which node it came from
            message = f"{path} ({target}): {message}"
        raise ConfigError(message) from cause


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


# ---------------------------------------------------------------------------------------------
# Building the run.


def _instantiate_dataset(cfg: DictConfig, module: pl.LightningModule) -> Any:
    """Build the dataset; token geometry and text shape left ``null`` in the data config (``patch_size``,
    ``vae_stride``, ``text_len``, ``text_dim``) are taken from the model, so they are set in one place."""
    overrides: dict[str, Any] = {}
    model_config = getattr(module, "config", None)
    for key in ("text_len", "text_dim", "patch_size", "vae_stride"):
        if key in cfg and cfg[key] is None:
            if model_config is None:
                raise ConfigError(f"data.dataset.{key} is null but the model has no `config.{key}`; set it.")
            overrides[key] = getattr(model_config, key)
    return _instantiate(cfg, "data.dataset", **overrides)


def _sequence_parallel_settings(cfg: DictConfig | None, module: pl.LightningModule) -> dict[str, Any] | None:
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
        if comm.get("alltoalls_per_layer", 0) is None:  # checkpointing recomputes the forward's four
            comm["alltoalls_per_layer"] = 12 if getattr(module, "activation_checkpointing", False) else 8
    return settings


def _with_sequence_parallel_callback(callbacks: list[pl.Callback], datamodule: Any) -> list[pl.Callback]:
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


def _instantiate_callbacks(cfg: DictConfig | None) -> list[pl.Callback]:
    callbacks: list[pl.Callback] = []
    for name, cb_cfg in (cfg or {}).items():
        if cb_cfg is None:
            continue  # `~callbacks.<name>` or `callbacks.<name>=null` removes one
        if not isinstance(cb_cfg, DictConfig) or "_target_" not in cb_cfg:
            raise ConfigError(f"callbacks.{name} must be a config with a `_target_`, got {cb_cfg!r}.")
        callbacks.append(_instantiate(cb_cfg, f"callbacks.{name}"))
    return callbacks


@dataclass
class Run:
    """Everything ``train`` builds from a config, before fitting."""

    module: pl.LightningModule
    datamodule: pl.LightningDataModule
    trainer: pl.Trainer
    # Class name → (config path, argument keys) of what was built, to word later errors as overrides.
    nodes: dict[str, tuple[str, list[str]]] = field(default_factory=dict)


def _warn_about_world_size(trainer: pl.Trainer, datamodule: Any) -> None:
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


def build(cfg: DictConfig) -> Run:
    """Check the settings, then instantiate model, data, bucketing policy, callbacks, logger, strategy and Trainer."""
    check_required(cfg)
    check_ckpt_path(cfg)

    import lightning.pytorch as pl
    from lightning.pytorch.utilities import rank_zero_info

    from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback

    check_resume_has_steps_left(cfg)
    check_accelerator(cfg)
    if cfg.get("seed") is not None:
        # Also the seed of FlowMatchingModule's timestep and noise draws (it reads it from here).
        pl.seed_everything(cfg.seed, workers=True)

    module = _instantiate(cfg.model, "model")
    dataset = _instantiate_dataset(cfg.data.dataset, module)
    policy = _instantiate(cfg.bucketing.policy, "bucketing.policy")
    sp_settings = _sequence_parallel_settings(cfg.data.get("sequence_parallel"), module)
    sp = {"sequence_parallel": sp_settings} if sp_settings is not None else {}
    datamodule = _instantiate(
        cfg.data.datamodule,
        "data.datamodule",
        dataset=dataset,
        policy=policy,
        balance=cfg.bucketing.balance,
        seed=cfg.get("seed") or 0,
        **sp,
    )
    if hasattr(datamodule, "print_plan"):
        # The DataModule prints the plan it trains, once, when its loader is built.
        datamodule.print_plan = bool(cfg.get("print_plan", True))
    callbacks = _instantiate_callbacks(cfg.get("callbacks"))
    if not cfg.bucketing.get("fit_from_benchmark", True):
        # The chosen policy is the point of the run (e.g. the equal-token baseline): keep it.
        kept = [cb for cb in callbacks if not isinstance(cb, ShapeBenchmarkCallback)]
        if len(kept) < len(callbacks):
            rank_zero_info(
                "bucketing.fit_from_benchmark=false: ShapeBenchmarkCallback is off; the configured policy is kept."
            )
        callbacks = kept
    if sp_settings is not None:
        callbacks = _with_sequence_parallel_callback(callbacks, datamodule)
    logger = _instantiate(cfg.logger, "logger") if cfg.get("logger") else False
    strategy = _instantiate(cfg.strategy, "strategy")
    trainer: pl.Trainer = _instantiate(
        cfg.trainer, "trainer", strategy=strategy, callbacks=callbacks, logger=logger
    )
    _warn_about_world_size(trainer, datamodule)
    built = {
        "model": module,
        "data.dataset": dataset,
        "data.datamodule": datamodule,
        "bucketing.policy": policy,
        "strategy": strategy,
        "trainer": trainer,
    }
    nodes = {
        type(obj).__name__: (path, _node_keys(OmegaConf.select(cfg, path)))
        for path, obj in built.items()
        if not isinstance(obj, (str, int, float, bool))  # e.g. strategy "auto"
    }
    nodes["Trainer"] = ("trainer", _node_keys(cfg.trainer))  # also a subclass's messages say `Trainer(...)`
    return Run(module, datamodule, trainer, nodes)


def _format_summary(summary: dict[str, float]) -> str:
    parts = []
    for key, value in summary.items():
        if key == "steps":
            continue
        if key.endswith("_cv") or key in ("bubble", "mfu", "data_wait_frac"):
            parts.append(f"{key} {value:.2%}")
        elif key == "tokens_per_s":
            parts.append(f"{key} {value:,.0f}")
        elif key in ("alloc_retries", "device_allocs"):
            parts.append(f"{key} {int(value)} in total")
        else:
            parts.append(f"{key} {value:.4g}")
    return ", ".join(parts)


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


def train(cfg: DictConfig) -> dict[str, float]:
    """Build the run from ``cfg`` and fit.

    Unless the environment says otherwise, CUDA's allocator uses expandable segments
    (:func:`configure_cuda_allocator`).

    Returns:
        The Trainer's final callback metrics as floats (``train/loss`` is the last logged step's).
        With a ``BalanceMonitor`` callback, its run means replace the last step's ``balance/*``
        values, so they agree with the balance report.
    """
    _running.clear()  # an earlier run in this process must not lend its rank to this one's errors
    configure_cuda_allocator()
    run = build(cfg)
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor

    _running["trainer"] = run.trainer
    watcher = _PeerErrorWatcher.start(cfg, run.trainer.world_size)
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=cfg.get("ckpt_path"))
    except Exception as err:
        cli_error = _as_cli_error(err, run.nodes)
        if cli_error is None:
            raise
        raise cli_error from err
    finally:
        if watcher is not None:
            watcher.stop()
    metrics = {k: float(v) for k, v in run.trainer.callback_metrics.items() if v.numel() == 1}
    if run.trainer.global_step == 0:
        rank_zero_warn("trained 0 steps: check trainer.max_steps, trainer.max_epochs and the data size.")

    lines = []
    if "train/loss" in metrics:
        lines.append(f"  train/loss at step {run.trainer.global_step} (the last logged value): {metrics['train/loss']:.6g}")
    monitor = next((cb for cb in run.trainer.callbacks if isinstance(cb, BalanceMonitor)), None)
    summary = monitor.summary() if monitor is not None else {}
    if summary:
        metrics.update({f"balance/{k}": float(v) for k, v in summary.items()})
        lines.append(f"  balance, means over {int(summary.get('steps', 0))} steps: {_format_summary(summary)}")
    else:
        lines.append(f"  last logged values: {metrics}")
    rank_zero_info("Final metrics\n" + "\n".join(lines))
    return metrics


# ---------------------------------------------------------------------------------------------
# One readable error per failure, also with several ranks.


# The Trainer of the run in progress: its rank and world size are the truth once `fit` has started
# (Lightning's launcher gives its processes LOCAL_RANK / NODE_RANK only, no RANK or WORLD_SIZE).
_running: dict[str, Any] = {}


def _world_size() -> int:
    trainer = _running.get("trainer")
    return int(trainer.world_size) if trainer is not None else int(os.environ.get("WORLD_SIZE", 1))


def _rank() -> int:
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


def _describe(err: BaseException) -> str:
    if isinstance(err, _user_error_types()):
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


class _PeerErrorWatcher:
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
    def start(cls, cfg: DictConfig, world_size: int) -> _PeerErrorWatcher | None:
        if world_size < 2 or _rank() != 0:
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


def _exit_on_error(err: BaseException, cfg: DictConfig | None) -> None:
    """Print one readable error for the run and exit 1.

    Rank 0 prints the cause last (its own, or a peer's when its own error only says that a peer
    went away); other ranks write their cause for rank 0 and exit quietly (printing it themselves
    only if rank 0 did not within a few seconds). ``HYDRA_FULL_ERROR=1`` re-raises with the traceback.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    rank = _rank()
    text = _describe(err)
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


@hydra.main(version_base="1.3", config_path=_config_path(), config_name="train")
def main(cfg: DictConfig) -> None:
    """Console script ``adaptiveload-train``."""
    try:
        OmegaConf.resolve(cfg)
        train(cfg)  # build() checks the required settings and ckpt_path before anything else
    except Exception as err:
        _exit_on_error(err, cfg)


if __name__ == "__main__":
    main()
