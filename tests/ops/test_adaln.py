"""AdaLN: the public op, its fallback, the custom-op plumbing and (on a GPU) the fused kernel."""

from __future__ import annotations

import importlib
import os
import re
import types
import warnings
from pathlib import Path

import pytest
import torch

import lightning_adaptiveload.ops as public
from lightning_adaptiveload.ops import (
    ADALN_MAX_D,
    ADALN_MAX_D_ANY,
    AdaLNLaunchOptions,
    adaln,
    adaln_ref,
    adaln_unsupported_reason,
)
from lightning_adaptiveload.ops import _adaln as ops  # internals: custom ops, caches, the extension slot

_ROOT = Path(__file__).resolve().parents[2]
_LAUNCH = list(AdaLNLaunchOptions().as_args())


def _ref64(x, scale, shift, weight=None, bias=None, eps=1e-6):
    """adaln_ref in float64 (the precision every check compares against)."""
    d = lambda t: None if t is None else t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    return adaln_ref(d(x), d(scale), d(shift), d(weight), d(bias), eps, torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# CPU: public API, errors, fallback.


def test_cpu_falls_back_to_reference_and_warns_once():
    ops._warned.clear()
    x, s, h = torch.randn(2, 5, 16), torch.randn(2, 16), torch.randn(2, 1, 16)
    with pytest.warns(UserWarning, match="needs CUDA"):
        y = adaln(x, s, h)
    torch.testing.assert_close(y, adaln_ref(x, s, h), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adaln(x, s, h)  # the same reason is not repeated


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"x": torch.randn(4, 8)}, ValueError, "`x` must be a \\[B, N, D\\]"),
        ({"scale": torch.randn(2, 7)}, ValueError, "`scale` has shape \\(2, 7\\)"),
        ({"shift": torch.randn(3, 1, 8)}, ValueError, "`shift` has shape"),
        ({"scale": torch.randn(2, 4, 8)}, ValueError, "`scale`"),
        ({"x": torch.randint(0, 3, (2, 5, 8))}, TypeError, "`x` has dtype torch.int64"),
        ({"weight": torch.ones(8)}, ValueError, "both `weight` and `bias`"),
        ({"weight": torch.ones(7), "bias": torch.zeros(7)}, ValueError, "`weight` must be"),
        ({"eps": 0.0}, ValueError, "`eps=0.0`"),
        ({"out_dtype": torch.int32}, TypeError, "`out_dtype=torch.int32`"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, exc, match):
    args = {"x": torch.randn(2, 5, 8), "scale": torch.randn(2, 8), "shift": torch.randn(2, 8)}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        adaln(**args)


@pytest.mark.parametrize("mod_shape", [(2, 16), (2, 1, 16), (1, 1, 16), (2, 5, 16)])
def test_cpu_public_api_matches_float64(mod_shape):
    x = torch.randn(2, 5, 16)
    s, h = torch.randn(mod_shape), torch.randn(mod_shape)
    y = adaln(x, s, h)
    assert _rel(y, _ref64(x, s, h)) < 1e-6


