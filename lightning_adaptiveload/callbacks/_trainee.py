"""The live Lightning training step as the calibration conductor's :class:`Trainee`, the key of what
determines its cost, and the conductor's other inputs and outputs on the Lightning side (the corpus, the
sampler settings, the checkpointing modes applied to the module). Private to
:mod:`~lightning_adaptiveload.callbacks.shape_benchmark`."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng

from lightning_adaptiveload.bucketing.buckets import count_buckets
from lightning_adaptiveload.calibration import derive, record
from lightning_adaptiveload.calibration.calibrate import ProfileSettings, Trainee
from lightning_adaptiveload.calibration.profile import MemoryProbe, plan_grid
from lightning_adaptiveload.models.compiling import compile_seconds
from lightning_adaptiveload.models.protocol import attention_tokens_of, check_batch_shape, check_module


class _StrategyCollectives:
    """:class:`~lightning_adaptiveload.calibration.profile.Collectives` over a Lightning strategy."""

    def __init__(self, trainer: Trainer) -> None:
        self.strategy = trainer.strategy

    def max(self, value: float) -> float:
        t = torch.tensor(float(value), device=self.strategy.root_device, dtype=torch.float64)
        return float(self.strategy.reduce(t, reduce_op="max"))

    def broadcast(self, obj: Any) -> Any:
        return self.strategy.broadcast(obj)


def lightning_trainee(trainer: Trainer, pl_module: LightningModule, auto_checkpointing: bool) -> Trainee:
    """The live strategy's training step, as the conductor drives it (per-bucket modes with
    ``auto_checkpointing``)."""
    strategy = trainer.strategy
    device = strategy.root_device
    cuda = device.type == "cuda"
    has_shape = callable(getattr(pl_module, "batch_shape", None))

    def make_step(batch_size: int, grid: tuple[int, int, int]):
        batch = pl_module.synthetic_batch(batch_size, grid, device)
        if has_shape:
            check_batch_shape(pl_module, batch, grid, batch_size, source="synthetic")
        return lambda: _step(trainer, pl_module, batch)

    has_state = all(len(opt.state) > 0 for opt in trainer.optimizers) if trainer.optimizers else True
    params = {id(p): p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    auto = auto_checkpointing
    return Trainee(
        make_step=make_step, collectives=_StrategyCollectives(trainer),
        modes=tuple(pl_module.checkpointing_modes) if auto else (),
        set_mode=pl_module.set_checkpointing if auto else None,
        device_memory=int(torch.cuda.get_device_properties(device).total_memory) if cuda else None,
        pending_bytes=derive.pending_optimizer_bytes(sum(p.numel() for p in params.values()), has_state),
        memory=MemoryProbe.for_device(device),
        synchronize=(lambda: torch.cuda.synchronize(device)) if cuda else None,
        on_oom=torch.cuda.empty_cache if cuda else None,
        compile_clock=compile_seconds if _uses_compile(pl_module) else None,
        isolation=lambda: _no_trace(trainer, pl_module), device_name=_device_name(device),
        world_size=int(trainer.world_size), attention_tokens=attention_tokens_of(pl_module))


#: Hyperparameters that change the optimizer step, the loss or the weights' values but not the cost of the
#: profiled forward + backward, so the calibration key leaves them out (a calibration is reused across them),
#: as it leaves out every name ending in :data:`KEY_EXCLUDED_SUFFIXES` (where files are read or written).
#: Every other hyperparameter is in the key: one the rule does not know re-profiles rather than reuses.
KEY_EXCLUDED_HPARAMS = frozenset({
    "lr", "learning_rate", "betas", "beta1", "beta2", "eps", "weight_decay", "momentum", "warmup_steps",
    "optimizer_impl", "scheduler", "max_grad_norm", "ema_decay", "seed", "timestep_shift", "num_train_timesteps",
    "pretrained",
})
KEY_EXCLUDED_SUFFIXES = ("_dir", "_path", "_file")
#: A hyperparameter value longer than this (in JSON) is kept in the key as its hash.
_KEY_VALUE_CHARS = 200


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _hparams_key(pl_module: LightningModule) -> dict[str, Any]:
    hparams = getattr(pl_module, "hparams", None) or {}
    out = {}
    for name in sorted(hparams):
        if name in KEY_EXCLUDED_HPARAMS or str(name).endswith(KEY_EXCLUDED_SUFFIXES):
            continue
        value = _plain(hparams[name])
        text = json.dumps(value, sort_keys=True)
        out[name] = value if len(text) <= _KEY_VALUE_CHARS else "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def _batch_key(pl_module: LightningModule, grids: np.ndarray) -> dict[str, Any]:
    """Shape (less the batch dimension) and dtype of every tensor of a one-sample synthetic batch of the corpus's
    shortest grid; the latents give their channels and dtype only (their grid is the bucket's)."""
    keys = getattr(pl_module, "batch_keys", None)
    latents_key = keys.get("latents", "latents") if isinstance(keys, dict) else "latents"
    grid = tuple(int(v) for v in grids[int(np.argmin(grids.prod(axis=1)))])
    with isolate_rng():  # a module whose synthetic_batch draws from the global RNG must not shift training's
        batch = pl_module.synthetic_batch(1, grid, torch.device("cpu"))
    if not isinstance(batch, dict):
        return {}
    out: dict[str, Any] = {}
    for name in sorted(batch, key=str):
        value = batch[name]
        if not isinstance(value, torch.Tensor):
            continue
        shape = list(value.shape[1:])
        out[str(name)] = [shape[:1] if name == latents_key else shape, str(value.dtype)]
    return out


def calibration_key(trainer: Trainer, pl_module: LightningModule, st: ProfileSettings, grids: np.ndarray,
                    profile_version: int) -> dict[str, Any]:
    """What determines a step's cost: the cache and checkpoint key, derived rather than hand-written.

    From the module: its architecture (:func:`~lightning_adaptiveload.calibration.record.model_fingerprint`:
    the model's ``config`` or every parameter's shape), its hyperparameters (``module.hparams``) except those
    in :data:`KEY_EXCLUDED_HPARAMS` (optimizer, schedule, seed, loss weighting, weight source: they do not
    change the profiled forward + backward) or named ``*_dir``, ``*_path``, ``*_file``, the shape and dtype of every tensor of its ``synthetic_batch``
    (the context's length and width, a mask, a pooled embedding; the latents' channels), the tokens its
    attention sees at every corpus length (when not the video tokens), and its activation-checkpointing state;
    the module's own ``calibration_key()`` is added under ``"module"``. From the run: device, precision,
    strategy kind, the profiled grid and settings, every corpus length, the profiler's version. The world size
    and the DataModule's loader settings (workers, pinning) are not in it.
    """
    seq = grids.prod(axis=1)
    corpus = grids if st.m_mem is None else grids[seq <= st.m_mem]
    plan = plan_grid(corpus, st.batch_sizes, st.max_shapes, max_tokens=st.m_mem) if len(corpus) else []
    own = getattr(pl_module, "calibration_key", None)
    attention = attention_tokens_of(pl_module)
    lengths = sorted({int(v) for v in seq})
    joint = {s: attention(s) for s in lengths}
    return {
        "model": record.model_fingerprint(pl_module),
        "hparams": _hparams_key(pl_module),
        "batch": _batch_key(pl_module, grids),
        **({"attention_tokens": [[s, a] for s, a in joint.items()]} if any(a != s for s, a in joint.items()) else {}),
        "device": _device_name(trainer.strategy.root_device),
        "precision": str(trainer.precision),
        "strategy": _strategy_kind(trainer.strategy),
        "form": st.form,
        "grid": [[s.batch_size, *s.grid] for s in plan],
        # Every corpus length: per-bucket modes are measured up to the longest.
        "seq_lens": sorted({int(v) for v in seq}),
        "repeats": [st.warmup, st.repeats],
        # "auto" or the fixed mode: an "auto" record carries the modes it chose.
        "checkpointing": getattr(pl_module, "checkpointing", None),
        "module": own() if callable(own) else None,
        "profile": profile_version,
    }


#: Standard deviation of the noise an all-zero parameter holds while profiling (:func:`_no_trace`).
ZERO_PARAMETER_NOISE = 0.02


def zero_parameters(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, local tensor)`` of the module's floating parameters whose values (this rank's shard) are all zero,
    e.g. Wan's zero-initialised output head."""
    out = []
    for name, p in module.named_parameters():
        local = p.data.to_local() if hasattr(p.data, "to_local") else p.data
        if local.is_floating_point() and local.numel() and local.device.type != "meta" and not bool(local.any()):
            out.append((name, local))
    return out


