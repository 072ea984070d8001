"""Regional compilation of the Wan blocks: exact numerics, and bucketed shapes do not recompile per bucket."""

import pytest
import torch
import torch._dynamo.testing

from lightning_adaptiveload.models.compiling import BLOCK_INDUCTOR_OPTIONS, block_compile_kwargs
from lightning_adaptiveload.models.wan import WanModel

GRIDS = [(1, 4, 4), (3, 4, 6), (5, 4, 6), (1, 8, 8), (2, 6, 6), (7, 2, 2), (1, 2, 2), (4, 4, 4), (9, 4, 4), (3, 3, 3)]


@pytest.mark.slow  # ~17 s on a 2-core CPU
def test_compiled_blocks_match_eager_and_recompile_a_bounded_number_of_times():
    torch._dynamo.reset()  # graphs and dynamic-shape decisions of earlier tests must not count here
    torch.manual_seed(0)
    model = WanModel("tiny")
    model.set_gradient_checkpointing(True)
    ref = WanModel("tiny")
    ref.load_state_dict(model.state_dict())
    ref.set_gradient_checkpointing(True)
    counter = torch._dynamo.testing.CompileCounter()
    model.compile_blocks(backend=counter)
    cfg = model.config
    for f, h, w in GRIDS:
        x = torch.randn(3, cfg.in_dim, f, 2 * h, 2 * w)
        t = torch.rand(3) * 1000
        c = torch.randn(3, cfg.text_len, cfg.text_dim)
        out, want = model(x, t, c), ref(x, t, c)
        out.square().mean().backward()
        want.square().mean().backward()
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
    # Ten token grids, 2 layers: one graph with dynamic sizes serves every block and grid (block 0's
    # input is contiguous and marked like the others'), and one more for a batch of 1 (dynamo
    # specialises sizes of 1).
    assert counter.frame_count == 1
    x = torch.randn(1, cfg.in_dim, 3, 8, 12)
    model(x, torch.rand(1) * 1000, torch.randn(1, cfg.text_len, cfg.text_dim)).square().mean().backward()
    model(torch.randn(1, cfg.in_dim, 5, 4, 8), torch.rand(1), torch.randn(1, cfg.text_len, cfg.text_dim))
    assert counter.frame_count == 2


def test_flow_matching_module_compiles_blocks_when_asked(monkeypatch):
    import pytest

    from lightning_adaptiveload.models.flow_matching import FlowMatchingModule

    calls = []
    monkeypatch.setattr(WanModel, "compile_blocks", lambda self, **kw: calls.append(len(self.blocks)))
    FlowMatchingModule("tiny").configure_model()
    assert calls == []
    FlowMatchingModule("tiny", compile=True).configure_model()
    assert calls == [2]
    with pytest.raises(ValueError, match="compile='yes'"):
        FlowMatchingModule("tiny", compile="yes")


@pytest.mark.slow  # ~25 s on a 2-core CPU
def test_compiled_checkpointing_modes_match_eager_and_never_fall_back_silently():
    import pytest

    from lightning_adaptiveload.models.compiling import RECOMPILE_LIMIT, compile_seconds

    torch.manual_seed(0)
    model = WanModel("tiny")
    ref = WanModel("tiny")
    ref.load_state_dict(model.state_dict())
    before = compile_seconds()
    # aot_eager runs AOTAutograd's partitioner (where the checkpoint policy is honoured) without inductor.
    model.compile_blocks(backend="aot_eager")
    assert torch._dynamo.config.fail_on_recompile_limit_hit
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT
    cfg = model.config
    for mode in ("selective", "full", "none"):
        model.set_gradient_checkpointing(mode)
        ref.set_gradient_checkpointing(mode)
        for b, (f, h, w) in ((2, (1, 4, 4)),):
            x = torch.randn(b, cfg.in_dim, f, 2 * h, 2 * w)
            t = torch.rand(b) * 1000
            c = torch.randn(b, cfg.text_len, cfg.text_dim)
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            out, want = model(x, t, c), ref(x, t, c)
            out.square().mean().backward()
            want.square().mean().backward()
            torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
            for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{mode} {name}")
    assert compile_seconds() > before
    # A limit that is hit is an error, not a silent eager fall-back.
    torch._dynamo.reset()
    small = WanModel("tiny")
    small.compile_blocks(backend="aot_eager")
    torch._dynamo.config.recompile_limit = 1
    try:
        small.set_gradient_checkpointing("none")
        small(torch.randn(2, cfg.in_dim, 1, 8, 8), torch.rand(2), torch.randn(2, cfg.text_len, cfg.text_dim))
        small.set_gradient_checkpointing("full")
        with pytest.raises(Exception, match="(?i)recompile"):
            with torch.enable_grad():
                small(torch.randn(2, cfg.in_dim, 1, 8, 8), torch.rand(2), torch.randn(2, cfg.text_len, cfg.text_dim))
    finally:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        torch._dynamo.reset()


