"""The rectified-flow LightningModule base of :class:`~lightning_adaptiveload.models.FlowMatchingModule` and
:class:`~lightning_adaptiveload.integrations.diffusers.DiffusersWanModule`.

Both train a Wan 2.1 DiT with Wan's objective and differ only in the model they build and call, so
everything else lives here once: argument checks, draw-seeded timesteps and noise (exact losses after a
resume), the training step with its throughput logs, the protocol members the callbacks use
(``compute_loss``, ``synthetic_batch``, ``batch_shape``, ``flops_per_sample``, the activation-checkpointing
protocol, ``calibration_key``), the data checks made before the shape benchmark profiles, and AdamW with
its clipping (:mod:`lightning_adaptiveload.models.optim`).

A subclass builds its model in ``configure_model`` and provides the few members marked "subclass" below.
An own model (one that is not a Wan DiT) needs only its ``forward(x_t, t, context)``, its ``patch_size`` and,
for joint attention, ``attention_tokens``: without a :attr:`RectifiedFlowModule.wan_config`, synthetic batches
copy the keys, shapes and dtypes of one real sample (:meth:`RectifiedFlowModule.set_example`, called in
``setup``), the context length is the hyperparameter ``text_len`` (or that sample's), and every training
argument has a default (:data:`DEFAULTS`). ``docs/your_own_model.md`` shows one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_adaptiveload._checks import check_choice
from lightning_adaptiveload.data.bad_samples import BAD_SAMPLES_KEY, SAMPLE_WEIGHT_KEY
from lightning_adaptiveload.geometry import latent_of_grid, tokens_of
from lightning_adaptiveload.models.attention import choose_attention
from lightning_adaptiveload.models.checkpointing import (
    CHECKPOINTING_MODES,
    CHECKPOINTING_SETTINGS,
    checkpointing_setting,
)
from lightning_adaptiveload.models.optim import adamw, clip_gradients, use_fused_adamw
from lightning_adaptiveload.models.wan import WanConfig, wan_forward_flops
from lightning_adaptiveload.ops.attention import fa4_unsupported_reason

__all__ = [
    "DEFAULTS",
    "ON_NONFINITE_LOSS",
    "OUTSIDE_STREAM",
    "TRAIN_STREAM",
    "RectifiedFlowModule",
    "check_training_arguments",
    "draw_seed",
    "rectified_flow_loss",
    "shift_timesteps",
]

# Streams of `draw_seed`: training steps, and calls of `compute_loss` without a generator
# (profiling, evaluation), which must never replay or shift a training step's draws.
TRAIN_STREAM = 0
OUTSIDE_STREAM = 1

#: What a training step whose loss is not finite does (:attr:`RectifiedFlowModule.on_nonfinite_loss`).
ON_NONFINITE_LOSS = ("error", "skip", "off")
#: How many skipped samples and dropped steps one rank names in warnings; later ones are counted only.
MAX_NAMED = 5
#: How many samples of a batch a message names.
_SAMPLES_SHOWN = 8
#: The training arguments of a module that does not save them as hyperparameters (an own model's defaults).
DEFAULTS: dict[str, Any] = {
    "lr": 1e-4, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "warmup_steps": 0, "timestep_shift": 1.0,
    "num_train_timesteps": 1000, "activation_checkpointing": False,
}


def draw_seed(seed: int, step: int, rank: int, micro_batch: int = 0, stream: int = TRAIN_STREAM) -> int:
    """64-bit seed of the timestep and noise draws of one micro-batch: a pure function of its arguments.

    A hash (blake2b) of the five integers, so neighbouring steps or ranks get unrelated streams and a
    resumed run, or a run on another number of ranks, draws exactly what the same (step, rank) drew
    before.
    """
    data = struct.pack("<5q", int(seed), int(stream), int(step), int(rank), int(micro_batch))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def shift_timesteps(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's shifted schedule ``t = shift·u / (1 + (shift - 1)·u)``, mapping [0, 1] onto [0, 1].

    ``shift > 1`` moves samples towards t = 1 (more noise), which high-resolution video needs
    because neighbouring tokens are strongly correlated; ``shift = 1`` is the identity.
    """
    return shift * u / (1 + (shift - 1) * u)


