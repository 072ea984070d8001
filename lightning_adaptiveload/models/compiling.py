"""Regional compilation of repeated blocks: the dynamo settings a bucketed corpus needs, and compile time.

A bucketed corpus feeds a compiled block 10-30 distinct (B, S); dynamo compiles one static graph,
then, on the first new size, one with symbolic sizes (automatic dynamic shapes), plus a graph per
size-0/1 specialisation (B = 1) and per activation-checkpointing mode. Its default recompile limit (8
per code object) leaves little room, and when the limit is hit dynamo silently runs that code eager
from then on. :func:`configure_recompiles` raises the limit to a stated number and makes hitting it
an error instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["BLOCK_INDUCTOR_OPTIONS", "RECOMPILE_LIMIT", "block_compile_kwargs", "check_compile_options", "compile_blocks",
           "compile_seconds", "configure_recompiles", "mark_dynamic", "whole_block_graphs"]

#: Graphs allowed per compiled block: a static and a dynamic graph per (checkpointing mode, B = 1 or
#: not), with room to spare. A corpus that needs more is a bug worth hearing about.
RECOMPILE_LIMIT = 32


def configure_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Allow ``limit`` graphs per compiled code object (never lowering a larger setting) and make
    reaching it raise (``torch._dynamo.config.fail_on_recompile_limit_hit``) rather than run eager."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(int(config.recompile_limit), int(limit))
    config.accumulated_recompile_limit = max(int(config.accumulated_recompile_limit), 8 * int(limit))
    config.fail_on_recompile_limit_hit = True


#: Inductor options compiled blocks get unless the caller sets them (and where this torch has them).
#: ``triton.mix_order_reduction: False`` works around a silent-correctness bug of inductor's mix-order
#: reduction (the row and column reductions of a norm's backward fused in one Triton kernel; GPU
#: only): when the column sums are slices of one buffer, as the gradients of a ``chunk``-ed AdaLN
#: modulation are at B = 1, the fused kernel's results are never written into it, and the backward
#: returns uninitialised or stale memory (pytorch/pytorch#193061, fixed by #193103; still present in
#: torch 2.13, ``_codegen_mix_order_reduction``). Measured on one H200 (torch 2.11, Wan 2.1 1.3B
#: compiled, B = 1): gradients of the time embedding 1,000-10,000x eager's, NaN within 11-34 steps
#: (``benchmarks/nonfinite_probe.py``). With the fusion off, its size thresholds (which compiled one
#: graph per side of each for a bucketed corpus) are gone too. The project's Wan block slices its
#: modulation instead of ``chunk``-ing it, so its gradients are right with the fusion on as well; it stays
#: off by default because it is slower here (mixed 480p+720p corpus on one H200: 43.4% MFU, 6 graphs and
#: a 113 s profile with it on, 44.4-44.6%, 3 graphs and 94-96 s with it off), and diffusers' Wan chunks.
BLOCK_INDUCTOR_OPTIONS: dict[str, Any] = {"triton.mix_order_reduction": False}


def block_compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keyword arguments for a block: ``kwargs`` with :data:`BLOCK_INDUCTOR_OPTIONS`
    filled in under ``options`` for the inductor backend, each only if the caller's options do not set
    it and this torch's inductor knows it. A ``mode`` excludes ``options`` in ``torch.compile``, so
    with one nothing is added and a warning says how to apply the options (the environment)."""
    out = dict(kwargs)
    backend = out.get("backend", "inductor")
    if backend != "inductor":
        return out
    if out.get("mode") is not None:
        import warnings

        warnings.warn(
            f"compile_blocks(mode={out['mode']!r}): torch.compile takes no inductor options with a mode, so the "
            "blocks compile without `triton.mix_order_reduction=False`, which avoids wrong gradients at batch "
            "size 1 on GPUs (pytorch/pytorch#193061). Set TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 in the environment, "
            "or pass `options` instead of `mode`.", stacklevel=3)
        return out
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    options = dict(out.get("options") or {})
    for name, value in BLOCK_INDUCTOR_OPTIONS.items():
        if name in known and name not in options:
            options[name] = value
    if options:
        out["options"] = options
    return out


