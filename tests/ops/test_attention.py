"""Attention backends: SDPA in the (B, S, H, D) layout against a float64 reference, the auto choice, the
module's per-length plan, and (on a GPU with flash-attn-4) FA4's forward and backward, compiled without a
graph break and kept by selective checkpointing."""

import logging

import pytest
import torch

from lightning_adaptiveload.models import wan
from lightning_adaptiveload.models.attention import attention_dtype, choose_attention
from lightning_adaptiveload.models.flow_matching import FlowMatchingModule
from lightning_adaptiveload.ops import attention as attn


def _reference(q, k, v):
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return (p @ v).transpose(1, 2)


def test_sdpa_backend_matches_float64_reference_in_bshd_layout():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 3, 8, generator=g)
    k, v = torch.randn(2, 5, 3, 8, generator=g), torch.randn(2, 5, 3, 8, generator=g)
    out = attn.attention(q, k, v, "sdpa")
    assert out.shape == (2, 7, 3, 8)
    ref = _reference(q, k, v)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


def test_bad_backend_and_setting_are_refused_in_one_line():
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(ValueError, match=r"attention\(backend='flash'\)"):
        attn.attention(q, q, q, "flash")
    with pytest.raises(ValueError, match=r"FlowMatchingModule\(attention='flash'\)` is not valid.*auto"):
        FlowMatchingModule("tiny", attention="flash")


def test_fa4_is_unsupported_on_cpu_with_the_reason():
    assert "CUDA" in attn.fa4_unsupported_reason("cpu")
    assert attn.available_backends("cpu") == ("sdpa",)


def test_choose_backends_keeps_sdpa_unless_another_is_min_gain_faster():
    timings = {100: {"sdpa": 1.0, "fa4": 0.99}, 200: {"sdpa": 1.0, "fa4": 0.9}, 300: {"sdpa": 1.0, "fa4": 1.2}}
    assert attn.choose_backends(timings) == {100: "sdpa", 200: "fa4", 300: "sdpa"}
    assert attn.choose_backends(timings, min_gain=0.0) == {100: "fa4", 200: "fa4", 300: "sdpa"}


def test_time_backends_times_each_length_with_a_bucket_sized_batch():
    t = attn.time_backends([16, 64], 2, 8, device="cpu", dtype=torch.float32, tokens=256, repeats=2, warmup=1)
    assert set(t) == {16, 64} and set(t[16]) == {"sdpa"} and all(v["sdpa"] > 0 for v in t.values())


def test_fa4_op_is_kept_by_selective_checkpointing():
    assert torch.ops.adaptiveload.fa4_attention.default in wan._ATTENTION_OPS


class _Trainer:
    def __init__(self, grids, precision="32-true"):
        self.precision = precision

        class _DS:
            def token_grids(self):
                return grids

        self.datamodule = type("DM", (), {"dataset": _DS()})()
        self.strategy = type("S", (), {"root_device": torch.device("cpu"), "broadcast": staticmethod(lambda x: x)})()


def test_auto_on_cpu_plans_sdpa_for_every_length_and_says_why():
    module = FlowMatchingModule("tiny")
    lines = []
    plan = choose_attention(_Trainer([(1, 2, 2), (2, 2, 2), (1, 2, 2)]), module, say=lines.append)
    assert plan == {4: "sdpa", 8: "sdpa"} and module.attention_plan == plan
    assert len(lines) == 1 and "SDPA" in lines[0] and "CUDA" in lines[0]
    assert module.calibration_key()["attention_plan"] == {"4": "sdpa", "8": "sdpa"}
    assert choose_attention(_Trainer([(1, 2, 2)]), FlowMatchingModule("tiny", attention="sdpa"), say=print) is None


def test_auto_times_only_the_backends_the_module_runs(monkeypatch):
    # A module whose model runs only SDPA (diffusers' non-Wan families) must not be given FA4 by auto, even
    # where FA4 could run: its plan would name a backend the model never runs (and key the calibration by it).
    import lightning_adaptiveload.models.attention as auto

    timed = []
    monkeypatch.setattr(auto, "fa4_unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(auto, "time_backends", lambda lengths, *a, backends=None, **k: timed.append(backends) or {
        s: {"sdpa": 2.0, "fa4": 1.0} for s in lengths})
    both = FlowMatchingModule("tiny")
    assert choose_attention(_Trainer([(1, 2, 2)]), both, say=print) == {4: "fa4"} and timed[-1] == ("sdpa", "fa4")
    only = FlowMatchingModule("tiny")
    only.attention_backends = ("sdpa",)
    lines = []
    assert choose_attention(_Trainer([(1, 2, 2), (2, 2, 2)]), only, say=lines.append) == {4: "sdpa", 8: "sdpa"}
    assert len(timed) == 1 and lines == ["attention=auto: SDPA (FlowMatchingModule runs only sdpa for this model)"]