def test_reference_output_dtype_is_promoted_unless_given():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    s, h = torch.randn(2, 8), torch.randn(2, 8)
    assert adaln(x, s, h).dtype == torch.float32
    assert adaln(x, s.bfloat16(), h.bfloat16()).dtype == torch.bfloat16
    assert adaln(x, s, h, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def _reason(D, dtype=torch.float32, device="meta"):
    x = torch.empty(1, 2, D, device=device, dtype=dtype)
    return adaln_unsupported_reason(x, x[:, :1], x[:, :1])


@pytest.mark.parametrize(
    ("D", "dtype", "too_wide"),
    [
        (ADALN_MAX_D_ANY, torch.float32, False),
        (ADALN_MAX_D_ANY + 1, torch.float32, True),  # wider than any layout and not a multiple of 4
        (ADALN_MAX_D_ANY + 4, torch.float32, False),  # 16-byte rows: the vector paths take it
        (ADALN_MAX_D_ANY + 4, torch.bfloat16, True),  # 8 bf16 values make 16 bytes
        (5120, torch.bfloat16, False),  # Wan 2.1 14B
        (ADALN_MAX_D, torch.float16, False),
        (ADALN_MAX_D + 8, torch.bfloat16, True),
    ],
)
def test_unsupported_reasons_name_the_d_limit(D, dtype, too_wide):
    # Decided before the device, so it holds without a GPU: rows the kernels cannot hold name D,
    # every other row width is refused here only for its device.
    reason = _reason(D, dtype)
    if too_wide:
        assert reason.startswith(f"D={D} ") and str(ADALN_MAX_D_ANY) in reason and str(ADALN_MAX_D) in reason
    else:
        assert reason == "`x` is on meta, the fused kernel needs CUDA"


def test_unsupported_reasons_name_dtype_and_device():
    assert "CUDA" in _reason(8, device="cpu")
    assert "float64" in _reason(8, dtype=torch.float64)
    x = torch.empty(1, 2, 8, dtype=torch.bfloat16, device="meta")
    half = x[:, :1].half()
    assert "modulation dtype" in adaln_unsupported_reason(x, half, half)
    assert "out_dtype torch.float16" in adaln_unsupported_reason(x, x[:, :1], x[:, :1], out_dtype=torch.float16)
    with pytest.raises(ValueError, match="`scale` has shape"):
        adaln_unsupported_reason(x, x[:, :, :4], x[:, :1])


def test_d_limits_are_the_kernels():
    # One pair of numbers in Python (ops/_adaln.py) and in the torch-free kernel header; the loaded
    # extension is checked against them as well.
    header = (_ROOT / "csrc" / "adaln.h").read_text()
    limits = dict(re.findall(r"constexpr int64_t (ADALN_MAX_D\w*) = (\d+);", header))
    assert limits == {"ADALN_MAX_D_ANY": str(ADALN_MAX_D_ANY), "ADALN_MAX_D": str(ADALN_MAX_D)}


def test_no_tuning_through_the_environment():
    # Launch choices come in as AdaLNLaunchOptions; neither the kernels nor the op read (or write)
    # environment variables.
    for path in [*(_ROOT / "csrc").glob("*.[ch]*"), *(_ROOT / "lightning_adaptiveload" / "ops").glob("*.py")]:
        text = path.read_text()
        assert "getenv" not in text and "os.environ" not in text, path


def test_ops_adaln_is_the_function_whatever_the_import():
    # One name, one thing: no module answers to `lightning_adaptiveload.ops.adaln` (importing one
    # would rebind the package attribute to it); the implementation module has its own name.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_adaptiveload.ops.adaln")
    importlib.import_module("lightning_adaptiveload.ops._adaln")
    assert public.adaln is adaln and callable(adaln) and not isinstance(adaln, types.ModuleType)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"pdl": 0}, "pdl=0"), ({"cluster": 3}, "cluster=3"), ({"fwd_features": 8}, "fwd_features=8"),
     ({"bwd_features": 32}, "bwd_features=32")],
)  # fmt: skip
def test_launch_options_name_a_bad_value(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        AdaLNLaunchOptions(**kwargs)


def test_launch_options_defaults_are_the_rules():
    assert AdaLNLaunchOptions().as_args() == (1, 0, 0, 0)
    assert AdaLNLaunchOptions(pdl=False, cluster=8, fwd_features=16, bwd_features=24).as_args() == (0, 8, 16, 24)


# ------------------------------------------------------------------------------------------------
# CPU: the custom-op plumbing (fake kernel, autograd, compile) with the extension emulated in PyTorch,
# so a CI machine without a GPU still checks everything but the CUDA code.


class _EmulatedOp(torch.autograd.Function):
    """What the extension's C++ autograd node (csrc/adaln_binding.cpp, AdalnFunction) does."""

    @staticmethod
    def forward(ctx, ext, x, scale, shift, weight, bias, eps, out_dtype, launch):
        y, mean, rstd = ext.fwd(x, scale, shift, weight, bias, eps, out_dtype, launch)
        ctx.save_for_backward(x, scale, weight, bias, mean, rstd)
        ctx.ext, ctx.launch, ctx.shift_dtype = ext, launch, shift.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, scale, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dscale, dshift, dw, db = ctx.ext.bwd(dy, x, scale, weight, bias, mean, rstd, ctx.launch)
        if scale.shape[1] != 1:
            dshift = dy.to(ctx.shift_dtype)
        if weight is None:
            dw = db = None
        return None, dx, dscale, dshift, dw, db, None, None, None


class _EmulatedExtension:
    def __init__(self):
        self.calls = []  # (entry point, launch options) of every call

    def adaln(self, x, scale, shift, weight, bias, eps, out_dtype, launch):
        return _EmulatedOp.apply(self, x, scale, shift, weight, bias, eps, out_dtype, launch)

    def fwd(self, x, scale, shift, weight, bias, eps, out_dtype, launch):
        self.calls.append(("fwd", tuple(launch)))
        xf = x.float()
        mean = xf.mean(-1)
        rstd = torch.rsqrt(xf.var(-1, unbiased=False) + eps)
        xh = (xf - mean[..., None]) * rstd[..., None]
        xa = xh if weight is None else xh * weight + bias
        y = xa * (1 + scale.float()) + shift.float()
        return y.to(out_dtype), mean.reshape(-1), rstd.reshape(-1)

    def bwd(self, dy, x, scale, weight, bias, mean, rstd, launch):
        self.calls.append(("bwd", tuple(launch)))
        B, N, D = x.shape
        g = dy.float()
        xh = (x.float() - mean.view(B, N, 1)) * rstd.view(B, N, 1)
        xa = xh if weight is None else xh * weight + bias
        gv = g * (1 + scale.float())
        per_token = scale.shape[1] != 1
        dscale = g * xa if per_token else (g * xa).sum(1, keepdim=True)
        dshift = scale.new_empty(0) if per_token else g.sum(1, keepdim=True).to(scale.dtype)
        dw = (gv * xh).sum((0, 1)) if weight is not None else x.new_empty(0, dtype=torch.float32)
        db = gv.sum((0, 1)) if weight is not None else x.new_empty(0, dtype=torch.float32)
        gx = gv if weight is None else gv * weight
        dx = rstd.view(B, N, 1) * (gx - gx.mean(-1, keepdim=True) - xh * (gx * xh).mean(-1, keepdim=True))
        return dx.to(x.dtype), dscale.to(scale.dtype), dshift, dw, db


@pytest.fixture
def emulated(monkeypatch):
    ext = _EmulatedExtension()
    monkeypatch.setattr(ops, "_extension", ext)
    monkeypatch.setattr(ops, "_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(ops, "_plans", {})  # plans made before the emulation said "needs CUDA"
    return ext


def _grads(fn, x, s, h, w, b):
    y = fn(x, s, h, w, b)
    gy = torch.randn_like(y)
    ts = [t for t in (x, s, h, w, b) if t is not None]
    return y, torch.autograd.grad(y, ts, gy)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_cpu_plumbing_gradients_match_reference(emulated, per_token, affine):
    torch.manual_seed(0)
    B, N, D = 2, 3, 8
    x = torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    e = torch.randn(B, 6, D, dtype=torch.float64, requires_grad=True)
    s, h = (torch.randn(B, N, D, dtype=torch.float64, requires_grad=True) for _ in range(2)) if per_token else (
        e.chunk(6, dim=1)[1],
        e.chunk(6, dim=1)[0],
    )
    w = torch.randn(D, dtype=torch.float64, requires_grad=True) if affine else None
    b = torch.randn(D, dtype=torch.float64, requires_grad=True) if affine else None
    torch.manual_seed(1)
    y, g = _grads(lambda *a: adaln(*a, out_dtype=torch.float64), x, s, h, w, b)
    torch.manual_seed(1)
    y_ref, g_ref = _grads(lambda *a: adaln_ref(*a, out_dtype=torch.float64), x, s, h, w, b)
    # The emulated kernel, like the real one, computes in float32.
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_cpu_plumbing_opcheck(emulated):
    x = torch.randn(2, 3, 8)
    s, h = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    torch.library.opcheck(ops.adaln_fwd, (x, s, h, None, None, 1e-6, torch.float32, _LAUNCH))
    y, mean, rstd = ops.adaln_fwd(x, s, h, None, None, 1e-6, torch.float32, _LAUNCH)
    torch.library.opcheck(ops.adaln_bwd, (torch.randn_like(y), x, s, None, None, mean, rstd, _LAUNCH))


def _no_custom_ops(monkeypatch):
    def refuse(*args):
        raise AssertionError("the eager path went through a torch.library custom op")

    monkeypatch.setattr(ops, "adaln_fwd", refuse)
    monkeypatch.setattr(ops, "adaln_bwd", refuse)


@pytest.mark.parametrize("options", [None, AdaLNLaunchOptions(pdl=False, cluster=1, bwd_features=16)])
def test_cpu_eager_calls_the_extension_directly_with_the_options(emulated, monkeypatch, options):
    _no_custom_ops(monkeypatch)
    x = torch.randn(2, 3, 8, requires_grad=True)
    e = torch.randn(2, 6, 8, requires_grad=True)
    ch = e.chunk(6, dim=1)
    y = adaln(x, ch[1], ch[0], options=options)
    y.square().sum().backward()
    launch = (options or AdaLNLaunchOptions()).as_args()
    assert emulated.calls == [("fwd", launch), ("bwd", launch)]
    y_ref = adaln_ref(x, ch[1], ch[0])
    g_ref = torch.autograd.grad(y_ref.square().sum(), (x, e))
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, g_ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e.grad, g_ref[1], atol=1e-5, rtol=1e-5)
    assert e.grad[:, 2:].abs().max() == 0


def test_cpu_eager_without_grad_runs_only_the_forward(emulated, monkeypatch):
    _no_custom_ops(monkeypatch)
    x, s, h = torch.randn(2, 3, 8), torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)
    with torch.no_grad():
        y = adaln(x, s, h)
    assert y.grad_fn is None and emulated.calls == [("fwd", (1, 0, 0, 0))]
    torch.testing.assert_close(y, adaln_ref(x, s, h), atol=1e-5, rtol=1e-5)


