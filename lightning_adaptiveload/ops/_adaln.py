"""AdaLN: ``y = LayerNorm(x) * (1 + scale) + shift``.

``adaln_ref`` is the definition (pure PyTorch, statistics and modulation in fp32, x̂ never rounded
to a low precision before modulation). The fused CUDA op (``csrc/``) computes the same function.

Two ways in, one pair of kernels. Eager calls go straight to the extension's ``adaln``, whose
autograd node is C++ (its backward runs on the autograd engine's thread without the GIL, as a
built-in op's does); checks and dtype decisions are cached per input signature, so a call costs a
dictionary lookup, a few attribute reads and the launch. Under ``torch.compile`` the same kernels
run as ``torch.library`` custom ops with fake kernels and a registered autograd formula, which the
compiler can trace (it cannot see into a pybind function).
"""

from __future__ import annotations

import dataclasses

import torch

from lightning_adaptiveload.ops._build import build_extension


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
# The kernels keep a row in registers: up to ADALN_MAX_D_ANY features on any layout, up to
# ADALN_MAX_D when D is a multiple of 16 bytes (csrc/adaln.h states the same numbers; the loaded
# extension is checked against them).
ADALN_MAX_D_ANY = 4096
ADALN_MAX_D = 6144
_SOURCES = ("adaln.cu", "adaln_binding.cpp")
_HEADERS = ("adaln.h",)

_extension = None
_build_error: str | None = None
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class AdaLNLaunchOptions:
    """Launch choices of the fused kernels; the defaults are the measured rules every call uses.

    Benchmarks pass other values to compare launch plans; results do not depend on them beyond
    fp32 summation order (clusters change the order in which the backward adds column partials).

    Args:
        pdl: programmatic dependent launch on sm_90+ (each kernel's launch overlaps the end of the
            one before it).
        cluster: thread-block clusters of the backward: ``None`` = the rule (clusters of 8 for strips
            of at most 16 rows), ``1`` = never, ``2``, ``4`` or ``8`` = always that size.
        fwd_features: features a thread of the streamed forward: ``None`` = the rule, 16 or 24.
        bwd_features: features a thread of the streamed backward: ``None`` = the rule, 16 or 24.

    Example::

        adaln(x, scale, shift, options=AdaLNLaunchOptions(cluster=1))
    """

    pdl: bool = True
    cluster: int | None = None
    fwd_features: int | None = None
    bwd_features: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pdl, bool):
            raise TypeError(f"`AdaLNLaunchOptions(pdl={self.pdl!r})` is not valid. Expected a bool.")
        if self.cluster not in (None, 1, 2, 4, 8):
            raise ValueError(f"`AdaLNLaunchOptions(cluster={self.cluster!r})` is not valid. Expected None, 1, 2, 4 or 8.")
        for name in ("fwd_features", "bwd_features"):
            value = getattr(self, name)
            if value not in (None, 16, 24):
                raise ValueError(f"`AdaLNLaunchOptions({name}={value!r})` is not valid. Expected None, 16 or 24.")

    def as_args(self) -> tuple[int, int, int, int]:
        """The options as the extension takes them: ``(pdl, cluster, fwd_features, bwd_features)``, 0 = rule."""
        return (int(self.pdl), self.cluster or 0, self.fwd_features or 0, self.bwd_features or 0)


_DEFAULT_LAUNCH = AdaLNLaunchOptions().as_args()


def _load_extension():
    """Builds (once per process; the build is cached on disk by sources and GPU arch) and imports the
    extension for the current CUDA device; ``None`` if that fails (``_build_error`` says why)."""
    global _extension, _build_error
    if _extension is not None or _build_error is not None:
        return _extension
    try:
        ext = build_extension("adaptiveload_adaln", _SOURCES, _HEADERS, torch.device("cuda", torch.cuda.current_device()))
        if (ext.max_d_any, ext.max_d) != (ADALN_MAX_D_ANY, ADALN_MAX_D):
            raise RuntimeError(
                f"csrc/adaln.h states D limits ({ext.max_d_any}, {ext.max_d}), the op ({ADALN_MAX_D_ANY}, {ADALN_MAX_D})"
            )
        _extension = ext
    except Exception as err:  # noqa: BLE001 - any build failure means "use the reference"
        _build_error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        _extension = None
    return _extension


def load_adaln_extension(device: torch.device | str | int | None = None) -> bool:
    """Builds the fused kernels for ``device`` (default: the current CUDA device) unless already
    built in this process, and returns whether they can run. :func:`adaln_build_error` says why not."""
    if device is None:
        return _load_extension() is not None
    with torch.cuda.device(device):
        return _load_extension() is not None


