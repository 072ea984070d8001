"""Rectified-flow (flow matching) training of a Wan 2.1 DiT as a LightningModule."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from typing_extensions import override

from lightning_adaptiveload.geometry import tokens_of
from lightning_adaptiveload.models.compiling import check_compile_options
from lightning_adaptiveload.models.optim import adamw, check_optimizer_impl, clip_gradients, use_fused_adamw
from lightning_adaptiveload.models.wan import (
    CHECKPOINTING_MODES,
    WanAttentionBlock,
    WanConfig,
    WanModel,
    checkpointing_mode,
    from_name_or_config,
)
from lightning_adaptiveload.models.wan_weights import load_wan_weights_

__all__ = ["FlowMatchingModule", "draw_seed", "rectified_flow_loss", "shift_timesteps", "wan_forward_flops"]

# Streams of `draw_seed`: training steps, and calls of `compute_loss` without a generator
# (profiling, evaluation), which must never replay or shift a training step's draws.
TRAIN_STREAM = 0
OUTSIDE_STREAM = 1


def draw_seed(seed: int, step: int, rank: int, micro_batch: int = 0, stream: int = TRAIN_STREAM) -> int:
    """64-bit seed of the timestep and noise draws of one micro-batch: a pure function of its arguments.

    A hash (blake2b) of the five integers, so neighbouring steps or ranks get unrelated streams and a
    resumed run, or a run on another number of ranks, draws exactly what the same (step, rank) drew
    before.
    """
    data = struct.pack("<5q", int(seed), int(stream), int(step), int(rank), int(micro_batch))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


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
    """
    x0 = batch["latents"].float()
    b = x0.shape[0]
    u = torch.rand(b, device=x0.device, generator=generator)
    t = shift_timesteps(u, timestep_shift)
    noise = torch.randn(x0.shape, dtype=x0.dtype, device=x0.device, generator=generator)
    tb = t.view(b, 1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * noise
    pred = predict(x_t, t * num_train_timesteps, batch["context"])
    return F.mse_loss(pred.float(), noise - x0)


def wan_forward_flops(config: WanConfig, seq_len: int) -> int:
    """FLOPs of one forward pass of :class:`~lightning_adaptiveload.models.wan.WanModel` for one sample.

    Counts every matmul (2 FLOPs per multiply-add) and nothing else (norms, RoPE, activations,
    residuals and modulation are element-wise). With S = ``seq_len``, D = dim, F = ffn_dim,
    L = text_len (the context is zero-padded to it), T = text_dim, P = prod(patch_size), N = num_layers::

        per token, every layer:   self-attn q, k, v, o  4·2·D²   cross-attn q, o  2·2·D²   FFN  2·2·D·F
        per token, once:          patch embedding 2·in_dim·P·D   head 2·D·out_dim·P
        per sample, every layer:  cross-attn k, v on the text tokens 2·2·L·D²
        per sample, once:         text MLP 2·L·(T·D + D²)   time MLP 2·(freq_dim·D + D²)   projection 2·6·D²
        attention, every layer:   self 4·S²·D (q·kᵀ and p·v)   cross 4·S·L·D

    ``torch.utils.flop_counter.FlopCounterMode`` counts the same number on the model's forward.
    """
    c = config
    d, s, n_text, p = c.dim, int(seq_len), c.text_len, math.prod(c.patch_size)
    per_token = 2 * (c.num_layers * (6 * d * d + 2 * d * c.ffn_dim) + c.in_dim * p * d + d * c.out_dim * p)
    per_sample = 2 * (
        c.num_layers * 2 * n_text * d * d + n_text * (c.text_dim * d + d * d) + c.freq_dim * d + d * d + 6 * d * d
    )
    attention = c.num_layers * (4 * s * s * d + 4 * s * n_text * d)
    return per_token * s + per_sample + attention


def shift_timesteps(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's shifted schedule ``t = shift·u / (1 + (shift - 1)·u)``, mapping [0, 1] onto [0, 1].

    ``shift > 1`` moves samples towards t = 1 (more noise), which high-resolution video needs
    because neighbouring tokens are strongly correlated; ``shift = 1`` is the identity.
    """
    return shift * u / (1 + (shift - 1) * u)


_PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _linear_warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps)


class FlowMatchingModule(pl.LightningModule):
    """Trains a :class:`~lightning_adaptiveload.models.wan.WanModel` with Wan's rectified-flow objective.

    For a clean latent ``x0`` and Gaussian ``noise``, draw ``u ~ U(0, 1)``, shift it to
    ``t = shift·u / (1 + (shift-1)·u)``, form ``x_t = (1 - t)·x0 + t·noise`` and regress the velocity
    ``noise - x0`` with an fp32 MSE; the model sees the timestep ``t · num_train_timesteps``.
    Every batch may have its own (F, H, W).

    The model is built in :meth:`configure_model`. Under a strategy that sets a device mesh
    (``lightning_adaptiveload.strategies.fsdp2_strategy`` or Lightning's ``ModelParallelStrategy``) it
    is built on the meta device, sharded with FSDP2 per :class:`~lightning_adaptiveload.models.wan.WanAttentionBlock`
    (HSDP on a 2-D mesh) and only each rank's shards are allocated and initialised (equal to the
    dense init of the same seed) or loaded from ``pretrained``; see ``docs/scale_out.md``.
    Lightning's FSDP1 ``FSDPStrategy`` wraps the dense model per block
    (``auto_wrap_policy={WanAttentionBlock}``). Activation checkpointing runs inside each
    :class:`~lightning_adaptiveload.models.wan.WanAttentionBlock` (non-reentrant
    ``torch.utils.checkpoint``), with and without FSDP and under ``torch.compile``; do not also set the
    strategy's ``activation_checkpointing_policy`` (blocks would be recomputed twice).

    Logged every step: ``train/loss``; from the second step of an epoch on, ``train/tokens_per_s``
    and ``train/samples_per_s`` of the previous step, from this rank's wall time between the
    starts of consecutive training steps (data loading included, host clock, no device sync).

    Args:
        model: preset name (``"tiny"``, ``"wan2_1_1_3b"``, ``"wan2_1_14b"``), a ``WanConfig`` or a dict.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear learning-rate warmup over this many optimizer steps (0: none).
        timestep_shift: Wan's schedule shift (5.0 for 480p/720p video; 1.0: uniform t).
        num_train_timesteps: scale of the timestep the model sees (Wan: 1000).
        activation_checkpointing: what backward recomputes in every block: ``"none"`` (or ``False``),
            ``"selective"`` (keep the attention outputs, recompute projections, FFN and element-wise
            ops), ``"full"`` (or ``True``), or ``"auto"``: the least recomputation under which the
            corpus's longest sample fits, chosen by
            :class:`~lightning_adaptiveload.callbacks.shape_benchmark.ShapeBenchmarkCallback` from
            measured peak memory (without that callback, ``"auto"`` trains with ``"full"`` and warns).
        seed: seed of the timestep and noise draws (see below); ``None``: the seed given to
            ``lightning.seed_everything`` (``adaptiveload-train``'s ``seed``), or 0 without one.
        compile: compile every transformer block with ``torch.compile`` (regional compilation;
            :meth:`WanModel.compile_blocks`). The first steps of new shapes compile (the shape
            benchmark's warm-up steps absorb that); dynamic sizes keep recompiles to a few in all.
        pretrained: Wan 2.1 safetensors weights to start from (a file or a directory, in the original
            or diffusers' ``WanTransformer3DModel`` layout, sharded files with an index included);
            under FSDP2 each rank reads only its shards. ``None``: Wan's random init.
        fsdp_param_dtype: dtype of the unsharded parameters under FSDP2 (``"bfloat16"``, or
            ``"float32"``); gradients are reduced in fp32, and the time embedding, its projection
            and the head keep fp32 parameters, as the reference computes them in fp32. bf16 needs
            ``Trainer(precision="bf16-mixed")`` (autocast runs the matmuls); the block parameters,
            the modulation included, are then bf16 in forward, fp32 in the optimizer.
        compile_options: inductor options for the compiled blocks (``torch.compile(options=...)``, names
            as in ``torch._inductor.config``, e.g. ``{"triton.mix_order_reduction_non_strict_mode": True}``);
            an unknown name is an error here, not at the first step. Needs ``compile=True``.
        optimizer_impl: AdamW's implementation: ``"fused"`` (one kernel for the whole update),
            ``"foreach"`` (PyTorch's default on GPU), or ``"auto"``: fused when every parameter is on a
            CUDA device, the strategy replicates them (one device or DDP; sharded parameters keep the
            default) and no fp16 gradient scaler is used (it needs the unscaled gradients before
            clipping), else PyTorch's default. Measured on an H200 (1.3B): the clipping + update phase
            of a step takes 29-32 ms fused, 47-51 ms foreach. Gradient clipping
            works with either (see :meth:`configure_gradient_clipping`).

    Timesteps and noise of a training micro-batch come from a ``torch.Generator`` on the batch's
    device seeded by :func:`draw_seed` from (seed, global step, global rank, micro-batch index
    within the step), never from the global RNG: a resumed run draws exactly what the
    uninterrupted run drew at every step, each rank draws its own noise, and a run on another
    number of ranks has a well-defined stream (rank r at step s always draws the same).
    :meth:`compute_loss` called outside ``training_step`` (profiling, evaluation) uses a separate
    stream unless it is given a ``generator``, so it never consumes or replays a training draw.

    Sequence parallelism: a batch with ``batch["sp_degree"] = k > 1`` is processed by the k ranks
    ``[g·k, (g+1)·k)`` that all received it, through the groups in :attr:`sequence_parallel` (set
    by the ``UlyssesSequenceParallel`` callback, or assign a
    :class:`~lightning_adaptiveload.parallel.ulysses.UlyssesGroups` yourself). The k ranks draw the
    timesteps and noise of the group's first rank, check that they hold the same batch, and each
    return k × the batch's loss, so that data parallelism's average over all W ranks weighs the
    batch k/W: the step's gradient is the one of a run in which each of the k ranks trained the
    batch alone (docs/sequence_parallel.md). ``train/loss`` logs the unscaled loss.

    Example::

        module = FlowMatchingModule("tiny")
        trainer = lightning.Trainer(max_steps=10, precision="bf16-mixed")
        trainer.fit(module, datamodule)
    """

    def __init__(
        self,
        model: str | WanConfig | Mapping[str, Any] = "tiny",
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        timestep_shift: float = 5.0,
        num_train_timesteps: int = 1000,
        activation_checkpointing: bool | str = False,
        seed: int | None = None,
        compile: bool = False,
        pretrained: str | None = None,
        fsdp_param_dtype: str = "bfloat16",
        optimizer_impl: str = "auto",
        compile_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        compile_options = check_compile_options(compile_options, compile)
        check_optimizer_impl(optimizer_impl, "FlowMatchingModule")
        if fsdp_param_dtype not in _PARAM_DTYPES:
            raise ValueError(
                f"`FlowMatchingModule(fsdp_param_dtype={fsdp_param_dtype!r})` is not valid. "
                f"Expected one of {sorted(_PARAM_DTYPES)}."
            )
        if pretrained is not None and not os.path.exists(pretrained):
            raise FileNotFoundError(
                f"`FlowMatchingModule(pretrained={pretrained!r})`: no such file or directory. Expected Wan 2.1 "
                "safetensors weights (a file, or a directory of shards with or without an index)."
            )
        config = from_name_or_config(model)
        if activation_checkpointing != "auto":
            try:
                checkpointing_mode(activation_checkpointing)
            except ValueError:
                raise ValueError(
                    f"`FlowMatchingModule(activation_checkpointing={activation_checkpointing!r})` is not valid. "
                    f"Expected one of {[*CHECKPOINTING_MODES, 'auto']} or true/false."
                ) from None
        if not lr > 0:
            raise ValueError(f"`FlowMatchingModule(lr={lr!r})` is not valid. Expected a positive float.")
        if not weight_decay >= 0:
            raise ValueError(
                f"`FlowMatchingModule(weight_decay={weight_decay!r})` is not valid. Expected a float >= 0."
            )
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"`FlowMatchingModule(betas={betas!r})` is not valid. Expected two floats in [0, 1)."
            )
        if not eps > 0:
            raise ValueError(f"`FlowMatchingModule(eps={eps!r})` is not valid. Expected a positive float.")
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(
                f"`FlowMatchingModule(warmup_steps={warmup_steps!r})` is not valid. Expected an integer >= 0."
            )
        if not timestep_shift > 0:
            raise ValueError(
                f"`FlowMatchingModule(timestep_shift={timestep_shift!r})` is not valid. Expected a positive float."
            )
        if not num_train_timesteps > 0:
            raise ValueError(
                f"`FlowMatchingModule(num_train_timesteps={num_train_timesteps!r})` is not valid. "
                "Expected a positive number."
            )
        if seed is not None and (int(seed) != seed or seed < 0):
            raise ValueError(
                f"`FlowMatchingModule(seed={seed!r})` is not valid. Expected a non-negative integer or None."
            )
        # save_hyperparameters reads the init arguments from this frame: store the resolved config
        # as a plain dict so hparams.yaml and `load_from_checkpoint` do not depend on the class.
        if not isinstance(model, str):
            model = dataclasses.asdict(config)
        betas = tuple(float(b) for b in betas)
        self.save_hyperparameters()
        self.config = config
        self.patch_size: tuple[int, int, int] = config.patch_size
        self.model: WanModel | None = None
        self._last_step_start: float | None = None
        self._last_step_samples = 0
        self._last_step_tokens = 0
        # (global step, index) of the last training micro-batch: the index counts micro-batches of
        # one optimizer step under gradient accumulation.
        self._micro_batch: tuple[int, int] = (-1, 0)
        self._checkpointing_decided = activation_checkpointing != "auto"
        # Duck-typed: `.group(k)` returns the group a `WanModel.forward(sequence_parallel=...)` takes,
        # with `.degree`, `.first_rank` and `.check_identical(tensor, what)`. Process groups come from
        # a higher layer (parallel/), so they are handed in rather than created here.
        self.sequence_parallel: Any | None = None

    @override
    def configure_model(self) -> None:
        """Build the Wan model once (Lightning calls this inside the strategy's init context).

        With a device mesh (FSDP2/HSDP): on the meta device, checkpointing inside each block, each
        block compiled, then ``fully_shard`` per block and the root (torchtitan's order), then each
        rank's shards allocated and initialised or loaded. Without one: the dense model.
        """
        if self.model is not None:
            return
        mesh = self.device_mesh
        pretrained = self.hparams.get("pretrained")
        if mesh is None:
            model = WanModel(self.config)
            self._prepare_blocks(model)
            if pretrained is not None:
                load_wan_weights_(model, pretrained)
            self.model = model
            return
        from lightning_adaptiveload.parallel.fsdp import fsdp_mesh, fully_shard_model, materialize_

        param_dtype = self.hparams.get("fsdp_param_dtype", "bfloat16")
        precision = str(self.trainer.precision) if self._trainer is not None else None
        if param_dtype == "bfloat16" and precision not in (None, "bf16-mixed"):
            # bf16 blocks take the fp32 residual stream and modulation as Wan computes them
            # (no input casts), so their matmuls need autocast to meet one dtype.
            raise ValueError(
                f"`FlowMatchingModule(fsdp_param_dtype='bfloat16')` needs `Trainer(precision='bf16-mixed')`, "
                f"got precision={precision!r}. Use precision='bf16-mixed', or fsdp_param_dtype='float32'."
            )
        with torch.device("meta"):
            model = WanModel(self.config)
        self._prepare_blocks(model)
        fully_shard_model(
            model,
            fsdp_mesh(mesh),
            [WanAttentionBlock],
            param_dtype=_PARAM_DTYPES[param_dtype],
            reduce_dtype=torch.float32,
            fp32_modules=[model.time_embedding, model.time_projection, model.head],
            # Wan keeps the residual stream and the modulation in fp32 between bf16 matmuls.
            cast_forward_inputs=False,
        )
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device(mesh.device_type)
        if pretrained is None:
            materialize_(model, device, model.init_weights)
        else:
            model.to_empty(device=device)
            load_wan_weights_(model, pretrained)
        self.model = model

    def _prepare_blocks(self, model: WanModel) -> None:
        setting = self.hparams.activation_checkpointing
        # "auto": full until the shape benchmark has measured what fits (the safe mode to start in).
        model.set_gradient_checkpointing("full" if setting == "auto" else setting)
        if self.hparams.get("compile", False):
            # Compilation is lazy: modules swapped in after this (FusedAdaLNCallback) are what gets traced.
            options = self.hparams.get("compile_options")
            model.compile_blocks(**({"options": dict(options)} if options else {}))

    #: What :meth:`set_checkpointing` accepts, least recomputation (most memory) first.
    checkpointing_modes: tuple[str, ...] = CHECKPOINTING_MODES

    @property
    def checkpointing(self) -> str:
        """The activation-checkpointing mode in use, or ``"auto"`` while it is still to be chosen."""
        if self.model is None or not self._checkpointing_decided:
            setting = self.hparams.activation_checkpointing
            return "auto" if setting == "auto" else checkpointing_mode(setting)
        blocks = [m for m in self._require_model().modules() if isinstance(m, WanAttentionBlock)]
        return blocks[0].checkpointing if blocks else "none"

    def set_checkpointing(self, mode: str) -> None:
        """Switch every block to ``mode`` (one of :attr:`checkpointing_modes`); compiled blocks recompile once."""
        self._require_model().set_gradient_checkpointing(mode)
        self._checkpointing_decided = True

    @override
    def on_fit_start(self) -> None:
        if self.checkpointing == "auto":
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                "`FlowMatchingModule(activation_checkpointing='auto')` needs ShapeBenchmarkCallback to choose a "
                "mode; training with 'full'. Add the callback or set the mode ('none', 'selective', 'full')."
            )
            self.set_checkpointing("full")

    def _require_model(self) -> WanModel:
        if self.model is None:
            raise RuntimeError(
                "`FlowMatchingModule.model` is not built yet. Call `configure_model()` first "
                "(the Trainer does this in `fit`)."
            )
        return self.model

    @override
    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Velocity prediction of the Wan model (timesteps in [0, num_train_timesteps])."""
        return self._require_model()(x, t, context)

    def sample_timesteps(
        self,
        batch_size: int,
        device: torch.device | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Draw ``batch_size`` flow times in [0, 1] from Wan's shifted schedule.

        From ``generator`` when given (on ``device``), else from the global RNG.
        """
        u = torch.rand(batch_size, device=self.device if device is None else device, generator=generator)
        return shift_timesteps(u, self.hparams.timestep_shift)

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

    def compute_loss(
        self, batch: Mapping[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Rectified-flow loss (fp32 scalar) of a batch with ``latents [B,C,F,H,W]`` and ``context [B,L,D]``.

        Timesteps, then noise, are drawn from ``generator`` (on the latents' device). Without one,
        from the stream kept apart from training (seeded by the module's seed, global step and rank),
        so calling it (profiling) neither consumes nor disturbs any training draw or the global RNG.
        """
        model = self._require_model()
        group = self.sequence_parallel_group(batch)
        if generator is None:
            rank = None if group is None else group.first_rank
            generator = self.noise_generator(batch["latents"].device, rank=rank, stream=OUTSIDE_STREAM)
        predict = model if group is None else functools.partial(model, sequence_parallel=group)
        hp = self.hparams
        return rectified_flow_loss(predict, batch, hp.timestep_shift, hp.num_train_timesteps, generator)

    def sequence_parallel_group(self, batch: Mapping[str, Any]) -> Any | None:
        """The sequence-parallel group of a batch with ``batch["sp_degree"]`` k > 1; ``None`` for k = 1.

        Raises:
            ValueError: ``sp_degree`` is not a positive int.
            RuntimeError: k > 1 and :attr:`sequence_parallel` is not set.
        """
        degree = batch.get("sp_degree", 1) if isinstance(batch, Mapping) else 1
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(
                f"`batch['sp_degree']={degree!r}` is not valid. Expected a positive int (1: data parallel)."
            )
        if degree == 1:
            return None
        if self.sequence_parallel is None:
            raise RuntimeError(
                f"A batch has sp_degree={degree}, but `{type(self).__name__}.sequence_parallel` is not set. Add "
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

    def batch_shape(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """``(B, S)`` of a batch: samples, and tokens per sample after patchify of ``latents [B,C,F,H,W]``."""
        return tokens_of(batch["latents"], self.patch_size)

    def tokens_in_batch(self, batch: Mapping[str, torch.Tensor]) -> int:
        """B · S of a batch: samples times tokens per sample after patchify."""
        b, s = self.batch_shape(batch)
        return b * s

    def flops_per_sample(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward for one sample of ``seq_len`` tokens: 3 × the forward.

        The forward is :func:`wan_forward_flops` (every matmul, attention included); backward counts
        as twice the forward, the usual model-FLOPs convention (the backward of a matmul is two
        matmuls of its size). Recomputation under activation checkpointing is not counted.
        """
        return 3.0 * wan_forward_flops(self.config, seq_len)

    def synthetic_batch(
        self,
        batch_size: int,
        grid: Sequence[int],
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Random batch for token grid ``(f, h, w)``, shaped like the collated data.

        Uses its own generator (seeded by ``seed``), so building profiling batches leaves the
        training RNG stream alone. ``index`` is ``-1`` to mark samples that are not from a dataset.

        Returns:
            ``{"latents": [B, in_dim, f·pt, h·ph, w·pw], "context": [B, text_len, text_dim],
            "index": LongTensor[B]}``.
        """
        if len(grid) != 3 or any(int(g) != g or g < 1 for g in grid):
            raise ValueError(
                f"`grid={tuple(grid)!r}` is not valid. Expected three positive integers (f, h, w)."
            )
        if batch_size < 1:
            raise ValueError(f"`batch_size={batch_size!r}` is not valid. Expected a positive integer.")
        device = self.device if device is None else torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        cfg = self.config
        shape = [int(g) * p for g, p in zip(grid, self.patch_size, strict=True)]
        return {
            "latents": torch.randn(batch_size, cfg.in_dim, *shape, device=device, generator=gen),
            "context": torch.randn(batch_size, cfg.text_len, cfg.text_dim, device=device, generator=gen),
            "index": torch.full((batch_size,), -1, dtype=torch.long, device=device),
        }

    @override
    def on_train_epoch_start(self) -> None:
        # The gap across an epoch boundary (validation, loader restart) is not a training step.
        self._last_step_start = None

    @override
    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        start = perf_counter()
        samples = int(batch["latents"].shape[0])
        group = self.sequence_parallel_group(batch)
        degree = 1 if group is None else group.degree
        if group is not None:
            group.check_identical(
                self.batch_fingerprint(batch), "latents shape, latents and context sums, index sums"
            )
        if self._last_step_start is not None:
            elapsed = start - self._last_step_start
            self.log("train/tokens_per_s", self._last_step_tokens / elapsed, batch_size=samples)
            self.log("train/samples_per_s", self._last_step_samples / elapsed, batch_size=samples)
        self._last_step_start = start
        # A rank of a sequence-parallel group processes 1/k of the batch's tokens.
        self._last_step_samples = samples / degree
        self._last_step_tokens = self.tokens_in_batch(batch) / degree
        step, index = self._micro_batch
        index = index + 1 if step == self.global_step else 0
        self._micro_batch = (self.global_step, index)
        rank = None if group is None else group.first_rank
        generator = self.noise_generator(batch["latents"].device, rank=rank, micro_batch=index)
        loss = self.compute_loss(batch, generator=generator)
        self.log("train/loss", loss, prog_bar=True, batch_size=samples)
        # The gradients of a group's k ranks sum to the gradient of `loss`; the data-parallel average
        # divides by all W ranks, so k × gives the batch the weight k/W of k ranks (see the class doc).
        return loss * degree if degree > 1 else loss

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by the global norm; under FSDP through the wrapper, which sums the shards' norms.

        Lightning's FSDP precision plugin refuses norm clipping, yet the sharded model can do it.
        A fused AdamW is clipped under bf16 too (:func:`lightning_adaptiveload.models.optim.clip_gradients`).
        """
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = self.trainer.model
        if gradient_clip_val and isinstance(model, FullyShardedDataParallel):
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(
                    f"`Trainer(gradient_clip_algorithm={gradient_clip_algorithm!r})` is not supported with FSDP; "
                    "use 'norm'."
                )
            model.clip_grad_norm_(gradient_clip_val)
            return
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    @property
    def fused_optimizer(self) -> bool:
        """Whether :meth:`configure_optimizers` builds a fused AdamW (see ``optimizer_impl``)."""
        return use_fused_adamw(self, self.hparams.get("optimizer_impl", "auto"))

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = adamw(self, (p for p in self.parameters() if p.requires_grad), hp.get("optimizer_impl", "auto"),
                          lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay)
        if hp.warmup_steps == 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, functools.partial(_linear_warmup, warmup_steps=hp.warmup_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

