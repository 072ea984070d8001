"""Pretrained Wan 2.1 weights in the original and diffusers layouts, dense (one process); the
two-rank FSDP2 loads are in test_fsdp_training.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_adaptiveload.models.flow_matching import FlowMatchingModule
from lightning_adaptiveload.models.wan import WanModel
from lightning_adaptiveload.models.wan_weights import detect_layout, diffusers_key, load_wan_weights_
from lightning_adaptiveload.parallel.pretrained import checkpoint_files


def _diffusers_model(model: WanModel):
    from diffusers import WanTransformer3DModel

    c = model.config
    return WanTransformer3DModel(
        patch_size=c.patch_size, num_attention_heads=c.num_heads, attention_head_dim=c.head_dim,
        in_channels=c.in_dim, out_channels=c.out_dim, text_dim=c.text_dim, freq_dim=c.freq_dim, ffn_dim=c.ffn_dim,
        num_layers=c.num_layers, cross_attn_norm=c.cross_attn_norm, qk_norm="rms_norm_across_heads", eps=c.eps,
    )


def test_diffusers_layout_is_what_WanTransformer3DModel_loads_and_computes_the_same(checkpoints):
    pytest.importorskip("diffusers")
    ours = WanModel("tiny")
    ours.load_state_dict(checkpoints["state"])
    theirs = _diffusers_model(ours)
    files = sorted(set(checkpoint_files(checkpoints["diffusers"]).values()))
    assert len(files) == 2
    state = {k: v for f in files for k, v in load_file(f).items()}
    theirs.load_state_dict(state, strict=True)  # every key and shape of diffusers' own model
    torch.manual_seed(1)
    x, t, ctx = torch.randn(2, 16, 3, 8, 8), torch.tensor([100.0, 800.0]), torch.randn(2, 16, 32)
    want = ours(x, t, ctx)
    got = theirs(x, t, ctx, return_dict=False)[0]
    # Same function (norm2/norm3 swap, attention names, head): equal to float32 rounding.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["wan", "diffusers"])
def test_flow_matching_module_loads_pretrained_in_both_layouts_exactly(checkpoints, layout):
    module = FlowMatchingModule("tiny", pretrained=str(checkpoints[layout]))
    module.configure_model()
    source = checkpoints["state"]
    for name, p in module.model.state_dict().items():
        # The original layout is stored in bf16 (as released); loading casts it up exactly.
        want = source[name].to(torch.bfloat16).float() if layout == "wan" else source[name]
        assert torch.equal(p, want), name
    assert detect_layout(checkpoint_files(checkpoints[layout])) == layout


def test_original_layout_with_the_diffusion_model_prefix_and_an_index(tmp_path, checkpoints):
    state = checkpoints["state"]
    keys = sorted(state)
    save_file({f"model.diffusion_model.{k}": state[k] for k in keys[:5]}, tmp_path / "a.safetensors")
    save_file({f"model.diffusion_model.{k}": state[k] for k in keys[5:]}, tmp_path / "b.safetensors")
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps({"weight_map": {
        f"model.diffusion_model.{k}": ("a" if i < 5 else "b") + ".safetensors" for i, k in enumerate(keys)}}))
    model = WanModel("tiny")
    assert load_wan_weights_(model, tmp_path) == "wan"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _rewrite(src, dst, change):
    state = load_file(src)
    change(state)
    save_file(state, dst)
    return dst


def test_a_missing_key_is_named_with_what_was_expected(tmp_path, checkpoints):
    path = _rewrite(checkpoints["wan"], tmp_path / "w.safetensors", lambda s: s.pop("blocks.1.ffn.2.weight"))
    with pytest.raises(KeyError, match=r"no key 'blocks\.1\.ffn\.2\.weight'.*model tensor 'blocks\.1\.ffn\.2\.weight', shape \(64, 128\)"):
        load_wan_weights_(WanModel("tiny"), path)


def test_a_shape_mismatch_is_named_with_the_expected_shape(tmp_path, checkpoints):
    def change(s):
        s["head.head.weight"] = torch.zeros(64, 32)

    path = _rewrite(checkpoints["wan"], tmp_path / "w.safetensors", change)
    with pytest.raises(ValueError, match=r"'head\.head\.weight' has shape \(64, 32\); expected \(64, 64\)"):
        load_wan_weights_(WanModel("tiny"), path)


def test_an_unexpected_key_is_named(tmp_path, checkpoints):
    def change(s):
        s["img_emb.proj.0.weight"] = torch.zeros(3)

    path = _rewrite(checkpoints["wan"], tmp_path / "w.safetensors", change)
    with pytest.raises(KeyError, match=r"'img_emb\.proj\.0\.weight' \(1 unexpected"):
        load_wan_weights_(WanModel("tiny"), path)


def test_a_diffusers_checkpoint_of_another_size_names_the_first_mismatch(tmp_path, checkpoints):
    # The tiny diffusers checkpoint into a 3-layer model: its first missing key is block 2's.
    model = WanModel({"preset": "tiny", "num_layers": 3})
    with pytest.raises(KeyError, match=r"no key 'blocks\.2\.scale_shift_table' \(model tensor 'blocks\.2\.modulation'"):
        load_wan_weights_(model, checkpoints["diffusers"])


def test_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="pretrained="):
        FlowMatchingModule("tiny", pretrained=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"holds no `\*\.safetensors`"):
        load_wan_weights_(WanModel("tiny"), tmp_path)
    with pytest.raises(ValueError, match="layout='hf'"):
        load_wan_weights_(WanModel("tiny"), tmp_path, layout="hf")


def test_diffusers_key_examples():
    assert diffusers_key("blocks.0.self_attn.q.weight") == "blocks.0.attn1.to_q.weight"
    assert diffusers_key("blocks.3.cross_attn.o.bias") == "blocks.3.attn2.to_out.0.bias"
    assert diffusers_key("blocks.0.norm3.weight") == "blocks.0.norm2.weight"
    assert diffusers_key("blocks.0.modulation") == "blocks.0.scale_shift_table"
    assert diffusers_key("head.modulation") == "scale_shift_table"
    assert diffusers_key("head.head.weight") == "proj_out.weight"
    assert diffusers_key("time_projection.1.weight") == "condition_embedder.time_proj.weight"