def test_attention_dtype_follows_precision():
    assert attention_dtype(_Trainer([], "bf16-mixed")) is torch.bfloat16
    assert attention_dtype(_Trainer([], "16-mixed")) is torch.float16
    assert attention_dtype(_Trainer([], "32-true")) is torch.float32


def test_the_plan_switches_the_blocks_backend_by_the_batch_length():
    module = FlowMatchingModule("tiny", attention="sdpa")
    module.configure_model()
    backends = lambda: {m.backend for m in module.model.modules() if isinstance(m, wan.WanSelfAttention)}  # noqa: E731
    assert backends() == {"sdpa"}
    module.set_attention_plan({4: "sdpa", 400: "fa4"})
    assert module._attention_for(4) == "sdpa" and module._attention_for(300) == "fa4"
    module._use_attention(module._attention_for(300))
    assert backends() == {"fa4"}
    batch = module.synthetic_batch(1, (1, 2, 2))
    module.compute_loss(batch)  # S = 4: back to SDPA before the model runs (fa4 would fail on CPU)
    assert backends() == {"sdpa"}


def test_fixed_fa4_without_a_gpu_is_refused_at_fit_start_naming_the_fix(caplog):
    module = FlowMatchingModule("tiny", attention="fa4")
    module.configure_model()
    with pytest.raises(ValueError, match=r"attention='fa4'\)` cannot run: FA4 runs on CUDA.*'auto'"):
        module.on_fit_start()


# ------------------------------------------------------------------------------------------------ GPU
def _fa4_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    reason = attn.fa4_unsupported_reason("cuda", torch.bfloat16, 128)
    if reason:
        pytest.skip(reason)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 1560, 12, 128), (1, 4096, 12, 128), (3, 300, 4, 64)])
def test_fa4_forward_and_backward_match_fp32_reference(shape):
    _fa4_or_skip()
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    out = attn.attention(q, k, v, "fa4")
    out.backward(dout)
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = attn.attention(qf, kf, vf, "sdpa")
    ref.backward(dout.float())
    for got, want in ((out, ref), (q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        assert torch.isfinite(got).all()
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.cuda
def test_fa4_compiles_without_a_graph_break_and_selective_checkpointing_keeps_it():
    _fa4_or_skip()
    torch._dynamo.reset()

    def f(q, k, v):
        return attn.attention(q * 1.0, k, v, "fa4").float().sum()

    q, k, v = (torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    compiled = torch.compile(f, fullgraph=True)  # fullgraph: a graph break is an error
    compiled(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.utils.checkpoint.checkpoint(f, q, k, v, use_reentrant=False, context_fn=wan.keep_attention_outputs).backward()
    for t, want in zip((q, k, v), grads, strict=True):
        assert torch.allclose(t.grad, want, rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
def test_fa4_deterministic_backward_repeats_bit_for_bit():
    _fa4_or_skip()
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 2048, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))
    grads = []
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for _ in range(2):
            attn.attention(q, k, v, "fa4").float().square().sum().backward()
            grads.append([t.grad.clone() for t in (q, k, v)])
            for t in (q, k, v):
                t.grad = None
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.cuda
def test_auto_times_both_backends_on_the_gpu_and_sets_the_plan(caplog):
    _fa4_or_skip()
    module = FlowMatchingModule("tiny")
    trainer = _Trainer([(1, 30, 52), (21, 30, 52)], "bf16-mixed")
    trainer.strategy.root_device = torch.device("cuda")
    lines = []
    plan = choose_attention(trainer, module, say=lines.append)
    assert set(plan) == {1560, 32760} and set(plan.values()) <= {"sdpa", "fa4"}
    assert "forward + backward ms" in lines[0] and "fa4" in lines[0]
    logging.getLogger(__name__).info(lines[0])