def test_cpu_eager_plan_is_kept_per_input_signature(emulated):
    x, s, h = torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 8)
    adaln(x, s, h)
    adaln(torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 8))
    assert len(ops._plans) == 1
    y = adaln(x[:1], s[:1], h[:1, None])  # another signature: checked and planned anew
    assert len(ops._plans) == 2 and y.shape == (1, 3, 8)
    with pytest.raises(ValueError, match="`scale` has shape"):
        adaln(x, s[:, :4], h)  # a cached plan never skips the checks of a new signature


def test_cpu_plumbing_compiles_fullgraph(emulated):
    torch._dynamo.reset()
    x = torch.randn(2, 3, 8, requires_grad=True)
    s, h = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)
    options = AdaLNLaunchOptions(cluster=2)
    fn = torch.compile(
        lambda x, s, h: adaln(x, s, h, options=options).square().sum(), fullgraph=True, backend="aot_eager"
    )
    out = fn(x, s, h)
    out.backward()
    torch.testing.assert_close(out, adaln_ref(x, s, h).square().sum())
    assert x.grad is not None and s.grad is not None
    # Traced through the custom ops (the eager autograd.Function is invisible to the compiler),
    # with the launch options as constants.
    assert {c for c in emulated.calls} == {("fwd", (1, 2, 0, 0)), ("bwd", (1, 2, 0, 0))}


