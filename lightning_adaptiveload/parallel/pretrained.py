"""Load safetensors checkpoints into a (sharded) model, each rank reading only the slices it owns.

A checkpoint is one ``*.safetensors`` file, a directory of them, or a directory with a
``*.safetensors.index.json`` (the Hugging Face sharded layout: ``{"weight_map": {key: file}}``).
:func:`load_safetensors_` maps every parameter name of the model to a checkpoint key, checks that
the keys and shapes match before it reads any tensor (the first mismatch is named, with what was
expected), then copies ``safe_open(file).get_slice(key)[local rows]`` into each parameter's local
shard (:func:`~lightning_adaptiveload.parallel.fsdp.local_slices`): with FSDP2 a rank reads
1/world of the weights, without it the whole tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from lightning_adaptiveload.parallel.fsdp import local_slices, local_tensor

__all__ = ["checkpoint_files", "checkpoint_shapes", "load_safetensors_"]


def checkpoint_files(path: str | os.PathLike) -> dict[str, Path]:
    """Map every tensor key of a safetensors checkpoint to the file that holds it (headers only).

    Raises:
        FileNotFoundError: ``path`` does not exist, holds no ``*.safetensors``, or its index names a
            missing file.
        ValueError: a directory with more than one index, or a key in two files.
    """
    from safetensors import safe_open

    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"Pretrained checkpoint {str(root)!r} does not exist.")
    if root.is_file():
        if root.suffix != ".safetensors":
            raise ValueError(f"Pretrained checkpoint {str(root)!r} is not a `.safetensors` file or a directory.")
        with safe_open(root, framework="pt") as f:
            return dict.fromkeys(f.keys(), root)
    indexes = sorted(root.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(
            f"Pretrained checkpoint directory {str(root)!r} has several indexes {[p.name for p in indexes]}. "
            "Point to the one model's directory (or its single file)."
        )
    if indexes:
        weight_map = json.loads(indexes[0].read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{indexes[0]} has no `weight_map`. Expected {{'weight_map': {{key: file}}}}.")
        files = {key: root / name for key, name in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"{indexes[0]} names files that do not exist: {missing}.")
        return files
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"Pretrained checkpoint directory {str(root)!r} holds no `*.safetensors` file.")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                if key in files:
                    raise ValueError(f"Key {key!r} is in both {files[key].name} and {shard.name} under {str(root)!r}.")
                files[key] = shard
    return files


def checkpoint_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Shape of every key (from the safetensors headers, no tensor data read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if files.get(key) == file:
                    shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def load_safetensors_(
    model: nn.Module,
    path: str | os.PathLike,
    key_of: Callable[[str], str] = lambda name: name,
    ignore: Iterable[str] = (),
) -> int:
    """Copy a safetensors checkpoint into ``model``'s parameters and buffers, shard by shard.

    Args:
        model: a dense model or one sharded by ``fully_shard`` (DTensor parameters, materialised).
        path: see :func:`checkpoint_files`.
        key_of: checkpoint key of a model state-dict name (the layout's naming).
        ignore: checkpoint keys the model does not need (not reported as unexpected).

    Returns:
        The number of tensors loaded.

    Raises:
        KeyError: the first model tensor whose key the checkpoint lacks, or the first checkpoint key
            the model does not have (names both and says which layout was expected).
        ValueError: the first key whose shape differs from the model's.
    """
    from safetensors import safe_open

    files = checkpoint_files(path)
    shapes = checkpoint_shapes(files)
    targets = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    keys = {name: key_of(name) for name in targets}
    for name, key in keys.items():
        if key not in shapes:
            near = sorted(shapes)[:3]
            raise KeyError(
                f"Pretrained checkpoint {str(path)!r} has no key {key!r} (model tensor {name!r}, "
                f"shape {tuple(targets[name].shape)}); its keys start {near}. Is it a checkpoint of this "
                "model and layout?"
            )
        if shapes[key] != tuple(targets[name].shape):
            raise ValueError(
                f"Pretrained checkpoint {str(path)!r}: key {key!r} has shape {shapes[key]}; expected "
                f"{tuple(targets[name].shape)} for model tensor {name!r}. Is it the same model size?"
            )
    unexpected = sorted(set(shapes) - set(keys.values()) - set(ignore))
    if unexpected:
        raise KeyError(
            f"Pretrained checkpoint {str(path)!r} has key {unexpected[0]!r} ({len(unexpected)} unexpected in all) "
            "that no model tensor maps to. Is it another model variant (e.g. image-to-video)?"
        )
    by_file: dict[Path, list[str]] = {}
    for name, key in keys.items():
        by_file.setdefault(files[key], []).append(name)
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            with safe_open(file, framework="pt") as f:
                for name in names:
                    target = targets[name]
                    local = local_tensor(target)
                    if local.numel() == 0:  # an empty last shard (fewer rows than ranks)
                        continue
                    part = f.get_slice(keys[name])[local_slices(target)]
                    local.copy_(part.to(dtype=local.dtype, device=local.device))
    return len(keys)
