"""Ulysses sequence parallelism on CPU gloo process groups: the exchanges, the model and the training step.

Every numerics check compares against the same computation without sequence parallelism in one process
(fp32; relative 1e-5, and 1e-5 of the largest entry for entries near zero).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_ranks import assert_close, free_port, init_rank, perturb_, spawn
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_adaptiveload.callbacks.sequence_parallel import UlyssesSequenceParallel
from lightning_adaptiveload.models.flow_matching import OUTSIDE_STREAM, FlowMatchingModule
from lightning_adaptiveload.models.wan import WanConfig, WanModel
from lightning_adaptiveload.parallel.ulysses import (
    UlyssesGroup,
    UlyssesGroups,
    allowed_sp_degrees,
    check_sp_degree,
    split_sizes,
)

# Four heads: degrees 2 and 4 both divide them.
CFG = WanConfig(dim=32, ffn_dim=64, num_heads=4, num_layers=2, text_dim=16, text_len=8)


def _model(checkpointing: bool = False) -> WanModel:
    torch.manual_seed(0)
    model = WanModel(CFG)
    perturb_(model)
    model.set_gradient_checkpointing(checkpointing)
    return model


def _inputs(grid, batch_size: int, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(batch_size, CFG.in_dim, f, 2 * h, 2 * w, generator=gen)
    t = 1000 * torch.rand(batch_size, generator=gen)
    context = torch.randn(batch_size, 5, CFG.text_dim, generator=gen)
    target = torch.randn(batch_size, CFG.out_dim, f, 2 * h, 2 * w, generator=gen)
    return x, t, context, target


def _loss_and_grads(model: WanModel, grid, batch_size: int, sequence_parallel=None):
    x, t, context, target = _inputs(grid, batch_size)
    model.zero_grad(set_to_none=True)
    out = model(x, t, context, sequence_parallel=sequence_parallel)
    loss = F.mse_loss(out, target)
    loss.backward()
    return out.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_model_parity(group: UlyssesGroup, grid, batch_size: int, checkpointing: bool = False) -> None:
    """Output, loss and the group's summed gradients with SP equal one process without SP."""
    model = _model(checkpointing)
    ref_out, ref_loss, ref_grads = _loss_and_grads(model, grid, batch_size)
    out, loss, grads = _loss_and_grads(model, grid, batch_size, sequence_parallel=group)
    what = f"rank {dist.get_rank()}, degree {group.degree}, grid {grid}"
    assert_close(out, ref_out, f"{what}: output")
    assert_close(loss, ref_loss, f"{what}: loss")
    for name, g in grads.items():
        # Each rank holds the part of the gradient that flows through its tokens.
        dist.all_reduce(g, group=group.group)
        assert_close(g, ref_grads[name], f"{what}: grad of {name}")


# ---------------------------------------------------------------------------------------------- degrees


def test_allowed_degrees_divide_heads_and_node():
    assert allowed_sp_degrees(12, 8) == [2, 4]  # Wan 1.3B on 8-GPU nodes
    assert allowed_sp_degrees(12, 12) == [2, 3, 4, 6, 12]
    assert allowed_sp_degrees(40, 8) == [2, 4, 8]  # Wan 14B on 8-GPU nodes
    assert allowed_sp_degrees(40, 10) == [2, 5, 10]
    assert check_sp_degree(4, 40, 8, 8) == 4 and check_sp_degree(1, 12, 1, 1) == 1
    assert check_sp_degree(2, 12, 8, 2) == 2  # two ranks of an 8-rank node


@pytest.mark.parametrize("degree, why", [(3, "the ranks of a node"), (5, "the heads"), (16, "the heads")])
def test_bad_degree_names_degree_heads_node_and_allowed(degree, why):
    with pytest.raises(ValueError) as err:
        check_sp_degree(degree, 12, 8, 16)
    msg = str(err.value)
    assert f"check_sp_degree(degree={degree})` is not valid: {degree} does not divide {why}" in msg
    assert "(num_heads=12, ranks_per_node=8)" in msg and "Expected one of [2, 4]" in msg


@pytest.mark.parametrize("degree", [0, -2, 2.0, True])
def test_degree_must_be_a_positive_int(degree):
    with pytest.raises(ValueError, match=rf"`check_sp_degree\(degree={degree!r}\)` is not valid. Expected a positive"):
        check_sp_degree(degree, 12, 8, 16)


