"""Tiny Wan checkpoints written in both published layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_adaptiveload.models.wan import WanModel
from lightning_adaptiveload.models.wan_weights import diffusers_key


def source_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny WanModel's weights, every tensor perturbed so none is zero or one (the head included)."""
    torch.manual_seed(seed)
    model = WanModel("tiny")
    return {k: (v + 0.05 * torch.randn_like(v)).contiguous() for k, v in model.state_dict().items()}


def write_wan(state: dict[str, torch.Tensor], path: Path) -> Path:
    """The original layout: one safetensors file with our (= Wan's) key names, in bf16 as released."""
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, path)
    return path


def write_diffusers(state: dict[str, torch.Tensor], root: Path) -> Path:
    """diffusers' layout: two ``diffusion_pytorch_model-0000x-of-00002.safetensors`` shards + index."""
    root.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        name = f"diffusion_pytorch_model-{i:05d}-of-00002.safetensors"
        save_file({diffusers_key(k): state[k] for k in part}, root / name)
        weight_map.update({diffusers_key(k): name for k in part})
    (root / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("wan_ckpt")
    state = source_state_dict()
    return {"state": state, "wan": write_wan(state, root / "wan2.1_tiny.safetensors"),
            "diffusers": write_diffusers(state, root / "transformer")}
