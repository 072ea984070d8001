"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and HSDP for any model with repeated blocks.

Nothing here knows Wan: the block type, the modules kept in fp32 and the init function are passed
in, so a user's model shards the same way. The order of the steps follows torchtitan's
``parallelize_llama``: activation checkpointing inside each block, then compile each block, then
``fully_shard`` each block, then the root (one all-gather per block; the root group holds the rest).

* :func:`fsdp_mesh` reads the device mesh a strategy set (``LightningModule.device_mesh``):
  ``("shard",)`` is FSDP, ``("replicate", "shard")`` is HSDP (replicate across nodes, shard inside a
  node), and Lightning's ``("data_parallel", "tensor_parallel")`` mesh of ``ModelParallelStrategy`` is
  FSDP over ``data_parallel`` when ``tensor_parallel`` has size 1.
* :func:`build_fsdp_mesh` builds those meshes and refuses sizes that do not tile the world.
* :func:`fully_shard_model` shards a (meta-device) model per block with a
  ``MixedPrecisionPolicy``.
* :func:`materialize_` allocates each rank's shards only (``to_empty``) and initialises them with
  exactly the values the dense model would get from the same seed (:func:`dense_equivalent_init`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "build_fsdp_mesh",
    "check_shard_size",
    "dense_equivalent_init",
    "fsdp_mesh",
    "fully_shard_model",
    "initialize_",
    "local_slices",
    "local_tensor",
    "materialize_",
]

# Mesh dimension names (torchtitan calls them "dp_replicate" and "fsdp").
REPLICATE = "replicate"
SHARD = "shard"

# In-place random fills (aten) that the init functions of torch.nn.init reduce to.
_RANDOM_FILLS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_",
                 "random_")
)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def local_slices(tensor: torch.Tensor) -> tuple[slice, ...]:
    """Index of this rank's shard in the full (global) tensor; the whole tensor for a plain one.

    ``full[local_slices(t)]`` has the shape of ``local_tensor(t)``, uneven last shards included.
    """
    if not _is_dtensor(tensor):
        return tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