@contextmanager
def _no_trace(trainer: Trainer, pl_module: LightningModule) -> Iterator[None]:
    """Profiling leaves no trace: RNG, buffers, train/eval modes and gradients are as they were.

    An all-zero parameter holds noise while profiling and is zeroed again after. A zero output layer (Wan's
    head, as its authors initialise it) sends zero gradients to every block, so a profiled backward would
    multiply zeros: a GPU runs that cooler, at a higher clock under its power cap, than training, whose first
    optimizer step makes the layer non-zero. (One H100, the project's 480p recipe from scratch: the profile
    timed 1 x 32,760 at 1.91 s, training ran it at 2.08 s; diffusers' Wan, whose init has no zero layer,
    trained within 0.99-1.04 of its profile.)"""
    modules = list(pl_module.modules())
    training_modes = [m.training for m in modules]
    buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}
    zeroed = zero_parameters(pl_module)
    if zeroed:
        largest = sorted(zeroed, key=lambda item: -item[1].numel())  # a zero weight says more than a zero bias
        names = ", ".join(name for name, _ in largest[:3]) + (f" and {len(zeroed) - 3} more" if len(zeroed) > 3 else "")
        rank_zero_info(f"{CALLBACK_NAME}: all-zero parameters ({names}) hold noise while profiling and are zeroed "
                       "again after: through a zero layer the backward multiplies zeros, faster than training's.")
    try:
        pl_module.train()
        with isolate_rng(), torch.enable_grad():
            with torch.no_grad():
                for _, t in zeroed:  # their own generator: the training RNG stream stays as it was
                    t.normal_(0.0, ZERO_PARAMETER_NOISE, generator=torch.Generator(t.device).manual_seed(0))
            yield
    finally:
        _clear_grads(trainer, pl_module)
        with torch.no_grad():
            for _, t in zeroed:
                t.zero_()
            for name, b in pl_module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for m, mode in zip(modules, training_modes, strict=True):
            m.training = mode