def test_world_must_be_whole_groups_on_whole_nodes():
    with pytest.raises(ValueError, match="12 ranks are not whole nodes of ranks_per_node=8, so a group could cross a node"):
        check_sp_degree(2, 12, 8, 12)
    with pytest.raises(ValueError, match="6 ranks do not split into groups of 4"):
        check_sp_degree(4, 12, 8, 6)
    with pytest.raises(ValueError, match="num_heads=0"):
        check_sp_degree(2, 0, 8, 8)


def test_split_sizes_are_tensor_split_sizes():
    for s, k in [(15, 2), (15, 4), (16, 4), (75600, 8), (7, 7)]:
        assert split_sizes(s, k) == tuple(len(c) for c in torch.arange(s).tensor_split(k))
    with pytest.raises(ValueError, match="3 tokens cannot be split over 4"):
        split_sizes(3, 4)


def test_groups_need_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        UlyssesGroups([2], num_heads=4, ranks_per_node=2)


# ----------------------------------------------------------------------------------------- one process


def _one_rank_group(port: int) -> UlyssesGroup:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return UlyssesGroup(dist.group.WORLD, [0])


def test_degree_one_path_is_bitwise_the_plain_path():
    """The whole SP code path (shard, exchanges, gather) on a group of one changes no bit."""
    group = _one_rank_group(free_port())
    model = _model()
    ref = _loss_and_grads(model, (2, 3, 5), 2)
    got = _loss_and_grads(model, (2, 3, 5), 2, sequence_parallel=group)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(got[2][n], g) for n, g in ref[2].items())


def test_module_refuses_an_sp_batch_without_groups_and_a_bad_degree():
    torch.manual_seed(0)
    module = FlowMatchingModule(CFG)
    module.configure_model()
    batch = module.synthetic_batch(1, (1, 2, 2))
    with pytest.raises(RuntimeError, match=r"sp_degree=2, but `FlowMatchingModule.sequence_parallel` is not set"):
        module.compute_loss({**batch, "sp_degree": 2})
    with pytest.raises(ValueError, match=r"`batch\['sp_degree'\]=0` is not valid"):
        module.compute_loss({**batch, "sp_degree": 0})
    # k = 1 is plain data parallelism: no groups needed.
    assert torch.isfinite(module.compute_loss({**batch, "sp_degree": 1}))


def test_diffusers_module_refuses_sp_batches():
    pytest.importorskip("diffusers")
    from lightning_adaptiveload.integrations.diffusers import DiffusersWanModule

    module = DiffusersWanModule({"num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 4,
                                 "out_channels": 4, "text_dim": 8, "ffn_dim": 16, "num_layers": 1}, text_len=3)
    module.configure_model()
    batch = module.synthetic_batch(1, (1, 2, 2))
    with pytest.raises(NotImplementedError, match="sp_degree=2: `DiffusersWanModule` has no sequence-parallel"):
        module.compute_loss({**batch, "sp_degree": 2})
    assert torch.isfinite(module.compute_loss({**batch, "sp_degree": 1}))


def test_callback_checks_degrees_and_the_module():
    with pytest.raises(ValueError, match="Expected positive integers"):
        UlyssesSequenceParallel(degrees=[2, 0])

    class Trainer1:
        num_devices, world_size = 1, 1

    class TwoNodesOfOne:
        num_devices, world_size = 1, 2

    module = FlowMatchingModule(CFG)
    with pytest.raises(ValueError, match=r"degree=2\)` is not valid: 2 does not divide the ranks of a node"):
        UlyssesSequenceParallel(degrees=[2]).setup(TwoNodesOfOne(), module, "fit")
    # A degree above the world size is never planned (as the sampler skips it): no group, no error.
    UlyssesSequenceParallel(degrees=[2]).setup(Trainer1(), module, "fit")
    assert module.sequence_parallel is None
    # Nothing to create on one rank: the module gets no groups, and an SP batch would be refused.
    UlyssesSequenceParallel().setup(Trainer1(), module, "fit")
    assert module.sequence_parallel is None
    with pytest.raises(MisconfigurationException, match="does not have"):
        UlyssesSequenceParallel().setup(Trainer1(), pl.LightningModule(), "fit")


# --------------------------------------------------------------------------------------------- 2 ranks