@__import__("pytest").mark.cuda
def test_inductor_checkpointing_modes_match_eager_on_gpu():
    """The real backend on the GPU: selective and full recompute inside compiled blocks give eager's gradients."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model = WanModel("tiny").cuda()
    ref = WanModel("tiny").cuda()
    ref.load_state_dict(model.state_dict())
    model.compile_blocks()
    cfg = model.config
    for mode in ("selective", "full", "none"):
        model.set_gradient_checkpointing(mode)
        ref.set_gradient_checkpointing(mode)
        x = torch.randn(2, cfg.in_dim, 3, 8, 12, device="cuda")
        t = torch.rand(2, device="cuda") * 1000
        c = torch.randn(2, cfg.text_len, cfg.text_dim, device="cuda")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, want = model(x, t, c), ref(x, t, c)
        out.square().mean().backward()
        want.square().mean().backward()
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            rel = (p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12)
            assert rel < 3e-2, f"{mode} {name}: relative gradient difference {rel:.3g}"


@pytest.mark.slow  # 9 s on a 2-core CPU under load: off the quick path
def test_compiled_blocks_under_bf16_autocast_compile_one_graph_for_every_block():
    # Under autocast the patch embedding gives bf16; the residual stream is fp32 after block 0. Every
    # block must still get one dtype, or block 0 compiles a graph of its own (seen on the H200: 8
    # graphs instead of 4 for the 1.3B recipe's profile).
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WanModel("tiny")
    counter = torch._dynamo.testing.CompileCounter()
    model.compile_blocks(backend=counter)
    cfg = model.config
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for f, h, w in GRIDS[:3]:
            x = torch.randn(3, cfg.in_dim, f, 2 * h, 2 * w)
            out = model(x, torch.rand(3) * 1000, torch.randn(3, cfg.text_len, cfg.text_dim))
            out.float().square().mean().backward()
    assert counter.frame_count == 1


def test_compile_options_reach_every_block_and_are_checked(monkeypatch):
    import pytest

    from lightning_adaptiveload.models.flow_matching import FlowMatchingModule

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    options = {"triton.mix_order_reduction_non_strict_mode": True}
    module = FlowMatchingModule("tiny", compile=True, compile_options=options)
    module.configure_model()
    assert seen == [block_compile_kwargs({"options": options})] * len(module.model.blocks)
    assert all(kw["options"]["triton.mix_order_reduction_non_strict_mode"] is True for kw in seen)
    seen.clear()
    FlowMatchingModule("tiny", compile=True, compile_options={}).configure_model()
    assert seen == [block_compile_kwargs({})] * 2  # empty: the blocks' default options
    with pytest.raises(ValueError, match="'triton.mix_order_reduction_non_strict' is not an inductor option.*"
                                         "mix_order_reduction_non_strict_mode"):
        FlowMatchingModule("tiny", compile=True, compile_options={"triton.mix_order_reduction_non_strict": True})
    with pytest.raises(ValueError, match="needs `compile=True`"):
        FlowMatchingModule("tiny", compile_options=options)
    with pytest.raises(ValueError, match="Expected a mapping"):
        FlowMatchingModule("tiny", compile=True, compile_options=["max_autotune"])


@pytest.mark.slow  # 7 s on a 2-core CPU under load: off the quick path
def test_compiled_blocks_under_ddp_compile_one_graph_each_not_one_per_gradient_bucket():
    """Inside a DDP forward dynamo would cut each block's graph at DDP's gradient buckets; the blocks
    opt out (their backward already hands DDP its gradients per block), and only around their calls."""
    import socket

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch._dynamo.reset()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    # ~3 MB of parameters a block: several 1 MB DDP buckets, so the DDP optimizer would split a block.
    model = WanModel({"preset": "tiny", "dim": 256, "ffn_dim": 512, "num_heads": 4})
    ref = WanModel({"preset": "tiny", "dim": 256, "ffn_dim": 512, "num_heads": 4})
    ref.load_state_dict(model.state_dict())
    counter = torch._dynamo.testing.CompileCounter()
    model.compile_blocks(backend=counter)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1.0)
    cfg = model.config
    x, t, c = torch.randn(2, cfg.in_dim, 3, 8, 8), torch.rand(2) * 1000, torch.randn(2, cfg.text_len, cfg.text_dim)
    out = ddp(x, t, c)
    out.square().mean().backward()
    want = ref(x, t, c)
    want.square().mean().backward()
    assert counter.frame_count == 1  # the DDP optimizer's split made it 4
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert torch._dynamo.config.optimize_ddp is True  # the user's own compiled code keeps dynamo's default


def test_blocks_get_the_default_inductor_options_unless_the_caller_sets_them(monkeypatch):
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    have = {k: v for k, v in BLOCK_INDUCTOR_OPTIONS.items() if k in known}
    assert block_compile_kwargs({}) == ({"options": have} if have else {})
    name = "triton.mix_order_reduction"
    if name in known:
        assert have == {name: False}  # the workaround for pytorch/pytorch#193061
        # The caller's value wins, other options are kept.
        assert block_compile_kwargs({"options": {name: True, "max_autotune": True}}) == {
            "options": {name: True, "max_autotune": True}}
    # `mode` excludes `options` in torch.compile: nothing is added, and the warning says how to get it.
    with pytest.warns(UserWarning, match="TORCHINDUCTOR_MIX_ORDER_REDUCTION=0"):
        assert block_compile_kwargs({"mode": "max-autotune"}) == {"mode": "max-autotune"}
    # Another backend gets nothing.
    assert block_compile_kwargs({"backend": "eager"}) == {"backend": "eager"}
    # An option this torch does not have is left out, not passed on to fail.
    monkeypatch.setitem(BLOCK_INDUCTOR_OPTIONS, "no_such_inductor_option", 1)
    assert "no_such_inductor_option" not in block_compile_kwargs({}).get("options", {})
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    WanModel("tiny").compile_blocks()
    assert seen == [block_compile_kwargs({})] * 2


@pytest.mark.cuda
@pytest.mark.parametrize("mix_order_reduction", [None, True, False], ids=["default", "fusion_on", "fusion_off"])
def test_compiled_gradients_at_batch_size_one_match_eager_on_the_gpu(mix_order_reduction):
    """Inductor's mix-order reduction (GPU only) left the [1, 6, D] modulation gradient of a B = 1 backward
    unwritten when the six modulation vectors were `chunk`-ed (pytorch/pytorch#193061): on an H200 the
    time-embedding gradients came out 1,000-10,000x eager's. The block slices them instead, so the compiled
    gradients match eager's with the fusion on or off."""
    options = {} if mix_order_reduction is None else {"options": {"triton.mix_order_reduction": mix_order_reduction}}
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WanModel({"preset": "wan2_1_1_3b", "num_layers": 2}).cuda()
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():  # zero-initialised (the head): give every parameter a gradient
                p.normal_(0, 0.02)
    ref = WanModel({"preset": "wan2_1_1_3b", "num_layers": 2}).cuda()
    ref.load_state_dict(model.state_dict())
    model.compile_blocks(**options)
    cfg = model.config
    for _ in range(2):  # a second step reuses freed memory, where an unwritten buffer holds stale values
        x = torch.randn(1, cfg.in_dim, 5, 60, 104, device="cuda")  # token grid (5, 30, 52): S = 7,800
        t, c = torch.rand(1, device="cuda") * 1000, torch.randn(1, cfg.text_len, cfg.text_dim, device="cuda")
        for net in (model, ref):
            net.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                net(x, t, c).float().square().mean().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            if "modulation" in name or name.startswith(("time_embedding", "time_projection")):
                assert torch.isfinite(p.grad).all(), name
                rel = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
                assert rel < 5e-2, f"{name}: relative gradient error {rel:.3g} against eager"  # fusion on (the bug), H200: 2.86


@pytest.mark.cuda
def test_default_options_compile_one_graph_per_batch_class_on_the_gpu():
    """Inductor's mix-order reduction guards on size thresholds (B·S >= 4096 and B·S·D-sized buffers);
    with the default block options (the fusion off) a Wan 1.3B-width block compiles two graphs (B = 1
    and B > 1) for every bucket of the 480p mix, where the thresholds alone made four."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = WanModel({"preset": "wan2_1_1_3b", "num_layers": 2}).cuda()
    model.compile_blocks()
    cfg = model.config
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for b, f in [(1, 21), (1, 1), (6, 1), (24, 1), (2, 9), (4, 5)]:  # (B, frames of a 30 x 52 token grid)
            x = torch.randn(b, cfg.in_dim, f, 60, 104, device="cuda")
            out = model(x, torch.rand(b, device="cuda") * 1000, torch.randn(b, cfg.text_len, cfg.text_dim, device="cuda"))
            out.float().square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.slow  # ~10-20 s on a 2-core CPU: inductor's C++ backend
def test_modulation_gradients_are_not_computed_into_a_concatenated_buffer():
    """The guard behind the GPU test above, on CPU: pytorch/pytorch#193061 drops the writes of a mix-order
    reduction whose output is an alias into another buffer. With the six modulation vectors `chunk`-ed, the
    B = 1 backward computes each [1, 1, D] column sum straight into its slice of the concatenated [1, 6, D]
    gradient (an ``# alias`` line in inductor's code); with slices, each is a buffer of its own."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WanModel({"preset": "tiny", "num_layers": 1})
    ref = WanModel({"preset": "tiny", "num_layers": 1})
    ref.load_state_dict(model.state_dict())
    model.compile_blocks()
    cfg = model.config
    x, t, c = torch.randn(1, cfg.in_dim, 2, 8, 8), torch.rand(1) * 1000, torch.randn(1, cfg.text_len, cfg.text_dim)

    def step():
        model(x, t, c).square().mean().backward()

    _, codes = run_and_get_code(step)
    backward = codes[-1]
    aliases = [line.strip() for line in backward.splitlines() if "# alias" in line]
    modulation = [line for line in aliases if f"(1, 1, {cfg.dim})" in line]
    assert not modulation, "modulation gradients computed into slices of one buffer:\n" + "\n".join(modulation)
    ref(x, t, c).square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
