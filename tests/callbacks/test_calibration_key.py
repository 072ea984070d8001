"""The calibration key is derived from the module (hyperparameters, architecture, synthetic batch shapes,
checkpointing, attention tokens): what changes the timed step re-profiles, what does not reuses."""

import importlib

import numpy as np
import pytest
from doc_mmdit import namespace
from lightning.pytorch import Trainer, seed_everything

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.calibration.calibrate import ProfileSettings
from lightning_adaptiveload.callbacks._trainee import calibration_key
from lightning_adaptiveload.callbacks.shape_benchmark import PROFILE_VERSION, ShapeBenchmarkCallback
from lightning_adaptiveload.data.collate import collate_batch
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset
from lightning_adaptiveload.models import FlowMatchingModule

GRIDS = np.array([(1, 4, 4), (1, 8, 8), (3, 4, 6)])
TINY = {"dim": 64, "ffn_dim": 128, "num_heads": 4, "num_layers": 2, "text_dim": 32, "text_len": 16}
NS = namespace()


def _trainer(**kwargs):
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   **kwargs)


def _key(module, trainer=None):
    return calibration_key(trainer or _trainer(), module, ProfileSettings(), GRIDS, PROFILE_VERSION)


def _wan(**kwargs):
    model = {**TINY, **kwargs.pop("model", {})}
    return FlowMatchingModule(model, **kwargs)


def _mmdit(text_len=16, **kwargs):
    module = NS["MyMMDiT"](text_len=text_len, channels=4, text_dim=8, **kwargs)
    dataset = SyntheticMixedDataset(4, "tiny", latent_channels=4, text_len=text_len, text_dim=8)
    module.set_example(collate_batch([dataset[0]]))
    return module


@pytest.mark.parametrize("change", [
    {"model": {"text_len": 32}}, {"activation_checkpointing": True}, {"model": {"dim": 32}},
    {"model": {"num_layers": 3}}, {"compile": True},
])
def test_a_setting_of_the_timed_step_gives_a_new_key(change):
    assert _key(_wan(**change)) != _key(_wan())


def test_optimizer_seed_and_loss_settings_keep_the_key():
    base = _key(_wan())
    assert _key(_wan(lr=3e-3, seed=7, weight_decay=0.1, betas=(0.8, 0.9), warmup_steps=5, timestep_shift=3.0,
                     optimizer_impl="foreach")) == base


def test_an_own_model_gets_its_key_from_its_batch_hparams_and_attention_tokens():
    base = _key(_mmdit())
    assert base["batch"]["context"] == [[16, 8], "torch.float32"]
    assert base["attention_tokens"] == [[16, 32], [64, 80], [72, 88]]
    assert base["hparams"] == {"channels": 4, "text_dim": 8, "text_len": 16}
    assert _key(_mmdit(text_len=32)) != base
    assert _key(_mmdit(dim=48)) != base and _key(_mmdit(depth=3)) != base
    assert _key(_mmdit(lr=1e-2)) == base
    # A context length the hyperparameters do not show is still seen in the synthetic batch's shapes.
    module = _mmdit()
    module.set_example(collate_batch([SyntheticMixedDataset(4, "tiny", latent_channels=4, text_len=24,
                                                            text_dim=8)[0]]))
    assert _key(module)["hparams"] == base["hparams"] and _key(module)["batch"] != base["batch"]


@pytest.fixture
def _keep_tiny_cpu_profiles(monkeypatch):
    conductor = importlib.import_module("lightning_adaptiveload.calibration.calibrate")
    monkeypatch.setattr(conductor, "NOISY_PROFILE_REL", float("inf"))


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_the_cache_is_reused_across_lr_seed_and_workers_and_not_across_text_length(tmp_path, _keep_tiny_cpu_profiles):
    def fit(text_len=16, num_workers=0, **kwargs):
        module = NS["MyMMDiT"](text_len=text_len, channels=4, text_dim=8, **kwargs)
        dataset = SyntheticMixedDataset(32, "tiny", latent_channels=4, text_len=text_len, text_dim=8)
        dm = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(m_mem=256, m_comp=256 * 64, p=2),
                                    num_workers=num_workers)
        cb = ShapeBenchmarkCallback(max_shapes=2, repeats=1, warmup=0, converge_rel=0.0, cache_dir=tmp_path / "cache",
                                    save_dir=tmp_path / "bench", closed_loop=False)
        _trainer(max_steps=1, use_distributed_sampler=False, callbacks=[cb], default_root_dir=tmp_path,
                 enable_checkpointing=False).fit(module, datamodule=dm)
        return cb

    assert fit().profiled
    seed_everything(5)  # the module's draws follow the global seed
    again = fit(lr=1e-3, num_workers=1)
    assert not again.profiled and again.source == "cache"
    assert fit(text_len=32).profiled
