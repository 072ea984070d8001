"""ATen calls counted by name, for the activation-checkpointing tests of both model families."""

from __future__ import annotations

import torch


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ATen calls by name (forward and backward, recomputation included)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def attention_calls(counts: dict[str, int]) -> int:
    """Forward SDPA calls among ``counts`` (a recomputed forward counts again)."""
    return sum(n for name, n in counts.items() if name.startswith("_scaled_dot_product") and "backward" not in name)
