"""What a user's LightningModule provides to the library: :class:`AdaptiveLoadModule`.

The callbacks and the DataModule never look inside the model. They ask the LightningModule for a
loss, for a synthetic batch of a given token grid and for the ``(B, S)`` of a batch, and read its
patch size. Any module with these members works; :class:`~lightning_adaptiveload.models.FlowMatchingModule`
and :class:`~lightning_adaptiveload.integrations.diffusers.DiffusersWanModule` are two of them.

Which callback needs what (``check_module(module, needs=...)`` enforces it with a message that names
every missing member and how to add it):

============================  ============================================================
``ShapeBenchmarkCallback``    ``compute_loss``, ``synthetic_batch``, ``batch_shape``; optional:
                              ``attention_tokens`` (the cost and memory models are fitted in them),
                              ``calibration_key`` (added to the derived cache key), ``checkpointing``,
                              ``checkpointing_modes``, ``set_checkpointing`` (per-bucket modes)
``BalanceMonitor``            ``batch_shape``; ``flops_per_sample`` for MFU (optional)
``AdaptiveLoadDataModule``    ``batch_shape`` and ``patch_size`` (first-batch check)
============================  ============================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

__all__ = [
    "OPTIONAL_MEMBERS",
    "REQUIRED_MEMBERS",
    "AdaptiveLoadModule",
    "check_batch_against_plan",
    "check_batch_shape",
    "attention_tokens_of",
    "check_module",
    "validate_synthetic_batch",
]


@runtime_checkable
class AdaptiveLoadModule(Protocol):
    """The members a LightningModule provides to lightning-adaptiveload.

    ``isinstance(module, AdaptiveLoadModule)`` checks that the four required members exist (not
    their signatures); :func:`check_module` checks them with a message that says how to fix each.

    Attributes:
        patch_size: the DiT's patch ``(t, h, w)``; latents ``[B, C, F, H, W]`` become
            ``(F/t)·(H/h)·(W/w)`` tokens per sample.
    """

    patch_size: tuple[int, int, int]

    def compute_loss(self, batch: Any) -> torch.Tensor:
        """The scalar training loss of ``batch`` (forward only; the caller runs backward)."""
        ...

    def synthetic_batch(
        self, batch_size: int, token_grid: Sequence[int], device: torch.device | str | None = None
    ) -> Any:
        """A random batch of ``batch_size`` samples of token grid ``(f, h, w)``, shaped and typed like the
        collated training data, so profiling it costs what a real batch costs.

        It must not draw from the global RNG (use a ``torch.Generator``): profiling must leave the
        training RNG stream alone.
        """
        ...

    def batch_shape(self, batch: Any) -> tuple[int, int]:
        """``(B, S)``: samples in ``batch`` and tokens per sample after patchify."""
        ...


# Optional members, looked up with getattr (a Protocol cannot mark a method optional):
#     def attention_tokens(self, seq_len: int) -> int
# The tokens one sample of ``seq_len`` video tokens has in attention: ``seq_len`` plus the text tokens
# joined to it for an MMDiT (joint attention), ``seq_len`` for a cross-attention model (the default when
# absent, :func:`attention_tokens_of`). Buckets, policies and the sampler stay keyed by video tokens; the
# cost and memory models are fitted and evaluated in these, so the policy's batch sizes, the sampler's
# predicted step costs and the balance report's predicted compute price text tokens too. The text length
# must be the one every batch has: a model whose captions vary pads them to its stated ``text_len`` (the
# collate refuses contexts of different lengths in one batch).
#     def flops_per_sample(self, seq_len: int) -> float
# Model FLOPs of forward + backward for one sample of ``seq_len`` video tokens, every token attention
# sees included (an MMDiT's joint text tokens; recomputation from activation checkpointing not counted),
# used for MFU.
#     def calibration_key(self) -> dict
# Plain JSON values of settings the derived key cannot see that change the timed training step (fused
# kernels in use, ...). The shape benchmark derives the key from the module's hyperparameters, its
# model's config, the shapes of its synthetic batch and the checkpointing state
# (``lightning_adaptiveload.callbacks._trainee.calibration_key``) and adds this to it, so a cached or
# checkpointed calibration made under other values is profiled again.
#     checkpointing: str; checkpointing_modes: tuple[str, ...]; def set_checkpointing(self, mode: str) -> None
# Activation checkpointing chosen by the shape benchmark: ``checkpointing`` is ``"auto"`` until a mode
# is set, ``checkpointing_modes`` lists the modes least recomputation first, and ``set_checkpointing``
# is called before every training batch with the bucket's mode, so it must be cheap.

REQUIRED_MEMBERS: tuple[str, ...] = ("compute_loss", "synthetic_batch", "batch_shape", "patch_size")
OPTIONAL_MEMBERS: tuple[str, ...] = ("attention_tokens", "flops_per_sample", "calibration_key")

_HOW_TO = {
    "compute_loss": "def compute_loss(self, batch) -> Tensor: return the scalar training loss of `batch` "
    "(what training_step would return)",
    "synthetic_batch": "def synthetic_batch(self, batch_size, token_grid, device=None): return a random batch "
    "of `batch_size` samples of token grid (f, h, w), shaped like the collated data, drawn with its own "
    "torch.Generator",
    "batch_shape": "def batch_shape(self, batch) -> tuple[int, int]: return (B, S), S = tokens per sample "
    "after patchify (e.g. `lightning_adaptiveload.geometry.tokens_of(batch['latents'], self.patch_size)`)",
    "patch_size": "set `self.patch_size = (t, h, w)` in __init__ (the DiT's patch embedding stride)",
    "flops_per_sample": "def flops_per_sample(self, seq_len) -> float: return the model FLOPs of forward + "
    "backward for one sample of `seq_len` tokens",
    "calibration_key": "def calibration_key(self) -> dict: return plain JSON values of the settings (besides the "
    "architecture) that change the timed training step",
    "attention_tokens": "def attention_tokens(self, seq_len) -> int: return the tokens one sample of `seq_len` video "
    "tokens has in attention (seq_len + text_len for joint attention)",
}


def attention_tokens_of(module: Any) -> Callable[[int], int]:
    """``S -> S_attn``: ``module.attention_tokens`` checked (an integer >= S), or the identity when the module
    has none (cross-attention: attention sees the video tokens). Every consumer takes it from here, so the
    default is one.

    Raises:
        MisconfigurationException: (when called) ``attention_tokens(S)`` returned something else than an
            integer >= S.
    """
    own = getattr(module, "attention_tokens", None)
    if own is None:
        return _identity
    if not callable(own):
        raise MisconfigurationException(
            f"`{type(module).__name__}.attention_tokens` is a {type(own).__name__}, not a method. Fix: "
            f"{_HOW_TO['attention_tokens']}."
        )
    cls = type(module).__name__

    def checked(seq_len: int) -> int:
        value = own(int(seq_len))
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < seq_len:
            raise MisconfigurationException(
                f"`{cls}.attention_tokens({int(seq_len)})` returned {value!r}; expected an integer >= {int(seq_len)} "
                "(the video tokens plus any text tokens joined to them in attention)."
            )
        return int(value)

    return checked


def _identity(seq_len: int) -> int:
    return int(seq_len)


def _problem(module: Any, name: str) -> str | None:
    """Why ``module.<name>`` does not satisfy the protocol (``None`` when it does)."""
    if name not in _HOW_TO:
        raise ValueError(
            f"`check_module(needs=[..., {name!r}])` is not valid. Expected names from "
            f"{list(REQUIRED_MEMBERS + OPTIONAL_MEMBERS)}."
        )
    value = getattr(module, name, None)
    if name == "patch_size":
        if value is None:
            return "is missing"
        try:
            ok = len(value) == 3 and all(int(v) == v and v >= 1 for v in value)
        except TypeError:
            ok = False
        return None if ok else f"is {value!r}, not three positive integers"
    if value is None:
        return "is missing"
    return None if callable(value) else f"is a {type(value).__name__}, not a method"


def check_module(module: Any, needs: Iterable[str] = REQUIRED_MEMBERS, who: str = "lightning-adaptiveload") -> None:
    """Check that ``module`` has the protocol members in ``needs``; one error lists every problem.

    Args:
        module: the LightningModule.
        needs: member names from :data:`REQUIRED_MEMBERS` and :data:`OPTIONAL_MEMBERS`.
        who: the caller, named in the message (e.g. ``"ShapeBenchmarkCallback"``).

    Raises:
        MisconfigurationException: a member is missing or has the wrong kind; the message names each
            one and the code that adds it.
        ValueError: ``needs`` names a member that is not part of the protocol.
    """
    needs = list(needs)
    problems = [(name, p) for name in needs if (p := _problem(module, name)) is not None]
    if not problems:
        return
    cls = type(module).__name__
    lines = "\n".join(f"  - `{cls}.{name}` {p}. Fix: {_HOW_TO[name]}." for name, p in problems)
    raise MisconfigurationException(
        f"{who} needs `{cls}` to provide {needs} (see `lightning_adaptiveload.models.protocol."
        f"AdaptiveLoadModule`):\n{lines}"
    )


def _grid(name: str, token_grid: Sequence[int]) -> tuple[int, int, int]:
    try:
        ok = len(token_grid) == 3 and all(int(g) == g and g >= 1 for g in token_grid)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"`{name}(token_grid={token_grid!r})` is not valid. Expected three positive integers.")
    return int(token_grid[0]), int(token_grid[1]), int(token_grid[2])


def _shape(module: Any, batch: Any, what: str) -> tuple[int, int]:
    shape = module.batch_shape(batch)
    try:
        b, s = shape
        return int(b), int(s)
    except (TypeError, ValueError):
        raise MisconfigurationException(
            f"`{type(module).__name__}.batch_shape({what})` returned {shape!r}; expected a pair (B, S) of integers."
        ) from None


def validate_synthetic_batch(
    module: Any,
    token_grid: Sequence[int] = (1, 2, 2),
    device: torch.device | str | None = None,
    batch_size: int = 2,
) -> Any:
    """Build one small synthetic batch and check that ``batch_shape`` reads back what was asked for.

    Catches the two ways a user's module silently breaks planning: ``synthetic_batch`` building
    latents of a different grid than asked, or ``batch_shape`` counting tokens before patchify.

    Args:
        module: has ``synthetic_batch`` and ``batch_shape`` (see :func:`check_module`).
        token_grid: a small grid ``(f, h, w)``.
        device: where to build it (default: ``module.device`` if it has one, else CPU).
        batch_size: samples B.

    Returns:
        The batch, for callers that want to run it.

    Raises:
        MisconfigurationException: ``batch_shape(batch) != (B, f·h·w)``; the message has both.
    """
    grid = _grid("validate_synthetic_batch", token_grid)
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(
            f"`validate_synthetic_batch(batch_size={batch_size!r})` is not valid. Expected a positive integer."
        )
    check_module(module, ("synthetic_batch", "batch_shape"), who="validate_synthetic_batch")
    if device is None:
        device = getattr(module, "device", None) or torch.device("cpu")
    batch = module.synthetic_batch(int(batch_size), grid, device)
    check_batch_shape(module, batch, grid, batch_size, source="synthetic")
    return batch


def check_batch_against_plan(
    module: Any, batch: Any, expected_grid: Sequence[int], expected_batch_size: int
) -> tuple[int, int]:
    """Check a real training batch against what the sampler planned for it.

    The sampler plans from the dataset's ``token_grids()`` (metadata); the model counts tokens of
    the tensors it gets. A disagreement (wrong patch size, latents cropped differently than the
    metadata says) would make every batch size and cost prediction wrong without an error.

    Args:
        module: has ``batch_shape``.
        batch: the collated batch.
        expected_grid: the token grid ``(f, h, w)`` the sampler planned for this batch.
        expected_batch_size: the batch size it planned.

    Returns:
        ``(B, S)`` of the batch.

    Raises:
        MisconfigurationException: ``batch_shape(batch) != (expected_batch_size, f·h·w)``; the message
            has both.
    """
    grid = _grid("check_batch_against_plan", expected_grid)
    check_module(module, ("batch_shape",), who="check_batch_against_plan")
    return check_batch_shape(module, batch, grid, expected_batch_size, source="planned")


def check_batch_shape(
    module: Any, batch: Any, token_grid: Sequence[int], batch_size: int, *, source: str
) -> tuple[int, int]:
    """The one (B, S) check: ``module.batch_shape(batch)`` against ``(batch_size, f·h·w)`` of ``token_grid``.

    Used for synthetic batches (:func:`validate_synthetic_batch`, the shape benchmark before it profiles)
    and for the first real batches (:func:`check_batch_against_plan`, the DataModule).

    Args:
        module: has ``batch_shape``.
        batch: the batch.
        token_grid: the token grid ``(f, h, w)`` the batch should have.
        batch_size: the samples B it should have.
        source: ``"synthetic"`` (built by ``module.synthetic_batch(batch_size, token_grid)``) or ``"planned"``
            (a real batch the sampler planned); the message names the causes of each.

    Returns:
        ``(B, S)`` of the batch.

    Raises:
        MisconfigurationException: ``batch_shape(batch)`` is not a pair, or not ``(batch_size, f·h·w)``; the
            message has both.
    """
    if source not in ("synthetic", "planned"):
        raise ValueError(f"`check_batch_shape(source={source!r})` is not valid. Expected 'synthetic' or 'planned'.")
    grid = _grid("check_batch_shape", token_grid)
    got = _shape(module, batch, "synthetic_batch(...)" if source == "synthetic" else "batch")
    expected = (int(batch_size), math.prod(grid))
    if got == expected:
        return got
    cls = type(module).__name__
    patch = getattr(module, "patch_size", "?")
    if source == "synthetic":
        raise MisconfigurationException(
            f"`{cls}.synthetic_batch(B={batch_size}, token_grid={grid})` returned a batch whose batch_shape is "
            f"{got}; expected {expected}: B samples of f·h·w = {expected[1]} tokens. Either synthetic_batch "
            f"builds latents of another grid (latents must be token_grid × patch_size = {patch}), or "
            "batch_shape does not count tokens after patchify."
        )
    raise MisconfigurationException(
        f"The first training batch has batch_shape {got} by `{cls}.batch_shape`; the sampler planned "
        f"{expected} (B={batch_size}, token grid {grid} = {expected[1]} tokens). The dataset's "
        f"`token_grids()` and the latents `__getitem__` returns disagree, or the model's patch_size "
        f"({patch}) differs from the dataset's."
    )
