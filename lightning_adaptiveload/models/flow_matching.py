"""Rectified-flow (flow matching) training of a Wan 2.1 DiT as a LightningModule."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from typing_extensions import override

from lightning_adaptiveload.models.compiling import check_compile_options
from lightning_adaptiveload.models.optim import check_optimizer_impl
from lightning_adaptiveload.models.rectified_flow import (
    OUTSIDE_STREAM,
    TRAIN_STREAM,
    RectifiedFlowModule,
    check_training_arguments,
    draw_seed,
    rectified_flow_loss,
    shift_timesteps,
)
from lightning_adaptiveload.models.wan import (
    WanAttentionBlock,
    WanConfig,
    WanModel,
    from_name_or_config,
    wan_forward_flops,
)
from lightning_adaptiveload.models.wan_weights import load_wan_weights_
from lightning_adaptiveload.modules.adaln import FusedAdaLayerNorm
from lightning_adaptiveload.ops.attention import check_attention_setting

__all__ = [
    "OUTSIDE_STREAM",
    "TRAIN_STREAM",
    "FlowMatchingModule",
    "draw_seed",
    "rectified_flow_loss",
    "shift_timesteps",
    "wan_forward_flops",
]

_PARAM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class FlowMatchingModule(RectifiedFlowModule):
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
            as in ``torch._inductor.config``, e.g. ``{"max_autotune": True}``; added to the blocks' defaults,
            :data:`~lightning_adaptiveload.models.compiling.BLOCK_INDUCTOR_OPTIONS`);
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

    supports_sequence_parallel = True
    attention_backends = ("sdpa", "fa4")

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
        attention: str = "auto",
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        check_attention_setting(attention, cls)  # before save_hyperparameters, as the other arguments
        compile_options = check_compile_options(compile_options, compile, cls)
        check_optimizer_impl(optimizer_impl, cls)
        if fsdp_param_dtype not in _PARAM_DTYPES:
            raise ValueError(
                f"`{cls}(fsdp_param_dtype={fsdp_param_dtype!r})` is not valid. Expected one of {sorted(_PARAM_DTYPES)}."
            )
        if pretrained is not None and not os.path.exists(pretrained):
            raise FileNotFoundError(
                f"`{cls}(pretrained={pretrained!r})`: no such file or directory. Expected Wan 2.1 "
                "safetensors weights (a file, or a directory of shards with or without an index)."
            )
        config = from_name_or_config(model)
        check_training_arguments(
            cls, activation_checkpointing=activation_checkpointing, lr=lr, weight_decay=weight_decay, betas=betas,
            eps=eps, warmup_steps=warmup_steps, timestep_shift=timestep_shift,
            num_train_timesteps=num_train_timesteps, seed=seed,
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
        # Duck-typed: `.group(k)` returns the group a `WanModel.forward(sequence_parallel=...)` takes,
        # with `.degree`, `.first_rank` and `.check_identical(tensor, what)`. Process groups come from
        # a higher layer (parallel/), so they are handed in rather than created here.
        self.sequence_parallel: Any | None = None
        self._init_attention(attention)

    @property
    def wan_config(self) -> WanConfig:
        return self.config

    @property
    def attention_heads(self) -> tuple[int, int]:
        """``(num_heads, head_dim)`` of the model's attention (what backends are timed with)."""
        return self.config.num_heads, self.config.dim // self.config.num_heads

    def _set_model_attention(self, backend: str) -> None:
        if self.model is not None:
            self.model.set_attention_backend(backend)


    def _built_model(self) -> WanModel | None:
        return self.model

    def _set_block_checkpointing(self, mode: str) -> None:
        self._require_model().set_gradient_checkpointing(mode)

    def _fused_adaln_sites(self) -> int:
        model = self.model
        return 0 if model is None else sum(isinstance(m, FusedAdaLayerNorm) for m in model.modules())

    def _context_problem(self, length: int) -> str | None:
        # WanModel zero-pads shorter contexts to text_len, so every length up to it costs the same.
        text_len = self.config.text_len
        return None if length <= text_len else f"the model takes at most text_len={text_len}"

    def _text_len_fix(self, length: int) -> str:
        return (f"Truncate the contexts to {self.config.text_len} tokens in the dataset, or build the model with "
                f"`WanConfig(text_len={length})`.")

    def calibration_key(self) -> dict[str, Any]:
        """:meth:`RectifiedFlowModule.calibration_key` and, under FSDP2, the unsharded parameter dtype."""
        return {**super().calibration_key(), "fsdp_param_dtype": self.hparams.get("fsdp_param_dtype", "bfloat16")}

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
        model.set_gradient_checkpointing(self._initial_checkpointing())
        model.set_attention_backend(self._attention_backend)
        if self.hparams.get("compile", False):
            # Compilation is lazy: modules swapped in after this (FusedAdaLNCallback) are what gets traced.
            options = self.hparams.get("compile_options")
            model.compile_blocks(**({"options": dict(options)} if options else {}))

    @override
    def forward(
        self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, sequence_parallel: Any | None = None
    ) -> torch.Tensor:
        """Velocity prediction of the Wan model (timesteps in [0, num_train_timesteps]); see :meth:`WanModel.forward`."""
        model = self._require_model()
        self._attention_for_latents(x)
        return model(x, t, context) if sequence_parallel is None else model(x, t, context, sequence_parallel)