@pytest.mark.parametrize("mod", ["sample", "chunk", "token"])
@pytest.mark.parametrize("affine", [False, True])
def test_cpu_fused_check_harness(emulated, mod, affine):
    # The CUDA comparison below, run through the emulated extension: checks the checker itself.
    _check_fused(2, 5, 32, torch.float32, 1e-5, mod=mod, affine=affine, device="cpu")


# ------------------------------------------------------------------------------------------------
# CUDA: the fused kernel against a float64 reference.

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)]


def _make(B, N, D, dtype, mod, mod_dtype, affine, device="cuda"):
    x = torch.randn(B, N, D, device=device, dtype=dtype) * 2 + 0.5
    if mod == "chunk":  # views of a leaf that requires grad, as Wan's modulation is
        e = (torch.randn(B, 6, D, device=device, dtype=mod_dtype) * 0.5).requires_grad_()
        s, h = e.chunk(6, dim=1)[1], e.chunk(6, dim=1)[3]
    elif mod == "token":
        s, h = (torch.randn(B, N, D, device=device, dtype=mod_dtype) * 0.5 for _ in range(2))
    else:
        s, h = (torch.randn(B, D, device=device, dtype=mod_dtype) * 0.5 for _ in range(2))
    w = torch.randn(D, device=device) if affine else None
    b = torch.randn(D, device=device) if affine else None
    return x, s, h, w, b