def rectified_flow_loss(
    predict: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    timestep_shift: float,
    num_train_timesteps: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Wan's rectified-flow loss (fp32 scalar) of a batch with ``latents [B,C,F,H,W]`` and ``context``.

    ``u ~ U(0, 1)`` shifted to ``t`` (:func:`shift_timesteps`), then Gaussian ``noise``, both from
    ``generator`` (the global RNG when ``None``), in that order; ``x_t = (1 - t)·x0 + t·noise``; the
    fp32 MSE of ``predict(x_t, t · num_train_timesteps, context)`` against the velocity ``noise - x0``.

    With ``batch["sample_weight"]`` (``[B]``; the collate adds it, 0 for samples the dataset skipped) the
    loss is the weighted mean of the per-sample MSEs, so a weight-0 sample adds nothing to the loss or the
    gradient; a batch of weight 0 only gives a loss of 0 that still runs backward (every rank then takes
    part in the same gradient reductions). Without it, the plain MSE over the batch.
    """
    x0 = batch["latents"].float()
    b = x0.shape[0]
    u = torch.rand(b, device=x0.device, generator=generator)
    t = shift_timesteps(u, timestep_shift)
    noise = torch.randn(x0.shape, dtype=x0.dtype, device=x0.device, generator=generator)
    tb = t.view(b, 1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * noise
    pred = predict(x_t, t * num_train_timesteps, batch["context"])
    weight = batch.get(SAMPLE_WEIGHT_KEY)
    if weight is None:
        return F.mse_loss(pred.float(), noise - x0)
    per_sample = F.mse_loss(pred.float(), noise - x0, reduction="none").flatten(1).mean(1)
    weight = weight.to(device=per_sample.device, dtype=per_sample.dtype)
    total = weight.sum()
    # A skipped sample's inputs are zeros, so its error is finite and 0 x error is 0 (0 x NaN would not be).
    return (per_sample * weight).sum() / torch.where(total > 0, total, torch.ones_like(total))


def _holds(check: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(check(value))
    except (TypeError, ValueError):
        return False


# name → (check, what is expected): the training arguments both modules take.
_ARGUMENT_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": (lambda v: v > 0, "a positive float"),
    "weight_decay": (lambda v: v >= 0, "a float >= 0"),
    "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two floats in [0, 1)"),
    "eps": (lambda v: v > 0, "a positive float"),
    "warmup_steps": (lambda v: not isinstance(v, bool) and int(v) == v and v >= 0, "an integer >= 0"),
    "timestep_shift": (lambda v: v > 0, "a positive float"),
    "num_train_timesteps": (lambda v: v > 0, "a positive number"),
    "seed": (lambda v: v is None or (not isinstance(v, bool) and int(v) == v and v >= 0),
             "a non-negative integer or None"),
    "activation_checkpointing": (lambda v: bool(checkpointing_setting(v)),
                                 f"one of {list(CHECKPOINTING_SETTINGS)} or true/false"),
}


def check_training_arguments(owner: str, **values: Any) -> None:
    """Check the training arguments named in ``values`` (``lr``, ``betas``, ``seed``, ...).

    Raises:
        ValueError: the first invalid one, as ``"`owner(name=value)` is not valid. Expected ..."``.
    """
    for name, value in values.items():
        check, expected = _ARGUMENT_CHECKS[name]
        if not _holds(check, value):
            raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected {expected}.")


def _linear_warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps)


def _plain(value: Any) -> Any:
    """``value`` as plain JSON (mappings sorted, tuples as lists, anything else as its string)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


#: How many dataset samples :meth:`RectifiedFlowModule.setup` reads (spread over the dataset) to check the
#: batch keys and context lengths before the shape benchmark profiles.
SAMPLES_CHECKED = 8


class RectifiedFlowModule(pl.LightningModule):
    """Base of the LightningModules that train a Wan DiT with Wan's rectified-flow objective.

    For a clean latent ``x0`` and Gaussian ``noise``: ``u ~ U(0, 1)``, ``t = shift·u / (1 + (shift-1)·u)``,
    ``x_t = (1 - t)·x0 + t·noise``; the loss is the fp32 MSE between the prediction for
    ``(x_t, t · num_train_timesteps, context)`` and the velocity ``noise - x0``.

    Timesteps and noise of a training micro-batch come from a ``torch.Generator`` on the batch's device
    seeded by :func:`draw_seed` from (seed, global step, global rank, micro-batch index within the step),
    never from the global RNG: a resumed run draws exactly what the uninterrupted run drew at every step,
    each rank draws its own noise, and a run on another number of ranks has a well-defined stream.
    :meth:`compute_loss` called outside ``training_step`` (profiling, evaluation) uses a separate stream
    unless it is given a ``generator``, so it never consumes or replays a training draw.

    Subclasses call :func:`check_training_arguments` and ``save_hyperparameters()`` (hparams ``lr``,
    ``weight_decay``, ``betas``, ``eps``, ``timestep_shift``, ``num_train_timesteps``,
    ``activation_checkpointing``, optionally ``warmup_steps``, ``seed``, ``compile``, ``compile_options``,
    ``optimizer_impl``), build the model in ``configure_model`` and provide the members marked
    "subclass". Batches are mappings; :attr:`batch_keys` names their latents and context.
    """

    #: What :meth:`set_checkpointing` accepts, least recomputation (most memory) first.
    checkpointing_modes: tuple[str, ...] = CHECKPOINTING_MODES
    #: Whether batches with ``sp_degree > 1`` are trained (through :attr:`sequence_parallel`).
    supports_sequence_parallel: bool = False
    #: What a training step whose loss is not finite on some rank does, decided on every rank together
    #: before the optimizer step (one all-gather of one number and one host sync per optimizer step):
    #: ``"error"`` (default) raises ``FloatingPointError`` naming the samples of that step, with the weights
    #: still those of the last good step (so no NaN reaches a checkpoint); ``"skip"`` drops the step's
    #: gradients on every rank (the optimizer leaves every parameter and its state alone), names the samples
    #: in a warning and counts the step in :attr:`nonfinite_loss_steps`; ``"off"``: no check (NaN trains into
    #: the weights). The check reads a flag on the host before each optimizer step. Measured through
    #: ``adaptiveload-train`` on the 480p recipe (one H100, ``BalanceMonitor`` timing with CUDA events, so no other
    #: per-step synchronisation; ``benchmarks/results/ab.json``): "off" against "error" 0.999x the epoch estimate,
    #: no measurable difference, the fused optimizer step's device time covering the host's hand-over to the next
    #: step. In a bare loop of short steps (one H200, B=1 x 7,800 tokens, batches already on the GPU, no callbacks)
    #: it cost +7 ms a step (1.9%); "off" is for such loops.
    on_nonfinite_loss: str = "error"

    def __init__(self) -> None:
        super().__init__()
        #: Batch key of the latents ``[B, C, F, H, W]`` and of the context ``[B, L, text_dim]``.
        self.batch_keys: dict[str, str] = {"latents": "latents", "context": "context"}
        # The mode set_checkpointing last applied; None: the constructor's setting still stands.
        self._checkpointing: str | None = None
        self._last_step_start: float | None = None
        self._last_step_samples = 0.0
        self._last_step_tokens = 0.0
        # (global step, index) of the last training micro-batch: the index counts micro-batches of
        # one optimizer step under gradient accumulation.
        self._micro_batch: tuple[int, int] = (-1, 0)
        #: Samples this rank trained past that the dataset had skipped (``on_bad_sample="skip"``: zeros
        #: with weight 0 in the loss), counted from ``batch["bad_samples"]``, so DataLoader workers' skips too.
        self.bad_samples = 0
        #: Optimizer steps dropped for a non-finite loss (``on_nonfinite_loss="skip"``).
        self.nonfinite_loss_steps = 0
        self._named = 0  # skipped samples and dropped steps named in warnings so far
        # (detached loss, batch["index"], (B, S)) of each micro-batch of the optimizer step under way.
        self._step_losses: list[tuple[torch.Tensor, Any, tuple[int, int]]] = []
        # On CUDA: losses on their way to pinned host memory (with the event after each copy), the newest arrived.
        self._loss_copies: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._shown_loss: torch.Tensor | None = None

    # ------------------------------------------------------------------ subclass
    @property
    def wan_config(self) -> WanConfig:
        """Subclass (Wan DiTs): the model's architecture as a :class:`WanConfig` (``text_len`` = the context length
        the model computes with); synthetic batches and the FLOP count are built from it. An own model leaves it
        out (see the module docstring)."""
        raise NotImplementedError

    @property
    def _is_wan(self) -> bool:
        return type(self).wan_config is not RectifiedFlowModule.wan_config

    def _built_model(self) -> nn.Module | None:
        """Subclass: the model once ``configure_model`` has built it, else ``None``. Default: the module itself
        (an own model's layers are its submodules)."""
        return self

    def _set_block_checkpointing(self, mode: str) -> None:
        """Subclass: make every block of the built model recompute as ``mode`` says (cheap: called per batch)."""
        raise NotImplementedError(
            f"`{type(self).__name__}` has no activation-checkpointing switch: override `_set_block_checkpointing(mode)` "
            "and `checkpointing_modes`, or leave `activation_checkpointing` off."
        )

    def _model_inputs(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Subclass: the batch's inputs the model takes besides latents, timesteps and context (keyword arguments
        of ``forward``, e.g. a family's ``context_mask`` or ``pooled``), checked; :meth:`compute_loss` passes them.
        Default: none."""
        return {}

    def attention_tokens(self, seq_len: int) -> int:
        """Tokens one sample of ``seq_len`` video tokens has in attention: ``seq_len`` (Wan attends to its text by
        cross-attention). A joint-attention (MMDiT) subclass returns ``seq_len + text_len``."""
        return int(seq_len)

    def _hp(self, name: str) -> Any:
        """The hyperparameter ``name``, or its default (:data:`DEFAULTS`) when the module did not save it."""
        return self.hparams.get(name, DEFAULTS[name])

    def _fused_adaln_sites(self) -> int:
        """Subclass: how many AdaLN sites of the built model run through the fused op."""
        return 0

    def _context_problem(self, length: int) -> str | None:
        """Why contexts of ``length`` tokens do not fit the model (``None`` if they do). Here: any length
        but the stated text length (:meth:`_text_shape`), the length profiling and the FLOP count assume."""
        text_len = self._text_shape()[0]
        return None if length == text_len else f"the model is set up for text_len={text_len}"

    def _text_shape(self) -> tuple[int, int]:
        """``(text_len, text_dim)`` every context must have: the Wan config's, or an own model's hyperparameter
        ``text_len`` (else the example sample's length) and the example's width."""
        if self._is_wan:
            cfg = self.wan_config
            return cfg.text_len, cfg.text_dim
        shape = self._example_spec(self.batch_keys["context"])[0]
        if len(shape) < 2:
            raise MisconfigurationException(
                f"`{type(self).__name__}`: the example's context has shape {shape}; expected [L, text_dim]."
            )
        stated = self.hparams.get("text_len", getattr(self, "text_len", None))
        return (int(shape[-2]) if stated is None else int(stated)), int(shape[-1])

    def set_example(self, sample: Mapping[str, Any]) -> None:
        """Remember the keys, shapes (less the batch dimension) and dtypes of one real (collated) sample:
        :meth:`synthetic_batch` of an own model builds batches like it (``setup`` calls this with the
        DataModule's first sample; call it yourself to profile or check outside ``Trainer.fit``)."""
        if not isinstance(sample, Mapping) or self.batch_keys["latents"] not in sample:
            raise ValueError(
                f"`{type(self).__name__}.set_example(sample)` needs a mapping with {self.batch_keys['latents']!r}; "
                f"got {sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__}."
            )
        self._example = {k: (tuple(v.shape[1:]), v.dtype) for k, v in sample.items() if isinstance(v, torch.Tensor)}

    def _example_spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        spec = getattr(self, "_example", None)
        if spec is None:
            raise MisconfigurationException(
                f"`{type(self).__name__}` has no example sample to build synthetic batches from. It is read from the "
                "DataModule's dataset in `setup` (Trainer.fit); outside fit call `module.set_example(collate_batch("
                "[dataset[0]]))` first, or define `wan_config`."
            )
        if key not in spec:
            raise MisconfigurationException(
                f"`{type(self).__name__}`: the example sample has no tensor {key!r}; it has {sorted(spec)}. "
                f"{self._keys_fix()}"
            )
        return spec[key]

    # ------------------------------------------------------------------ model
    def _require_model(self) -> nn.Module:
        model = self._built_model()
        if model is None:
            raise RuntimeError(
                f"The model of `{type(self).__name__}` is not built yet. Call `configure_model()` first "
                "(the Trainer does this in `fit`)."
            )
        return model

    # ------------------------------------------------------------------ activation checkpointing
    @property
    def checkpointing(self) -> str:
        """The activation-checkpointing mode in use, or ``"auto"`` while it is still to be chosen."""
        if self._checkpointing is not None:
            return self._checkpointing
        return checkpointing_setting(self._hp("activation_checkpointing"))

    def _initial_checkpointing(self) -> str:
        """The mode blocks are built with: the set or configured one; ``"full"`` while ``"auto"`` is undecided
        (the safe mode to start in)."""
        mode = self.checkpointing
        return "full" if mode == "auto" else mode

    def set_checkpointing(self, mode: str) -> None:
        """Make every block recompute as ``mode`` (one of :attr:`checkpointing_modes`) says.

        Cheap enough to call before every batch (a per-bucket mode): an unchanged mode returns at once and
        a change sets one attribute per block that the block's forward reads; compiled blocks compile one
        graph per mode and reuse it on every later switch.
        """
        if mode not in self.checkpointing_modes:
            raise ValueError(
                f"`{type(self).__name__}.set_checkpointing({mode!r})` is not valid. Expected one of "
                f"{list(self.checkpointing_modes)}."
            )
        if mode == self._checkpointing:
            return
        if self._built_model() is not None:
            self._set_block_checkpointing(mode)
        self._checkpointing = mode

    # ------------------------------------------------------------------ attention backend
    #: The attention backends this module can run (:data:`~lightning_adaptiveload.ops.attention.ATTENTION_BACKENDS`).
    attention_backends: tuple[str, ...] = ("sdpa",)

    def _init_attention(self, attention: str) -> None:
        #: Attention backend per sequence length (``attention="auto"``: chosen by measurement, see
        #: :meth:`set_attention_plan`); ``None`` until chosen, or with a fixed backend.
        self.attention_plan: dict[int, str] | None = None
        self._attention_backend = "sdpa" if attention == "auto" else attention

    @property
    def attention(self) -> str:
        """The ``attention=`` setting: ``"auto"``, ``"sdpa"`` or ``"fa4"`` (``"sdpa"`` for a module without one)."""
        return self.hparams.get("attention", "sdpa")

    @property
    def attention_heads(self) -> tuple[int, int]:
        """``(num_heads, head_dim)`` of the model's attention (what backends are timed with)."""
        raise NotImplementedError

    def _set_model_attention(self, backend: str) -> None:
        """Make the built model run ``backend`` (called only with one of :attr:`attention_backends`)."""

    def set_attention_plan(self, plan: Mapping[int, str]) -> None:
        """Use ``plan[S]`` for batches of ``S`` tokens per sample (the nearest planned length for others)."""
        self.attention_plan = {int(s): str(b) for s, b in plan.items()}
        if len(set(self.attention_plan.values())) == 1:
            self._use_attention(next(iter(self.attention_plan.values())))

    def _use_attention(self, backend: str) -> None:
        if backend != getattr(self, "_attention_backend", "sdpa"):
            self._attention_backend = backend
            self._set_model_attention(backend)

    def _attention_for(self, seq_len: int) -> str:
        plan = getattr(self, "attention_plan", None)
        if not plan:
            return getattr(self, "_attention_backend", "sdpa")
        if seq_len in plan:
            return plan[seq_len]
        return plan[min(plan, key=lambda s: abs(s - seq_len))]

    def _attention_for_latents(self, latents: torch.Tensor) -> None:
        """Before a forward: switch to the plan's backend for the latents' sequence length (cheap)."""
        plan = getattr(self, "attention_plan", None)
        if plan and len(set(plan.values())) > 1:
            self._use_attention(self._attention_for(tokens_of(latents, self.patch_size)[1]))

    def _check_attention(self) -> None:
        """At fit start: a fixed backend that cannot run is refused; ``"auto"`` without a shape benchmark's
        choice chooses here (:func:`~lightning_adaptiveload.models.attention.choose_attention`)."""
        setting, cls = self.attention, type(self).__name__
        if setting not in ("auto", "sdpa") and setting not in self.attention_backends:
            raise ValueError(f"`{cls}(attention={setting!r})` is not available for this model (it runs "
                             f"{list(self.attention_backends)}). Use attention='auto' or 'sdpa'.")
        if setting == "fa4":
            reason = fa4_unsupported_reason(self.device, None, self.attention_heads[1])
            if reason is not None:
                raise ValueError(f"`{cls}(attention='fa4')` cannot run: {reason}. "
                                 "Use attention='auto' (falls back to SDPA) or 'sdpa'.")
        if setting == "auto" and getattr(self, "attention_plan", None) is None and self._trainer is not None:
            choose_attention(self.trainer, self, say=rank_zero_info)

    @override
    def on_fit_start(self) -> None:
        self._check_attention()
        if self.checkpointing == "auto":
            cls = type(self).__name__
            rank_zero_warn(
                f"`{cls}(activation_checkpointing='auto')` needs ShapeBenchmarkCallback to choose a mode; training "
                "with 'full'. Add the callback or set the mode ('none', 'selective', 'full')."
            )
            self.set_checkpointing("full")

    def calibration_key(self) -> dict[str, Any]:
        """What the derived calibration key cannot see: the number of AdaLN sites fused by ``FusedAdaLNCallback``.

        The shape benchmark derives the rest (``lightning_adaptiveload.callbacks._trainee.calibration_key``):
        the context length from :meth:`synthetic_batch`, ``activation_checkpointing``, ``compile`` and its
        options from the hyperparameters, the architecture from the model's config.
        """
        plan = getattr(self, "attention_plan", None)
        key = {"fused_adaln_sites": self._fused_adaln_sites()}
        if plan is not None:  # the backends auto chose (the setting itself is a hyperparameter)
            key["attention_plan"] = {str(s): b for s, b in sorted(plan.items())}
        return _plain(key)

    # ------------------------------------------------------------------ batches
    def _get(self, batch: Any, name: str, where: str = "a batch") -> torch.Tensor:
        """``batch[batch_keys[name]]``, or an error naming the keys the batch has and the fix."""
        key = self.batch_keys[name]
        if isinstance(batch, Mapping) and key in batch:
            return batch[key]
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise MisconfigurationException(
            f"`{type(self).__name__}`: {where} has no {key!r} (the {name}); it has {keys}. {self._keys_fix()}"
        )

    def _keys_fix(self) -> str:
        return ("Return batches keyed 'latents' [B, C, F, H, W] and 'context' [B, L, text_dim] (the project's "
                "collate does).")

    def _check_context(self, context: torch.Tensor, where: str) -> int:
        """The context's length L; an error naming ``where``, L and the model's setting if it does not fit."""
        cls = type(self).__name__
        text_len, text_dim = self._text_shape()
        if context.ndim < 2 or context.shape[-1] != text_dim:
            raise MisconfigurationException(
                f"`{cls}`: the context of {where} has shape {list(context.shape)}; expected [..., L, "
                f"text_dim={text_dim}] (the model's text_dim)."
            )
        length = int(context.shape[-2])
        problem = self._context_problem(length)
        if problem is not None:
            raise MisconfigurationException(
                f"`{cls}`: the context of {where} has L={length} tokens, but {problem}; the shape benchmark "
                f"and the FLOP count would time and count {text_len}. {self._text_len_fix(length)}"
            )
        return length

    def _text_len_fix(self, length: int) -> str:
        return f"Pad or truncate the contexts to {self._text_shape()[0]} tokens in the dataset."

    def check_batch(self, batch: Any, where: str = "a training batch") -> None:
        """Check a collated batch: the latents and context keys, and the context's length and width.

        Raises:
            MisconfigurationException: naming the batch, what it holds and the fix.
        """
        self._get(batch, "latents", where)
        self._check_context(self._get(batch, "context", where), where)

    @override
    def setup(self, stage: str) -> None:
        """Before the shape benchmark profiles (``on_fit_start``): read up to :data:`SAMPLES_CHECKED`
        samples spread over the DataModule's ``dataset``, collated one by one through its ``collate_fn``
        (if it sets one), and check their keys and contexts (:meth:`check_batch`). With the project's
        default collate, which stacks contexts of one length, contexts of different lengths are refused
        here, naming the samples, rather than at the first batch that mixes them."""
        trainer = self._trainer
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        dataset = getattr(datamodule, "dataset", None)
        if stage != "fit" or dataset is None or not callable(getattr(dataset, "__getitem__", None)):
            return
        try:
            n = len(dataset)
        except TypeError:
            return
        collate = getattr(datamodule, "collate_fn", None)
        count = min(n, SAMPLES_CHECKED)
        indices = sorted({round(k * (n - 1) / max(count - 1, 1)) for k in range(count)})
        contexts = []
        for i in indices:
            sample = dataset[i]
            batch = collate([sample]) if collate is not None else sample
            where = f"dataset[{i}]" + ("" if collate is None else " (collated)")
            if not self._is_wan and getattr(self, "_example", None) is None:
                self._get(batch, "latents", where)
                self.set_example(batch if collate is not None else {k: v.unsqueeze(0) if isinstance(
                    v, torch.Tensor) else v for k, v in batch.items()})
            self._get(batch, "latents", where)
            contexts.append((i, where, self._get(batch, "context", where)))
        lengths: dict[int, list[int]] = {}
        for i, where, context in contexts:
            if context.ndim < 2:
                self._check_context(context, where)  # raises, naming the shape
            lengths.setdefault(int(context.shape[-2]), []).append(i)
        if collate is None and len(lengths) > 1:
            found = "; ".join(f"L={length} at dataset{idx}" for length, idx in lengths.items())
            raise MisconfigurationException(
                f"`{type(self).__name__}`: the dataset's contexts have different lengths ({found}); the default "
                f"collate stacks contexts of one length. Pad every context to text_len={self._text_shape()[0]} "
                "in the dataset (as ManifestDataset and ShardedLatentDataset do), or pass "
                "`AdaptiveLoadDataModule(collate_fn=...)` that pads them."
            )
        for _, where, context in contexts:
            self._check_context(context, where)

    def batch_shape(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """``(B, S)`` of a batch: samples, and tokens per sample after patchify of its latents ``[B,C,F,H,W]``."""
        return tokens_of(self._get(batch, "latents"), self.patch_size)

    def tokens_in_batch(self, batch: Mapping[str, torch.Tensor]) -> int:
        """B · S of a batch: samples times tokens per sample after patchify."""
        b, s = self.batch_shape(batch)
        return b * s

    def synthetic_batch(
        self,
        batch_size: int,
        grid: Sequence[int],
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Random batch for token grid ``(f, h, w)``, keyed and shaped like the collated data.

        Uses its own generator (seeded by ``seed``), so building profiling batches leaves the
        training RNG stream alone. ``index`` is ``-1`` to mark samples that are not from a dataset.

        Returns:
            ``{latents: [B, in_dim, f·pt, h·ph, w·pw], context: [B, text_len, text_dim], "index": LongTensor[B]}``
            under the names of :attr:`batch_keys`.
        """
        try:
            ok = len(grid) == 3 and all(int(g) == g and g >= 1 for g in grid)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"`{type(self).__name__}.synthetic_batch(grid={tuple(grid)!r})` is not valid. Expected a "
                             "token grid: three positive integers (f, h, w).")
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"`{type(self).__name__}.synthetic_batch(batch_size={batch_size!r})` is not valid. "
                             "Expected a positive integer.")
        device = self.device if device is None else torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        shape = latent_of_grid(grid, self.patch_size)
        if not self._is_wan:
            return self._synthetic_from_example(batch_size, shape, device, gen)
        cfg = self.wan_config
        return {
            self.batch_keys["latents"]: torch.randn(batch_size, cfg.in_dim, *shape, device=device, generator=gen),
            self.batch_keys["context"]: torch.randn(batch_size, cfg.text_len, cfg.text_dim, device=device,
                                                    generator=gen),
            "index": torch.full((batch_size,), -1, dtype=torch.long, device=device),
        }

    def _synthetic_from_example(self, batch_size: int, latent_shape: Sequence[int], device: torch.device,
                                gen: torch.Generator) -> dict[str, Any]:
        """A batch keyed, shaped and typed like the example sample (:meth:`set_example`): float tensors normal,
        integer and boolean ones (masks) ones, the latents of ``latent_shape``, ``index`` -1."""
        latents_key = self.batch_keys["latents"]
        self._example_spec(latents_key)  # raises without an example
        out: dict[str, Any] = {}
        for key, (shape, dtype) in self._example.items():
            if key == latents_key:
                shape = (shape[0], *latent_shape)
            if key == "index":
                out[key] = torch.full((batch_size,), -1, dtype=torch.long, device=device)
            elif dtype.is_floating_point:
                out[key] = torch.randn(batch_size, *shape, device=device, generator=gen).to(dtype)
            else:
                out[key] = torch.ones(batch_size, *shape, dtype=dtype, device=device)
        return out

    def flops_per_sample(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward for one sample of ``seq_len`` video tokens: 3 × the forward.

        The forward is :func:`~lightning_adaptiveload.models.wan.wan_forward_flops` of :attr:`wan_config`
        (every matmul, attention included); backward counts as twice the forward, the usual model-FLOPs
        convention. Recomputation under activation checkpointing is not counted. An own model's forward is
        counted by ``torch.utils.flop_counter`` on fake tensors (no compute, no memory; once per length) of one
        sample of token grid ``(1, 1, seq_len)`` and the example's context, so joint attention is counted over
        every token it sees; 0 (no MFU, with one warning) if the forward cannot run on fake tensors.
        """
        if self._is_wan:
            return 3.0 * wan_forward_flops(self.wan_config, seq_len)
        cache = self.__dict__.setdefault("_flops_cache", {})
        if cache.get("uncountable"):
            return 0.0
        if seq_len not in cache:
            cache[seq_len] = 3.0 * self._counted_forward_flops(int(seq_len))
        return cache[seq_len]

    def _counted_forward_flops(self, seq_len: int) -> float:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils.flop_counter import FlopCounterMode

        latents_key, context_key = self.batch_keys["latents"], self.batch_keys["context"]
        (channels, *_), dtype = self._example_spec(latents_key)
        context_shape, context_dtype = self._example_spec(context_key)
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), FlopCounterMode(display=False) as counter:
                x = torch.empty(1, channels, *latent_of_grid((1, 1, seq_len), self.patch_size), dtype=dtype,
                                device=self.device)
                t = torch.empty(1, device=self.device)
                self(x, t, torch.empty(1, *context_shape, dtype=context_dtype, device=self.device))
        except Exception as err:  # an op without a fake kernel, a sharded or compiled model
            rank_zero_warn(f"`{type(self).__name__}.flops_per_sample`: the forward could not be counted on fake "
                           f"tensors ({type(err).__name__}: {err}); no MFU. Override `flops_per_sample(seq_len)`.")
            self.__dict__["_flops_cache"]["uncountable"] = True
            return 0.0
        return float(counter.get_total_flops())

    # ------------------------------------------------------------------ draws and loss
    @property
    def draw_seed(self) -> int:
        """The ``seed`` argument, or the seed of ``lightning.seed_everything`` (``PL_GLOBAL_SEED``), or 0."""
        seed = self.hparams.get("seed")
        return int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else int(seed)

    def noise_generator(
        self,
        device: torch.device | str | None = None,
        step: int | None = None,
        rank: int | None = None,
        micro_batch: int = 0,
        stream: int = TRAIN_STREAM,
    ) -> torch.Generator:
        """A generator on ``device`` seeded by :func:`draw_seed` (step and rank default to the Trainer's)."""
        device = self.device if device is None else torch.device(device)
        step = self.global_step if step is None else step
        rank = self.global_rank if rank is None else rank
        return torch.Generator(device=device).manual_seed(
            draw_seed(self.draw_seed, step, rank, micro_batch, stream)
        )

    def sequence_parallel_group(self, batch: Mapping[str, Any]) -> Any | None:
        """The sequence-parallel group of a batch with ``batch["sp_degree"]`` k > 1; ``None`` for k = 1.

        Raises:
            ValueError: ``sp_degree`` is not a positive int.
            NotImplementedError: k > 1 and this module has no sequence-parallel path.
            RuntimeError: k > 1 and :attr:`sequence_parallel` is not set.
        """
        degree = batch.get("sp_degree", 1) if isinstance(batch, Mapping) else 1
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(
                f"`batch['sp_degree']={degree!r}` is not valid. Expected a positive int (1: data parallel)."
            )
        if degree == 1:
            return None
        cls = type(self).__name__
        if not self.supports_sequence_parallel:
            raise NotImplementedError(
                f"A batch has sp_degree={degree}: `{cls}` has no sequence-parallel path. Plan data-parallel "
                "batches only (sp_degree 1), or train FlowMatchingModule."
            )
        if getattr(self, "sequence_parallel", None) is None:
            raise RuntimeError(
                f"A batch has sp_degree={degree}, but `{cls}.sequence_parallel` is not set. Add "
                "`lightning_adaptiveload.callbacks.sequence_parallel.UlyssesSequenceParallel` to the Trainer's "
                "callbacks, or set `module.sequence_parallel = UlyssesGroups(degrees, num_heads, ranks_per_node)` "
                "(lightning_adaptiveload.parallel.ulysses) on every rank before the first batch."
            )
        return self.sequence_parallel.group(degree)

    @staticmethod
    def batch_fingerprint(batch: Mapping[str, Any]) -> torch.Tensor:
        """Shape, fp64 sums of ``latents`` and ``context``, and two sums of ``index``: equal on the ranks
        of a sequence-parallel group when they hold the same batch (cheap: no copy of the latents)."""
        latents, context = batch["latents"], batch["context"]
        index = batch.get("index")
        index = torch.zeros(1, device=latents.device) if index is None else index.to(torch.float64)
        weights = torch.arange(1, index.numel() + 1, dtype=torch.float64, device=index.device)
        sums = torch.stack([
            torch.sum(latents, dtype=torch.float64),
            torch.sum(context, dtype=torch.float64),
            index.sum(),
            (index.reshape(-1) * weights).sum(),
        ])
        shape = torch.tensor(latents.shape, dtype=torch.float64, device=latents.device)
        return torch.cat([shape, sums])

    def compute_loss(
        self, batch: Mapping[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Rectified-flow loss (fp32 scalar) of a batch with latents ``[B,C,F,H,W]`` and context ``[B,L,D]``.

        Timesteps, then noise, are drawn from ``generator`` (on the latents' device). Without one,
        from the stream kept apart from training (seeded by the module's seed, global step and rank),
        so calling it (profiling) neither consumes nor disturbs any training draw or the global RNG.
        A ``batch["sample_weight"]`` weights the samples (:func:`rectified_flow_loss`). The model is called
        with the batch's further inputs of :meth:`_model_inputs` as keyword arguments (none here).
        """
        self._require_model()
        latents, context = self._get(batch, "latents"), self._get(batch, "context")
        extras = self._model_inputs(batch)
        group = self.sequence_parallel_group(batch)
        if generator is None:
            rank = None if group is None else group.first_rank
            generator = self.noise_generator(latents.device, rank=rank, stream=OUTSIDE_STREAM)
        predict = self if group is None else functools.partial(self, sequence_parallel=group)
        if extras:
            predict = functools.partial(predict, **extras)
        inputs = {"latents": latents, "context": context}
        if isinstance(batch, Mapping) and batch.get(SAMPLE_WEIGHT_KEY) is not None:
            inputs[SAMPLE_WEIGHT_KEY] = batch[SAMPLE_WEIGHT_KEY]
        return rectified_flow_loss(predict, inputs, self._hp("timestep_shift"), self._hp("num_train_timesteps"),
                                   generator)

    # ------------------------------------------------------------------ training
    @override
    def on_train_epoch_start(self) -> None:
        # The gap across an epoch boundary (validation, loader restart) is not a training step.
        self._last_step_start = None

    @override
    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The loss of the batch with this (step, rank, micro-batch)'s draws.

        Logged every step: ``train/loss``; from the second step of an epoch on, ``train/tokens_per_s`` and
        ``train/samples_per_s`` of the previous step, from this rank's wall time between the starts of
        consecutive training steps (data loading included, host clock, no device sync); once this rank has
        met a sample the dataset skipped (``batch["bad_samples"]``), ``train/bad_samples``, its running count
        (the first few are named in warnings). The loss is kept for the non-finite check made before the
        optimizer step (:attr:`on_nonfinite_loss`).
        """
        start = perf_counter()
        self.check_batch(batch)
        samples, seq_len = self.batch_shape(batch)
        group = self.sequence_parallel_group(batch)
        degree = 1 if group is None else group.degree
        if group is not None:
            group.check_identical(
                self.batch_fingerprint(batch), "latents shape, latents and context sums, index sums"
            )
        if self._last_step_start is not None:
            elapsed = start - self._last_step_start
            # Host values as CPU tensors: Lightning would copy a float to the device, which waits for the device.
            self.log("train/tokens_per_s", torch.tensor(self._last_step_tokens / elapsed), batch_size=samples)
            self.log("train/samples_per_s", torch.tensor(self._last_step_samples / elapsed), batch_size=samples)
        self._last_step_start = start
        # A rank of a sequence-parallel group processes 1/k of the batch's tokens.
        self._last_step_samples = samples / degree
        self._last_step_tokens = self.tokens_in_batch(batch) / degree
        step, index = self._micro_batch
        index = index + 1 if step == self.global_step else 0
        self._micro_batch = (self.global_step, index)
        rank = None if group is None else group.first_rank
        generator = self.noise_generator(self._get(batch, "latents").device, rank=rank, micro_batch=index)
        loss = self.compute_loss(batch, generator=generator)
        if loss.device.type == "cuda":
            # The progress bar reads its values every step (a device tensor there waits for the device): it
            # shows the newest loss already copied to the host instead, and loggers read train/loss itself.
            self.log("train/loss", loss, batch_size=samples)
            shown = self._arrived_loss(loss)
            if shown is not None:
                self.log("loss", shown, prog_bar=True, logger=False, batch_size=samples)
        else:
            self.log("train/loss", loss, prog_bar=True, batch_size=samples)
        if index == 0:
            self._step_losses = []
        self._step_losses.append((loss.detach(), batch.get("index"), (samples, seq_len)))
        skipped = batch.get(BAD_SAMPLES_KEY)
        if skipped:
            self._note_skipped_samples(skipped)
        if self.bad_samples:
            self.log("train/bad_samples", float(self.bad_samples), batch_size=samples)
        # The gradients of a group's k ranks sum to the gradient of `loss`; the data-parallel average
        # divides by all W ranks, so k × gives the batch the weight k/W of k ranks.
        return loss * degree if degree > 1 else loss

    def _arrived_loss(self, loss: torch.Tensor) -> torch.Tensor | None:
        """Queue a copy of ``loss`` to pinned host memory; return (a CPU tensor of) the newest queued loss whose
        copy has completed, without waiting for the device (``None`` before the first has)."""
        pending = self._loss_copies
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(loss.detach().float(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        pending.append((host, done))
        arrived = None
        while pending and pending[0][1].query():
            arrived = pending.pop(0)[0]
        if arrived is not None:
            self._shown_loss = arrived.clone()
        return self._shown_loss

    # ------------------------------------------------------------------ bad samples and non-finite losses
    def _warn_named(self, message: str) -> None:
        """Warn ``message`` (this rank's) for the first :data:`MAX_NAMED` events, then once that later ones are counted."""
        self._named += 1
        if self._named <= MAX_NAMED:
            warnings.warn(message, stacklevel=3)
        elif self._named == MAX_NAMED + 1:
            warnings.warn(
                f"`{type(self).__name__}` (rank {self.global_rank}): more skipped samples or dropped steps; from here on "
                "they are counted (`bad_samples`, logged as train/bad_samples; `nonfinite_loss_steps`), not named.",
                stacklevel=3,
            )

    def _note_skipped_samples(self, messages: Sequence[str]) -> None:
        self.bad_samples += len(messages)
        for message in messages:
            self._warn_named(
                f"`{type(self).__name__}` (rank {self.global_rank}, step {self.global_step}): a sample the dataset "
                f"skipped trains with weight 0: {message}"
            )

    def _describe_samples(self, index: Any, shape: tuple[int, int]) -> str:
        """``B=2, S=1560: dataset indices [3, 17] (manifest row 4 (a.safetensors); ...)`` for a message."""
        head = f"B={shape[0]}, S={shape[1]}"
        if not isinstance(index, torch.Tensor):
            return f"{head} (the batch has no 'index')"
        indices = [int(i) for i in index.reshape(-1).tolist()]
        shown = indices[:_SAMPLES_SHOWN]
        more = ", ..." if len(indices) > len(shown) else ""
        text = f"{head}: dataset indices [{', '.join(map(str, shown))}{more}]"
        dataset = getattr(getattr(self._trainer, "datamodule", None), "dataset", None)
        label = getattr(dataset, "sample_label", None)
        if callable(label) and shown and min(shown) >= 0:
            text += f" ({'; '.join(str(label(i)) for i in shown)}{more})"
        return text

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Stop (or with ``on_nonfinite_loss="skip"`` drop) an optimizer step whose loss is not finite on some
        rank, naming its samples, before the step can write NaN into the weights."""
        pending, self._step_losses = self._step_losses, []
        mode = check_choice(type(self).__name__, "on_nonfinite_loss", self.on_nonfinite_loss, ON_NONFINITE_LOSS)
        if not pending or mode == "off":
            return
        finite = torch.isfinite(torch.stack([loss for loss, _, _ in pending]))
        flag = (~finite.all()).to(torch.int32)
        trainer = self._trainer
        # Every rank decides together: the gradients are already reduced, so one rank's NaN has reached every
        # rank's gradients, and a rank that stopped alone would leave the others waiting in the next collective.
        flags = trainer.strategy.all_gather(flag) if trainer is not None else flag
        bad_ranks = torch.nonzero(flags.reshape(-1)).flatten().tolist()
        if not bad_ranks:
            return
        cls, rank, step = type(self).__name__, self.global_rank, self.global_step
        if bool(flag):
            batches = "; ".join(
                f"micro-batch {k} (loss {float(loss):g}, {self._describe_samples(index, shape)})"
                for k, ((loss, index, shape), ok) in enumerate(zip(pending, finite.tolist(), strict=True))
                if not ok
            )
            what = f"the loss of step {step} is not finite on rank {rank}: {batches}"
        else:
            what = (f"the loss of step {step} is not finite on rank(s) {bad_ranks} (their messages name the "
                    f"samples); rank {rank}'s own loss is finite")
        if mode == "error":
            raise FloatingPointError(
                f"`{cls}`: {what}. The optimizer step was not taken, so the weights are still those of the last "
                "step. Look at the model's numerics (learning rate, gradient clipping, precision) or at these samples, "
                f"or set `{cls}.on_nonfinite_loss = 'skip'` to drop such steps and train on."
            )
        optimizer.zero_grad(set_to_none=True)  # the optimizer skips parameters without a gradient
        self.nonfinite_loss_steps += 1
        self._warn_named(f"`{cls}`: {what}; the step was dropped on every rank (`on_nonfinite_loss='skip'`).")

    # ------------------------------------------------------------------ optimizer
    @property
    def fused_optimizer(self) -> bool:
        """Whether :meth:`configure_optimizers` builds a fused AdamW (see ``optimizer_impl``)."""
        return use_fused_adamw(self, self.hparams.get("optimizer_impl", "auto"))

    @override
    def configure_optimizers(self) -> Any:
        """AdamW (fused when safe, :func:`~lightning_adaptiveload.models.optim.adamw`) with a linear
        learning-rate warmup over ``warmup_steps`` optimizer steps when that is > 0."""
        hp = self.hparams
        optimizer = adamw(self, (p for p in self.parameters() if p.requires_grad), hp.get("optimizer_impl", "auto"),
                          lr=self._hp("lr"), betas=tuple(self._hp("betas")), eps=self._hp("eps"),
                          weight_decay=self._hp("weight_decay"))
        warmup = int(self._hp("warmup_steps"))
        if warmup == 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_linear_warmup, warmup_steps=warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's clipping, also for a fused AdamW under bf16 and by the global norm under FSDP1
        (:func:`~lightning_adaptiveload.models.optim.clip_gradients`)."""
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)