def adaln_build_error() -> str | None:
    """Why the fused kernels did not build or load (``None`` if they did, or if no build was tried)."""
    return _build_error


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
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"adaln: `{name}` has dtype {got}; expected a floating tensor (float16/32/64, bfloat16).")
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
    """Why the fused op cannot run these inputs (``None`` when it can). What the kernels compile
    (dtypes, D) is decided before the device and the build, so it holds on any machine."""
    if x.dtype not in _KERNEL_DTYPES:
        return f"`x` has dtype {x.dtype} (compiled: float32, bfloat16, float16)"
    mod = torch.promote_types(scale.dtype, shift.dtype)
    if mod not in (torch.float32, x.dtype):
        return f"modulation dtype {mod} with x {x.dtype} (compiled: float32 or x's dtype)"
    if out_dtype not in (torch.promote_types(x.dtype, mod), torch.bfloat16):
        return f"out_dtype {out_dtype} (compiled: the promoted dtype or bfloat16)"
    D = x.shape[-1]
    vec = 16 // x.element_size()
    if D > ADALN_MAX_D or (D > ADALN_MAX_D_ANY and D % vec != 0):
        return (
            f"D={D} (the fused kernel holds rows of up to {ADALN_MAX_D_ANY} features, "
            f"{ADALN_MAX_D} when D % {vec} == 0 for {x.dtype})"
        )
    if x.device.type != "cuda":
        return f"`x` is on {x.device.type}, the fused kernel needs CUDA"
    if any(t.device != x.device for t in (scale, shift) + (() if weight is None else (weight,))):
        return "the inputs are on different devices"
    if not _extension_ready():
        return f"the CUDA extension did not build ({_build_error})"
    return None


def adaln_unsupported_reason(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> str | None:
    """Why :func:`adaln` would run the reference for these inputs instead of the fused kernel
    (``None`` when the fused kernel runs them). Builds the extension if that is the last question.

    Raises:
        ValueError, TypeError: for inputs :func:`adaln` rejects (as :func:`adaln` does).
    """
    _check_inputs(x, scale, shift, weight, bias, 1.0, out_dtype)
    return _unsupported_reason(x, scale, shift, weight, out_dtype or _out_dtype(x, scale, shift))


def _wide_rows(t: torch.Tensor) -> bool:
    # Rows wider than ADALN_MAX_D_ANY run only on the 16-byte vector paths (csrc/adaln.h).
    vec = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % vec == 0 for s in t.stride()[:-1])


# ---- torch.compile path: torch.library custom ops ---------------------------------------------------


@torch.library.custom_op("adaptiveload::adaln_fwd", mutates_args=())
def adaln_fwd(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused forward on 3-D inputs: ``(y, mean, rstd)`` with fp32 ``[B*N]`` statistics; ``launch``
    is :meth:`AdaLNLaunchOptions.as_args`."""
    return _load_extension().fwd(x, scale, shift, weight, bias, eps, out_dtype, launch)


@adaln_fwd.register_fake
def _(x, scale, shift, weight, bias, eps, out_dtype, launch):
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
    launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: ``(dx, dscale, dshift, dweight, dbias)``; ``dshift`` is empty for per-token
    modulation (it equals ``dy``) and ``dweight``/``dbias`` are empty without an affine."""
    return _load_extension().bwd(dy, x, scale, weight, bias, mean, rstd, launch)


@adaln_bwd.register_fake
def _(dy, x, scale, weight, bias, mean, rstd, launch):
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
    x, scale, shift, weight, bias, _eps, _out_dtype, launch = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, scale, weight, bias, mean, rstd)
    ctx.shift_dtype = shift.dtype
    ctx.launch = launch
    ctx.mark_non_differentiable(mean, rstd)
    # mean/rstd never get a gradient; without this autograd would fill two [B * N] zero tensors
    # for them on every backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:  # only mean/rstd reached the loss: they are constants of x, scale and shift
        return (None,) * 8
    x, scale, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dscale, dshift, dweight, dbias = adaln_bwd(dy, x, scale, weight, bias, mean, rstd, ctx.launch)
    # As the extension's own autograd node (csrc/adaln_binding.cpp, AdalnFunction) does.
    if scale.shape[1] != 1:
        dshift = dy.to(ctx.shift_dtype)  # per token, d(shift) is the output gradient itself
    if weight is None:
        return dx, dscale, dshift, None, None, None, None, None
    return dx, dscale, dshift, dweight.to(weight.dtype), dbias.to(bias.dtype), None, None, None


adaln_fwd.register_autograd(_backward, setup_context=_setup_context)


def _adaln_traced(x, scale, shift, weight, bias, eps, out_dtype, launch):
    """The op as torch.compile traces it: checks in the graph's guards, kernels as custom ops."""
    _check_inputs(x, scale, shift, weight, bias, eps, out_dtype)
    dtype = out_dtype or _out_dtype(x, scale, shift)
    reason = _unsupported_reason(x, scale, shift, weight, dtype)
    if reason is not None:
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
    rows = N if N > 1 and N in (scale.shape[1], shift.shape[1]) else 1
    scale = scale.expand(B, rows, D)
    shift = shift.expand(B, rows, D)
    if scale.stride(-1) != 1:
        scale = scale.contiguous()
    if shift.stride(-1) != 1:
        shift = shift.contiguous()
    if D > ADALN_MAX_D_ANY:
        # Fresh contiguous copies are 16-byte aligned; views traced here keep their strides.
        x, scale, shift = x.contiguous(), scale.contiguous(), shift.contiguous()
    if weight is not None:
        weight, bias = weight.float(), bias.float()
    return adaln_fwd(x, scale, shift, weight, bias, float(eps), dtype, list(launch))[0]