def _check_fused(
    B, N, D, dtype, tol, mod="sample", mod_dtype=torch.float32, affine=False, out_dtype=None, device="cuda"
):
    x, s, h, w, b = _make(B, N, D, dtype, mod, mod_dtype, affine, device)
    # For chunk views the leaf is the [B, 6, D] tensor they view.
    sources = (x, s._base, w, b) if mod == "chunk" else (x, s, h, w, b)
    leaves = [t.requires_grad_() for t in sources if t is not None]
    assert ops._unsupported_reason(x, s, h, w, out_dtype or ops._out_dtype(x, s, h)) is None
    y = adaln(x, s, h, w, b, out_dtype=out_dtype)
    y64 = _ref64(x, s, h, w, b)
    assert y.dtype == (out_dtype or ops._out_dtype(x, s, h))
    assert _rel(y, y64) < tol, _rel(y, y64)
    gy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, gy)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    if mod == "chunk":  # rebuild the views on the float64 leaf
        x64, e64 = leaves64[0], leaves64[1]
        args = (x64, e64.chunk(6, 1)[1], e64.chunk(6, 1)[3], *leaves64[2:])
    else:
        args = tuple(leaves64)
    ref = adaln_ref(*args, out_dtype=torch.float64)
    grads64 = torch.autograd.grad(ref, leaves64, gy.double())
    for name, g, g64 in zip(("x", "modulation", "shift", "weight", "bias")[: len(grads)], grads, grads64, strict=True):
        assert _rel(g, g64) < tol * 2, (name, _rel(g, g64))


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize(("B", "N", "D"), [(1, 1, 1023), (3, 7, 256), (2, 7, 64), (2, 7, 1000), (1, 7, 5121)])
def test_fused_odd_shapes(B, N, D, dtype, tol):
    if D > ADALN_MAX_D_ANY:
        x = torch.randn(B, N, D, device="cuda", dtype=dtype)
        assert "D=" in ops._unsupported_reason(x, x[:, :1], x[:, :1], None, ops._out_dtype(x, x, x))
        return
    _check_fused(B, N, D, dtype, tol)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("mod", ["sample", "chunk", "token"])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize(("N", "D"), [(1, 1536), (7, 5120), (32760, 1536)])
def test_fused_matches_float64(dtype, tol, mod, affine, N, D):
    _check_fused(2 if N < 1000 else 1, N, D, dtype, tol, mod=mod, affine=affine)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("D", [512, 1000, 2048, 6144])
def test_fused_streamed_rows_across_strips(dtype, tol, D):
    # Per-sample modulation on aligned rows streams each sample's rows through a ring in shared
    # memory: several samples, strips of ~N/strips rows that wrap the ring many times, a partial
    # last row group, the narrowest streamed width and the widest (two 16-byte chunks a thread for
    # fp32, a ring over 48 KB); D = 1000 leaves the last warp's chunks partly empty (bounds checks).
    _check_fused(3, 1999, D, dtype, tol, mod="chunk", affine=D == 2048)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES)
@pytest.mark.parametrize("D", [1000, 1536])
def test_fused_streamed_forward_deals_row_groups_in_turn(dtype, tol, D):
    # Long samples (at least 4 row groups for every CTA on any GPU up to 132 SMs) make the 16-bit
    # streamed forward deal its 4-row groups out in turn across CTAs instead of one strip each:
    # two samples and a partial last group (20001 rows), rows covered exactly and bounds-checked.
    _check_fused(2, 20001, D, dtype, tol, mod="chunk", affine=D == 1000)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "tol"), DTYPES[1:])
def test_fused_modulation_in_x_dtype_and_bf16_output(dtype, tol):
    _check_fused(2, 33, 1536, dtype, tol, mod="chunk", mod_dtype=dtype)
    _check_fused(2, 33, 1536, dtype, tol, out_dtype=torch.bfloat16)
    _check_fused(2, 33, 1536, torch.float32, 2e-2, mod="chunk", out_dtype=torch.bfloat16)


