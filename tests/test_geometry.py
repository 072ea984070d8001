import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_adaptiveload.geometry import latent_of_grid, pixel_token_grid, tokens_of

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_tokens_of_counts_after_patchify():
    latents = torch.zeros(3, 16, 21, 60, 104)
    assert tokens_of(latents) == (3, 21 * 30 * 52)
    assert tokens_of(latents.shape, (1, 4, 4)) == (3, 21 * 15 * 26)
    assert latent_of_grid((21, 30, 52)) == (21, 60, 104)
    assert pixel_token_grid(81, 480, 832) == (21, 30, 52)
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        tokens_of(torch.zeros(1, 16, 1, 6, 6), (1, 4, 4))
    with pytest.raises(ValueError, match=r"not \[B, C, F, H, W\]"):
        tokens_of(torch.zeros(16, 1, 6, 6))


def test_data_configs_take_patch_and_vae_stride_from_the_model():
    from hydra import compose, initialize_config_dir

    from lightning_adaptiveload.cli.train import build

    for data in ("synthetic_tiny", "synthetic_wan", "manifest"):
        text = (CONF / "data" / f"{data}.yaml").read_text()
        assert "patch_size: null" in text and "vae_stride: null" in text, data
    with initialize_config_dir(config_dir=os.fspath(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["++model.model.patch_size=[1,4,4]", "++model.model.vae_stride=[4,16,16]",
                                          "output_dir=/tmp/geometry_test", "trainer.devices=1",
                                          "data.dataset.num_samples=32"])
    run = build(cfg)
    dataset = run.datamodule.dataset
    assert dataset.patch_size == (1, 4, 4) and dataset.vae_stride == (4, 16, 16)
    # 64x64 pixels / 16 / 4 = 1 token a side.
    assert (1, 1, 1) in {tuple(g) for g in np.asarray(dataset.token_grids()).tolist()}