def _step(trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
    """One forward + backward as the training loop runs it, without optimizer step or hooks.

    Through the strategy's wrapper, so the gradient synchronisation DDP and FSDP run inside the backward is
    timed. The optimizer step is not: timing it would need the weights and the optimizer state copied and
    restored (for Adam three times the parameters, beyond what :func:`_no_trace` keeps), and its first step
    allocates that state, which the memory budget counts apart (``pending_bytes``). It costs the same for
    every batch, so it belongs to the intercept, which the closed loop measures from training's own steps
    (:func:`lightning_adaptiveload.calibration.feedback.refit`) together with the loader hand-over,
    callbacks and logging."""
    strategy = trainer.strategy
    with trainer.precision_plugin.train_step_context():
        wrapper = strategy.model
        if wrapper is not None and wrapper is not pl_module:
            # Calls through the wrapper's forward (DDP/FSDP gather and reducer hooks), the same
            # redirection Strategy.training_step uses.
            loss = strategy._forward_redirection(wrapper, pl_module, "compute_loss", batch)
        else:
            loss = pl_module.compute_loss(batch)
    # Not `strategy.backward`: that runs every callback's on_before/after_backward hooks, which
    # must not see profiling steps.
    strategy.pre_backward(loss)
    trainer.precision_plugin.backward(loss, pl_module, None)
    strategy.post_backward(loss)
    # Training zeroes gradients (set_to_none) every step, so each timed backward allocates them.
    _clear_grads(trainer, pl_module)


def _uses_compile(module: torch.nn.Module) -> bool:
    """Whether any part of the module runs through ``torch.compile`` (``Module.compile`` or a wrapper)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, OptimizedModule)
               for m in module.modules())


def _strategy_kind(strategy: Any) -> str:
    """The part of the strategy that changes a sample's step cost: replicated weights (one device or
    DDP: a rank runs the whole model on its batch) or the sharding strategy's class. So resuming a
    one-GPU run on eight DDP GPUs keeps the calibration."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        return "replicated"
    return type(strategy).__name__


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # The CPU's architecture, not its thread count: the key must not change with the rank layout.
    return f"{device.type}:{platform.machine()}"


def _clear_grads(trainer: Trainer, pl_module: LightningModule) -> None:
    # The wrapper (e.g. FSDP's root) may own flat parameters the LightningModule does not list.
    modules = [pl_module] + ([trainer.strategy.model] if trainer.strategy.model is not None else [])
    for module in modules:
        for p in module.parameters():
            p.grad = None


