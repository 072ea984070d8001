"""AdaLN: ``y = LayerNorm(x) * (1 + scale) + shift``.

``adaln_ref`` is the definition (pure PyTorch, statistics and modulation in fp32, x̂ never rounded
to a low precision before modulation). The fused CUDA op must compute the same function.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
from pathlib import Path

import torch


def _out_dtype(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.dtype:
    # What eager PyTorch produces for LN(x.float()).to(x) * (1 + scale) + shift without autocast.
    return torch.promote_types(torch.promote_types(x.dtype, scale.dtype), shift.dtype)


def adaln_ref(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference AdaLN.

    Args:
        x: ``[B, N, D]`` activations (bf16, fp16 or fp32).
        scale, shift: ``[B, D]``, ``[B, 1, D]`` (per sample) or ``[B, N, D]`` (per token).
        weight, bias: optional LayerNorm affine ``[D]``.
        eps: LayerNorm epsilon.
        out_dtype: output dtype; defaults to the promoted dtype of ``x``, ``scale`` and ``shift``.
    """
    if x.dim() != 3:
        raise ValueError(f"adaln: `x` must be [B, N, D], got shape {tuple(x.shape)}")
    if scale.dim() == 2:
        scale = scale.unsqueeze(1)
    if shift.dim() == 2:
        shift = shift.unsqueeze(1)
    dtype = out_dtype or _out_dtype(x, scale, shift)
    xf = x.float()
    xhat = torch.nn.functional.layer_norm(
        xf,
        (x.shape[-1],),
        None if weight is None else weight.float(),
        None if bias is None else bias.float(),
        eps,
    )
    return (xhat * (1 + scale.float()) + shift.float()).to(dtype)


# ---------------------------------------------------------------------------------------------------
# Fused CUDA op (csrc/adaln.cu), built on first CUDA use.

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernels keep a row in registers: up to 4096 features on any layout, up to 6144 when rows are
# 16-byte aligned (csrc/adaln.h, ADALN_MAX_D).
_MAX_D_ANY = 4096
_MAX_D_ALIGNED = 6144
_SOURCES = ("adaln.h", "adaln.cu", "adaln_binding.cpp")

_extension = None
_build_error: str | None = None
_warned: set[str] = set()


def _csrc_dir() -> Path:
    try:
        return Path(str(importlib.resources.files("lightning_adaptiveload.csrc")))
    except ModuleNotFoundError:
        # A source checkout on PYTHONPATH without an install: csrc/ sits beside the package.
        return Path(__file__).resolve().parents[2] / "csrc"


