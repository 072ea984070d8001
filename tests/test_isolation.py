"""The suite's isolation of process-wide torch state (tests/conftest.py): the two tests run in file order, the
second after the first has left deterministic mode on through Lightning, as the GPU resume test does."""

import lightning.pytorch as pl
import torch


def test_trainer_turns_deterministic_mode_on_for_the_process():
    pl.Trainer(deterministic=True, accelerator="cpu", logger=False, enable_checkpointing=False)
    assert torch.are_deterministic_algorithms_enabled()


def test_the_next_test_starts_with_it_off():
    # Left on, every torch.empty of the later tests fills its memory: the AdaLN backward's kernel count (a GPU
    # test) saw two fill kernels after the deterministic resume test had run.
    assert not torch.are_deterministic_algorithms_enabled()
