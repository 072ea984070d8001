"""Wan 2.1 text-to-video diffusion transformer (DiT).

The architecture follows the public Wan 2.1 release: a 3-D patch embedding of the VAE latents,
an MLP over umT5 text features, a sinusoidal timestep embedding projected to six AdaLN
modulation vectors per block, and blocks of (AdaLN → self-attention with q/k RMSNorm and 3-D
RoPE → gated residual) + (LayerNorm → cross-attention to text) + (AdaLN → GELU(tanh) FFN →
gated residual), then a modulated head and unpatchify. Parameter names and layouts match the
published checkpoints (``blocks.0.self_attn.q.weight``, ``head.head.weight``, ...), so they load
with ``load_state_dict``.

Differences from the reference code, all on purpose:

* Every sample of a batch shares one token grid (the bucketing sampler guarantees it), so there
  is no padding, no per-sample loop and no ``seq_lens``; attention runs through
  ``F.scaled_dot_product_attention`` on the whole batch.
* RoPE uses real arithmetic in fp32 (the reference rotates complex fp64 numbers), with the
  angles computed in fp64 so positions up to a few thousand lose no precision.
* Every norm + modulate site is an :class:`~lightning_adaptiveload.modules.adaln.AdaLayerNorm`,
  so a callback can swap in a fused kernel.
* Sequence parallelism (Ulysses) is an argument of :meth:`WanModel.forward`, with the process
  groups passed in as a duck-typed object (docs/sequence_parallel.md); a length the degree does
  not divide is split unevenly rather than padded, so the result is exact.

Exact parameter counts (``WanModel(config).num_parameters()``): ``wan2_1_1_3b`` 1,418,996,800;
``wan2_1_14b`` 14,288,491,584. With D = dim, F = ffn_dim, T = text_dim, P = prod(patch_size):

    patch  in_dim·P·D + D            text   T·D + D + D² + D
    time   freq_dim·D + D + D² + D   proj   6D² + 6D
    block  8D² + 2DF + 21D + F       head   D·out_dim·P + out_dim·P + 2D
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import lightning_adaptiveload.models.checkpointing as _checkpointing
from lightning_adaptiveload.geometry import token_grid as _token_grid

# The activation-checkpointing mechanism lives in models.checkpointing; its names stay importable from here.
from lightning_adaptiveload.models.checkpointing import (  # noqa: F401
    _ATTENTION_OPS,
    CHECKPOINTING_MODES,
    checkpointing_mode,
    keep_attention_outputs,
    run_checkpointed,
)
from lightning_adaptiveload.models.compiling import compile_blocks as compile_repeated
from lightning_adaptiveload.models.compiling import mark_dynamic, whole_block_graphs
from lightning_adaptiveload.modules.adaln import AdaLayerNorm
from lightning_adaptiveload.ops.attention import ATTENTION_BACKENDS, attention

__all__ = [
    "WAN_CONFIGS",
    "WanAttentionBlock",
    "WanConfig",
    "WanModel",
    "from_name_or_config",
    "rope_angles",
    "rope_apply",
    "sinusoidal_embedding",
    "wan_forward_flops",
]


@dataclass(frozen=True)
class WanConfig:
    """Hyperparameters of a Wan 2.1 DiT.

    Args:
        dim: hidden size.
        ffn_dim: FFN inner size.
        num_heads: attention heads; ``dim / num_heads`` must be even (RoPE rotates pairs).
        num_layers: number of :class:`WanAttentionBlock`.
        in_dim: latent channels in.
        out_dim: latent channels out.
        text_dim: text-encoder feature size (umT5-XXL: 4096).
        text_len: text tokens; shorter contexts are zero-padded to it, as Wan does.
        freq_dim: size of the sinusoidal timestep embedding.
        patch_size: (t, h, w) patch of the 3-D patch embedding.
        vae_stride: (t, h, w) compression of the VAE whose latents the model sees (Wan 2.1: 4, 8, 8);
            data configs take it, and ``patch_size``, from here.
        eps: epsilon of every norm.
        qk_norm: RMSNorm on queries and keys.
        cross_attn_norm: affine LayerNorm before cross-attention.
        window_size: local attention window; only global attention ``(-1, -1)`` is supported.
        residual_fp32: keep the residual stream between blocks in fp32, as Wan's reference does. ``False``
            keeps it in the dtype the patch embedding computes in (bf16 under ``bf16-mixed``) and adds each
            update in fp32, rounding once, as diffusers' ``WanTransformerBlock``: the AdaLN, RoPE and
            element-wise kernels then read and write half the bytes (on one H200 the fp32 stream cost 2.4%
            of a 2 x 14,040 step and 0.4% of a 1 x 32,760 one against diffusers' model, ``docs/benchmarks.md``
            3). It changes the numerics, so a checkpoint trains on from where it was, not bit for bit.
    """

    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    in_dim: int = 16
    out_dim: int = 16
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    patch_size: tuple[int, int, int] = field(default=(1, 2, 2))
    vae_stride: tuple[int, int, int] = field(default=(4, 8, 8))
    eps: float = 1e-6
    qk_norm: bool = True
    cross_attn_norm: bool = True
    window_size: tuple[int, int] = field(default=(-1, -1))
    residual_fp32: bool = True

    def __post_init__(self) -> None:
        # Lists come from YAML/JSON; keep the frozen config hashable and comparable.
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        object.__setattr__(self, "vae_stride", tuple(int(v) for v in self.vae_stride))
        object.__setattr__(self, "window_size", tuple(int(w) for w in self.window_size))
        for name in (
            "dim",
            "ffn_dim",
            "num_heads",
            "num_layers",
            "in_dim",
            "out_dim",
            "text_dim",
            "text_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`WanConfig({name}={value!r})` is not valid. Expected a positive integer.")
        if self.freq_dim < 2 or self.freq_dim % 2:
            raise ValueError(
                f"`WanConfig(freq_dim={self.freq_dim!r})` is not valid. Expected a positive even integer."
            )
        if self.dim % self.num_heads:
            raise ValueError(
                f"`WanConfig(dim={self.dim}, num_heads={self.num_heads})` is not valid. "
                "Expected `dim` divisible by `num_heads`."
            )
        head_dim = self.dim // self.num_heads
        if head_dim % 2 or head_dim < 6:
            raise ValueError(
                f"`WanConfig(dim={self.dim}, num_heads={self.num_heads})` gives head_dim={head_dim}. "
                "Expected an even head_dim >= 6 (3-D RoPE splits it into three bands of pairs)."
            )
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(
                f"`WanConfig(patch_size={self.patch_size!r})` is not valid. Expected three positive integers."
            )
        if len(self.vae_stride) != 3 or min(self.vae_stride) < 1:
            raise ValueError(
                f"`WanConfig(vae_stride={self.vae_stride!r})` is not valid. Expected three positive integers."
            )
        if self.window_size != (-1, -1):
            raise ValueError(
                f"`WanConfig(window_size={self.window_size!r})` is not supported. "
                "Only global attention `(-1, -1)` is implemented (as in every released Wan 2.1 model)."
            )
        if not self.eps > 0:
            raise ValueError(f"`WanConfig(eps={self.eps!r})` is not valid. Expected a positive float.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


WAN_CONFIGS: dict[str, WanConfig] = {
    # Small enough to train for a few steps on two CPU cores in seconds.
    "tiny": WanConfig(dim=64, ffn_dim=128, num_heads=4, num_layers=2, text_dim=32, text_len=16),
    "wan2_1_1_3b": WanConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
    "wan2_1_14b": WanConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
}


def from_name_or_config(model: str | WanConfig | Mapping[str, Any]) -> WanConfig:
    """Resolve a preset name, a :class:`WanConfig` or a dict of its fields to a :class:`WanConfig`.

    A dict may name a ``preset`` and override some of its fields.

    Raises:
        ValueError: unknown preset name or unknown dict keys.
        TypeError: any other type.
    """
    if isinstance(model, WanConfig):
        return model
    if isinstance(model, str):
        if model not in WAN_CONFIGS:
            raise ValueError(f"Unknown Wan model preset {model!r}. Expected one of {sorted(WAN_CONFIGS)}.")
        return WAN_CONFIGS[model]
    if isinstance(model, Mapping):
        fields = dict(model)
        known = {f.name for f in dataclasses.fields(WanConfig)}
        unknown = sorted(set(fields) - known - {"preset"})
        if unknown:
            raise ValueError(
                f"Unknown WanConfig fields {unknown} in {fields!r}. Expected keys among {sorted(known | {'preset'})}."
            )
        preset = fields.pop("preset", None)
        if preset is not None:
            # A preset with some fields changed, e.g. {"preset": "wan2_1_1_3b", "num_layers": 4}.
            return dataclasses.replace(from_name_or_config(preset), **fields)
        return WanConfig(**fields)
    raise TypeError(
        f"`model={model!r}` is not valid. Expected a preset name in {sorted(WAN_CONFIGS)}, a WanConfig or a dict."
    )


def wan_forward_flops(config: WanConfig, seq_len: int) -> int:
    """FLOPs of one forward pass of a Wan 2.1 DiT for one sample of ``seq_len`` tokens.

    The one count of the project, for :class:`WanModel` and for diffusers' ``WanTransformer3DModel``
    (same matmuls). Counts every matmul (2 FLOPs per multiply-add) and nothing else (norms, RoPE,
    activations, residuals and modulation are element-wise). With S = ``seq_len``, D = dim, F = ffn_dim,
    L = text_len (:class:`WanModel` zero-pads the context to it), T = text_dim, P = prod(patch_size), N = num_layers::

        per token, every layer:   self-attn q, k, v, o  4·2·D²   cross-attn q, o  2·2·D²   FFN  2·2·D·F
        per token, once:          patch embedding 2·in_dim·P·D   head 2·D·out_dim·P
        per sample, every layer:  cross-attn k, v on the text tokens 2·2·L·D²
        per sample, once:         text MLP 2·L·(T·D + D²)   time MLP 2·(freq_dim·D + D²)   projection 2·6·D²
        attention, every layer:   self 4·S²·D (q·kᵀ and p·v)   cross 4·S·L·D

    ``torch.utils.flop_counter.FlopCounterMode`` counts the same number on either model's forward
    (tests/models/test_flow_matching.py, tests/integrations/test_diffusers.py). Image conditioning
    (Wan I2V's image embedder) is not counted.
    """
    c = config
    d, s, n_text, p = c.dim, int(seq_len), c.text_len, math.prod(c.patch_size)
    per_token = 2 * (c.num_layers * (6 * d * d + 2 * d * c.ffn_dim) + c.in_dim * p * d + d * c.out_dim * p)
    per_sample = 2 * (
        c.num_layers * 2 * n_text * d * d + n_text * (c.text_dim * d + d * d) + c.freq_dim * d + d * d + 6 * d * d
    )
    attention = c.num_layers * (4 * s * s * d + 4 * s * n_text * d)
    return per_token * s + per_sample + attention


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Wan's timestep embedding ``[cos(t·ω), sin(t·ω)]`` with ``ω_i = 10000^(-i / (dim/2))``.

    Computed in fp64 (timesteps reach 1000, fp32 phases would lose ~1e-4 rad), returned in fp32.
    """
    half = dim // 2
    pos = t.to(torch.float64)
    omega = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    phase = torch.outer(pos, omega)
    return torch.cat([torch.cos(phase), torch.sin(phase)], dim=1).float()


def _rope_bands(head_dim: int) -> tuple[int, int, int]:
    # Pairs per axis, as Wan splits them: time gets the remainder, height and width a third each.
    pairs = head_dim // 2
    return pairs - 2 * (pairs // 3), pairs // 3, pairs // 3


def rope_angles(
    grid: tuple[int, int, int], head_dim: int, theta: float = 10000.0, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables ``[S, head_dim // 2]`` (fp32) of the 3-D RoPE for a token grid (f, h, w).

    Token ``(i, j, k)`` (row-major, as the patch embedding flattens) rotates its time pairs by
    ``i·θ^(-n/N_f)``, its height pairs by ``j·θ^(-n/N_h)`` and its width pairs by ``k·θ^(-n/N_w)``,
    where ``N_*`` is the number of pairs of that band.
    """
    f, h, w = grid
    angles = []
    for length, pairs in zip((f, h, w), _rope_bands(head_dim), strict=True):
        inv = torch.pow(theta, -torch.arange(pairs, dtype=torch.float64, device=device) / pairs)
        angles.append(torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv))
    af, ah, aw = angles
    full = torch.cat(
        [
            af[:, None, None, :].expand(f, h, w, -1),
            ah[None, :, None, :].expand(f, h, w, -1),
            aw[None, None, :, :].expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, -1)
    return torch.cos(full).float(), torch.sin(full).float()


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2n], x[2n+1])`` of ``x [B, S, H, D]`` in fp32; returns fp32.

    Written as ``x·cos + swap(x)·(−sin, sin)``: in eager mode the same values, bit for bit, as
    ``(x0·c − x1·s, x0·s + x1·c)`` (negating is exact), but faster once compiled: with ``unbind`` +
    ``stack`` inductor's fused backward of the q/k RMSNorm and RoPE took 1.26 ms for two 1.3B blocks at
    2 x 14,040 tokens on one H100, with ``flip`` 0.78 ms (``benchmarks/bench_block_variants.py``,
    ``block_variants.json``; about 1% of a block's step there, too little to show end to end).
    """
    b, s, n, d = x.shape
    pairs = x.float().reshape(b, s, n, d // 2, 2)
    c = cos[None, :, None, :, None]
    signed_sin = torch.stack([-sin, sin], dim=-1)[None, :, None]  # a [S, D/2, 2] table, not a per-token tensor
    return (pairs * c + pairs.flip(-1) * signed_sin).reshape(b, s, n, d)


class WanRMSNorm(nn.Module):
    """RMSNorm over the last dim, statistics in fp32, learned weight; output in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class WanLayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 and cast back (Wan's cross-attention pre-norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class WanSelfAttention(nn.Module):
    """Multi-head attention with q/k RMSNorm over the full width; RoPE when ``rope`` is given.

    Used for both self-attention (``context=None``, with RoPE) and cross-attention to text
    (``context`` given, no RoPE), like Wan's T2V cross-attention.
    """

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()
        #: The attention backend (:data:`~lightning_adaptiveload.ops.attention.ATTENTION_BACKENDS`), set by
        #: :meth:`WanModel.set_attention_backend`; compiled blocks compile once per backend they run.
        self.backend = "sdpa"

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        sequence_parallel: Any | None = None,
    ) -> torch.Tensor:
        """``sequence_parallel``: self-attention only; ``x`` is this rank's token shard and the object
        (a :meth:`WanModel.forward` layout) trades it for a head shard of the full sequence and back."""
        b, n, d = x.shape[0], self.num_heads, self.head_dim
        kv = x if context is None else context
        q = self.norm_q(self.q(x)).view(b, -1, n, d)
        k = self.norm_k(self.k(kv)).view(b, -1, n, d)
        v = self.v(kv).view(b, -1, n, d)
        if rope is not None:
            # RoPE returns fp32; SDPA needs one dtype (bf16 under autocast), as the reference
            # casts to the flash-attention dtype after rotating.
            q = rope_apply(q, *rope).to(v.dtype)
            k = rope_apply(k, *rope).to(v.dtype)
        else:
            q, k = q.to(v.dtype), k.to(v.dtype)
        if sequence_parallel is not None:
            # One exchange for q, k and v (stacked on the batch dim) instead of three.
            q, k, v = sequence_parallel.seq_to_heads(torch.cat([q, k, v])).chunk(3)
        out = attention(q, k, v, self.backend)
        if sequence_parallel is not None:
            out = sequence_parallel.heads_to_seq(out)
        return self.o(out.flatten(2))


class WanAttentionBlock(nn.Module):
    """One Wan 2.1 transformer block (the FSDP wrap unit).

    Args:
        config: model hyperparameters.

    Attributes:
        checkpointing: what backward recomputes (:data:`~lightning_adaptiveload.models.checkpointing.CHECKPOINTING_MODES`,
            through :func:`~lightning_adaptiveload.models.checkpointing.run_checkpointed`): ``"none"`` keeps every activation; ``"selective"`` keeps the
            outputs of the attention kernels (the S²-cost part) and recomputes the rest of the block
            (projections, FFN, norms, RoPE, gating); ``"full"`` keeps only the block's inputs.
            Set by :meth:`WanModel.set_gradient_checkpointing`.
    """

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        dim, eps = config.dim, config.eps
        self.dim = dim
        self.checkpointing = "none"
        self.norm1 = AdaLayerNorm(dim, eps)
        self.self_attn = WanSelfAttention(dim, config.num_heads, config.qk_norm, eps)
        self.norm3 = (
            WanLayerNorm(dim, eps, elementwise_affine=True) if config.cross_attn_norm else nn.Identity()
        )
        self.cross_attn = WanSelfAttention(dim, config.num_heads, config.qk_norm, eps)
        self.norm2 = AdaLayerNorm(dim, eps)
        self.ffn = nn.Sequential(
            nn.Linear(dim, config.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(config.ffn_dim, dim)
        )
        self.modulation = nn.Parameter(torch.empty(1, 6, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Also what FSDP calls when it materialises a meta-device block.
        nn.init.normal_(self.modulation, std=self.dim**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        e0: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        sequence_parallel: Any | None = None,
    ) -> torch.Tensor:
        """Args: ``x [B, S, D]``, ``e0 [B, 6, D]`` fp32, ``context [B, L, D]``, ``rope`` (cos, sin) ``[S, hd/2]``.

        With ``sequence_parallel`` (the layout of :meth:`WanModel.forward`), ``x`` and ``rope`` are this
        rank's shard of the sequence."""
        # Inside the block so that an FSDP unit wrapping it unshards once around the recompute,
        # and a compiled block compiles the checkpoint with it (the partitioner honours the policy).
        return _checkpointing.run_checkpointed(
            self._forward, self.checkpointing, x, e0, context, rope, sequence_parallel
        )

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether backward recomputes anything (``checkpointing != "none"``)."""
        return self.checkpointing != "none"

    def _forward(
        self,
        x: torch.Tensor,
        e0: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        sequence_parallel: Any | None = None,
    ) -> torch.Tensor:
        # Modulation in fp32: six strided [B, 1, D] views, no copies. Slices, not `chunk`: the backward
        # of `chunk` concatenates the six gradients, and inductor computes each column sum straight into
        # its slice of the concatenated buffer, where its mix-order reduction drops the write
        # (pytorch/pytorch#193061). The slices' gradients are summed into a fresh buffer instead.
        mod = self.modulation.float() + e0.float()
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (mod[:, i:i + 1] for i in range(6))
        # Residual updates are plain tensor ops (autocast leaves them alone), added in fp32 and kept in the
        # stream's dtype: fp32 from block 0 on, as in Wan (`residual_fp32`, where the casts are no-ops), or
        # the patch embedding's compute dtype, rounded once per update, as diffusers' block does.
        # The modulated norms write the stream's dtype (fp32 stream: the promoted dtype, as before).
        y = self.self_attn(self.norm1(x, scale_sa, shift_sa, out_dtype=x.dtype), rope=rope,
                           sequence_parallel=sequence_parallel)
        x = (x.float() + y * gate_sa).to(x.dtype)
        x = (x.float() + self.cross_attn(self.norm3(x), context=context)).to(x.dtype)
        x = (x.float() + self.ffn(self.norm2(x, scale_ff, shift_ff, out_dtype=x.dtype)) * gate_ff).to(x.dtype)
        return x


class WanHead(nn.Module):
    """Output head: AdaLN with a ``[1, 2, D]`` modulation of the time embedding, then a fp32 Linear."""

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        self.dim = config.dim
        self.norm = AdaLayerNorm(config.dim, config.eps)
        self.head = nn.Linear(config.dim, config.out_dim * math.prod(config.patch_size))
        self.modulation = nn.Parameter(torch.empty(1, 2, config.dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.modulation, std=self.dim**-0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation.float() + e.float().unsqueeze(1)).chunk(2, dim=1)
        y = self.norm(x, scale, shift)
        # The reference runs the projection in fp32; it is tiny (out = 64 for Wan) and its output
        # is the velocity the loss sees.
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = None if self.head.bias is None else self.head.bias.float()
            return F.linear(y.float(), self.head.weight.float(), bias)


def _mark_block_inputs_dynamic(block: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook of a compiled block: batch and sequence sizes of the tensors it is called
    with are symbolic from the first graph on (tokens ``[B, S, D]``: B and S; ``e0``, ``context``: B;
    RoPE ``(cos, sin)``: S)."""
    if len(args) < 4:
        return
    x, e0, context, rope = args[:4]
    mark_dynamic(x, 0, 1)
    mark_dynamic(e0, 0)
    mark_dynamic(context, 0)
    for angles in rope:
        mark_dynamic(angles, 0)


class WanModel(nn.Module):
    """Wan 2.1 text-to-video DiT.

    Args:
        config: a :class:`WanConfig`, a preset name from :data:`WAN_CONFIGS` or a dict of fields.

    Example::

        model = WanModel("tiny")
        x = torch.randn(2, 16, 5, 8, 12)  # [B, C, F, H, W] latents
        v = model(x, torch.tensor([10.0, 900.0]), torch.randn(2, 16, 32))  # same shape as x
    """

    def __init__(self, config: str | WanConfig | Mapping[str, Any]) -> None:
        super().__init__()
        config = from_name_or_config(config)
        self.config = config
        dim = config.dim
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv3d(
            config.in_dim, dim, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.text_embedding = nn.Sequential(
            nn.Linear(config.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(config.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList(WanAttentionBlock(config) for _ in range(config.num_layers))
        self.head = WanHead(config)
        self._blocks_compiled = False
        self.init_weights()

    def init_weights(self) -> None:
        """Wan's initialisation: xavier-uniform Linears with zero bias, N(0, 0.02) text/time
        embeddings, xavier patch embedding (as a [D, C·P] matrix), zero output projection.

        Call it again after materialising a meta-device model if Wan's init matters (FSDP's
        materialisation runs each module's own ``reset_parameters``).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        weight = self.patch_embedding.weight
        # xavier on the flattened view: fan_in = C·P, fan_out = D (the conv's own fans count P twice).
        bound = math.sqrt(6.0 / (weight.shape[0] + weight[0].numel()))
        nn.init.uniform_(weight, -bound, bound)
        nn.init.zeros_(self.patch_embedding.bias)
        for module in (*self.text_embedding, *self.time_embedding):
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(self.head.head.weight)
        nn.init.zeros_(self.head.head.bias)
        for block in self.blocks:
            block.reset_parameters()
        self.head.reset_parameters()

    def set_gradient_checkpointing(self, mode: bool | str = True) -> None:
        """Choose what backward recomputes in every block: ``"none"``, ``"selective"`` or ``"full"``
        (see :class:`WanAttentionBlock`); ``True`` means ``"full"``, ``False`` ``"none"``."""
        # Through self.modules() (apply_checkpointing): a wrapper around a block (FSDP1's FullyShardedDataParallel)
        # would take the attribute itself and leave the block it wraps unchanged.
        _checkpointing.apply_checkpointing(self, mode, lambda module: isinstance(module, WanAttentionBlock))

    def set_attention_backend(self, backend: str) -> None:
        """Run self- and cross-attention of every block through ``backend`` (``"sdpa"`` or ``"fa4"``, see
        :mod:`lightning_adaptiveload.ops.attention`). Cheap: it sets one attribute per attention module."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"`WanModel.set_attention_backend({backend!r})` is not valid. Expected one of {list(ATTENTION_BACKENDS)}."
            )
        for module in self.modules():
            if isinstance(module, WanSelfAttention):
                module.backend = backend

    def compile_blocks(self, **kwargs: Any) -> None:
        """Compile every transformer block in place (regional compilation, as ``torch.compile``
        recommends for repeated blocks: one compiled graph serves all blocks of the same code).

        Blocks see only tensors (RoPE angles are computed outside them). Batch and sequence sizes are
        marked dynamic from the first graph on, so the buckets of a corpus share a graph (B = 1 and
        each activation-checkpointing mode get their own), and the recompile limit is raised to
        :data:`~lightning_adaptiveload.models.compiling.RECOMPILE_LIMIT` with hitting it an error,
        never a silent fall-back to eager (:func:`~lightning_adaptiveload.models.compiling.configure_recompiles`).
        ``kwargs`` go to :meth:`torch.nn.Module.compile` (e.g. ``mode``, ``backend``, ``options``);
        with inductor and no ``mode``, the options of
        :data:`~lightning_adaptiveload.models.compiling.BLOCK_INDUCTOR_OPTIONS` are added unless
        ``options`` sets them (they avoid an inductor bug that returns wrong gradients at B = 1 on GPUs).
        """
        compile_repeated(self.blocks, _mark_block_inputs_dynamic, **kwargs)
        self._blocks_compiled = True

    def num_parameters(self) -> int:
        """Total number of parameters (works on the meta device)."""
        return sum(p.numel() for p in self.parameters())

    def token_grid(self, latent_shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """Latent (F, H, W) → token grid (f, h, w); raises if the patch does not divide it."""
        return _token_grid(latent_shape, self.patch_size)

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        context: torch.Tensor,
        sequence_parallel: Any | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity.

        Args:
            x: noisy latents ``[B, in_dim, F, H, W]``; the patch must divide (F, H, W).
            t: timesteps ``[B]`` in [0, 1000] (a scalar is broadcast).
            context: text features ``[B, L, text_dim]`` with ``L <= text_len`` (zero-padded to
                ``text_len`` as Wan does; the padding passes through the text MLP's biases).
            sequence_parallel: run sequence-parallel over a group of ranks that all call this with the
                same inputs (e.g. :class:`lightning_adaptiveload.parallel.ulysses.UlyssesGroup`). A
                duck type: ``sequence_parallel.layout(S)`` returns an object with ``shard(x, dim)``
                (this rank's tokens of a replicated tensor), ``gather(x, dim)`` (all ranks' shards,
                concatenated), ``seq_to_heads(x)`` (``[B, S_local, H, d]`` → ``[B, S, H/k, d]``) and
                ``heads_to_seq(x)`` (its inverse). Tokens and RoPE angles are sharded after the
                patch embedding, self-attention exchanges through the last two, cross-attention
                and the FFN run on the local tokens, and the head's output is gathered.

        Returns:
            ``[B, out_dim, F, H, W]`` in fp32 (the full prediction on every rank of a group).
        """
        cfg = self.config
        if x.dim() != 5 or x.shape[1] != cfg.in_dim:
            raise ValueError(f"`x` has shape {tuple(x.shape)}. Expected [B, {cfg.in_dim}, F, H, W].")
        b = x.shape[0]
        grid = self.token_grid(tuple(x.shape[2:]))
        t = t.reshape(-1).expand(b) if t.numel() == 1 else t
        if t.shape != (b,):
            raise ValueError(f"`t` has shape {tuple(t.shape)}. Expected [{b}] (one timestep per sample).")
        if (
            context.dim() != 3
            or context.shape[0] != b
            or context.shape[2] != cfg.text_dim
            or context.shape[1] > cfg.text_len
        ):
            raise ValueError(
                f"`context` has shape {tuple(context.shape)}. Expected [{b}, L <= {cfg.text_len}, {cfg.text_dim}]."
            )
        if context.shape[1] < cfg.text_len:
            context = F.pad(context, (0, 0, 0, cfg.text_len - context.shape[1]))

        # [B, S, D] in fp32: the residual stream is fp32 from the first block's update on (as in Wan), so
        # upcasting the embedding (exact) changes no value and gives every block inputs of one dtype; else
        # block 0 sees the bf16 of autocast and the rest fp32, and compiled blocks compile both. Without
        # `residual_fp32` the stream stays in the embedding's dtype (bf16 under autocast) throughout.
        tokens = self.patch_embedding(x).flatten(2).transpose(1, 2)
        if cfg.residual_fp32:
            tokens = tokens.float()

        # Time embedding and its projection in fp32 (the reference asserts fp32 modulation).
        with torch.autocast(device_type=x.device.type, enabled=False):
            w = self.time_embedding[0].weight
            e = self.time_embedding(sinusoidal_embedding(t, cfg.freq_dim).to(w.dtype)).float()
            e0 = self.time_projection(e.to(w.dtype)).float().unflatten(1, (6, cfg.dim))

        context = self.text_embedding(context)
        rope = rope_angles(grid, cfg.head_dim, device=x.device)
        layout = None
        if sequence_parallel is not None:
            layout = sequence_parallel.layout(tokens.shape[1])
            tokens = layout.shard(tokens, 1)
            rope = (layout.shard(rope[0], 0), layout.shard(rope[1], 0))
        if self._blocks_compiled:
            # Every block must see the same kind of input, or blocks compile graphs of their own: the
            # first block's tokens would be a transposed view of the patch embedding (dynamo guards
            # on its base's strides) while later blocks get fresh tensors. Each block's pre-hook
            # marks the sizes of its inputs dynamic (compile_blocks).
            tokens = tokens.contiguous()
        with whole_block_graphs() if self._blocks_compiled else contextlib.nullcontext():
            for block in self.blocks:
                tokens = block(tokens, e0, context, rope, layout)
        out = self.head(tokens, e)
        if layout is not None:
            out = layout.gather(out, 1)
        return self.unpatchify(out, grid)

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``[B, S, P·C]`` (per-token layout (pt, ph, pw, C)) → ``[B, C, f·pt, h·ph, w·pw]``."""
        b, c = x.shape[0], self.config.out_dim
        f, h, w = grid
        pt, ph, pw = self.patch_size
        x = x.reshape(b, f, h, w, pt, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, c, f * pt, h * ph, w * pw)
