"""Samples the dataset skipped train with weight 0 (counted and named); a non-finite loss stops every rank, or is
dropped on every rank, before the optimizer step, naming the samples of that step."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from gloo_ranks import init_rank, perturb_, spawn
from safetensors.torch import save_file

from lightning_adaptiveload.bucketing.policy import FixedBatchPolicy
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.manifest import ManifestDataset
from lightning_adaptiveload.models.flow_matching import FlowMatchingModule

GRID = (1, 2, 3)  # latents [16, 1, 4, 6], S = 6


def _module(**kwargs) -> FlowMatchingModule:
    torch.manual_seed(0)
    module = FlowMatchingModule("tiny", lr=1e-3, seed=0, **kwargs)
    module.configure_model()
    perturb_(module.model)  # Wan zero-initialises the output projection, which would zero every other gradient
    return module


def _loss_and_grads(module, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = module.compute_loss(batch, generator=torch.Generator().manual_seed(7))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b, strict=True))


def test_a_weight_zero_sample_adds_nothing_to_the_loss_or_the_gradient():
    module = _module()
    batch = module.synthetic_batch(3, GRID, seed=1)
    other = dict(batch, latents=batch["latents"].clone(), context=batch["context"].clone())
    other["latents"][1] = 100 * torch.randn(other["latents"][1].shape)  # sample 1 replaced by something else
    other["context"][1] = torch.randn(other["context"][1].shape)
    weight = torch.tensor([1.0, 0.0, 1.0])

    loss, grads = _loss_and_grads(module, {**batch, "sample_weight": weight})
    loss_other, grads_other = _loss_and_grads(module, {**other, "sample_weight": weight})
    assert torch.equal(loss, loss_other) and _close(grads, grads_other)  # sample 1's content does not matter
    _, grads_all = _loss_and_grads(module, {**other, "sample_weight": torch.ones(3)})
    assert not _close(grads, grads_all)  # ... as it does with weight 1

    # The weighted loss is the mean over the weight-1 samples; all ones is the plain MSE of the batch.
    per_sample = [_loss_and_grads(module, {**batch, "sample_weight": torch.eye(3)[i]})[0] for i in range(3)]
    torch.testing.assert_close(loss, (per_sample[0] + per_sample[2]) / 2)
    plain, _ = _loss_and_grads(module, batch)
    torch.testing.assert_close(_loss_and_grads(module, {**batch, "sample_weight": torch.ones(3)})[0], plain)
    torch.testing.assert_close(plain, sum(per_sample) / 3)


def test_a_batch_of_only_skipped_samples_gives_a_zero_loss_that_still_runs_backward():
    module = _module()
    batch = module.synthetic_batch(2, GRID, seed=1)
    loss, grads = _loss_and_grads(module, {**batch, "sample_weight": torch.zeros(2)})
    assert loss.item() == 0.0
    # Every parameter gets a gradient (zeros), so DDP / FSDP reduce the same buckets as on the other ranks.
    assert len(grads) == len(list(module.parameters())) and all(not g.any() for g in grads)


# ------------------------------------------------------------------ through the Trainer and a manifest
def _manifest(tmp_path: Path, n: int = 8, bad: dict[int, str] | None = None) -> Path:
    """n latent files of token grid GRID with contexts; ``bad``: index → "nan" latents or "huge" context."""
    bad = bad or {}
    rows = []
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        latents, context = torch.randn(16, 1, 4, 6, generator=gen), torch.randn(16, 32, generator=gen)
        if bad.get(i) == "nan":
            latents[0, 0, 1, 2] = float("nan")
        elif bad.get(i) == "huge":
            context[3, 3] = 1e30
        save_file({"latents": latents, "context": context}, str(tmp_path / f"s{i}.safetensors"))
        rows.append(f'{{"path": "s{i}.safetensors", "num_frames": 1, "height": 32, "width": 48}}\n')
    (tmp_path / "manifest.jsonl").write_text("".join(rows))
    return tmp_path / "manifest.jsonl"


def _fit(module, dataset, callbacks=(), num_workers=0, max_steps=-1) -> pl.Trainer:
    data = AdaptiveLoadDataModule(dataset, FixedBatchPolicy(None, default=2), shuffle=False, num_workers=num_workers,
                                  print_plan=False)  # fmt: skip
    trainer = pl.Trainer(max_epochs=1, max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks))  # fmt: skip
    trainer.fit(module, datamodule=data)
    return trainer


class _Weights(pl.Callback):
    """The parameters at the start and the end of every training batch."""

    def __init__(self) -> None:
        self.start: list[list[torch.Tensor]] = []
        self.end: list[list[torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start.append([p.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end.append([p.detach().clone() for p in pl_module.parameters()])


def test_skipped_samples_train_with_weight_zero_and_are_counted_and_named_across_workers(tmp_path):
    dataset = ManifestDataset(_manifest(tmp_path, bad={2: "nan", 5: "huge"}), text_len=16, text_dim=32,
                              on_bad_sample="skip")  # fmt: skip
    module, weights = _module(), _Weights()
    with pytest.warns(UserWarning, match=r"a sample the dataset skipped trains with weight 0") as record:
        trainer = _fit(module, dataset, callbacks=[weights], num_workers=2)
    named = [str(w.message) for w in record if "trains with weight 0" in str(w.message)]
    assert len(named) == 2
    assert "manifest row 3 (s2.safetensors): latents [16, 1, 4, 6] hold 1 NaN value(s)" in named[0]
    assert "manifest row 6 (s5.safetensors): context [16, 32] hold 1 value(s) with |x| > 10000" in named[1]
    # Counted in the training process from the batches: the DataLoader workers' own reports never come back.
    assert module.bad_samples == 2 and trainer.callback_metrics["train/bad_samples"].item() == 2
    assert len(weights.end) == 4 == trainer.global_step  # every planned step ran
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_setting_the_max_abs_value_too_low_is_named_in_the_error(tmp_path):
    dataset = ManifestDataset(_manifest(tmp_path), text_len=16, text_dim=32, max_abs_value=1.0)
    with pytest.raises(Exception, match=r"manifest row 1 \(s0.safetensors\): latents .* with \|x\| > 1 "):
        _fit(_module(), dataset)


class _NaNLossFor(FlowMatchingModule):
    """A model that diverges on the batches holding one of ``poison`` (dataset indices)."""

    poison: set[int] = set()

    def compute_loss(self, batch, generator=None):
        loss = super().compute_loss(batch, generator)
        if any(int(i) in self.poison for i in batch["index"].tolist()):
            return loss * float("nan")
        return loss


def _diverging(poison: set[int], **kwargs) -> _NaNLossFor:
    torch.manual_seed(0)
    module = _NaNLossFor("tiny", lr=1e-3, seed=0, **kwargs)
    module.poison = poison
    return module


def test_a_nonfinite_loss_stops_before_the_optimizer_step_naming_the_samples(tmp_path):
    dataset = ManifestDataset(_manifest(tmp_path), text_len=16, text_dim=32)
    module, weights = _diverging({5}), _Weights()
    with pytest.raises(FloatingPointError) as err:
        _fit(module, dataset, callbacks=[weights])
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("`_NaNLossFor`: the loss of step 2 is not finite on rank 0: micro-batch 0 (loss nan, "
                           "B=2, S=6: dataset indices [4, 5] (manifest row 5 (s4.safetensors); manifest row 6 "
                           "(s5.safetensors))). The optimizer step was not taken")
    assert "on_nonfinite_loss = 'skip'" in text
    # The weights are those the step started with: nothing NaN reached them (or a checkpoint).
    assert len(weights.start) == 3 and len(weights.end) == 2
    assert all(torch.equal(p.detach(), w) for p, w in zip(module.parameters(), weights.start[2], strict=True))


def test_on_nonfinite_loss_skip_drops_the_step_and_trains_on(tmp_path):
    dataset = ManifestDataset(_manifest(tmp_path), text_len=16, text_dim=32)
    module, weights = _diverging({2}), _Weights()
    module.on_nonfinite_loss = "skip"
    with pytest.warns(UserWarning, match=r"the loss of step 1 is not finite on rank 0: micro-batch 0 \(loss nan, B=2, "
                                         r"S=6: dataset indices \[2, 3\] .*the step was dropped on every rank"):
        trainer = _fit(module, dataset, callbacks=[weights])
    assert trainer.global_step == 4 and module.nonfinite_loss_steps == 1
    same = [all(torch.equal(a, b) for a, b in zip(s, e, strict=True)) for s, e in zip(weights.start, weights.end,
                                                                                     strict=True)]  # fmt: skip
    assert same == [False, True, False, False]  # only the dropped step left every weight as it was
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_on_nonfinite_loss_off_trains_the_nan_into_the_weights(tmp_path):
    module = _diverging({2})
    module.on_nonfinite_loss = "off"  # the behaviour without the check, for loops that avoid every per-step sync
    _fit(module, ManifestDataset(_manifest(tmp_path), text_len=16, text_dim=32))
    assert module.nonfinite_loss_steps == 0 and not all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_an_unknown_on_nonfinite_loss_is_named(tmp_path):
    module = _diverging(set())
    module.on_nonfinite_loss = "ignore"
    with pytest.raises(ValueError, match=r"`_NaNLossFor\(on_nonfinite_loss='ignore'\)` is not valid. Expected one of "
                                         r"\('error', 'skip', 'off'\)"):
        _fit(module, ManifestDataset(_manifest(tmp_path), text_len=16, text_dim=32), max_steps=1)


# ------------------------------------------------------------------ two ranks
def _two_ranks(rank: int, world: int, port: int, out: str) -> None:
    init_rank(rank, world, port)
    warnings.filterwarnings("ignore")

    def batches():
        module = FlowMatchingModule("tiny")
        out = []
        for step in range(3):
            batch = module.synthetic_batch(2, GRID, seed=10 * rank + step)
            batch["index"] = torch.tensor([100 * rank + 2 * step, 100 * rank + 2 * step + 1])
            if rank == 0 and step == 2:  # every sample of this rank's batch was skipped by the dataset
                batch["sample_weight"] = torch.zeros(2)
                batch["bad_samples"] = ["sample 4 (test)", "sample 5 (test)"]
            out.append(batch)
        return out

    results = {}
    for mode in ("skip", "error"):
        module = _diverging({103}, )  # rank 1's step 1
        module.on_nonfinite_loss = mode
        weights = _Weights()
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
            max_steps=3, callbacks=[weights], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        )
        loader = torch.utils.data.DataLoader(batches(), batch_size=None)
        try:
            trainer.fit(module, loader)
            results[mode] = {"steps": trainer.global_step, "dropped": module.nonfinite_loss_steps,
                             "bad_samples": module.bad_samples,
                             "params": [p.detach().clone() for p in module.parameters()],
                             "same": [all(torch.equal(a, b) for a, b in zip(s, e, strict=True))
                                      for s, e in zip(weights.start, weights.end, strict=True)]}  # fmt: skip
        except FloatingPointError as err:
            results[mode] = {"error": str(err), "steps": len(weights.end)}
    torch.save(results, Path(out) / f"rank{rank}.pt")


def test_two_ranks_drop_the_step_together_or_stop_together(tmp_path):
    spawn(_two_ranks, 2, str(tmp_path))  # returns: no rank hung
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r, got in enumerate(ranks):
        skip = got["skip"]
        assert skip["steps"] == 3 and skip["dropped"] == 1 and skip["same"] == [False, True, False], r
        assert skip["bad_samples"] == (2 if r == 0 else 0)  # rank 0's all-skipped batch still took its step
        assert all(torch.isfinite(p).all() for p in skip["params"])
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["skip"]["params"], ranks[1]["skip"]["params"], strict=True))
    # Error: both ranks stop at step 1, the rank whose loss was NaN naming its samples, the other pointing to it.
    assert [got["error"]["steps"] for got in ranks] == [1, 1]
    assert "the loss of step 1 is not finite on rank 1: micro-batch 0 (loss nan, B=2, S=6: dataset indices " \
           "[102, 103])" in ranks[1]["error"]["error"]
    assert "the loss of step 1 is not finite on rank(s) [1] (their messages name the samples); rank 0's own loss " \
           "is finite" in ranks[0]["error"]["error"]
