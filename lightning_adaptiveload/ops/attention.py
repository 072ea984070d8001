"""Attention backends in the ``(B, S, H, D)`` layout: PyTorch SDPA, and FlashAttention-4 on Hopper/Blackwell.

:func:`attention` runs ``softmax(q·kᵀ/√D)·v`` (non-causal, no mask) through one backend:

- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` (cuDNN / flash / efficient kernels on
  CUDA, the math kernel on CPU); it wants ``(B, H, S, D)``, so the call transposes around it (views).
- ``"fa4"``: FlashAttention-4 (``pip install "lightning-adaptiveload[fa4]"``, the ``flash-attn-4`` CuTe-DSL
  kernels; compute capability 9.x-12.x, bf16/fp16, head dim a multiple of 8 up to 256). It takes
  ``(B, S, H, D)`` as it is. Forward and backward are ``torch.library`` custom ops
  (``adaptiveload::fa4_attention`` / ``fa4_attention_backward``) with fake implementations, so
  compiled blocks call them without a graph break and selective activation checkpointing can keep
  their outputs. The package's own ``flash_attn_func`` is an ``autograd.Function`` that dynamo cannot
  trace into a graph (its kernels are launched from Python through CuTe's JIT), hence the wrapper.

:func:`time_backends` measures forward + backward of every available backend at given sequence lengths
(what ``attention="auto"`` uses to pick one per bucket) and :func:`fa4_unsupported_reason` says why FA4
cannot run (not installed, no CUDA, GPU, dtype, head dim).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_SETTINGS",
    "attention",
    "available_backends",
    "check_attention_setting",
    "choose_backends",
    "fa4_unsupported_reason",
    "time_backends",
]

#: The backends :func:`attention` runs.
ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "fa4")
#: What a model's ``attention=`` setting accepts: a backend, or ``"auto"`` (the fastest available one per
#: bucket, measured by the shape benchmark; SDPA where FA4 cannot run).
ATTENTION_SETTINGS: tuple[str, ...] = ("auto", *ATTENTION_BACKENDS)


def check_attention_setting(value: Any, owner: str) -> str:
    """``value`` if it is one of :data:`ATTENTION_SETTINGS`, else a one-line error naming ``owner``'s argument."""
    if value not in ATTENTION_SETTINGS:
        raise ValueError(
            f"`{owner}(attention={value!r})` is not valid. Expected one of {list(ATTENTION_SETTINGS)} "
            "(auto: the fastest measured per bucket; fa4 needs `pip install \"lightning-adaptiveload[fa4]\"`)."
        )
    return value


@functools.cache
def _fa4_import_error() -> str | None:
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as err:  # ImportError, or the CuTe DSL failing to load its CUDA libraries
        return f"flash-attn-4 does not import ({type(err).__name__}: {err}); install it with " \
               "`pip install \"lightning-adaptiveload[fa4]\"`"
    return None


def fa4_unsupported_reason(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str | None:
    """Why FlashAttention-4 cannot run here (``None`` when it can).

    Args:
        device: the device attention runs on (default: the current CUDA device).
        dtype: the dtype of q, k and v (bf16 and fp16 are supported).
        head_dim: the per-head width (a multiple of 8, at most 256).
    """
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"FA4 runs on CUDA GPUs, not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10, 11, 12):
        return f"FA4 needs compute capability 9.x-12.x (Hopper or Blackwell); this GPU is {major}.{minor}"
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return f"FA4 takes bf16 or fp16 inputs, not {dtype} (train with precision='bf16-mixed')"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"FA4 needs a head dim that is a multiple of 8 up to 256, not {head_dim}"
    return _fa4_import_error()


# ---------------------------------------------------------------------------------------------- FA4 ops
@torch.library.custom_op("adaptiveload::fa4_attention", mutates_args=(), device_types="cuda")
def _fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=False, return_lse=True)
    return out, lse


@_fa4_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("adaptiveload::fa4_attention_backward", mutates_args=(), device_types="cuda")
def _fa4_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    softmax_scale: float, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, softmax_scale, False,
                                 deterministic=deterministic)
    return dq, dk, dv


