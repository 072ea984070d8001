"""Step cost of Ulysses sequence parallelism: ``t_sp(B, S, k)`` for an SP group of k ranks.

``t_sp(B, S, k) = t(0, S) + (t(B, S) - t(0, S)) / k + n_a2a · L · (latency + bytes(B, S, k) / bandwidth)``

- ``t`` is a fitted single-GPU :class:`~lightning_adaptiveload.calibration.costmodel.CostModel`;
  ``t(0, S)`` is its fixed per-step overhead (optimizer step, launches), which SP does not split.
- Compute is split k ways (assumption): linear layers and element-wise work run on S/k tokens per
  rank, self-attention on all S tokens for num_heads/k heads per rank, so both the ``S`` and the
  ``S²`` terms divide by k. Cross-attention to the text also runs on S/k query tokens per rank.
- Ulysses adds four all-to-alls per layer in the forward (q, k and v in: sequence-sharded →
  head-sharded; the attention output back) and four in the backward (their gradients), so
  ``n_a2a = 8`` (12 with activation checkpointing, which recomputes the forward's four). Each rank
  holds ``B·S/k`` tokens of width D and sends the ``(k-1)/k`` of them owned by other ranks:
  ``bytes(B, S, k) = B·S·D·bytes_per_element·(k-1)/k²`` per rank per all-to-all.
- Communication is assumed not to overlap compute (conservative).

Default link parameters (assumptions, overridable and fittable with :meth:`UlyssesCommModel.fit`):
``bandwidth = 450e9`` B/s, the per-direction half of the 900 GB/s bidirectional NVLink 4 bandwidth
NVIDIA's H200 SXM datasheet gives per GPU (a peak; NCCL's achieved all-to-all bandwidth is lower),
and ``latency = 25e-6`` s per all-to-all (an assumed order of magnitude for NCCL inside one
NVSwitch node). Measure both on the target cluster before trusting absolute SP times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import nnls

from lightning_adaptiveload._checks import check_positive
from lightning_adaptiveload.calibration.costmodel import CostModel

#: Per-direction NVLink 4 bandwidth of an H200 SXM (half the datasheet's 900 GB/s bidirectional), B/s.
H200_NVLINK_BANDWIDTH = 450e9
#: Assumed latency of one all-to-all inside an NVSwitch node, s.
H200_NVLINK_LATENCY = 25e-6
_JSON_FORMAT = "lightning_adaptiveload.SequenceParallelCostModel"
_JSON_VERSION = 1


@dataclass(frozen=True)
class UlyssesCommModel:
    """Time of the Ulysses all-to-alls of one training step.

    Args:
        hidden_dim: model width D (Wan 2.1 1.3B: 1536, 14B: 5120).
        num_layers: transformer blocks (1.3B: 30, 14B: 40).
        bytes_per_element: activation bytes (2 for bf16).
        bandwidth: bytes per second one rank sends in an all-to-all.
        latency: seconds per all-to-all.
        alltoalls_per_layer: 8 (forward q, k, v, output and their backward), 12 with activation
            checkpointing.
    """

    hidden_dim: int
    num_layers: int
    bytes_per_element: int = 2
    bandwidth: float = H200_NVLINK_BANDWIDTH
    latency: float = H200_NVLINK_LATENCY
    alltoalls_per_layer: int = 8

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("hidden_dim", "num_layers", "bytes_per_element", "alltoalls_per_layer"):
            object.__setattr__(self, field, int(check_positive(name, field, getattr(self, field), integer=True)))
        object.__setattr__(self, "bandwidth", check_positive(name, "bandwidth", self.bandwidth))
        object.__setattr__(self, "latency", check_positive(name, "latency", self.latency, zero=True))

    def bytes_per_alltoall(self, batch_size: Any, seq_len: Any, degree: int) -> np.ndarray | float:
        """Bytes one rank sends in one all-to-all: ``B·S·D·bytes·(k-1)/k²``."""
        k = float(degree)
        out = (np.asarray(batch_size, np.float64) * np.asarray(seq_len, np.float64) * self.hidden_dim
               * self.bytes_per_element * (k - 1.0) / (k * k))
        return float(out) if np.ndim(out) == 0 else out

    def predict(self, batch_size: Any, seq_len: Any, degree: int) -> np.ndarray | float:
        """Seconds of all-to-all per step (0 for degree 1)."""
        if int(degree) <= 1:
            return 0.0 * np.asarray(batch_size, np.float64) if np.ndim(batch_size) else 0.0
        per = self.latency + np.asarray(self.bytes_per_alltoall(batch_size, seq_len, degree)) / self.bandwidth
        out = self.alltoalls_per_layer * self.num_layers * per
        return float(out) if np.ndim(out) == 0 else out

    @classmethod
    def fit(cls, message_bytes: Any, seconds: Any, *, hidden_dim: int, num_layers: int,
            bytes_per_element: int = 2, alltoalls_per_layer: int = 8) -> UlyssesCommModel:
        """Latency and bandwidth from measured all-to-all times (non-negative least squares of
        ``seconds = latency + bytes / bandwidth``), e.g. from ``torch.distributed.all_to_all_single``
        timed at a few message sizes on the cluster.

        Raises:
            ValueError: mismatched lengths, non-positive values, fewer than two distinct sizes, or times
                that do not grow with the message size.
        """
        b = np.asarray(message_bytes, np.float64).reshape(-1)
        t = np.asarray(seconds, np.float64).reshape(-1)
        if len(b) != len(t) or len(np.unique(b)) < 2:
            raise ValueError(
                f"`UlyssesCommModel.fit` needs one time per message size and at least two distinct sizes; got "
                f"{len(b)} sizes ({len(np.unique(b))} distinct) and {len(t)} times."
            )
        if not (np.all(np.isfinite(b)) and np.all(np.isfinite(t)) and b.min() > 0 and t.min() > 0):
            raise ValueError("`UlyssesCommModel.fit`: message sizes and times must be finite and positive.")
        scale = float(b.max())
        # Relative residuals: small messages (latency-bound) count as much as large ones.
        design = np.stack([np.ones_like(b), b / scale], axis=1) / t[:, None]
        (lat, inv_bw), _ = nnls(design, np.ones_like(t))
        if inv_bw <= 0:
            raise ValueError(
                f"`UlyssesCommModel.fit`: the times {t.tolist()} do not grow with the message size; cannot fit a "
                "bandwidth. Time larger messages."
            )
        return cls(hidden_dim, num_layers, bytes_per_element, float(scale / inv_bw), float(lat), alltoalls_per_layer)

    def to_dict(self) -> dict[str, Any]:
        return {"hidden_dim": self.hidden_dim, "num_layers": self.num_layers,
                "bytes_per_element": self.bytes_per_element, "bandwidth": self.bandwidth,
                "latency": self.latency, "alltoalls_per_layer": self.alltoalls_per_layer}


@dataclass(frozen=True)
class SequenceParallelCostModel:
    """A single-GPU cost model extended with the Ulysses SP step cost (module docstring).

    ``predict(B, S)`` is the base model unchanged (data-parallel batches plan exactly as without
    SP); ``predict_sp(B, S, k)`` is the predicted time of one SP batch on each of its k ranks.

    Example::

        cm = SequenceParallelCostModel(default_cost_model(), UlyssesCommModel(hidden_dim=1536, num_layers=30))
        cm.predict_sp(1, 75_600, 4)      # seconds per step on each of 4 ranks
    """

    base: Any
    comm: UlyssesCommModel

    def __post_init__(self) -> None:
        if not callable(getattr(self.base, "predict", None)):
            raise ValueError(
                f"`SequenceParallelCostModel(base={self.base!r})` is not valid. Expected a cost model with "
                "`predict(B, S)`, e.g. `CostModel.fit(...)`."
            )
        if not isinstance(self.comm, UlyssesCommModel):
            raise ValueError(f"`SequenceParallelCostModel(comm={self.comm!r})` is not valid. Expected a UlyssesCommModel.")

    def predict(self, batch_size: Any, seq_len: Any) -> np.ndarray | float:
        return self.base.predict(batch_size, seq_len)

    def predict_sp(self, batch_size: Any, seq_len: Any, degree: int) -> np.ndarray | float:
        """Seconds per step of a batch of B samples of S tokens on each rank of an SP group of k."""
        k = int(degree)
        if k < 1:
            raise ValueError(f"`predict_sp(degree={degree!r})` is not valid. Expected an integer >= 1.")
        b = np.asarray(batch_size, np.float64)
        s = np.asarray(seq_len, np.float64)
        full = np.asarray(self.base.predict(b, s), np.float64)
        if k == 1:
            out = full
        else:
            fixed = np.asarray(self.base.predict(np.zeros_like(b), s), np.float64)
            out = fixed + (full - fixed) / k + np.asarray(self.comm.predict(b, s, k), np.float64)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict[str, Any]:
        base = self.base.to_dict() if callable(getattr(self.base, "to_dict", None)) else repr(self.base)
        return {"format": _JSON_FORMAT, "version": _JSON_VERSION, "base": base, "comm": self.comm.to_dict()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> SequenceParallelCostModel:
        """Inverse of :meth:`to_dict` (the base must be a serialised ``CostModel``)."""
        if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT or data.get("version") != _JSON_VERSION:
            raise ValueError(
                f"Not a serialised SequenceParallelCostModel (format {_JSON_FORMAT!r}, version {_JSON_VERSION}): "
                f"{str(data)[:200]!r}."
            )
        comm = data.get("comm")
        if not isinstance(comm, dict):
            raise ValueError(f"SequenceParallelCostModel JSON has comm={comm!r}. Expected an object.")
        return cls(CostModel.from_dict(data.get("base")), UlyssesCommModel(**comm))