@pytest.mark.cuda
def test_fused_non_contiguous_x_and_large_batch():
    base = torch.randn(3, 9, 2 * 768, device="cuda")
    x = base[:, ::2, :768].requires_grad_()  # strided rows
    s, h = torch.randn(3, 768, device="cuda"), torch.randn(3, 768, device="cuda")
    torch.testing.assert_close(adaln(x, s, h), adaln_ref(x, s, h), atol=1e-5, rtol=1e-5)
    x = torch.randn(70000, 1, 64, device="cuda")  # B beyond grid.y limits
    s, h = torch.randn(70000, 64, device="cuda"), torch.randn(70000, 64, device="cuda")
    torch.testing.assert_close(adaln(x, s, h), adaln_ref(x, s, h), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_fused_backward_is_deterministic():
    x, s, h, w, b = _make(1, 32760, 1536, torch.bfloat16, "chunk", torch.float32, True)
    leaves = [t.requires_grad_() for t in (x, s._base, w, b)]
    y = adaln(x, s, h, w, b)
    gy = torch.randn_like(y)
    g1 = torch.autograd.grad(y, leaves, gy, retain_graph=True)
    g2 = torch.autograd.grad(y, leaves, gy)
    for a, c in zip(g1, g2, strict=True):
        assert torch.equal(a, c)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [1536, 1000, 5120])
def test_fused_statistics_of_offset_rows_and_outlier_features(dtype, D):
    # Rows far from zero (mean 300, unit spread) and DiT-style massive activations (feature 0 and
    # every 97th at 1000x): the saved mean/rstd and y must keep fp32 accuracy, on rows the streamed
    # kernels cover exactly (1536, 5120) and with bounds checks (1000).
    g = torch.Generator(device="cuda").manual_seed(0)
    x = 300 + torch.randn(2, 4001, D, device="cuda", generator=g)
    x[..., ::97] = 1000 * torch.randn(2, 4001, (D + 96) // 97, device="cuda", generator=g)
    x = x.to(dtype)
    s, h = (torch.randn(2, 1, D, device="cuda", generator=g) * 0.5 for _ in range(2))
    y, mean, rstd = ops.adaln_fwd(x, s, h, None, None, 1e-6, torch.float32, _LAUNCH)
    x64 = x.double()
    mean64 = x64.mean(-1)
    rstd64 = (x64.var(-1, unbiased=False) + 1e-6).rsqrt()
    assert _rel(mean, mean64.flatten()) < 1e-6
    assert _rel(rstd, rstd64.flatten()) < 1e-6
    assert _rel(y, _ref64(x, s, h)) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("B", "N", "D"), [(2, 3001, 1536), (2, 3001, 1000), (2, 601, 5120), (1, 20001, 1536)])
