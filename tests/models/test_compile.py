"""Regional compilation of the Wan blocks: exact numerics, and bucketed shapes do not recompile per bucket."""

import torch
import torch._dynamo.testing

from lightning_adaptiveload.models.wan import WanModel

GRIDS = [(1, 4, 4), (3, 4, 6), (5, 4, 6), (1, 8, 8), (2, 6, 6), (7, 2, 2), (1, 2, 2), (4, 4, 4), (9, 4, 4), (3, 3, 3)]


def test_compiled_blocks_match_eager_and_recompile_a_bounded_number_of_times():
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
    # Ten token grids: a static compile, then dynamic sizes; far below dynamo's recompile limit (8),
    # after which it would silently run eager.
    assert 1 <= counter.frame_count <= 4
    assert counter.frame_count < torch._dynamo.config.recompile_limit


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