def _two_ranks(rank: int, world: int, port: int) -> None:
    init_rank(rank, world, port)
    groups = UlyssesGroups([2], num_heads=CFG.num_heads, ranks_per_node=2)
    group = groups.group(2)
    assert group.ranks == (0, 1) and group.rank == rank and group.first_rank == 0
    assert UlyssesGroups.group_ranks(rank, 2) == (0, 1)
    with pytest.raises(ValueError, match="No sequence-parallel group of degree 4"):
        groups.group(4)

    # The exchanges on an uneven split (7 tokens: 4 + 3): exact values and exact adjoints.
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2, 7, 4, 3, generator=gen)
    weight = torch.randn(2, 7, 4, 3, generator=gen)
    layout = group.layout(7)
    assert layout.sizes == (4, 3) and layout.offset == 4 * rank
    local = layout.shard(full, 1).clone().requires_grad_()
    heads = layout.seq_to_heads(local)
    assert heads.shape == (2, 7, 2, 3)
    assert torch.equal(heads, full[:, :, 2 * rank: 2 * rank + 2])
    back = layout.heads_to_seq(heads)
    assert back.shape == local.shape and torch.equal(back, local)
    # sum over ranks of <seq_to_heads(x), w_heads> = <x, w>: each rank's gradient is its shard of w.
    (heads * weight[:, :, 2 * rank: 2 * rank + 2]).sum().backward()
    assert torch.equal(local.grad, layout.shard(weight, 1))
    local.grad = None
    (layout.heads_to_seq(layout.seq_to_heads(local)) * layout.shard(weight, 1)).sum().backward()
    assert torch.equal(local.grad, layout.shard(weight, 1))
    gathered = layout.gather(local, 1)
    assert torch.equal(gathered, full)
    local.grad = None
    (gathered * weight).sum().backward()
    assert torch.equal(local.grad, layout.shard(weight, 1))

    # The model: 16 tokens (8 + 8) and 15 tokens (8 + 7), the latter also with checkpointing.
    _check_model_parity(group, (2, 2, 4), 2)
    _check_model_parity(group, (1, 3, 5), 2, checkpointing=True)

    # The module: both ranks draw the first rank's timesteps and noise; training_step returns k × loss.
    class Ranked(FlowMatchingModule):  # the rank a Trainer would give, without a Trainer
        global_rank = property(lambda self: dist.get_rank())

    torch.manual_seed(0)
    module = Ranked(CFG, seed=11)
    module.configure_model()
    perturb_(module.model)
    module.sequence_parallel = groups
    batch = module.synthetic_batch(2, (1, 3, 5), seed=4)
    ref = module.compute_loss(batch, module.noise_generator(rank=0, stream=OUTSIDE_STREAM))
    assert_close(module.compute_loss({**batch, "sp_degree": 2}), ref, f"rank {rank}: compute_loss")
    step_ref = module.compute_loss(batch, module.noise_generator(rank=0, step=0))
    assert_close(module.training_step({**batch, "sp_degree": 2}, 0), 2 * step_ref, f"rank {rank}: training_step")

    # Ranks of one group holding different batches: every rank raises (none hangs).
    other = module.synthetic_batch(2, (1, 3, 5), seed=4)
    other["index"] = torch.tensor([0, 1]) if rank == 1 else other["index"]
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] \(degree 2\) must process one batch"):
        module.training_step({**other, "sp_degree": 2}, 1)
    dist.destroy_process_group()


def test_two_ranks_exchanges_model_and_module_match_one_process():
    spawn(_two_ranks, 2)


# --------------------------------------------------------------------------------------------- 4 ranks

# The mixed step: ranks 0 and 1 share batch A with sp_degree 2, ranks 2 and 3 train C and D alone.
MIXED = {"A": ((1, 3, 5), 2, 20), "C": ((1, 2, 3), 3, 21), "D": ((2, 2, 2), 1, 22)}
RANK_BATCH = {0: "A", 1: "A", 2: "C", 3: "D"}
SEED = 13


def _mixed_module() -> FlowMatchingModule:
    torch.manual_seed(0)
    module = FlowMatchingModule(CFG, seed=SEED, lr=1e-3)
    module.configure_model()
    perturb_(module.model)
    return module


