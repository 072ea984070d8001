"""Rectified-flow (flow matching) training of a Wan 2.1 DiT as a LightningModule."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from time import perf_counter
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from typing_extensions import override

from lightning_adaptiveload.models.wan import WanConfig, WanModel, from_name_or_config

__all__ = ["FlowMatchingModule", "shift_timesteps"]


def shift_timesteps(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's shifted schedule ``t = shift·u / (1 + (shift - 1)·u)``, mapping [0, 1] onto [0, 1].

    ``shift > 1`` moves samples towards t = 1 (more noise), which high-resolution video needs
    because neighbouring tokens are strongly correlated; ``shift = 1`` is the identity.
    """
    return shift * u / (1 + (shift - 1) * u)


def _linear_warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps)


class FlowMatchingModule(pl.LightningModule):
    """Trains a :class:`~lightning_adaptiveload.models.wan.WanModel` with Wan's rectified-flow objective.

    For a clean latent ``x0`` and Gaussian ``noise``, draw ``u ~ U(0, 1)``, shift it to
    ``t = shift·u / (1 + (shift-1)·u)``, form ``x_t = (1 - t)·x0 + t·noise`` and regress the velocity
    ``noise - x0`` with an fp32 MSE; the model sees the timestep ``t · num_train_timesteps``.
    Every batch may have its own (F, H, W).

    The model is built in :meth:`configure_model`, so Lightning's ``FSDPStrategy`` can wrap it;
    wrap per block with ``auto_wrap_policy={WanAttentionBlock}``. ``activation_checkpointing=True``
    checkpoints inside each :class:`~lightning_adaptiveload.models.wan.WanAttentionBlock`
    (non-reentrant ``torch.utils.checkpoint``), which works with and without FSDP; do not also
    set the strategy's ``activation_checkpointing_policy`` (blocks would be recomputed twice).

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
        activation_checkpointing: recompute block activations in backward.

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
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        config = from_name_or_config(model)
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

    @override
    def configure_model(self) -> None:
        """Build the Wan model once (Lightning calls this inside the strategy's init context)."""
        if self.model is not None:
            return
        self.model = WanModel(self.config)
        self.model.set_gradient_checkpointing(self.hparams.activation_checkpointing)

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

    def sample_timesteps(self, batch_size: int, device: torch.device | None = None) -> torch.Tensor:
        """Draw ``batch_size`` flow times in [0, 1] from Wan's shifted schedule (global RNG)."""
        u = torch.rand(batch_size, device=self.device if device is None else device)
        return shift_timesteps(u, self.hparams.timestep_shift)

    def compute_loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Rectified-flow loss (fp32 scalar) of a batch with ``latents [B,C,F,H,W]`` and ``context [B,L,D]``."""
        model = self._require_model()
        x0 = batch["latents"].float()
        b = x0.shape[0]
        t = self.sample_timesteps(b, x0.device)
        noise = torch.randn_like(x0)
        tb = t.view(b, 1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * noise
        pred = model(x_t, t * self.hparams.num_train_timesteps, batch["context"])
        return F.mse_loss(pred.float(), noise - x0)

    def tokens_in_batch(self, batch: Mapping[str, torch.Tensor]) -> int:
        """B · S of a batch: samples times tokens per sample after patchify."""
        latents = batch["latents"]
        tokens = math.prod(s // p for s, p in zip(latents.shape[2:], self.patch_size, strict=True))
        return int(latents.shape[0]) * tokens

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
        if self._last_step_start is not None:
            elapsed = start - self._last_step_start
            self.log("train/tokens_per_s", self._last_step_tokens / elapsed, batch_size=samples)
            self.log("train/samples_per_s", self._last_step_samples / elapsed, batch_size=samples)
        self._last_step_start = start
        self._last_step_samples = samples
        self._last_step_tokens = self.tokens_in_batch(batch)
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=samples)
        return loss

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by the global norm; under FSDP through the wrapper, which sums the shards' norms.

        Lightning's FSDP precision plugin refuses norm clipping, yet the sharded model can do it.
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
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad],
            lr=hp.lr,
            betas=tuple(hp.betas),
            eps=hp.eps,
            weight_decay=hp.weight_decay,
        )
        if hp.warmup_steps == 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, functools.partial(_linear_warmup, warmup_steps=hp.warmup_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
