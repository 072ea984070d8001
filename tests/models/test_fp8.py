"""FP8 linear layers (``fp8``): which layers torchao's float8 training converts, and the checks around it.

FP8 GEMMs need a GPU of compute capability >= 8.9, so on CPU the conversion is checked by the layers it swaps
(the capability check patched out) and the training run by the error it stops with; ``cuda`` tests train.
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_adaptiveload.models.rectified_flow as rf
from lightning_adaptiveload.bucketing.policy import EqualTokenPolicy
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset
from lightning_adaptiveload.models.flow_matching import FlowMatchingModule
from lightning_adaptiveload.models.fp8 import FP8_RECIPES, check_fp8_device, convert_blocks_to_fp8
from lightning_adaptiveload.models.wan import WanModel

# What stays nn.Linear in the tiny WanModel: everything outside the blocks, and cross-attention K/V.
TINY_KEPT = {"text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2", "time_projection.1",
             "head.head", *(f"blocks.{i}.cross_attn.{p}" for i in range(2) for p in "kv")}
TINY_CONVERTED = [f"blocks.{i}.{name}" for i in range(2) for name in (
    "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.o", "ffn.0", "ffn.2")]


def _linears(model: nn.Module) -> tuple[set[str], set[str]]:
    """(names of torchao Float8Linear layers, names of plain nn.Linear layers) of ``model``."""
    from torchao.float8.float8_linear import Float8Linear

    fp8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    return fp8, {n for n, m in model.named_modules() if type(m) is nn.Linear}


@pytest.fixture
def capable_gpu(monkeypatch):
    """The run's device passes the capability check (the conversion itself runs on any device)."""
    monkeypatch.setattr(rf, "check_fp8_device", lambda owner, recipe, device: None)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_converts_the_blocks_linear_layers_but_cross_attention_kv(capable_gpu, recipe):
    pytest.importorskip("torchao.float8")
    module = FlowMatchingModule("tiny", fp8=recipe)
    module.configure_model()
    assert module.fp8_layers == TINY_CONVERTED
    converted, kept = _linears(module.model)
    assert converted == set(TINY_CONVERTED)
    assert kept == TINY_KEPT


def test_layers_whose_features_are_not_multiples_of_16_stay_linear():
    pytest.importorskip("torchao.float8")
    model = WanModel({"preset": "tiny", "ffn_dim": 72})  # ffn.0: 64 -> 72, ffn.2: 72 -> 64
    names = convert_blocks_to_fp8(model.blocks, "tensorwise", FlowMatchingModule.fp8_excluded)
    assert names == [n for n in TINY_CONVERTED if ".ffn." not in n]
    assert {f"blocks.{i}.ffn.{j}" for i in range(2) for j in (0, 2)} <= _linears(model)[1]
    # Already converted layers are left alone.
    assert convert_blocks_to_fp8(model.blocks, "tensorwise", FlowMatchingModule.fp8_excluded) == []