def _load_extension():
    """Builds (once per source hash and GPU arch) and imports the extension; ``None`` if it fails."""
    global _extension, _build_error
    if _extension is not None or _build_error is not None:
        return _extension
    try:
        from torch.utils.cpp_extension import load

        src = _csrc_dir()
        major, minor = torch.cuda.get_device_capability()
        digest = hashlib.sha256(f"sm_{major}{minor};torch {torch.__version__}".encode())
        for name in _SOURCES:
            digest.update((src / name).read_bytes())
        key = digest.hexdigest()[:16]
        # torch reads the target arch from this variable; build for the device we run on only.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
        _extension = load(
            name=f"adaptiveload_adaln_{key}",
            sources=[str(src / "adaln.cu"), str(src / "adaln_binding.cpp")],
            extra_include_paths=[str(src)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-std=c++17"],
            verbose=False,
        )
    except Exception as err:  # noqa: BLE001 - any build failure means "use the reference"
        _build_error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        _extension = None
    return _extension


@torch.compiler.assume_constant_result
def _extension_ready() -> bool:
    # Traced as a constant by torch.compile, so the build happens eagerly, never inside a graph.
    return _load_extension() is not None


def _warn_once(reason: str) -> None:
    if reason in _warned or torch.compiler.is_compiling():
        return
    _warned.add(reason)
    from lightning.fabric.utilities.rank_zero import rank_zero_warn

    rank_zero_warn(f"adaln: using the PyTorch reference instead of the fused CUDA kernel: {reason}")


def _check_inputs(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype | None,
) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"adaln: `x` must be a [B, N, D] tensor, got {shape}. Reshape it to 3-D first.")
    B, N, D = x.shape
    for name, t in (("x", x), ("scale", scale), ("shift", shift)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"adaln: `{name}` has dtype {t.dtype}; expected a floating dtype (float16/32/64, bfloat16).")
    for name, t in (("scale", scale), ("shift", shift)):
        ok = (t.dim() == 2 and t.shape[0] in (1, B) and t.shape[1] == D) or (
            t.dim() == 3 and t.shape[0] in (1, B) and t.shape[1] in (1, N) and t.shape[2] == D
        )
        if not ok:
            raise ValueError(
                f"adaln: `{name}` has shape {tuple(t.shape)}; expected [B, D], [B, 1, D] or [B, N, D] "
                f"with B={B}, N={N}, D={D} (B may be 1 to broadcast)."
            )
    if (weight is None) != (bias is None):
        raise ValueError("adaln: pass both `weight` and `bias` (the LayerNorm affine) or neither.")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != D or t.dtype not in _FLOAT_DTYPES):
            raise ValueError(f"adaln: `{name}` must be a floating [D={D}] tensor, got {t.dtype} {tuple(t.shape)}.")
    if not eps > 0:
        raise ValueError(f"adaln: `eps={eps!r}` is not valid. Expected a positive float.")
    if out_dtype is not None and out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"adaln: `out_dtype={out_dtype!r}` is not valid. Expected a floating dtype.")


def _unsupported_reason(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, weight: torch.Tensor | None, out_dtype: torch.dtype
) -> str | None:
    """Why the fused op cannot run these inputs (``None`` when it can)."""
    if x.device.type != "cuda":
        return f"`x` is on {x.device.type}, the fused kernel needs CUDA"
    if any(t.device != x.device for t in (scale, shift) + (() if weight is None else (weight,))):
        return "the inputs are on different devices"
    if x.dtype not in _KERNEL_DTYPES:
        return f"`x` has dtype {x.dtype} (compiled: float32, bfloat16, float16)"
    mod = torch.promote_types(scale.dtype, shift.dtype)
    if mod not in (torch.float32, x.dtype):
        return f"modulation dtype {mod} with x {x.dtype} (compiled: float32 or x's dtype)"
    if out_dtype not in (torch.promote_types(x.dtype, mod), torch.bfloat16):
        return f"out_dtype {out_dtype} (compiled: the promoted dtype or bfloat16)"
    D = x.shape[-1]
    vec = 16 // x.element_size()
    if D > _MAX_D_ALIGNED or (D > _MAX_D_ANY and D % vec != 0):
        return f"D={D} (the fused kernel holds rows of up to {_MAX_D_ANY} features, {_MAX_D_ALIGNED} when D % {vec} == 0)"
    if not _extension_ready():
        return f"the CUDA extension did not build ({_build_error})"
    return None


