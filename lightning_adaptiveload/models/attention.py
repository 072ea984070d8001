"""``attention="auto"``: time every available attention backend at the corpus's sequence lengths and give
the module the fastest per length.

Called by :class:`~lightning_adaptiveload.callbacks.shape_benchmark.ShapeBenchmarkCallback` before it profiles
(so the profile, the calibration key and training all see the chosen backends), or by the module itself
at ``on_fit_start`` when no shape benchmark runs. Every rank times (which also compiles each backend's
kernels on every rank before training); rank 0's choice is broadcast, so all ranks run the same backends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_adaptiveload.ops.attention import choose_backends, fa4_unsupported_reason, time_backends

__all__ = ["attention_dtype", "choose_attention"]

_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "bf16": torch.bfloat16,
           "16-mixed": torch.float16, "16-true": torch.float16, "16": torch.float16}


def attention_dtype(trainer: Trainer) -> torch.dtype:
    """The dtype attention runs in under ``trainer``'s precision (bf16 under bf16-mixed autocast)."""
    return _DTYPES.get(str(trainer.precision), torch.float32)


def _lengths(trainer: Trainer) -> list[int]:
    dataset = getattr(getattr(trainer, "datamodule", None), "dataset", None)
    grids = getattr(dataset, "token_grids", None)
    if not callable(grids):
        return []
    return sorted({int(s) for s in np.prod(np.asarray(grids()).reshape(-1, 3), axis=1)})


def choose_attention(trainer: Trainer, pl_module: LightningModule, say: Callable[[str], Any]) -> dict[int, str] | None:
    """Measure and set ``pl_module``'s attention backend per sequence length when its ``attention`` is ``"auto"``.

    The module provides ``attention`` (the setting), ``attention_heads`` (``(num_heads, head_dim)``) and
    ``set_attention_plan(plan)``; optionally ``attention_tokens(seq_len)`` (joint text tokens of an MMDiT,
    timed as part of the attention length), and ``attention_backends`` (what it can run; only those are
    timed). Without a second usable backend (the module runs only SDPA, no CUDA, FA4 not installed, an
    unsupported GPU or dtype) it sets SDPA everywhere and says why in one line.

    Returns:
        The plan ``{S: backend}``, or ``None`` when the module does not choose (not ``"auto"``).
    """
    if getattr(pl_module, "attention", None) != "auto" or not callable(getattr(pl_module, "set_attention_plan", None)):
        return None
    lengths = _lengths(trainer)
    heads, head_dim = pl_module.attention_heads
    device = trainer.strategy.root_device
    dtype = attention_dtype(trainer)
    runs = tuple(getattr(pl_module, "attention_backends", ("sdpa",)))
    reason = (fa4_unsupported_reason(device, dtype, head_dim) if "fa4" in runs
              else f"{type(pl_module).__name__} runs only {', '.join(runs)} for this model")
    if reason is not None or not lengths:
        plan = {s: "sdpa" for s in lengths} or {0: "sdpa"}
        pl_module.set_attention_plan(plan)
        say(f"attention=auto: SDPA ({reason or 'no sequence lengths to time'})")
        return plan
    to_attention = getattr(pl_module, "attention_tokens", None)
    attn = {s: int(to_attention(s)) if callable(to_attention) else s for s in lengths}
    start = time.perf_counter()
    timed = time_backends(sorted(set(attn.values())), heads, head_dim, device=device, dtype=dtype, backends=runs)
    plan = choose_backends({s: timed[attn[s]] for s in lengths})
    plan = trainer.strategy.broadcast(plan)
    pl_module.set_attention_plan(plan)
    chosen = sorted(set(plan.values()))
    where = f"{chosen[0]} at every length" if len(chosen) == 1 else ", ".join(
        f"{b} at {sum(v == b for v in plan.values())} lengths" for b in chosen)
    detail = "; ".join(f"S={s:,}: " + " / ".join(f"{b} {ms:.2f}" for b, ms in timed[attn[s]].items())
                       for s in lengths[:8])
    more = f" (+{len(lengths) - 8} more)" if len(lengths) > 8 else ""
    say(f"attention=auto: {where} (forward + backward ms of a {32_768:,}-token batch, {detail}{more}; "
        f"measured in {time.perf_counter() - start:.1f} s)")
    return plan