def test_conversion_keeps_the_parameters_and_works_on_the_meta_device():
    pytest.importorskip("torchao.float8")
    model = WanModel("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_blocks_to_fp8(model.blocks, "tensorwise", FlowMatchingModule.fp8_excluded)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with torch.device("meta"):
        meta = WanModel("tiny")
    assert convert_blocks_to_fp8(meta.blocks, "tensorwise", FlowMatchingModule.fp8_excluded) == TINY_CONVERTED


def test_diffusers_blocks_convert_but_attn2_kv(capable_gpu):
    pytest.importorskip("torchao.float8")
    pytest.importorskip("diffusers")
    from lightning_adaptiveload.integrations.diffusers import DiffusersWanModule

    # tests/integrations/test_diffusers.py's tiny transformer, widened to multiples of 16 (dim 32, ffn 64).
    config = {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4,
              "out_channels": 4, "text_dim": 8, "freq_dim": 16, "ffn_dim": 64, "num_layers": 2,
              "cross_attn_norm": True, "rope_max_seq_len": 32}
    module = DiffusersWanModule(config, text_len=3, fp8="tensorwise")
    module.configure_model()
    expected = [f"blocks.{i}.{name}" for i in range(2) for name in (
        "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0",
        "ffn.net.0.proj", "ffn.net.2")]
    assert module.fp8_layers == expected
    converted, kept = _linears(module.transformer)
    assert converted == set(expected)
    assert kept == {"condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2",
                    "condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1",
                    "condition_embedder.text_embedder.linear_2", "proj_out",
                    *(f"blocks.{i}.attn2.to_{p}" for i in range(2) for p in "kv")}
    module.configure_model()  # again (a second fit): nothing converted twice
    assert module.fp8_layers == expected


def test_bad_values_are_refused_at_construction():
    for bad in ("fp8", "TENSORWISE", True, 8):
        with pytest.raises(ValueError, match=r"`FlowMatchingModule\(fp8=.*\)` is not valid\. Expected one of "
                                             r"\(None, 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'\)"):
            FlowMatchingModule("tiny", fp8=bad)
    pytest.importorskip("diffusers")
    from lightning_adaptiveload.integrations.diffusers import DiffusersWanModule

    with pytest.raises(ValueError, match=r"`DiffusersWanModule\(fp8='e4m3'\)` is not valid"):
        DiffusersWanModule({"num_layers": 1}, fp8="e4m3")


def test_missing_torchao_names_the_install(capable_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    module = FlowMatchingModule("tiny", fp8="tensorwise")
    with pytest.raises(ImportError, match=r"`FlowMatchingModule\(fp8='tensorwise'\)` needs torchao: "
                                          r"pip install 'lightning-adaptiveload\[fp8\]'"):
        module.configure_model()


def test_capability_check_names_the_device_and_the_fix(monkeypatch):
    check_fp8_device("M", None, torch.device("cpu"))  # off: nothing to check
    with pytest.raises(MisconfigurationException, match=r"`M\(fp8='rowwise'\)` needs FP8 matmuls: a CUDA GPU of "
                                                        r"compute capability >= 8\.9 .*this run is on cpu\. "
                                                        r"Remove the fp8 setting or run on such a GPU"):
        check_fp8_device("M", "rowwise", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(MisconfigurationException,
                       match=r"this run is on cuda:1 \(NVIDIA A100-SXM4-80GB, compute capability 8\.0\)"):
        check_fp8_device("M", "tensorwise", torch.device("cuda", 1))
    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        check_fp8_device("M", "tensorwise", torch.device("cuda", 0))


def test_fit_on_cpu_stops_before_the_first_step_with_the_capability_error(tmp_path, monkeypatch):
    steps = []
    monkeypatch.setattr(FlowMatchingModule, "training_step", lambda self, batch, i: steps.append(i))
    dataset = SyntheticMixedDataset(8, [{"num_frames": 1, "height": 64, "width": 64, "weight": 1.0}],
                                    text_len=16, text_dim=32)
    module = FlowMatchingModule("tiny", fp8="tensorwise")
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationException, match=r"`FlowMatchingModule\(fp8='tensorwise'\)` needs FP8 "
                                                        r"matmuls.*this run is on cpu"):
        trainer.fit(module, datamodule=AdaptiveLoadDataModule(dataset, EqualTokenPolicy(64)))
    assert steps == [] and module.fp8_layers is None


def test_calibration_key_tells_fp8_from_bf16():
    bf16, fp8 = FlowMatchingModule("tiny").calibration_key(), FlowMatchingModule("tiny", fp8="tensorwise").calibration_key()
    assert bf16["fp8"] is None and fp8["fp8"] == "tensorwise"
    assert {k: v for k, v in fp8.items() if k != "fp8"} == {k: v for k, v in bf16.items() if k != "fp8"}
    assert FlowMatchingModule("tiny", fp8="rowwise").calibration_key() != fp8


class _Losses(pl.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_fit_start(self, trainer, pl_module):
        # Wan zero-inits the head, which would make the first loss independent of the blocks (and their
        # gradients zero): a seeded xavier head makes the first step run the FP8 forward and backward.
        weight = pl_module.model.head.head.weight
        nn.init.xavier_uniform_(weight, generator=torch.Generator(weight.device).manual_seed(0))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit_compiled(tmp_path, fp8):
    # dim 256 (2 heads of 128), 2 blocks; 2 images of 3 x 5 tokens: 30 rows, not a multiple of 16, so the
    # weight-gradient GEMMs need the padding torchao is configured with.
    config = {"preset": "tiny", "dim": 256, "ffn_dim": 1024, "num_heads": 2, "text_dim": 64, "text_len": 32}
    dataset = SyntheticMixedDataset(8, [{"num_frames": 1, "height": 48, "width": 80, "weight": 1.0}],
                                    text_len=32, text_dim=64)
    pl.seed_everything(0)
    module = FlowMatchingModule(config, lr=1e-3, seed=0, compile=True, fp8=fp8)
    losses = _Losses()
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, callbacks=[losses])
    trainer.fit(module, datamodule=AdaptiveLoadDataModule(dataset, EqualTokenPolicy(30)))
    return module, losses.losses


@pytest.mark.cuda
def test_compiled_fp8_training_tracks_bf16_on_a_capable_gpu(tmp_path):
    pytest.importorskip("torchao.float8")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need a GPU of compute capability >= 8.9")
    from torchao.float8.float8_linear import Float8Linear

    _, bf16 = _fit_compiled(tmp_path / "bf16", None)
    module, fp8 = _fit_compiled(tmp_path / "fp8", "tensorwise")
    layers = [m for name, m in module.model.named_modules() if name in set(module.fp8_layers)]
    assert len(layers) == 16 and all(isinstance(m, Float8Linear) for m in layers)
    assert len(fp8) == len(bf16) == 4 and all(torch.isfinite(torch.tensor(fp8)))
    # Same seed, batches and init: the first step's loss (and the later ones) within 5% of bf16's, and not
    # bit-equal to it (the FP8 GEMMs ran).
    assert fp8[0] != bf16[0] and abs(fp8[0] - bf16[0]) < 0.05 * abs(bf16[0])
    assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(fp8, bf16, strict=True))