@torch.library.custom_op("adaptiveload::adaln_fwd", mutates_args=())
def adaln_fwd(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused forward on 3-D inputs: ``(y, mean, rstd)`` with fp32 ``[B*N]`` statistics."""
    return _load_extension().fwd(x, scale, shift, weight, bias, eps, out_dtype)


@adaln_fwd.register_fake
def _(x, scale, shift, weight, bias, eps, out_dtype):
    B, N, D = x.shape
    torch._check(scale.dim() == 3 and shift.dim() == 3)
    torch._check(scale.shape[0] == B and scale.shape[2] == D)
    torch._check(shift.shape[0] == B and shift.shape[2] == D)
    torch._check(scale.dtype == shift.dtype)
    y = x.new_empty((B, N, D), dtype=out_dtype)
    stats = x.new_empty((B * N,), dtype=torch.float32)
    return y, stats, torch.empty_like(stats)


@torch.library.custom_op("adaptiveload::adaln_bwd", mutates_args=())
def adaln_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: ``(dx, dscale, dshift, dweight, dbias)``; ``dshift`` is empty for per-token
    modulation (it equals ``dy``) and ``dweight``/``dbias`` are empty without an affine."""
    return _load_extension().bwd(dy, x, scale, weight, bias, mean, rstd)


@adaln_bwd.register_fake
def _(dy, x, scale, weight, bias, mean, rstd):
    B, N, D = x.shape
    torch._check(dy.shape == x.shape)
    torch._check(scale.dim() == 3 and scale.shape[0] == B and scale.shape[2] == D)
    torch._check(mean.numel() == B * N and rstd.numel() == B * N)
    per_token = scale.shape[1] != 1
    dscale = scale.new_empty((B, N if per_token else 1, D))
    dshift = scale.new_empty((0,)) if per_token else scale.new_empty((B, 1, D))
    n_aff = D if weight is not None else 0
    dweight = x.new_empty((n_aff,), dtype=torch.float32)
    return x.new_empty((B, N, D)), dscale, dshift, dweight, torch.empty_like(dweight)


def _setup_context(ctx, inputs, output) -> None:
    x, scale, shift, weight, bias, _eps, _out_dtype = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, scale, weight, bias, mean, rstd)
    ctx.shift_dtype = shift.dtype
    ctx.mark_non_differentiable(mean, rstd)
    # mean/rstd never get a gradient; without this autograd would fill two [B * N] zero tensors
    # for them on every backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:  # only mean/rstd reached the loss: they are constants of x, scale and shift
        return None, None, None, None, None, None, None
    x, scale, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dscale, dshift, dweight, dbias = adaln_bwd(dy, x, scale, weight, bias, mean, rstd)
    if scale.shape[1] != 1:
        dshift = dy.to(ctx.shift_dtype)  # per token, d(shift) is the output gradient itself
    if weight is None:
        return dx, dscale, dshift, None, None, None, None
    return dx, dscale, dshift, dweight.to(weight.dtype), dbias.to(bias.dtype), None, None


adaln_fwd.register_autograd(_backward, setup_context=_setup_context)


def adaln(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """AdaLN ``LayerNorm(x) * (1 + scale) + shift``: the fused CUDA op where it applies, else ``adaln_ref``.

    Same arguments and result as :func:`adaln_ref`. The fused op runs for CUDA inputs with
    modulation in fp32 or x's dtype, an output in the promoted dtype or bf16 and ``D`` up to 4096
    (6144 for 16-byte-aligned rows); anything else runs the reference and says why once. Strided
    modulation views (Wan's ``e.chunk(6, dim=1)``) are read in place, without a copy.
    """
    _check_inputs(x, scale, shift, weight, bias, eps, out_dtype)
    dtype = out_dtype or _out_dtype(x, scale, shift)
    reason = _unsupported_reason(x, scale, shift, weight, dtype)
    if reason is not None:
        _warn_once(reason)
        return adaln_ref(x, scale, shift, weight, bias, eps, out_dtype)
    B, N, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    mod = torch.promote_types(scale.dtype, shift.dtype)
    scale, shift = scale.to(mod), shift.to(mod)
    if scale.dim() == 2:
        scale = scale.unsqueeze(1)
    if shift.dim() == 2:
        shift = shift.unsqueeze(1)
    # One modulation per sample or per token for both tensors; expands are views (stride 0).
    rows = N if N > 1 and N in (scale.shape[1], shift.shape[1]) else 1
    scale = scale.expand(B, rows, D)
    shift = shift.expand(B, rows, D)
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    if shift.stride(-1) != 1:
        shift = shift.contiguous()
    if weight is not None:
        weight, bias = weight.float(), bias.float()
    return adaln_fwd(x, scale, shift, weight, bias, float(eps), dtype)[0]