def check_compile_options(options: Mapping[str, Any] | None, compile: bool,
                           owner: str = "FlowMatchingModule") -> dict[str, Any] | None:
    """``owner``'s ``compile`` flag and ``compile_options``: the options as a plain dict (``None`` if
    empty), each name checked against ``torch._inductor.config``.

    Raises:
        ValueError: ``compile`` not a bool; options not a mapping of names; options without ``compile``;
            a name inductor does not know (with the closest names).
    """
    if not isinstance(compile, bool):
        raise ValueError(f"`{owner}(compile={compile!r})` is not valid. Expected true or false.")
    if options is None or (isinstance(options, Mapping) and not options):
        return None
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"`{owner}(compile_options={options!r})` is not valid. Expected a mapping of "
                         "inductor option names to values, e.g. {'max_autotune': True}.")
    if not compile:
        raise ValueError(f"`{owner}(compile_options={dict(options)!r})` needs `compile=True`; "
                         "without it nothing is compiled.")
    import difflib

    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            raise ValueError(f"`{owner}(compile_options=...)`: {name!r} is not an inductor option of this "
                             f"torch ({torch.__version__}). Close names: {close or 'none'}; see torch._inductor.config.")
    return dict(options)


def compile_blocks(blocks: Iterable[nn.Module], mark_inputs: Callable[[nn.Module, tuple[Any, ...]], None] | None,
                   **kwargs: Any) -> None:
    """Compile each of ``blocks`` in place (regional compilation: blocks of one class share a graph).

    Raises the recompile limit (:func:`configure_recompiles`), fills in :data:`BLOCK_INDUCTOR_OPTIONS`
    (:func:`block_compile_kwargs`) and passes ``kwargs`` to :meth:`torch.nn.Module.compile`.
    ``mark_inputs(block, args)``, if given, runs as each block's forward pre-hook, outside the
    compiled code, to mark the batch and sequence dims of the tensors the block is called with
    dynamic (:func:`mark_dynamic`), so the first graph already has symbolic sizes. A pre-hook, not
    marks made by the caller: FSDP2's pre-forward hook (prepended, so it runs before this one) hands
    the block new tensor objects, and marks on the caller's tensors would be lost. A block compiled
    before gets no second hook. Run the blocks inside :func:`whole_block_graphs` under DDP.
    """
    import torch._dynamo

    configure_recompiles()
    kwargs = block_compile_kwargs(kwargs)
    for block in blocks:
        first = getattr(block, "_compiled_call_impl", None) is None
        block.compile(**kwargs)
        if first and mark_inputs is not None:
            # Disabled for dynamo: it runs eagerly before the block's forward frame is compiled
            # (dynamo refuses a mark inside traced code).
            block.register_forward_pre_hook(torch._dynamo.disable(mark_inputs))


def whole_block_graphs() -> Any:
    """Context in which compiled blocks called under DDP compile one graph each.

    Inside a DDP forward, dynamo's DDP optimizer (``torch._dynamo.config.optimize_ddp``) splits every
    graph at DDP's gradient-bucket boundaries (25 MB) so that all-reduce can start inside one large
    graph's backward. A compiled block's backward already hands its gradients to DDP's reducer when it
    ends, so with regional compilation the split adds nothing to overlap: it only cuts each block into
    several inductor graphs (more to compile, fusions lost at the cuts). On torch 2.11 with CUDA it
    also failed outright at the first backward of the Wan block ("CompiledFunctionBackward returned an
    invalid gradient ... [1536] ... [1, 1, 1536]"). Read by dynamo when it compiles, so it is entered
    around the block calls, not set globally for the user's other compiled code.
    """
    import torch._dynamo

    return torch._dynamo.config.patch(optimize_ddp=False)


def compile_seconds() -> float:
    """Wall seconds this process has spent compiling with ``torch.compile`` so far (forward and backward).

    Reads dynamo's own timing (``torch._dynamo.utils.calculate_time_spent``), a private helper:
    0.0 if this torch build lacks it, so callers only lose the report, never the run.
    """
    try:
        from torch._dynamo.utils import calculate_time_spent
    except ImportError:  # pragma: no cover - older or stripped builds
        return 0.0
    try:
        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a private API; the number is informative only
        return 0.0


def mark_dynamic(tensor: torch.Tensor, *dims: int) -> None:
    """Compile ``dims`` of ``tensor`` with symbolic sizes from the first graph on (no static graph
    first), where dynamo allows it; a no-op outside compilation."""
    for d in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, d)