class _DenseEquivalentInit(TorchDispatchMode):
    """Runs each random fill of a DTensor on a full-size temporary and keeps this rank's slice.

    Every rank draws the whole tensor from the same RNG state, so the shards together equal what the
    dense model draws from that seed, whatever the mesh (DTensor's own random ops only give that on
    CUDA meshes, and draw other numbers than a dense run). Costs one full parameter of scratch at a
    time (283 MB for Wan 14B's largest, fp32) and every rank's time to draw the whole model.

    A dispatch mode, not a function mode: ``nn.init`` functions re-dispatch through
    ``__torch_function__`` and would reach the fill with a function mode switched off; at the aten
    level every fill is seen, before DTensor's own dispatch.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _RANDOM_FILLS and args and _is_dtensor(args[0]):
            target = args[0]
            local = target._local_tensor  # the storage itself; to_local() would dispatch a view
            full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
            func(full, *args[1:], **kwargs)
            local.copy_(full[local_slices(target)])
            return target
        return func(*args, **kwargs)


@contextmanager
def dense_equivalent_init() -> Iterator[None]:
    """Inside it, ``nn.init`` on DTensor parameters gives each rank the shard of the dense init.

    Example::

        with dense_equivalent_init():
            nn.init.xavier_uniform_(sharded_linear.weight)  # == the dense init's rows of this rank
    """
    with _DenseEquivalentInit():
        yield


def _modules_with_own_tensors(model: nn.Module) -> Iterator[nn.Module]:
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            yield module


def initialize_(model: nn.Module, init: Callable[[], None] | None = None) -> None:
    """``reset_parameters()`` of every module that owns tensors, then ``init()`` (the model's own scheme).

    The same RNG draws, in the same order, for a dense model and a sharded one (under
    :func:`dense_equivalent_init`), so both get identical weights from one seed.

    Raises:
        TypeError: a module owns parameters or buffers but has no ``reset_parameters`` (its memory
            would stay uninitialised after ``to_empty``).
    """
    modules = list(_modules_with_own_tensors(model))
    missing = sorted({type(m).__name__ for m in modules if not callable(getattr(m, "reset_parameters", None))})
    if missing:
        raise TypeError(
            f"Modules {missing} of {type(model).__name__} own parameters or buffers but define no "
            "`reset_parameters()`, so their memory would stay uninitialised after `to_empty`. "
            "Add a `reset_parameters()` that fills them."
        )
    with torch.no_grad():
        for module in modules:
            module.reset_parameters()
        if init is not None:
            init()


def materialize_(model: nn.Module, device: torch.device | str, init: Callable[[], None] | None = None) -> None:
    """Allocate a meta-device (sharded) model on ``device`` and initialise it shard by shard.

    ``to_empty`` allocates only each rank's local shards; :func:`initialize_` then fills them under
    :func:`dense_equivalent_init`, so the sharded weights equal the dense model's for the same seed.
    """
    model.to_empty(device=device)
    with dense_equivalent_init():
        initialize_(model, init)


def build_fsdp_mesh(world_size: int, shard_size: int | None, device_type: str) -> Any:
    """A ``("shard",)`` mesh over all ranks (FSDP) or a ``("replicate", "shard")`` mesh (HSDP).

    Args:
        world_size: number of ranks.
        shard_size: ranks one model copy is sharded over (HSDP: the GPUs of a node); ``None`` or
            ``world_size``: shard over all ranks.
        device_type: ``"cuda"`` or ``"cpu"``.

    Raises:
        ValueError: ``shard_size`` is not a positive divisor of ``world_size``.
    """
    check_shard_size(world_size, shard_size)
    from torch.distributed.device_mesh import init_device_mesh

    if shard_size is None or shard_size == world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=(SHARD,))
    return init_device_mesh(device_type, (world_size // shard_size, shard_size), mesh_dim_names=(REPLICATE, SHARD))


def check_shard_size(world_size: int, shard_size: int | None) -> None:
    """Raise a clear ``ValueError`` unless ``shard_size`` is ``None`` or a positive divisor of ``world_size``."""
    if shard_size is None:
        return
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"`shard_size={shard_size!r}` is not valid. Expected a positive integer or None.")
    if world_size % shard_size:
        raise ValueError(
            f"`shard_size={shard_size}` does not divide the world size {world_size}: HSDP needs "
            f"world_size = replicas x shard_size. Use a divisor of {world_size} (usually the GPUs per node) "
            "or None to shard over all ranks."
        )


def fsdp_mesh(device_mesh: Any) -> Any:
    """The mesh to ``fully_shard`` over, read from a strategy's device mesh (see the module docstring).

    Raises:
        ValueError: a Lightning ``ModelParallelStrategy`` mesh with ``tensor_parallel`` size > 1, or a
            mesh with other dimension names.
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    if names in ((SHARD,), (REPLICATE, SHARD)):
        return device_mesh
    if names == ("data_parallel", "tensor_parallel"):
        if device_mesh["tensor_parallel"].size() != 1:
            raise ValueError(
                f"The device mesh {device_mesh} asks for tensor parallelism "
                f"(tensor_parallel size {device_mesh['tensor_parallel'].size()}), which this model does not "
                "implement. Use `ModelParallelStrategy(tensor_parallel_size=1)` for FSDP, or "
                "`lightning_adaptiveload.strategies.fsdp2_strategy(shard_size=...)` for HSDP."
            )
        return device_mesh["data_parallel"]
    raise ValueError(
        f"Device mesh dimensions {names} are not understood. Expected ('shard',), ('replicate', 'shard') "
        "or Lightning's ('data_parallel', 'tensor_parallel')."
    )


def fully_shard_model(
    model: nn.Module,
    mesh: Any,
    block_types: Iterable[type[nn.Module]],
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    fp32_modules: Sequence[nn.Module] = (),
    reshard_after_forward: bool = True,
    cast_forward_inputs: bool = True,
) -> int:
    """``fully_shard`` every module of ``block_types``, each of ``fp32_modules``, then ``model`` itself.

    Apply activation checkpointing and compilation to the blocks first (torchtitan's order). A 2-D
    ``(replicate, shard)`` mesh gives HSDP: gradients are reduce-scattered inside a shard group and
    all-reduced across replicas.

    Args:
        model: the root module (on the meta device for a large model).
        mesh: from :func:`fsdp_mesh` / :func:`build_fsdp_mesh`.
        block_types: the repeated block classes (one all-gather unit each).
        param_dtype: dtype of the unsharded parameters in forward/backward (``None``: keep fp32).
        reduce_dtype: dtype of the gradient reduction (fp32 keeps it exact to fp32 accumulation).
        fp32_modules: submodules whose own group keeps fp32 parameters (e.g. the time embedding
            and output head that the reference computes in fp32).
        reshard_after_forward: free each block's full parameters after its forward (re-gathered in
            backward); ``False`` trades memory for one all-gather per block.
        cast_forward_inputs: cast each unit's floating inputs to ``param_dtype`` (FSDP2's default).
            ``False`` keeps them as they come, for models that carry an fp32 residual stream and
            fp32 modulation into bf16 blocks and leave the matmuls to autocast.

    Returns:
        The number of block units sharded.

    Raises:
        ValueError: no module of ``block_types`` in ``model``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    block_types = tuple(block_types)
    blocks = [m for m in model.modules() if isinstance(m, block_types)]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no module of the block types {[t.__name__ for t in block_types]}. "
            "Pass the class of its repeated transformer block."
        )
    policy = MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs=cast_forward_inputs)
    fp32 = MixedPrecisionPolicy(torch.float32, torch.float32, cast_forward_inputs=cast_forward_inputs)
    for module in fp32_modules:
        fully_shard(module, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return len(blocks)
