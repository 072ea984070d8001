"""AdaptiveLoadModule protocol: check_module, validate_synthetic_batch, check_batch_against_plan."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_adaptiveload.models.protocol import (
    OPTIONAL_MEMBERS,
    REQUIRED_MEMBERS,
    AdaptiveLoadModule,
    check_batch_against_plan,
    check_batch_shape,
    check_module,
    validate_synthetic_batch,
)


class GoodModule:
    """Latents [B, 4, F, H, W] with patch (1, 2, 2)."""

    patch_size = (1, 2, 2)

    def compute_loss(self, batch):
        return batch["latents"].pow(2).mean()

    def synthetic_batch(self, batch_size, token_grid, device=None):
        gen = torch.Generator().manual_seed(0)
        shape = [g * p for g, p in zip(token_grid, self.patch_size, strict=True)]
        return {"latents": torch.randn(batch_size, 4, *shape, generator=gen, device=device)}

    def batch_shape(self, batch):
        b, _, f, h, w = batch["latents"].shape
        pt, ph, pw = self.patch_size
        return b, (f // pt) * (h // ph) * (w // pw)

    def flops_per_sample(self, seq_len):
        return 6.0 * seq_len


class CountsBeforePatchify(GoodModule):
    def batch_shape(self, batch):
        b, _, f, h, w = batch["latents"].shape
        return b, f * h * w


def test_good_module_satisfies_protocol_and_checks():
    m = GoodModule()
    assert isinstance(m, AdaptiveLoadModule)
    check_module(m)
    check_module(m, needs=("batch_shape", "flops_per_sample"))
    batch = validate_synthetic_batch(m, (1, 2, 3), batch_size=3)
    assert m.batch_shape(batch) == (3, 6)
    assert check_batch_against_plan(m, batch, (1, 2, 3), 3) == (3, 6)


def test_check_module_names_every_missing_member_and_the_fix():
    class Partial:
        patch_size = (1, 2)
        synthetic_batch = 3

        def compute_loss(self, batch):
            return torch.zeros(())

    assert not isinstance(Partial(), AdaptiveLoadModule)
    with pytest.raises(MisconfigurationException) as err:
        check_module(Partial(), needs=("compute_loss", "synthetic_batch", "batch_shape", "patch_size",
                                       "flops_per_sample"), who="BalanceMonitor")
    msg = str(err.value)
    assert msg.startswith("BalanceMonitor needs `Partial` to provide")
    assert "`Partial.compute_loss`" not in msg
    assert "`Partial.synthetic_batch` is a int, not a method" in msg
    assert "`Partial.batch_shape` is missing. Fix: def batch_shape(self, batch)" in msg
    assert "`Partial.patch_size` is (1, 2), not three positive integers" in msg
    assert "`Partial.flops_per_sample` is missing. Fix: def flops_per_sample(self, seq_len)" in msg
    check_module(Partial(), needs=("compute_loss",))  # only what is asked for is checked
    with pytest.raises(ValueError, match="'loss'"):
        check_module(GoodModule(), needs=("loss",))


def test_validate_synthetic_batch_reports_both_shapes():
    with pytest.raises(MisconfigurationException) as err:
        validate_synthetic_batch(CountsBeforePatchify(), (1, 2, 2))
    assert "synthetic_batch(B=2, token_grid=(1, 2, 2))` returned a batch whose batch_shape is (2, 16); " \
        "expected (2, 4)" in str(err.value)

    class WrongGrid(GoodModule):
        def synthetic_batch(self, batch_size, token_grid, device=None):
            return super().synthetic_batch(batch_size, (1, 1, 1), device)

    with pytest.raises(MisconfigurationException, match=r"batch_shape is \(2, 1\); expected \(2, 6\)"):
        validate_synthetic_batch(WrongGrid(), (1, 2, 3))

    class NotAPair(GoodModule):
        def batch_shape(self, batch):
            return 8

    with pytest.raises(MisconfigurationException, match="returned 8; expected a pair"):
        validate_synthetic_batch(NotAPair())
    with pytest.raises(ValueError, match=r"token_grid=\(1, 0, 2\)"):
        validate_synthetic_batch(GoodModule(), (1, 0, 2))
    with pytest.raises(MisconfigurationException, match="`object.batch_shape` is missing"):
        validate_synthetic_batch(object())


def test_check_batch_against_plan_reports_both_shapes():
    m = GoodModule()
    batch = m.synthetic_batch(4, (3, 4, 6))
    assert check_batch_against_plan(m, batch, (3, 4, 6), 4) == (4, 72)
    with pytest.raises(MisconfigurationException) as err:
        check_batch_against_plan(m, batch, (5, 4, 6), 4)
    msg = str(err.value)
    assert "batch_shape (4, 72)" in msg and "planned (4, 120) (B=4, token grid (5, 4, 6) = 120 tokens)" in msg
    with pytest.raises(MisconfigurationException, match=r"planned \(2, 72\)"):
        check_batch_against_plan(m, batch, (3, 4, 6), 2)


def test_check_batch_shape_is_the_one_check_of_both_callers():
    # validate_synthetic_batch and check_batch_against_plan raise check_batch_shape's messages, word for word.
    m, bad = GoodModule(), CountsBeforePatchify()
    batch = bad.synthetic_batch(2, (1, 2, 2))
    assert check_batch_shape(m, batch, (1, 2, 2), 2, source="planned") == (2, 4)
    for source, call in [("synthetic", lambda: validate_synthetic_batch(bad, (1, 2, 2))),
                         ("planned", lambda: check_batch_against_plan(bad, batch, (1, 2, 2), 2))]:
        with pytest.raises(MisconfigurationException) as direct:
            check_batch_shape(bad, batch, (1, 2, 2), 2, source=source)
        with pytest.raises(MisconfigurationException) as via:
            call()
        assert str(via.value) == str(direct.value)
    with pytest.raises(ValueError, match="source='real'"):
        check_batch_shape(m, batch, (1, 2, 2), 2, source="real")


def test_flow_matching_module_satisfies_the_protocol():
    from lightning_adaptiveload.models.flow_matching import FlowMatchingModule

    module = FlowMatchingModule("tiny")
    if not hasattr(module, "batch_shape"):
        pytest.skip("FlowMatchingModule has no batch_shape yet")
    module.configure_model()
    check_module(module, REQUIRED_MEMBERS + OPTIONAL_MEMBERS)
    batch = validate_synthetic_batch(module, (2, 2, 3), device="cpu")
    assert module.batch_shape(batch) == (2, 12)
    assert torch.isfinite(module.compute_loss(batch))
    if hasattr(module, "flops_per_sample"):
        assert math.isfinite(module.flops_per_sample(12)) and module.flops_per_sample(12) > 0