def _mixed_batch(module: FlowMatchingModule, name: str) -> dict:
    grid, batch_size, seed = MIXED[name]
    return module.synthetic_batch(batch_size, grid, seed=seed)


class _Capture(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_after_backward(self, trainer, pl_module):
        # After DDP's all-reduce: the gradient the optimizer applies, the same on every rank.
        grads = {n: p.grad.clone() for n, p in pl_module.model.named_parameters()}
        torch.save(grads, self.out / f"grads{trainer.global_rank}.pt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.save(outputs["loss"].detach(), self.out / f"loss{trainer.global_rank}.pt")


def _four_ranks(rank: int, world: int, port: int, out: str) -> None:
    init_rank(rank, world, port)
    groups = UlyssesGroups([2, 4], num_heads=CFG.num_heads, ranks_per_node=4)
    # Degree 4 over 15 tokens (4 + 4 + 4 + 3).
    _check_model_parity(groups.group(4), (1, 3, 5), 1)

    module = _mixed_module()
    batch = _mixed_batch(module, RANK_BATCH[rank])
    if rank < 2:
        batch["sp_degree"] = 2
    loader = torch.utils.data.DataLoader([batch], batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
        max_steps=1, callbacks=[UlyssesSequenceParallel(degrees=[2]), _Capture(Path(out))], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, loader)


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_four_ranks_degree_four_and_a_mixed_ddp_step_match_one_process(tmp_path):
    spawn(_four_ranks, 4, str(tmp_path))
    module = _mixed_module()
    losses, grads = {}, {}
    for name, rank in (("A", 0), ("C", 2), ("D", 3)):
        module.model.zero_grad(set_to_none=True)
        # The draws of a batch with sp_degree k are those of its group's first rank.
        loss = module.compute_loss(_mixed_batch(module, name), module.noise_generator(rank=rank, step=0))
        loss.backward()
        losses[name] = loss.detach()
        grads[name] = {n: p.grad.clone() for n, p in module.model.named_parameters()}
    # The rule: DDP averages over W = 4 ranks, and the SP batch counts for its k = 2 ranks.
    expected = {n: (2 * grads["A"][n] + grads["C"][n] + grads["D"][n]) / 4 for n in grads["A"]}
    for rank in range(4):
        assert_close(torch.load(tmp_path / f"loss{rank}.pt"), (2 if rank < 2 else 1) * losses[RANK_BATCH[rank]],
                      f"rank {rank}: returned loss")
    got = torch.load(tmp_path / "grads3.pt")
    assert torch.equal(got["head.head.weight"], torch.load(tmp_path / "grads0.pt")["head.head.weight"])
    for n, g in expected.items():
        assert_close(got[n], g, f"DDP-averaged grad of {n}")


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.cuda
def test_cuda_degree_one_path_is_exactly_the_plain_path_and_exchange_shapes():
    """On one GPU (NCCL): the SP code path with degree 1 gives exactly (bitwise) the plain forward and
    backward in fp32, and the exchanges round-trip with the documented shapes. Under bf16 autocast the
    two paths hand attention q, k, v with other strides (a view of the all-to-all's buffer), which may
    pick another attention kernel: there they agree to bf16 rounding."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group = UlyssesGroup(dist.group.WORLD, [0])
    layout = group.layout(75)
    x = torch.randn(2, 75, 12, 16, device="cuda", requires_grad=True)
    heads = layout.seq_to_heads(x)
    assert heads.shape == (2, 75, 12, 16) and torch.equal(heads, x)
    back = layout.heads_to_seq(heads)
    assert back.shape == (2, 75, 12, 16) and torch.equal(back, x)
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert torch.equal(layout.gather(layout.shard(x, 1), 1), x)

    model = _model().cuda()

    def run(sp, dtype):
        x, t, context, target = (v.cuda() for v in _inputs((3, 6, 10), 2))
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x, t, context, sequence_parallel=sp)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        return out.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, got = run(None, None), run(group, None)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    different = [n for n, g in ref[2].items() if not torch.equal(got[2][n], g)]
    assert not different, different
    ref, got = run(None, torch.bfloat16), run(group, torch.bfloat16)
    for name, g in [("output", got[0]), ("loss", got[1]), *got[2].items()]:
        expected = ref[0] if name == "output" else ref[1] if name == "loss" else ref[2][name]
        torch.testing.assert_close(g, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()), msg=name)
