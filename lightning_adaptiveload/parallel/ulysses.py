"""Ulysses sequence parallelism: k ranks of one node share a batch, each holds S/k of its tokens.

Everything but self-attention is per token, so each rank runs it on its own shard of the sequence.
Self-attention needs every token: an all-to-all trades the sequence shard of q, k and v
(``[B, S/k, H, d]``) for a head shard over the full sequence (``[B, S, H/k, d]``), each rank
attends with its H/k heads, and a second all-to-all trades back (DeepSpeed-Ulysses, arXiv 2309.14509;
Wan 2.1 trained this way inside a node). Cross-attention needs nothing: the text is replicated.

The pieces:

* :func:`check_sp_degree` / :func:`allowed_sp_degrees`: a degree must divide the heads and the
  ranks per node (a group never spans nodes).
* :class:`UlyssesGroups`: creates the process groups of a set of degrees up front (group creation
  is collective: every rank creates every group, in the same order) and hands out this rank's.
* :class:`UlyssesGroup`: one group of k consecutive ranks ``[g·k, (g+1)·k)``; what
  ``WanModel.forward(..., sequence_parallel=...)`` takes. :meth:`UlyssesGroup.layout` gives the
  :class:`UlyssesLayout` of one sequence length: how it is split, and the exchanges.
* :func:`seq_to_heads` / :func:`heads_to_seq`: the all-to-alls as autograd functions (each one's
  backward is the other's forward: an all-to-all is a permutation of blocks, its adjoint the inverse).

A length S that k does not divide is split unevenly (``torch.tensor_split`` sizes: the first
``S mod k`` ranks hold one token more) with the all-to-all's split sizes, so nothing is padded and
no attention mask is needed (Wan's own sequence-parallel code pads and leaves the padded keys
unmasked, which changes the result whenever S is not a multiple of k).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_adaptiveload.bucketing.sequence_parallel import allowed_sp_degrees, check_sp_degree

__all__ = [
    "UlyssesGroup",
    "UlyssesGroups",
    "UlyssesLayout",
    "allowed_sp_degrees",
    "check_sp_degree",
    "heads_to_seq",
    "seq_to_heads",
    "split_sizes",
]


# The degree rule lives with the planner (bucketing, a lower layer), which checks degrees before
# training; the groups built here follow the same rule.
def split_sizes(seq_len: int, degree: int) -> tuple[int, ...]:
    """Tokens per rank when ``degree`` ranks split ``seq_len`` tokens (``torch.tensor_split``'s sizes)."""
    if seq_len < degree:
        raise ValueError(
            f"A sequence of {seq_len} tokens cannot be split over {degree} sequence-parallel ranks. "
            "Give batches this short a smaller degree (1: data parallel)."
        )
    # `//` and `-`, not divmod: dynamo traces them on a symbolic length (the backward of an exchange).
    base = seq_len // degree
    extra = seq_len - base * degree
    return tuple(base + (i < extra) for i in range(degree))


@dataclass(frozen=True, eq=False)
class UlyssesLayout:
    """How one sequence of ``sum(sizes)`` tokens is split over a group, and the exchanges on it.

    Attributes:
        group: the process group (its ranks all hold the same batch).
        rank: this process's position in the group (0 .. degree - 1).
        sizes: tokens of each position, in sequence order.
    """

    group: Any
    rank: int
    sizes: tuple[int, ...]

    @property
    def degree(self) -> int:
        return len(self.sizes)

    @property
    def seq_len(self) -> int:
        return sum(self.sizes)

    @property
    def offset(self) -> int:
        """Index of this rank's first token in the full sequence."""
        return sum(self.sizes[: self.rank])

    @property
    def local_len(self) -> int:
        return self.sizes[self.rank]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a replicated ``x`` (a view; its backward fills zeros elsewhere)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"`shard` got {x.shape[dim]} tokens along dim {dim} of a tensor of shape {tuple(x.shape)}; "
                f"this layout splits {self.seq_len}."
            )
        return x.narrow(dim, self.offset, self.local_len)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All ranks' shards of ``x`` concatenated along ``dim``, on every rank.

        The backward returns this rank's slice of the output gradient, without communication. That
        is the gradient when every rank of the group computes the same function of the gathered
        tensor (the loss of the shared batch): the group's parameter gradients then sum to the
        gradient of that function (see docs/sequence_parallel.md).
        """
        return _GatherSequence.apply(x, self, dim)

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`seq_to_heads` in this layout."""
        return seq_to_heads(x, self)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """:func:`heads_to_seq` in this layout."""
        return heads_to_seq(x, self)


# The exchanges use `dist.all_to_all_single`, which NCCL and gloo
# both implement (gloo for CPU tensors since pytorch/pytorch#41424, 2020), uneven split sizes included,
# so the CPU tests run the code path GPUs run: no test-only substitute is needed. They are
# our own autograd functions: torch's public autograd wrapper (`torch.distributed.nn.functional.
# all_to_all_single`) is deprecated, and its replacement lives in the private, still-changing
# `torch.distributed._functional_collectives` across the torch versions this package supports.


