"""FP8 linear layers in training (``model.fp8``, off by default), through torchao's float8 training.

torchao's ``convert_to_float8_training`` swaps an ``nn.Linear`` for its ``Float8Linear``, which casts the
inputs, weights and output gradients of the layer's three GEMMs to float8 with dynamic scales and runs
them with ``torch._scaled_mm``. torchao is the maintained implementation (compile support, FSDP2,
recipes); this module adds only which layers to convert and the checks of the argument, the device
and the install.

Converted: the ``nn.Linear`` layers of the repeated transformer blocks (attention projections and FFN),
where the block's GEMM FLOPs are. Left in bf16:

* everything outside the blocks: the patch embedding, the text and time MLPs and the time projection
  (GEMMs of B × 512 or B rows, too small for the FP8 casts to pay) and the head, whose output is the
  fp32 velocity the loss sees;
* the cross-attention K/V projections: they run on the B × 512 text tokens, too few rows for the
  casts to pay (the Q and output projections run on the video tokens and are converted);
* any Linear whose in or out features are not multiples of 16, which ``torch._scaled_mm`` requires.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_adaptiveload._checks import check_choice

__all__ = ["FP8_RECIPES", "MIN_CAPABILITY", "check_fp8", "check_fp8_device", "convert_blocks_to_fp8"]

#: What ``fp8`` accepts besides ``None`` (off): the recipe names of torchao 0.18's
#: ``Float8LinearConfig.from_recipe_name``. ``tensorwise``: one scale per tensor; ``rowwise``: one per
#: row, more accurate, slower on the Wan 1.3B FFN GEMMs; ``rowwise_with_gw_hp``: rowwise, and the weight
#: gradient GEMM in high precision.
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")

#: FP8 tensor cores (``torch._scaled_mm``): compute capability 8.9 (Ada) and newer (Hopper: 9.0).
MIN_CAPABILITY: tuple[int, int] = (8, 9)


def check_fp8(owner: str, value: Any) -> str | None:
    """``value`` when it is ``None`` or one of :data:`FP8_RECIPES`; else ``ValueError`` naming
    ``owner(fp8=value)``."""
    return check_choice(owner, "fp8", value, (None, *FP8_RECIPES))


def check_fp8_device(owner: str, recipe: str | None, device: torch.device) -> None:
    """Refuse ``fp8`` on a device without FP8 matmuls (anything but a CUDA GPU of capability >= 8.9).

    Raises:
        MisconfigurationException: naming ``owner(fp8=recipe)``, the run's device and the fix.
    """
    if recipe is None:
        return
    where = str(device)
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= MIN_CAPABILITY:
            return
        where += f" ({torch.cuda.get_device_name(device)}, compute capability {capability[0]}.{capability[1]})"
    raise MisconfigurationException(
        f"`{owner}(fp8={recipe!r})` needs FP8 matmuls: a CUDA GPU of compute capability >= "
        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada or Hopper, e.g. L40S, H100, H200); this run is on {where}. "
        "Remove the fp8 setting or run on such a GPU."
    )


def _converter(owner: str, recipe: str) -> Callable[..., nn.Module]:
    """torchao's ``convert_to_float8_training`` with the recipe's config; an ImportError naming the install."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ImportError(
            f"`{owner}(fp8={recipe!r})` needs torchao: pip install 'lightning-adaptiveload[fp8]'"
        ) from err
    # The weight-gradient GEMM contracts over the micro-batch's B·S tokens, which `torch._scaled_mm` wants
    # a multiple of 16; Wan's are often only of 8 (S = 1,560 for a 480p image, 32,760 for 81 frames of
    # 480p video), so torchao pads that inner dim with zeros where needed.
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    return functools.partial(convert_to_float8_training, config=config)


def convert_blocks_to_fp8(
    blocks: Sequence[nn.Module],
    recipe: str,
    excluded: Collection[str],
    prefix: str = "blocks",
    owner: str = "",
) -> list[str]:
    """Swap the ``nn.Linear`` layers of each block for torchao's ``Float8Linear``, in place.

    Parameters keep their names and values (``state_dict`` is unchanged), so it works on meta-device
    blocks before FSDP2 shards them and must run before the blocks are compiled.

    Args:
        blocks: the model's repeated transformer blocks (e.g. ``model.blocks``).
        recipe: one of :data:`FP8_RECIPES`.
        excluded: names inside a block that stay ``nn.Linear`` (e.g. ``{"cross_attn.k", "cross_attn.v"}``);
            so do layers whose in or out features are not multiples of 16, and layers already converted.
        prefix: the blocks' name in the model, for the names returned.
        owner: the class whose ``fp8`` argument this is, for the error messages.

    Returns:
        The converted layers' qualified names, ``f"{prefix}.{i}.{name}"``.

    Raises:
        ImportError: torchao is not installed (with the command that installs it).
    """
    convert = _converter(owner, recipe)
    converted: list[str] = []
    for i, block in enumerate(blocks):

        def keep(module: nn.Module, name: str, i: int = i) -> bool:
            # Exactly nn.Linear: Float8Linear subclasses it, and converting twice would double the casts.
            ok = (
                type(module) is nn.Linear
                and name not in excluded
                and module.in_features % 16 == 0
                and module.out_features % 16 == 0
            )
            if ok:
                converted.append(f"{prefix}.{i}.{name}")
            return ok

        convert(block, module_filter_fn=keep)
    return converted