@_fa4_backward.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.deterministic = torch.are_deterministic_algorithms_enabled()


def _fa4_autograd(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _fa4_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None


_fa4_forward.register_autograd(_fa4_autograd, setup_context=_fa4_setup_context)

#: The ops whose outputs selective activation checkpointing keeps (besides SDPA's ATen kernels).
FA4_OPS = (torch.ops.adaptiveload.fa4_attention.default,)


# ------------------------------------------------------------------------------------------ the entry
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """Non-causal attention of ``q [B, Sq, H, D]`` over ``k, v [B, Sk, H, D]``; returns ``[B, Sq, H, D]``.

    Args:
        backend: ``"sdpa"`` or ``"fa4"`` (see the module docstring; ``fa4`` raises if it cannot run).
    """
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    if backend == "fa4":
        out, _ = _fa4_forward(q, k, v, 1.0 / math.sqrt(q.shape[-1]))
        return out
    raise ValueError(f"`attention(backend={backend!r})` is not valid. Expected one of {list(ATTENTION_BACKENDS)}.")


def available_backends(device: torch.device | str, dtype: torch.dtype | None = None,
                       head_dim: int | None = None) -> tuple[str, ...]:
    """The backends that can run on ``device`` for inputs of ``dtype`` and ``head_dim`` (SDPA always)."""
    return ("sdpa",) if fa4_unsupported_reason(device, dtype, head_dim) else ATTENTION_BACKENDS


def _forward_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, backend: str) -> None:
    torch.autograd.backward(attention(q, k, v, backend), grad)
    q.grad = k.grad = v.grad = None


def _median_ms(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        import time

        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_backends(
    lengths: Iterable[int],
    num_heads: int,
    head_dim: int,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    backends: Sequence[str] | None = None,
    tokens: int = 32_768,
    kv_lengths: Mapping[int, int] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    generator_seed: int = 0,
) -> dict[int, dict[str, float]]:
    """Forward + backward milliseconds of each backend at each sequence length.

    Each length ``S`` runs a batch of ``max(1, tokens // S)`` samples (the work of a bucket's step, not one
    sample) of random bf16 q, k, v (drawn from a private generator: the training RNG is not touched).
    The first calls of a backend compile its kernels and are not timed (``warmup``).

    Args:
        lengths: the sequence lengths (attention tokens per sample).
        num_heads, head_dim: the model's attention heads and their width.
        device, dtype: where and in which dtype the model's attention runs.
        backends: which backends to time (default: :func:`available_backends`).
        tokens: tokens per timed batch.
        kv_lengths: a different key/value length per query length (cross-attention); default: the same.
        repeats: timed calls per (length, backend); the median is kept.

    Returns:
        ``{S: {backend: ms}}``.
    """
    device = torch.device(device)
    backends = tuple(backends or available_backends(device, dtype, head_dim))
    gen = torch.Generator(device=device).manual_seed(generator_seed)
    result: dict[int, dict[str, float]] = {}
    for s in sorted({int(s) for s in lengths}):
        b = max(1, tokens // s)
        sk = int((kv_lengths or {}).get(s, s))
        q, k, v = (torch.randn(b, n, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
                   .requires_grad_(True) for n in (s, sk, sk))
        grad = torch.randn(b, s, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
        result[s] = {be: _median_ms(functools.partial(_forward_backward, q, k, v, grad, be), device, repeats, warmup)
                     for be in backends}
    return result


#: ``attention="auto"`` leaves SDPA for another backend only when that one is at least this much faster at a
#: length (a near tie would otherwise flip between runs, and the plan is part of the calibration key).
MIN_GAIN = 0.02


def choose_backends(timings: Mapping[int, Mapping[str, float]], default: str = "sdpa",
                    min_gain: float = MIN_GAIN) -> dict[int, str]:
    """The fastest backend per length of :func:`time_backends`'s timings; ``default`` unless another is
    at least ``min_gain`` faster."""
    plan = {}
    for s, t in timings.items():
        best = min(t, key=t.__getitem__)
        if default in t and t[best] > t[default] * (1.0 - min_gain):
            best = default
        plan[int(s)] = best
    return plan
