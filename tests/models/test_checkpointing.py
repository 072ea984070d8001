import pytest
import torch

from lightning_adaptiveload.models import checkpointing, wan
from lightning_adaptiveload.models.rectified_flow import check_training_arguments
from lightning_adaptiveload.models.wan import WAN_CONFIGS, WanAttentionBlock, WanModel


def test_modes_and_settings_parse_in_one_place():
    assert checkpointing.CHECKPOINTING_MODES == ("none", "selective", "full")
    assert [checkpointing.checkpointing_mode(m) for m in (True, False, "selective")] == ["full", "none", "selective"]
    assert [checkpointing.checkpointing_setting(m) for m in ("auto", True, "none")] == ["auto", "full", "none"]
    with pytest.raises(ValueError, match="'auto' is not valid"):
        checkpointing.checkpointing_mode("auto")
    with pytest.raises(ValueError, match="'some' is not valid"):
        checkpointing.checkpointing_setting("some")
    check_training_arguments("M", activation_checkpointing="auto")
    with pytest.raises(ValueError, match=r"Expected one of \['none', 'selective', 'full', 'auto'\] or true/false"):
        check_training_arguments("M", activation_checkpointing="some")


def test_old_import_paths_are_the_mechanism():
    for name in ("CHECKPOINTING_MODES", "checkpointing_mode", "keep_attention_outputs", "run_checkpointed",
                 "_ATTENTION_OPS"):
        assert getattr(wan, name) is getattr(checkpointing, name), name


def test_apply_checkpointing_refuses_a_bad_mode_before_changing_a_block():
    model = WanModel(WAN_CONFIGS["tiny"])
    is_block = lambda m: isinstance(m, WanAttentionBlock)  # noqa: E731
    with pytest.raises(ValueError, match="'some' is not valid"):
        checkpointing.apply_checkpointing(model, "some", is_block)
    assert {b.checkpointing for b in model.blocks} == {"none"}
    assert checkpointing.apply_checkpointing(model, True, is_block) == len(model.blocks)
    assert {b.checkpointing for b in model.blocks} == {"full"}


def test_installed_forward_runs_the_body_under_the_blocks_mode():
    def forward(self, x):
        return checkpointing.run_checkpointed(getattr(self, checkpointing.BODY), self.checkpointing, x)

    block = torch.nn.Linear(3, 3)
    checkpointing.install_checkpointed_forward(block, forward)
    assert checkpointing.has_forward(block, forward) and block.checkpointing == "none"
    body = getattr(block, checkpointing.BODY)
    checkpointing.install_checkpointed_forward(block, forward)  # once: the body is kept
    assert getattr(block, checkpointing.BODY) is body
    x = torch.randn(2, 3)
    ref = torch.nn.functional.linear(x, block.weight, block.bias)
    for mode in checkpointing.CHECKPOINTING_MODES:
        block.checkpointing = mode
        torch.testing.assert_close(block(x), ref)