def test_fused_statistics_when_row_means_jump(dtype, B, N, D):
    # The streamed forward sums each row shifted by the previous row's mean in the same CTA slot and
    # passes over the rows again, shifted by the mean just found, where that shift was a poor guess.
    # Row means that jump by 0-5 standard deviations (one pass) and by 10^4 (one pass there would
    # lose every bit of the variance) from one row to the next, in runs long enough to span row
    # groups and strips, and constant rows: every row's mean and rstd must keep fp32 accuracy, row
    # by row (fp32 x at D = 1000 and 5120 takes the row-packing kernel's two-pass sums instead; the
    # 16-bit forward deals 20001 rows out in row groups in turn, so a pivot comes from rows apart).
    g = torch.Generator(device="cuda").manual_seed(1)
    levels = torch.tensor([0.0, 1.0, 2.5, 5.0, 1e4, -1e4], device="cuda", dtype=torch.float64)
    pick = torch.randint(0, len(levels), (B, (N + 4) // 5), device="cuda", generator=g)
    means = levels[pick].repeat_interleave(5, dim=1)[:, :N]  # runs of 5 rows at one level
    spread = torch.rand(B, N, 1, device="cuda", generator=g, dtype=torch.float64) * 3 + 0.5
    x64 = means[..., None] + spread * torch.randn(B, N, D, device="cuda", generator=g, dtype=torch.float64)
    x64[:, 100:105] = 3.25  # constant rows: variance 0 wherever the pivot was
    x = x64.to(dtype)
    s, h = (torch.randn(B, 1, D, device="cuda", generator=g) * 0.5 for _ in range(2))
    y, mean, rstd = ops.adaln_fwd(x, s, h, None, None, 1e-6, torch.float32, _LAUNCH)
    x64 = x.double()
    mean64 = x64.mean(-1).flatten()
    rstd64 = (x64.var(-1, unbiased=False) + 1e-6).rsqrt().flatten()
    # Row by row: the mean to fp32 rounding of the largest |x| in the row, rstd to a few fp32 ulps.
    scale = x64.abs().amax(-1).flatten()
    assert ((mean.double() - mean64).abs() / scale).max().item() < 1e-6
    assert ((rstd.double() - rstd64).abs() / rstd64).max().item() < 1e-5
    # y from those statistics: x - mean of a row far from zero loses digits in fp32 whatever the
    # kernel, so the output step is checked on the kernel's own mean and rstd.
    y_ref = (x64 - mean.double().view(B, N, 1)) * rstd.double().view(B, N, 1) * (1 + s.double()) + h.double()
    assert _rel(y, y_ref) < 1e-6


@pytest.mark.cuda
def test_fused_backward_launches_no_zero_fills():
    # mean/rstd are outputs without gradients: autograd must not materialise zeros for them.
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2, 300, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    s, h = (torch.randn(2, 1, 1536, device="cuda", requires_grad=True) for _ in range(2))
    y = adaln(x, s, h)
    gy = torch.randn_like(y)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(y, (x, s, h), gy)
        torch.cuda.synchronize()
    kernels = [e.key for e in prof.key_averages() if e.device_time_total > 0]
    assert any("adaln_bwd" in k for k in kernels), kernels
    assert not [k for k in kernels if "Fill" in k], kernels


@pytest.mark.cuda
def test_fused_backward_clusters_and_plain_ctas_agree():
    # cluster=1 turns off the cluster reduction of the column partials: dx must not change at all
    # and dscale/dshift only by fp32 summation order.
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 1560, 1536, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    e = (torch.randn(4, 6, 1536, device="cuda", generator=g) * 0.5).requires_grad_()
    gy = torch.randn(4, 1560, 1536, device="cuda", generator=g, dtype=torch.bfloat16)
    out = {}
    for cluster in (1, 8):
        ch = e.chunk(6, dim=1)
        y = adaln(x, ch[1], ch[0], out_dtype=torch.bfloat16, options=AdaLNLaunchOptions(cluster=cluster))
        out[cluster] = torch.autograd.grad(y, (x, e), gy)
    assert torch.equal(out[1][0], out[8][0])
    assert _rel(out[8][1], out[1][1]) < 1e-6
    assert not torch.equal(out[8][1], out[1][1])  # the options reached the kernels: another sum order
    assert out[8][1][:, 2:].abs().max() == 0 and out[8][1][:, :2].abs().min() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("options", [AdaLNLaunchOptions(pdl=False), AdaLNLaunchOptions(fwd_features=16, bwd_features=16),
                                     AdaLNLaunchOptions(fwd_features=24, bwd_features=24)])  # fmt: skip
def test_fused_launch_options_compute_the_same_function(options):
    x, s, h, _, _ = _make(2, 1999, 1536, torch.float32, "chunk", torch.float32, False)
    x.requires_grad_()
    gy = torch.randn(2, 1999, 1536, device="cuda")
    y = adaln(x, s, h)
    (gx,) = torch.autograd.grad(y, x, gy)
    y_o = adaln(x, s, h, options=options)
    (gx_o,) = torch.autograd.grad(y_o, x, gy)
    assert _rel(y_o, y) < 1e-6 and _rel(gx_o, gx) < 1e-6


@pytest.mark.cuda
def test_fused_eager_refuses_double_backward():
    x, s, h, _, _ = _make(2, 7, 256, torch.float32, "sample", torch.float32, False)
    x.requires_grad_()
    (gx,) = torch.autograd.grad(adaln(x, s, h).square().sum(), x, create_graph=False)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(adaln(x, s, h).square().sum(), x, create_graph=True)


@pytest.mark.cuda
def test_fused_eager_op_is_the_extensions_autograd_node():
    # Eager calls go straight to the C++ node: no custom-op dispatch, no Python backward.
    x, s, h, _, _ = _make(2, 7, 256, torch.bfloat16, "sample", torch.float32, False)
    y = adaln(x.requires_grad_(), s, h)
    assert type(y.grad_fn).__name__ == "CppNode<AdalnFunction>" or "AdalnFunction" in y.grad_fn.name()
    with torch.no_grad():
        assert adaln(x, s, h).grad_fn is None


@pytest.mark.cuda
def test_fused_opcheck():
    x, s, h, w, b = _make(2, 7, 256, torch.bfloat16, "sample", torch.float32, True)
    s, h = s[:, None], h[:, None]
    torch.library.opcheck(ops.adaln_fwd, (x, s, h, w, b, 1e-6, torch.float32, _LAUNCH))
    y, mean, rstd = ops.adaln_fwd(x, s, h, w, b, 1e-6, torch.float32, _LAUNCH)
    torch.library.opcheck(ops.adaln_bwd, (torch.randn_like(y), x, s, w, b, mean, rstd, _LAUNCH))


@pytest.mark.cuda
def test_fused_under_torch_compile_fullgraph():
    torch._dynamo.reset()
    x, s, h, _, _ = _make(1, 1000, 1536, torch.bfloat16, "chunk", torch.float32, False)
    x.requires_grad_()
    fn = torch.compile(lambda x, s, h: adaln(x, s, h, out_dtype=torch.bfloat16), fullgraph=True)
    y = fn(x, s, h)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    y_e = adaln(x, s, h, out_dtype=torch.bfloat16)
    (gx_e,) = torch.autograd.grad(y_e, x, gy)
    assert torch.equal(y, y_e) and torch.equal(gx, gx_e)


@pytest.mark.cuda
def test_fused_with_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    x, s, h, w, b = _make(2, 100, 512, torch.bfloat16, "sample", torch.float32, True)
    leaves = [t.requires_grad_() for t in (x, s, h, w, b)]
    y = checkpoint(lambda *a: adaln(*a).square(), x, s, h, w, b, use_reentrant=False)
    g = torch.autograd.grad(y.sum(), leaves)
    g_ref = torch.autograd.grad(adaln(x, s, h, w, b).square().sum(), leaves)
    for a, c in zip(g, g_ref, strict=True):
        assert torch.equal(a, c)


@pytest.mark.cuda
@pytest.mark.skipif(not os.environ.get("ADALN_TEST_HUGE"), reason="set ADALN_TEST_HUGE=1 (needs ~20 GB, slow)")
def test_fused_beyond_2_31_elements():
    B, N, D = 1, 2**31 // 1024 + 7, 1024  # 2^31 + 7168 elements
    x = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)
    s, h = torch.randn(B, D, device="cuda"), torch.randn(B, D, device="cuda")
    y = adaln(x, s, h, out_dtype=torch.bfloat16)
    tail = slice(N - 64, N)
    torch.testing.assert_close(y[:, tail], adaln_ref(x[:, tail], s, h, out_dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)
    gy = torch.randn_like(y)
    del y
    x.requires_grad_()
    y = adaln(x, s, h, out_dtype=torch.bfloat16)
    (gx,) = torch.autograd.grad(y, x, gy)
    xt = x[:, tail].detach().requires_grad_()
    (gx_ref,) = torch.autograd.grad(adaln_ref(xt, s, h, out_dtype=torch.bfloat16), xt, gy[:, tail])
    torch.testing.assert_close(gx[:, tail], gx_ref, atol=2e-2, rtol=2e-2)


# Last: a failed capture leaves the CUDA generator unusable for the tests after it.
@pytest.mark.cuda
@pytest.mark.parametrize(("B", "N", "D", "dtype"), [(4, 1560, 1536, torch.bfloat16), (3, 1999, 1024, torch.float32)])
def test_fused_forward_backward_replay_in_a_cuda_graph(B, N, D, dtype):
    # The streamed kernels launch with programmatic dependent launch and the backward in thread-block
    # clusters on sm_90: captured into a CUDA graph and replayed, they must give the eager bits.
    # Everything runs on a side stream (autograd must not tie the capture to the legacy stream).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x, s, h, _, _ = _make(B, N, D, dtype, "chunk", torch.float32, False)
        e = s._base
        x.requires_grad_()
        gy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16)

        def step():
            ch = e.chunk(6, dim=1)
            return torch.autograd.grad(adaln(x, ch[1], ch[3], out_dtype=torch.bfloat16), (x, e), gy)

        eager = step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for _ in range(3):
            graph.replay()
    torch.cuda.synchronize()
    for a, c in zip(eager, captured, strict=True):
        assert torch.equal(a, c)
