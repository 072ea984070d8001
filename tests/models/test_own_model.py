"""An own model writes its forward only: the doc's MMDiT on RectifiedFlowModule (docs/your_own_model.md)."""

import numpy as np
import pytest
import torch
from doc_mmdit import glue_lines, namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_adaptiveload.data.collate import collate_batch
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset
from lightning_adaptiveload.models.protocol import attention_tokens_of, check_module, validate_synthetic_batch
from lightning_adaptiveload.models.rectified_flow import draw_seed

NS = namespace()


def _module(**kwargs):
    module = NS["MyMMDiT"](**{"text_len": 16, "channels": 4, "text_dim": 8, **kwargs})
    dataset = SyntheticMixedDataset(8, "tiny", latent_channels=4, text_len=kwargs.get("text_len", 16), text_dim=8,
                                    extra_inputs={"context_mask": [kwargs.get("text_len", 16)]})
    module.set_example(collate_batch([dataset[0]]))
    return module, dataset


def test_the_doc_glue_is_at_most_12_lines():
    lines = glue_lines()
    assert len(lines) <= 12, "\n".join(lines)


def test_the_base_gives_the_protocol_from_one_real_sample():
    module, dataset = _module()
    check_module(module, needs=("compute_loss", "synthetic_batch", "batch_shape", "patch_size", "attention_tokens",
                                "flops_per_sample"))
    batch = validate_synthetic_batch(module, token_grid=(3, 4, 6))
    # Every tensor key of the real sample, its shape and dtype; latents of the asked grid.
    real = collate_batch([dataset[0]])
    assert set(batch) == {k for k, v in real.items() if isinstance(v, torch.Tensor)}
    assert batch["latents"].shape == (2, 4, 3, 8, 12) and batch["context"].shape == (2, 16, 8)
    assert batch["context_mask"].shape == (2, 16) and batch["context_mask"].dtype == real["context_mask"].dtype
    # Building it leaves the global RNG alone.
    state = torch.random.get_rng_state()
    module.synthetic_batch(2, (1, 4, 4))
    assert torch.equal(state, torch.random.get_rng_state())
    assert attention_tokens_of(module)(72) == 72 + 16
    assert torch.isfinite(module.compute_loss(batch))


def test_draws_are_seeded_by_seed_step_and_rank():
    module, dataset = _module()
    batch = collate_batch([dataset[i] for i in (0, 0)])

    def loss(step, rank, seed=0):
        gen = torch.Generator().manual_seed(draw_seed(seed, step, rank))
        return float(module.compute_loss(batch, generator=gen))

    assert module.noise_generator("cpu", step=3, rank=1).initial_seed() == draw_seed(0, 3, 1)
    assert loss(3, 1) == loss(3, 1)
    assert len({loss(3, 1), loss(4, 1), loss(3, 0)}) == 3


def test_the_flop_count_covers_the_joint_text_tokens():
    module, _ = _module()
    s = 64
    flops = module.flops_per_sample(s)
    # More text tokens: more FLOPs at the same video length (the joint attention and the text stream).
    longer, _ = _module(text_len=48)
    assert longer.flops_per_sample(s) > flops > 0
    # The attention alone over S + L tokens: 2 matmuls of 2·(S+L)²·dim per block, forward, x3 for backward.
    dim, depth = 32, 2
    attention = 3 * depth * 2 * 2 * (s + 16) ** 2 * dim
    assert flops > attention


def test_a_batch_with_another_text_length_is_refused_naming_the_fix():
    module, _ = _module()
    other = SyntheticMixedDataset(4, "tiny", latent_channels=4, text_len=20, text_dim=8)
    with pytest.raises(MisconfigurationException, match=r"has L=20 tokens, but the model is set up for text_len=16.*"
                       r"Pad or truncate the contexts to 16 tokens"):
        module.check_batch(collate_batch([other[0]]))


def test_without_an_example_synthetic_batch_says_how_to_get_one():
    module = NS["MyMMDiT"](channels=4, text_dim=8)
    with pytest.raises(MisconfigurationException, match=r"set_example\(collate_batch\(\[dataset\[0\]\]\)\)"):
        module.synthetic_batch(1, (1, 2, 2))
    assert np.isfinite(module.hparams.lr)


@pytest.mark.slow
def test_the_doc_mmdit_resumes_with_the_losses_of_the_uninterrupted_run(tmp_path):
    import lightning as L

    from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule

    class Losses(L.Callback):
        def __init__(self):
            self.seen = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen[trainer.global_step] = float(outputs["loss"])

    def fit(max_steps, ckpt=None):
        L.seed_everything(0)
        module = NS["MyMMDiT"](text_len=16, channels=4, text_dim=8)
        dataset = SyntheticMixedDataset(32, "tiny", latent_channels=4, text_len=16, text_dim=8)
        dm = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(m_mem=128, m_comp=128 * 64, p=2))
        losses = Losses()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                            default_root_dir=tmp_path, callbacks=[losses])
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
        return trainer, losses.seen

    _, full = fit(4)
    trainer, first = fit(2)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    _, rest = fit(4, tmp_path / "half.ckpt")
    assert {**first, **rest} == full and set(rest) == {3, 4}