def _seq_to_heads(x: torch.Tensor, layout: UlyssesLayout) -> torch.Tensor:
    k = layout.degree
    b, s_local, h, d = x.shape
    if h % k:
        raise ValueError(f"{h} heads cannot be split over {k} sequence-parallel ranks; the degree must divide them.")
    if s_local != layout.local_len:
        raise ValueError(f"`seq_to_heads` got {s_local} tokens; this rank holds {layout.local_len} in its layout.")
    # Block j (heads j·h/k ..) goes to rank j; a rank receives the sources' tokens in sequence order.
    send = x.reshape(b, s_local, k, h // k, d).permute(2, 1, 0, 3, 4).contiguous().view(k * s_local, b, h // k, d)
    recv = x.new_empty((layout.seq_len, b, h // k, d))
    dist.all_to_all_single(
        recv, send, output_split_sizes=list(layout.sizes), input_split_sizes=[s_local] * k, group=layout.group
    )
    return recv.permute(1, 0, 2, 3)


def _heads_to_seq(x: torch.Tensor, layout: UlyssesLayout) -> torch.Tensor:
    k = layout.degree
    b, s, hk, d = x.shape
    if s != layout.seq_len:
        raise ValueError(f"`heads_to_seq` got {s} tokens; the layout has {layout.seq_len}.")
    s_local = layout.local_len
    send = x.permute(1, 0, 2, 3).contiguous()  # [S, B, H/k, d]: rank j's tokens go to rank j
    recv = x.new_empty((k * s_local, b, hk, d))
    dist.all_to_all_single(
        recv, send, output_split_sizes=[s_local] * k, input_split_sizes=list(layout.sizes), group=layout.group
    )
    # Source j sent its head block j of our tokens.
    # Contiguous also when k = 1 (a reshape would return a strided view): the output projection's matmul
    # then sees the layout the plain path gives it, which keeps degree 1 bitwise equal to no SP.
    return recv.view(k, s_local, b, hk, d).permute(2, 1, 0, 3, 4).contiguous().view(b, s_local, k * hk, d)


class _AllToAll(torch.autograd.Function):
    """One exchange (``to_heads``: sequence shard → head shard, else back); its backward is the other."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: UlyssesLayout, to_heads: bool) -> torch.Tensor:
        out = (_seq_to_heads if to_heads else _heads_to_seq)(x, layout)
        # The backward rebuilds the layout from the full length read off a shape ([B, S, H/k, d]) instead of
        # keeping `layout`. In compiled blocks the layout's sizes become symbolic graph inputs from the
        # second sequence length on, and inside a checkpointed block (selective or full) dynamo (torch 2.13)
        # wires such sizes, saved for the backward, to the outer graph and fails ("Argument ... does not
        # belong to this Graph"); a length read off a shape is a node of the exchange's own graph.
        ctx.group, ctx.rank, ctx.degree, ctx.to_heads = layout.group, layout.rank, layout.degree, to_heads
        ctx.seq_len = (out if to_heads else x).shape[1]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout = UlyssesLayout(ctx.group, ctx.rank, split_sizes(ctx.seq_len, ctx.degree))
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, layout), None, None


def seq_to_heads(x: torch.Tensor, layout: UlyssesLayout) -> torch.Tensor:
    """``[B, S_local, H, d]`` sequence shard → ``[B, S, H/k, d]`` head shard (heads ``rank·H/k ..``).

    Collective over ``layout.group``; differentiable (the backward is :func:`heads_to_seq`). The
    result is a strided view (sequence-major in memory), which attention kernels accept.
    """
    return _AllToAll.apply(x, layout, True)


def heads_to_seq(x: torch.Tensor, layout: UlyssesLayout) -> torch.Tensor:
    """``[B, S, H/k, d]`` head shard → ``[B, S_local, H, d]`` sequence shard; inverse of :func:`seq_to_heads`."""
    return _AllToAll.apply(x, layout, False)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: UlyssesLayout, dim: int) -> torch.Tensor:
        ctx.layout, ctx.dim = layout, dim
        if x.shape[dim] != layout.local_len:
            raise ValueError(f"`gather` got {x.shape[dim]} tokens; this rank holds {layout.local_len}.")
        # all_gather needs equal sizes: pad the shorter shards by one token and cut it off after.
        width = max(layout.sizes)
        pad = list(x.shape)
        pad[dim] = width - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
        parts = [torch.empty_like(x) for _ in layout.sizes]
        dist.all_gather(parts, x, group=layout.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, layout.sizes, strict=True)], dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout = ctx.layout
        return grad.narrow(ctx.dim, layout.offset, layout.local_len), None, None


class UlyssesGroup:
    """A sequence-parallel group of consecutive global ranks that process one batch together.

    This is the object ``WanModel.forward(..., sequence_parallel=...)`` takes: the model calls
    :meth:`layout` with the batch's sequence length.

    Args:
        group: the process group of ``ranks`` (``torch.distributed`` must be initialised).
        ranks: its global ranks, ascending; this process must be one of them.
    """

    def __init__(self, group: Any, ranks: Sequence[int]) -> None:
        self.group = group
        self.ranks = tuple(int(r) for r in ranks)
        me = dist.get_rank()
        if me not in self.ranks:
            raise ValueError(f"`UlyssesGroup(ranks={self.ranks})` does not contain this process (rank {me}).")
        self.rank = self.ranks.index(me)

    @property
    def degree(self) -> int:
        return len(self.ranks)

    @property
    def first_rank(self) -> int:
        """Global rank of the group's first member; the group draws its noise with this rank's seed."""
        return self.ranks[0]

    def layout(self, seq_len: int) -> UlyssesLayout:
        """The split of a sequence of ``seq_len`` tokens over this group (see :func:`split_sizes`)."""
        return UlyssesLayout(self.group, self.rank, split_sizes(int(seq_len), self.degree))

    def check_identical(self, fingerprint: torch.Tensor, what: str) -> None:
        """Raise on every rank of the group unless all ranks pass the same ``fingerprint``.

        One small all-gather (and a host sync). Every rank raises, so none is left waiting in a
        later collective.

        Args:
            fingerprint: a 1-D tensor of the same length on every rank (e.g. shape and checksums).
            what: what the numbers are, for the message.

        Raises:
            RuntimeError: the fingerprints differ; the message lists each rank's.
        """
        values = fingerprint.detach().to(torch.float64).reshape(-1).contiguous()
        parts = [torch.empty_like(values) for _ in self.ranks]
        dist.all_gather(parts, values, group=self.group)
        rows = [p.tolist() for p in parts]
        if any(row != rows[0] for row in rows):
            listing = "; ".join(f"rank {r}: {row}" for r, row in zip(self.ranks, rows, strict=True))
            raise RuntimeError(
                f"The sequence-parallel group of ranks {list(self.ranks)} (degree {self.degree}) must process one "
                f"batch, but its ranks got different ones ({what}): {listing}. The batch sampler must give the "
                "same batch to the k consecutive ranks [g·k, (g+1)·k) of a batch with sp_degree k."
            )

    def __repr__(self) -> str:
        return f"UlyssesGroup(ranks={list(self.ranks)}, rank={self.rank})"


class UlyssesGroups:
    """The sequence-parallel process groups of a set of degrees, created once, up front.

    For each degree k > 1 the world is cut into groups of k consecutive ranks ``[g·k, (g+1)·k)``,
    ``g = rank // k`` (inside one node, since k divides the ranks per node). Creating a process
    group is collective over all ranks, so every rank must build this object with the same
    ``degrees`` at the same point (e.g. in a ``setup`` hook), before the first batch.

    Args:
        degrees: the degrees to create (1 is accepted and needs no group).
        num_heads: attention heads of the model.
        ranks_per_node: ranks on one node.

    Raises:
        ValueError: a degree fails :func:`check_sp_degree`.
        RuntimeError: ``torch.distributed`` is not initialised.

    Example::

        groups = UlyssesGroups([2, 4], num_heads=12, ranks_per_node=8)
        model(x, t, context, sequence_parallel=groups.group(2))
    """

    def __init__(self, degrees: Iterable[int], num_heads: int, ranks_per_node: int) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "`UlyssesGroups` needs an initialised torch.distributed process group (create it after the "
                "strategy has set up the processes, e.g. in a callback's `setup`)."
            )
        self.world_size = dist.get_world_size()
        self.num_heads = num_heads
        self.ranks_per_node = ranks_per_node
        degrees = sorted({check_sp_degree(k, num_heads, ranks_per_node, self.world_size) for k in degrees})
        rank = dist.get_rank()
        self._groups: dict[int, UlyssesGroup] = {}
        for k in degrees:
            if k == 1:
                continue
            partition = [list(range(g * k, (g + 1) * k)) for g in range(self.world_size // k)]
            # torch's helper calls new_group for every block of the partition, in order, on every rank.
            mine, _ = dist.new_subgroups_by_enumeration(partition)
            self._groups[k] = UlyssesGroup(mine, partition[rank // k])

    @property
    def degrees(self) -> tuple[int, ...]:
        """The degrees > 1 whose groups exist."""
        return tuple(self._groups)

    @staticmethod
    def group_ranks(rank: int, degree: int) -> tuple[int, ...]:
        """Global ranks of the group of ``degree`` that holds ``rank``: ``[g·k, (g+1)·k)``, ``g = rank // k``."""
        g = rank // degree
        return tuple(range(g * degree, (g + 1) * degree))

    def group(self, degree: int) -> UlyssesGroup:
        """This rank's group of ``degree`` (> 1).

        Raises:
            ValueError: no group of that degree was created.
        """
        if degree not in self._groups:
            raise ValueError(
                f"No sequence-parallel group of degree {degree!r} was created; this run has degrees "
                f"{list(self._groups)}. Pass every degree the batch sampler may plan to `UlyssesGroups(degrees=...)`."
            )
        return self._groups[degree]

    def __repr__(self) -> str:
        return f"UlyssesGroups(degrees={list(self._groups)}, world_size={self.world_size})"