# ---- eager path: the extension's C++ autograd op, with a cached plan ----------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What an input signature needs before the launch, decided once (``_make_plan``)."""

    reason: str | None  # why the reference runs instead (None: the fused kernel runs)
    out_dtype: torch.dtype
    mod_dtype: torch.dtype
    cast_scale: bool
    cast_shift: bool
    shape: tuple[int, int, int]  # [B, rows, D] the modulation is viewed as
    view_scale: bool  # unsqueeze/expand needed to reach `shape`
    view_shift: bool
    wide: bool  # D > ADALN_MAX_D_ANY: rows must be 16-byte aligned
    cast_affine: bool


# One entry per input signature (shapes, dtypes, devices, eps, out_dtype): as many as a run has
# buckets, times the call sites that differ. Cleared, not evicted, if it ever grows past the bound.
_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _make_plan(x, scale, shift, weight, bias, eps, out_dtype) -> _Plan:
    _check_inputs(x, scale, shift, weight, bias, eps, out_dtype)
    dtype = out_dtype or _out_dtype(x, scale, shift)
    mod = torch.promote_types(scale.dtype, shift.dtype)
    B, N, D = x.shape

    def rows_of(t):
        return 1 if t.dim() == 2 else t.shape[1]

    rows = N if N > 1 and N in (rows_of(scale), rows_of(shift)) else 1
    shape = (B, rows, D)
    return _Plan(
        reason=_unsupported_reason(x, scale, shift, weight, dtype),
        out_dtype=dtype,
        mod_dtype=mod,
        cast_scale=scale.dtype != mod,
        cast_shift=shift.dtype != mod,
        shape=shape,
        view_scale=tuple(scale.shape) != shape,
        view_shift=tuple(shift.shape) != shape,
        wide=D > ADALN_MAX_D_ANY,
        cast_affine=weight is not None and (weight.dtype != torch.float32 or bias.dtype != torch.float32),
    )


def _modulation(t: torch.Tensor, plan: _Plan, cast: bool, view: bool) -> torch.Tensor:
    if cast:
        t = t.to(plan.mod_dtype)
    if view:
        # One modulation per sample or per token for both tensors; expands are views (stride 0).
        t = (t.unsqueeze(1) if t.dim() == 2 else t).expand(plan.shape)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t


def adaln(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    *,
    options: AdaLNLaunchOptions | None = None,
) -> torch.Tensor:
    """AdaLN ``LayerNorm(x) * (1 + scale) + shift``: the fused CUDA op where it applies, else ``adaln_ref``.

    Same arguments and result as :func:`adaln_ref`. The fused op runs for CUDA inputs with
    modulation in fp32 or x's dtype, an output in the promoted dtype or bf16 and ``D`` up to
    ``ADALN_MAX_D_ANY`` (``ADALN_MAX_D`` when D is a multiple of 16 bytes); anything else runs the
    reference and says why once (:func:`adaln_unsupported_reason`). Strided modulation views (Wan's
    ``e.chunk(6, dim=1)``) are read in place, without a copy. ``options`` overrides the kernels'
    launch rules (benchmarks); it never changes the function computed.
    """
    launch = _DEFAULT_LAUNCH if options is None else options.as_args()
    if torch.compiler.is_compiling():
        return _adaln_traced(x, scale, shift, weight, bias, eps, out_dtype, launch)
    try:
        key = (
            x.shape, x.dtype, x.device, scale.shape, scale.dtype, scale.device, shift.shape, shift.dtype,
            shift.device, None if weight is None else (weight.shape, weight.dtype, weight.device),
            None if bias is None else (bias.shape, bias.dtype), eps, out_dtype,
        )  # fmt: skip
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable eps: let the checks say what
        key, plan = None, None
    if plan is None:
        plan = _make_plan(x, scale, shift, weight, bias, eps, out_dtype)
        if key is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
    if plan.reason is not None:
        _warn_once(plan.reason)
        return adaln_ref(x, scale, shift, weight, bias, eps, out_dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    scale = _modulation(scale, plan, plan.cast_scale, plan.view_scale)
    shift = _modulation(shift, plan, plan.cast_shift, plan.view_shift)
    if plan.wide:
        x, scale, shift = (t if _wide_rows(t) else t.contiguous() for t in (x, scale, shift))
    if plan.cast_affine:
        weight, bias = weight.float(), bias.float()
    return _extension.adaln(x, scale, shift, weight, bias, eps, plan.out_dtype, launch)
