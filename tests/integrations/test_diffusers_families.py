"""DiffusersVideoModule across diffusers' video families: Wan 2.1 / 2.2, HunyuanVideo, CogVideoX, LTX-Video.

Every family is taken from its tiny Hydra config (conf/model/diffusers_*_tiny.yaml), so the configs users
pick with `model=` are the ones tested.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from hydra_compose import compose_train

pytest.importorskip("diffusers")

import lightning.pytorch as pl  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from lightning.fabric.utilities.exceptions import MisconfigurationException  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import lightning_adaptiveload  # noqa: E402
from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy  # noqa: E402
from lightning_adaptiveload.calibration.record import model_fingerprint  # noqa: E402
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule  # noqa: E402
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset  # noqa: E402
from lightning_adaptiveload.integrations.diffusers import DiffusersVideoModule, DiffusersWanModule  # noqa: E402
from lightning_adaptiveload.models.protocol import (  # noqa: E402
    OPTIONAL_MEMBERS,
    REQUIRED_MEMBERS,
    check_module,
    validate_synthetic_batch,
)

CONF_DIR = Path(lightning_adaptiveload.__file__).parent.parent / "conf"
# config → (diffusers class name, joint text attention, patch (t, h, w), VAE stride)
TINY = {
    "diffusers_wan2_1_tiny": ("WanTransformer3DModel", False, (1, 2, 2), (4, 8, 8)),
    "diffusers_wan2_2_tiny": ("WanTransformer3DModel", False, (1, 2, 2), (4, 16, 16)),
    "diffusers_hunyuan_video_tiny": ("HunyuanVideoTransformer3DModel", True, (1, 2, 2), (4, 8, 8)),
    "diffusers_cogvideox_tiny": ("CogVideoXTransformer3DModel", True, (1, 2, 2), (4, 8, 8)),
    "diffusers_ltx_video_tiny": ("LTXVideoTransformer3DModel", False, (1, 1, 1), (8, 32, 32)),
}
REAL = ["diffusers_wan2_1_1_3b", "diffusers_wan2_2_ti2v_5b", "diffusers_hunyuan_video", "diffusers_cogvideox_5b",
        "diffusers_ltx_video"]

pytestmark = pytest.mark.filterwarnings("ignore:adaln. using the PyTorch reference")


def _node(name: str):
    return OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")


def _module(name: str, **overrides) -> DiffusersVideoModule:
    node = _node(name)
    with open_dict(node):
        node.update(overrides)
    torch.manual_seed(0)
    return instantiate(node)


def _dataset(module: DiffusersVideoModule, n: int = 24) -> SyntheticMixedDataset:
    cfg = module.config
    return SyntheticMixedDataset(n, "tiny", latent_channels=cfg.in_dim, text_len=cfg.text_len, text_dim=cfg.text_dim,
                                 vae_stride=cfg.vae_stride, patch_size=cfg.patch_size,
                                 extra_inputs=getattr(cfg, "extra_inputs", None), seed=0)


def _datamodule(module):
    return AdaptiveLoadDataModule(_dataset(module), DualConstraintPolicy(m_mem=128, m_comp=128 * 64, p=2), seed=0)


class _LossTape(pl.Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()


def _fit(tmp_path, module, max_steps, ckpt_path=None, checkpoint_every=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    tape = _LossTape()
    callbacks = [tape]
    if checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=checkpoint_every, save_top_k=-1,
                                         filename="{step}"))
    trainer = pl.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_checkpointing=bool(checkpoint_every), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=_datamodule(module), ckpt_path=ckpt_path)
    return tape.losses


@pytest.mark.parametrize("name", list(TINY))
def test_each_family_provides_the_protocol_and_counts_its_attention_tokens(name):
    class_name, joint, patch, stride = TINY[name]
    module = _module(name)
    assert module.family.model_class.__name__ == class_name
    assert module.patch_size == patch and module.config.vae_stride == stride
    module.configure_model()
    check_module(module, REQUIRED_MEMBERS + OPTIONAL_MEMBERS)
    batch = validate_synthetic_batch(module, (2, 2, 3), device="cpu")
    assert module.batch_shape(batch) == (2, 12)
    text_len = module.hparams.text_len
    assert module.attention_tokens(12) == 12 + (text_len if joint else 0)
    loss = module.compute_loss(batch)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    # The prediction reached every parameter that takes part in training the family's task.
    without_grad = [n for n, p in module.named_parameters() if p.grad is None]
    assert len(without_grad) < len(list(module.parameters())) // 10, without_grad


@pytest.mark.slow  # 2 s on a 2-core CPU under load: off the quick path
@pytest.mark.parametrize("name", list(TINY))
def test_flops_per_sample_is_three_times_the_counted_forward_over_video_and_text(name):
    module = _module(name)
    module.configure_model()
    batch = module.synthetic_batch(2, (2, 2, 3))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:  # the math path is counted as matmuls
        module(batch["latents"], torch.tensor([500.0, 10.0]), batch["context"], **module._extras(batch))
    # The model ran attention over video + text (joint families), so the count has the text tokens in it.
    assert module.flops_per_sample(12) == pytest.approx(3 * counter.get_total_flops() / 2, rel=1e-12)


@pytest.mark.slow  # 21 s on a 2-core CPU under load: off the quick path
@pytest.mark.parametrize("name", ["diffusers_hunyuan_video_tiny", "diffusers_cogvideox_tiny",
                                  "diffusers_ltx_video_tiny", "diffusers_wan2_2_tiny"])
def test_each_family_resumes_with_the_uninterrupted_losses(tmp_path, name):
    full = _fit(tmp_path / "full", _module(name, activation_checkpointing="selective"), 4, checkpoint_every=2)
    assert len(full) == 4
    torch.manual_seed(99)  # another global RNG state: the draws are keyed by (seed, step, rank)
    resumed = _fit(tmp_path / "resumed", _module(name, activation_checkpointing="selective"), 4,
                   ckpt_path=tmp_path / "full" / "step=2.ckpt")
    assert sorted(resumed) == [3, 4]
    assert {s: full[s] for s in resumed} == resumed  # exactly equal


def test_the_calibration_key_differs_per_family_and_config_and_not_with_the_weights_source(tmp_path):
    import json

    import numpy as np

    from lightning_adaptiveload.calibration.calibrate import ProfileSettings
    from lightning_adaptiveload.callbacks._trainee import calibration_key

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    grids = np.array([(1, 2, 2), (1, 2, 4)])

    def key(module):
        return json.dumps(calibration_key(trainer, module, ProfileSettings(), grids, 3), sort_keys=True)

    keys = {name: key(_module(name)) for name in list(TINY) + REAL}
    assert len(set(keys.values())) == len(keys)  # every config its own calibration
    assert model_fingerprint(_module("diffusers_wan2_1_tiny")) != model_fingerprint(_module("diffusers_wan2_2_tiny"))
    deeper = _module("diffusers_hunyuan_video_tiny", transformer={**_node("diffusers_hunyuan_video_tiny").transformer,
                                                                  "num_single_layers": 2})
    assert key(deeper) != keys["diffusers_hunyuan_video_tiny"]
    hunyuan = json.loads(keys["diffusers_hunyuan_video_tiny"])
    assert hunyuan["batch"]["pooled"] == [[16], "torch.float32"]  # the family's extra input is in it
    assert hunyuan["attention_tokens"] == [[4, 12], [8, 16]]  # joint text tokens: S + 8
    assert "attention_tokens" not in json.loads(keys["diffusers_ltx_video_tiny"])
    # The same config read twice, or with another seed or weights directory: the same key (a calibration is reused).
    assert key(_module("diffusers_ltx_video_tiny", seed=5, lr=1e-2)) == keys["diffusers_ltx_video_tiny"]
    source = _module("diffusers_ltx_video_tiny")
    source.configure_model()
    source.transformer.save_pretrained(tmp_path)
    assert key(_module("diffusers_ltx_video_tiny", pretrained=str(tmp_path))) == keys["diffusers_ltx_video_tiny"]


@pytest.mark.parametrize("name", list(TINY))
def test_pretrained_weights_load_from_a_local_directory_through_the_config(tmp_path, name):
    source = _module(name)
    if source.family.model_class._keep_in_fp32_modules:  # diffusers loads those through accelerate
        pytest.importorskip("accelerate")
    source.configure_model()
    torch.manual_seed(3)
    for p in source.transformer.parameters():  # weights no fresh model has
        p.data.normal_()
    source.transformer.save_pretrained(tmp_path / "transformer")
    loaded = _module(name, pretrained=str(tmp_path))  # a model directory with transformer/
    loaded.configure_model()
    assert all(torch.equal(a, b) for a, b in zip(loaded.transformer.state_dict().values(),
                                                  source.transformer.state_dict().values(), strict=True))
    batch = source.synthetic_batch(1, (1, 2, 2))
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert torch.equal(loaded.compute_loss(batch, gen()), source.compute_loss(batch, gen()))
    # The directory's config alone builds the module (family from its _class_name).
    bare = DiffusersVideoModule(pretrained=str(tmp_path / "transformer"), text_len=source.hparams.text_len)
    assert bare.family is source.family and bare.patch_size == source.patch_size


def test_pretrained_without_accelerate_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    source = _module("diffusers_wan2_1_tiny")
    source.configure_model()
    source.transformer.save_pretrained(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real(n, *a))
    module = _module("diffusers_wan2_1_tiny", pretrained=str(tmp_path))
    with pytest.raises(ImportError, match=r"WanTransformer3DModel.*needs accelerate.*lightning-adaptiveload\[diffusers\]"):
        module.configure_model()


def test_real_size_configs_read_their_geometry_without_building_the_model():
    sizes = {name: (_module(name).config.dim, _module(name).config.num_layers) for name in REAL}
    assert sizes == {"diffusers_wan2_1_1_3b": (1536, 30), "diffusers_wan2_2_ti2v_5b": (3072, 30),
                     "diffusers_hunyuan_video": (3072, 60), "diffusers_cogvideox_5b": (3072, 42),
                     "diffusers_ltx_video": (2048, 28)}
    hunyuan = _module("diffusers_hunyuan_video")
    assert hunyuan.attention_tokens(32760) == 32760 + 256 and hunyuan.config.extra_inputs == {"pooled": [768]}
    assert _module("diffusers_ltx_video").attention_tokens(32760) == 32760


def test_a_wrong_patch_size_is_refused_against_the_latents():
    module = _module("diffusers_hunyuan_video_tiny")
    batch = module.synthetic_batch(2, (1, 2, 2))
    module.patch_size = (1, 1, 1)  # counts 4x the tokens the model makes
    with pytest.raises(MisconfigurationException, match=r"patch_size` is \(1, 1, 1\), but the transformer patchifies "
                                                         r"latents \[2, 16, 1, 4, 4\] by \(1, 2, 2\).*count 16 tokens "
                                                         r"a sample instead of 4"):
        module.batch_shape(batch)
    with pytest.raises(MisconfigurationException, match="patch_size"):
        module.training_step(batch, 0)


def test_hunyuan_needs_the_pooled_embedding_and_reads_an_optional_mask():
    module = _module("diffusers_hunyuan_video_tiny")
    module.configure_model()
    batch = module.synthetic_batch(2, (1, 2, 2))
    assert batch["pooled"].shape == (2, 16) and torch.equal(batch["context_mask"], torch.ones(2, 8, dtype=torch.long))
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    with_mask = module.compute_loss(batch, gen())
    without_mask = module.compute_loss({k: v for k, v in batch.items() if k != "context_mask"}, gen())
    assert torch.equal(with_mask, without_mask)  # no mask: every text token is real
    half = dict(batch, context_mask=torch.tensor([[1] * 4 + [0] * 4] * 2))
    assert not torch.equal(module.compute_loss(half, gen()), with_mask)  # the mask reaches the model
    del batch["pooled"]
    with pytest.raises(MisconfigurationException, match=r"a batch has no 'pooled' \(\[B, 16\].*"
                                                         r"SyntheticMixedDataset\(extra_inputs=\{'pooled': \[16\]\}\)"):
        module.compute_loss(batch)
    renamed = _module("diffusers_hunyuan_video_tiny", batch_keys={"pooled": "pooled_prompt_embeds"})
    assert "pooled_prompt_embeds" in renamed.synthetic_batch(1, (1, 1, 1))


@pytest.mark.parametrize("name", ["diffusers_hunyuan_video_tiny", "diffusers_ltx_video_tiny"])
def test_checkpointing_modes_give_the_gradients_of_none(name):
    module = _module(name)
    module.configure_model()
    batch = module.synthetic_batch(2, (2, 2, 2))
    grads = {}
    for mode in ("none", "selective", "full"):
        module.set_checkpointing(mode)
        module.zero_grad(set_to_none=True)
        module.compute_loss(batch, torch.Generator().manual_seed(0)).backward()
        grads[mode] = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    blocks = [m for m in module.transformer.modules() if type(m) in module.family.block_classes]
    assert blocks and {b.checkpointing for b in blocks} == {"full"}
    for mode in ("selective", "full"):
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads[mode], grads["none"], strict=True))


def test_family_arguments_are_checked_in_one_line():
    tiny = dict(_node("diffusers_hunyuan_video_tiny").transformer)
    with pytest.raises(ValueError, match=r"family='mochi'\)` is not valid. Expected one of \['cogvideox'"):
        DiffusersVideoModule(tiny, family="mochi")
    with pytest.raises(ValueError, match=r"does not say which model it configures. Pass `family="):
        DiffusersVideoModule(tiny)
    with pytest.raises(ValueError, match=r"family='wan'\)` disagrees with the transformer, a HunyuanVideo"):
        DiffusersVideoModule({**tiny, "_class_name": "HunyuanVideoTransformer3DModel"}, family="wan")
    with pytest.raises(ValueError, match=r"image_condition_type.*train the T2V config"):
        DiffusersVideoModule({**tiny, "image_condition_type": "latent_concat"}, family="hunyuan_video")
    cog = dict(_node("diffusers_cogvideox_tiny").transformer, use_rotary_positional_embeddings=False)
    with pytest.raises(ValueError, match=r"text_len=5\)`: CogVideoX with sincos .* Set text_len=8"):
        DiffusersVideoModule(cog, family="cogvideox", text_len=5)
    with pytest.raises(ValueError, match=r"pretrained='/nonexistent'\)` is not valid: no config.json"):
        DiffusersVideoModule(pretrained="/nonexistent")
    with pytest.raises(ValueError, match=r"batch_keys=\{'pooled': 'p'\}\)` is not valid"):
        DiffusersVideoModule(dict(_node("diffusers_wan2_1_tiny").transformer), family="wan", batch_keys={"pooled": "p"})
    assert DiffusersWanModule(dict(_node("diffusers_wan2_1_tiny").transformer)).family.name == "wan"  # the default


_compose_train = compose_train


# ~4 s on an idle 2-core CPU (profiles two shapes), ~10 s beside other jobs.
@pytest.mark.slow  # 7 s on a 2-core CPU under load: off the quick path
def test_adaptiveload_train_trains_hunyuan_video_on_the_synthetic_corpus_without_glue(tmp_path):
    from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
    from lightning_adaptiveload.cli.train import build

    cfg = _compose_train([
        "model=diffusers_hunyuan_video_tiny", "data=synthetic_tiny", "trainer=cpu", "logger=none",
        "++trainer.max_steps=3", "trainer.enable_progress_bar=false",
        "callbacks.shape_benchmark.max_shapes=2", "callbacks.shape_benchmark.batch_sizes=[1,2]",
        "callbacks.shape_benchmark.repeats=1", "callbacks.shape_benchmark.warmup=0",
    ], tmp_path)
    run = build(cfg)
    assert run.datamodule.dataset[0]["pooled"].shape == (16,)  # the corpus carries what the family reads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.trainer.fit(run.module, datamodule=run.datamodule)
    (bench,) = [cb for cb in run.trainer.callbacks if isinstance(cb, ShapeBenchmarkCallback)]
    assert bench.source == "profiled"
    assert run.trainer.global_step == 3 and torch.isfinite(run.trainer.callback_metrics["train/loss"])


def test_the_synthetic_corpus_carries_extra_inputs_without_changing_latents_or_context():
    plain = SyntheticMixedDataset(4, "tiny", latent_channels=4, text_len=3, text_dim=8, seed=0)
    extra = SyntheticMixedDataset(4, "tiny", latent_channels=4, text_len=3, text_dim=8, seed=0,
                                  extra_inputs={"pooled": [5]})
    a, b = plain[2], extra[2]
    assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["context"], b["context"])
    assert b["pooled"].shape == (5,) and torch.equal(b["pooled"], extra[2]["pooled"])  # a pure function of the index
    with pytest.raises(ValueError, match=r"extra_inputs=\{'context': \[5\]\}\)` is not valid"):
        SyntheticMixedDataset(4, "tiny", extra_inputs={"context": [5]})
    with pytest.raises(ValueError, match=r"extra_inputs=\{'pooled': \[0\]\}\)` is not valid"):
        SyntheticMixedDataset(4, "tiny", extra_inputs={"pooled": [0]})


@pytest.mark.slow  # ~15 s on a 2-core CPU: dynamo traces both block kinds
def test_hunyuan_compiled_blocks_compile_one_graph_per_block_kind_and_batch_one_for_every_bucket():
    # Dynamo's graphs with the eager backend: what the marks decide (inductor only lowers each graph, at
    # minutes a graph on a CPU). Without the marks every new grid compiled two more graphs.
    from torch._dynamo.utils import counters

    from lightning_adaptiveload.integrations import diffusers as integ
    from lightning_adaptiveload.models.compiling import compile_blocks

    torch._dynamo.reset()
    counters.clear()
    module = _module("diffusers_hunyuan_video_tiny")
    module.configure_model()
    eager = _module("diffusers_hunyuan_video_tiny")
    eager.configure_model()
    eager.load_state_dict(module.state_dict())
    blocks = [m for m in module.transformer.modules() if type(m) in module.family.block_classes]
    compile_blocks(blocks, integ._mark_block_inputs, backend="eager")
    module._blocks_compiled = True
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    for b, grid in [(2, (1, 2, 2)), (2, (2, 2, 3)), (2, (1, 4, 4)), (1, (3, 2, 3)), (2, (2, 4, 4)), (3, (1, 3, 5))]:
        batch = module.synthetic_batch(b, grid)
        assert torch.equal(module.compute_loss(batch, gen()), eager.compute_loss(batch, gen()))
    assert counters["stats"]["unique_graphs"] == 4  # {dual, single} x {B >= 2, B = 1}
    torch._dynamo.reset()



def test_hunyuan_drops_an_all_true_joint_mask_at_the_blocks_and_keeps_a_padded_one(monkeypatch):
    # Every text token real: the blocks' attention gets no mask (SDPA may then take its flash / cuDNN kernels) and
    # the loss is the one with the all-true mask kept; a padded context keeps its mask.
    from diffusers.models.transformers import transformer_hunyuan_video as hv

    module = _module("diffusers_hunyuan_video_tiny")
    module.configure_model()
    batch = module.synthetic_batch(2, (1, 2, 2))
    masks = []
    real = hv.HunyuanVideoAttnProcessor2_0.__call__

    def spy(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        masks.append(attention_mask)
        return real(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    monkeypatch.setattr(hv.HunyuanVideoAttnProcessor2_0, "__call__", spy)
    n = len(module.transformer.transformer_blocks) + len(module.transformer.single_transformer_blocks)
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    dense = module.compute_loss(batch, gen())
    assert len(masks) == n and masks == [None] * n
    family = type(module.family)
    with monkeypatch.context() as m:
        m.setattr(family, "all_text_real", staticmethod(lambda extras, mask: False))
        masks.clear()
        kept = module.compute_loss(batch, gen())
        assert len(masks) == n and all(bool(x.all()) for x in masks)
    torch.testing.assert_close(dense, kept, rtol=1e-6, atol=1e-7)
    masks.clear()
    module.compute_loss(dict(batch, context_mask=torch.tensor([[1] * 4 + [0] * 4] * 2)), gen())
    assert len(masks) == n and not any(bool(x.all()) for x in masks)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_every_family_checkpoints_through_the_one_mechanism(monkeypatch, mode):
    # The own Wan DiT, diffusers' Wan and HunyuanVideo blocks all recompute through
    # models.checkpointing.run_checkpointed (one call per block and forward), with the mode set on the block.
    from lightning_adaptiveload.models import checkpointing
    from lightning_adaptiveload.models.flow_matching import FlowMatchingModule

    calls = []
    real = checkpointing.run_checkpointed

    def counting(fn, block_mode, *args):
        calls.append(block_mode)
        return real(fn, block_mode, *args)

    monkeypatch.setattr(checkpointing, "run_checkpointed", counting)
    own = FlowMatchingModule(model="tiny", activation_checkpointing=mode)
    own.configure_model()
    modules = {"own wan": own}
    for name in ("diffusers_wan2_1_tiny", "diffusers_hunyuan_video_tiny"):
        modules[name] = _module(name, activation_checkpointing=mode)
        modules[name].configure_model()
    for name, module in modules.items():
        model = module._built_model()
        blocks = [m for m in model.modules() if getattr(m, "checkpointing", None) in checkpointing.CHECKPOINTING_MODES]
        calls.clear()
        module.compute_loss(module.synthetic_batch(1, (1, 2, 2)), torch.Generator().manual_seed(0)).backward()
        assert blocks and calls == [mode] * len(blocks), name