# ---------------------------------------------------------------------- the conductor's other inputs
#: How messages name the callback these helpers serve.
CALLBACK_NAME = "`ShapeBenchmarkCallback`"


def check_fit(trainer: Trainer, pl_module: LightningModule) -> None:
    """The module and the DataModule provide what calibration needs.

    Raises:
        MisconfigurationException: naming what is missing.
    """
    # batch_shape is optional: with it, every synthetic batch is checked against its grid.
    check_module(pl_module, ("compute_loss", "synthetic_batch"), who=CALLBACK_NAME)
    dm = trainer.datamodule
    dataset = getattr(dm, "dataset", None)
    if (
        dm is None
        or not callable(getattr(dataset, "token_grids", None))
        or not callable(getattr(dm, "set_policy", None))
        or not callable(getattr(dm, "set_cost_model", None))
    ):
        raise MisconfigurationException(
            f"{CALLBACK_NAME} needs `trainer.fit(..., datamodule=dm)` with `dm.dataset.token_grids()`, "
            f"`dm.set_policy` and `dm.set_cost_model` (see AdaptiveLoadDataModule); got {type(dm).__name__}."
        )


def log_dir(trainer: Trainer) -> Path:
    """The run's log directory (``trainer.log_dir``, else ``default_root_dir``)."""
    found = trainer.log_dir
    return Path(found if isinstance(found, (str, os.PathLike)) else trainer.default_root_dir)


def corpus(trainer: Trainer) -> tuple[np.ndarray, np.ndarray]:
    """The dataset's distinct token grids and their sample counts (calibration needs no more)."""
    grids = np.asarray(trainer.datamodule.dataset.token_grids())
    if len(grids) == 0:
        raise MisconfigurationException(f"{CALLBACK_NAME}: the dataset has no samples to profile.")
    return count_buckets(grids)


def samples_of(trainer: Trainer) -> tuple[np.ndarray, Any]:
    """Every sample's token grid and the dataset's ``sample_label`` (oversize errors name the sample)."""
    dataset = trainer.datamodule.dataset
    return np.asarray(dataset.token_grids()), getattr(dataset, "sample_label", None)


def sampler_settings(trainer: Trainer) -> dict[str, Any]:
    """The DataModule's sampler settings the derivation needs: balance, seed, oversize rule and SP degree."""
    dm = trainer.datamodule
    # With sequence parallelism the planner trains a sample too long for one rank on a group of k ranks,
    # so only samples above the largest usable k times the memory budget are oversize.
    sp = getattr(dm, "sp_config", None)
    sp_degree = max(sp.usable_degrees(trainer.world_size), default=1) if sp is not None else 1
    return {"balance": getattr(dm, "balance", "cost"), "seed": int(getattr(dm, "seed", 0) or 0),
            "oversize": getattr(getattr(dm, "policy", None), "oversize", "error"), "sp_degree": sp_degree}


def apply_checkpointing(pl_module: LightningModule, derivation: derive.Derivation, source: str, auto: bool) -> None:
    """Give the module the activation-checkpointing mode(s) its calibration was profiled with (cache, file,
    checkpoint): an ``"auto"`` module (``auto``) gets the first tier's mode (batches switch it per bucket);
    a module with a fixed mode is warned when the calibration was profiled in another.

    Raises:
        ValueError: the calibration holds a mode the module does not support.
    """
    current = getattr(pl_module, "checkpointing", None)
    if current is None:
        return
    modes = [t["mode"] for t in derivation.tiers]
    if not modes:
        if auto:
            rank_zero_warn(f"{CALLBACK_NAME}: the calibration from {source} does not record activation-checkpointing "
                           "modes; training with 'full'. Profile again (`force=True`) to choose them per bucket.")
            pl_module.set_checkpointing("full")
        return
    unknown = [m for m in modes if m not in getattr(pl_module, "checkpointing_modes", ())]
    if unknown:
        raise ValueError(f"The calibration from {source} was profiled with activation checkpointing {unknown[0]!r}, "
                         f"which {type(pl_module).__name__} does not support. Profile again (`force=True`).")
    if auto:
        pl_module.set_checkpointing(modes[0])  # the batches switch it per bucket (on_train_batch_start)
    elif modes != [current]:
        rank_zero_warn(f"{CALLBACK_NAME}: the calibration from {source} was profiled with activation checkpointing "
                       f"{' / '.join(modes)}, but the module uses {current!r}; its timings may not match.")
