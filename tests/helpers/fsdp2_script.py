"""A CPU FSDP2 fit on gloo ranks: forked from the test process (``fit_ranks`` through ``gloo_ranks.spawn``), or
run by hand as a script (Lightning launches the other ranks by re-running it).

Every rank writes ``<out>/rank<r>.pt``: its losses and batches per step, the checks made right
after ``configure_model`` (weights gathered from the shards vs the pretrained source, each rank's
local share of every parameter, the sharded init vs the dense init of the same seed), and after the
last step its coordinate in the device mesh and its local shards of the weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from gloo_ranks import init_rank
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset
from lightning_adaptiveload.models.flow_matching import FlowMatchingModule
from lightning_adaptiveload.models.wan import WanAttentionBlock, WanModel
from lightning_adaptiveload.parallel.fsdp import fsdp_mesh, fully_shard_model, initialize_, materialize_
from lightning_adaptiveload.parallel.pretrained import checkpoint_files
from lightning_adaptiveload.strategies import FSDP2Strategy

NUM_SAMPLES = 32
SEED = 3
LR = 1e-3
CLIP = 0.05


def _source(path: str) -> dict[str, torch.Tensor]:
    files = sorted(set(checkpoint_files(path).values()))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


class CheckedModule(FlowMatchingModule):
    """Records, right after sharding, what each rank holds and what the shards add up to."""

    # Set after construction: save_hyperparameters would put init arguments into the checkpoint.
    _source: dict[str, torch.Tensor] | None = None
    _key_of = None
    checks: dict = {}

    def configure_model(self) -> None:
        super().configure_model()
        from torch.distributed.tensor import DTensor, Shard

        model = self.model
        self.checks["local_shape"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
        self.checks["full_shape"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
        from torch.distributed.fsdp import FSDPModule

        self.checks["fsdp_units"] = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
        self.checks["placements"] = sorted({tuple(map(repr, p.placements)) for p in model.parameters()})
        self.checks["all_sharded"] = all(
            isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters()
        )
        if self._source is not None:
            self.checks["pretrained_equal"] = all(
                torch.equal(p.full_tensor(), self._source[self._key_of(n)].float()) for n, p in model.named_parameters()
            )
        # The sharded init equals the dense init of the same seed, exactly.
        with torch.device("meta"):
            meta = WanModel(self.config)
        fully_shard_model(meta, fsdp_mesh(self.device_mesh), [WanAttentionBlock], param_dtype=None)
        torch.manual_seed(11)
        materialize_(meta, "cpu", meta.init_weights)
        dense = WanModel(self.config)
        torch.manual_seed(11)
        initialize_(dense, dense.init_weights)
        self.checks["init_equal"] = all(
            torch.equal(p.full_tensor(), q) for p, q in zip(meta.parameters(), dense.parameters(), strict=True)
        )


    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
        self.checks.setdefault("clipped_norms", []).append(float(getattr(norm, "full_tensor", lambda: norm)()))


class _Record(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[dict] = []
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        # The weights training starts from (after a checkpoint's restore), gathered.
        self.start = {n: p.full_tensor().detach().clone() for n, p in pl_module.model.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({"step": trainer.global_step - 1, "loss": outputs["loss"].detach().clone(),
                           "latents": batch["latents"].clone(), "context": batch["context"].clone()})

    def on_train_end(self, trainer, pl_module) -> None:
        from lightning_adaptiveload.parallel.fsdp import local_slices

        model = pl_module.model
        final = {n: {"local": p.to_local().detach().clone(), "slices": local_slices(p)}
                 for n, p in model.named_parameters()}
        mesh = pl_module.device_mesh
        torch.save({"steps": self.steps, "checks": pl_module.checks, "world_size": trainer.world_size,
                    "start": self.start, "final": final, "mesh_dims": mesh.mesh_dim_names,
                    "mesh_coordinate": mesh.get_coordinate()},
                   self.out / f"rank{trainer.global_rank}.pt")


def fit(out: str, pretrained: str, layout: str, max_steps: int = 4, shard_size: int | None = None,
        ckpt: str | None = None, devices: int = 2, no_checkpoints: bool = False) -> None:
    torch.set_num_threads(1)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from lightning_adaptiveload.models.wan_weights import diffusers_key

    key_of = diffusers_key if layout == "diffusers" else (lambda n: n)
    module = CheckedModule("tiny", lr=LR, seed=SEED, pretrained=pretrained, fsdp_param_dtype="float32")
    module._source, module._key_of, module.checks = _source(pretrained), key_of, {}
    dataset = SyntheticMixedDataset(NUM_SAMPLES, "tiny", text_len=16, text_dim=32, seed=5)
    datamodule = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(4096, 4096 * 64, 2.0), seed=1)
    trainer = Trainer(
        default_root_dir=str(out), accelerator="cpu", devices=devices, strategy=FSDP2Strategy(shard_size=shard_size),
        precision="32-true", use_distributed_sampler=False, max_epochs=-1, max_steps=max_steps,
        gradient_clip_val=CLIP, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=not no_checkpoints,
        callbacks=[_Record(out)] + ([] if no_checkpoints else [
            ModelCheckpoint(dirpath=str(out / "ckpt"), every_n_train_steps=2, save_top_k=-1,
                            filename="step={step}", auto_insert_metric_name=False)]),
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)


def fit_ranks(rank: int, world: int, port: int, out: str, kwargs: dict) -> None:
    """One forked rank of ``fit(out, devices=world, **kwargs)`` (``gloo_ranks.spawn(fit_ranks, world, ...)``):
    two or more join a gloo process group first, which the strategy then uses as it is; one rank is left to
    set up its own, as in a launched run."""
    if world > 1:
        init_rank(rank, world, port)
    fit(out, devices=world, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--layout", choices=("wan", "diffusers"), required=True)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--no-checkpoints", action="store_true", help="save no distributed checkpoints")
    fit(**vars(parser.parse_args()))


if __name__ == "__main__":
    main()
