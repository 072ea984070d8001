"""Pretrained Wan 2.1 weights in both published layouts, loaded straight into a (sharded) WanModel.

* The original checkpoint (``Wan-AI/Wan2.1-T2V-*``): :class:`~lightning_adaptiveload.models.wan.WanModel`
  uses its key names (``blocks.0.self_attn.q.weight``, ``head.head.weight``, ...), optionally under a
  ``model.diffusion_model.`` prefix.
* diffusers' ``WanTransformer3DModel`` (``*-Diffusers`` repositories, ``transformer/`` folder:
  ``diffusion_pytorch_model-0000x-of-0000y.safetensors`` + index). :func:`diffusers_key` is the
  renaming of diffusers' ``convert_wan_transformer_to_diffusers`` (``loaders/single_file_utils.py``)
  restricted to the text-to-video keys; the tests check it against ``WanTransformer3DModel`` itself.

Both layouts may use the same file names, so the layout is told from the keys.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from lightning_adaptiveload.parallel.pretrained import checkpoint_files, load_safetensors_

__all__ = ["LAYOUTS", "detect_layout", "diffusers_key", "load_wan_weights_"]

LAYOUTS = ("wan", "diffusers")
_PREFIX = "model.diffusion_model."

# (ours, diffusers') substrings, applied in order. diffusers swaps the names of norm2 and norm3.
_RENAMES = (
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("cross_attn", "attn2"),
    ("self_attn", "attn1"),
    (".o.", ".to_out.0."),
    (".q.", ".to_q."),
    (".k.", ".to_k."),
    (".v.", ".to_v."),
    ("head.modulation", "scale_shift_table"),
    ("head.head", "proj_out"),
    ("modulation", "scale_shift_table"),
    ("ffn.0", "ffn.net.0.proj"),
    ("ffn.2", "ffn.net.2"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
)


def diffusers_key(name: str) -> str:
    """diffusers' ``WanTransformer3DModel`` key of a :class:`WanModel` state-dict name."""
    for ours, theirs in _RENAMES:
        name = name.replace(ours, theirs)
    return name


def detect_layout(keys: set[str] | dict[str, object]) -> str:
    """``"diffusers"`` when the keys are diffusers' (``condition_embedder.*``), else ``"wan"``."""
    return "diffusers" if any(k.startswith("condition_embedder.") for k in keys) else "wan"


def load_wan_weights_(model: nn.Module, path: str | os.PathLike, layout: str = "auto") -> str:
    """Load Wan 2.1 weights from ``path`` (file or directory) into ``model``; returns the layout used.

    ``model`` may be dense or sharded with FSDP2 (then each rank reads only its rows).

    Raises:
        ValueError: unknown ``layout``; see :func:`~lightning_adaptiveload.parallel.pretrained.load_safetensors_`
            for mismatching keys and shapes.
    """
    if layout not in ("auto", *LAYOUTS):
        raise ValueError(f"`layout={layout!r}` is not valid. Expected 'auto' or one of {LAYOUTS}.")
    keys = checkpoint_files(Path(path))
    if layout == "auto":
        layout = detect_layout(keys)
    if layout == "diffusers":
        key_of = diffusers_key
    elif any(k.startswith(_PREFIX) for k in keys):
        key_of = _PREFIX.__add__
    else:
        def key_of(name: str) -> str:
            return name
    load_safetensors_(model, path, key_of)
    return layout
