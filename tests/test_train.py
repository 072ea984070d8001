"""Hydra configs compose and instantiate; the quickstart and the console script run end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from hydra_compose import compose_train
from omegaconf import OmegaConf, open_dict

import lightning_adaptiveload
from lightning_adaptiveload.bucketing.policy import EqualTokenPolicy
from lightning_adaptiveload.calibration.costmodel import CostModel
from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
from lightning_adaptiveload.cli.checks import MissingSettingError, missing_keys
from lightning_adaptiveload.cli.train import build, train
from lightning_adaptiveload.factories import cost_model_policy
from lightning_adaptiveload.models.wan import WAN_CONFIGS

CONF_DIR = Path(lightning_adaptiveload.__file__).parent.parent / "conf"
GROUPS = ["model", "data", "bucketing", "strategy", "trainer", "callbacks", "logger", "experiment"]


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


_compose = compose_train


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_has_choices(group):
    assert _choices(group), f"conf/{group}/ has no choices"


@pytest.mark.parametrize(
    ("group", "choice"), [(g, c) for g in GROUPS if g != "experiment" for c in _choices(g)]
)
def test_every_choice_composes_and_instantiates(group, choice, tmp_path):
    overrides = [f"{group}={choice}"]
    if choice == "cost_model":
        b, sl = np.meshgrid([1, 2, 4, 8], [16, 64, 120])
        t = 1e-3 + b * (2e-5 * sl + 3e-8 * sl**2)
        cm = CostModel.fit(b.ravel(), sl.ravel(), t.ravel(), form="quadratic")
        (tmp_path / "cm.json").write_text(cm.to_json())
        overrides.append(f"bucketing.policy.cost_model_path={tmp_path / 'cm.json'}")
    if choice == "fixed":
        overrides.append("bucketing.policy.batch_sizes={16: 2}")
    cfg = _compose(overrides, tmp_path)
    node = cfg[group]
    if group == "data":
        assert node.dataset._target_ and node.datamodule._target_
        # Data on disk (a manifest, shards) needs a path; their file errors are tested in tests/data.
        if "path" not in node.dataset.keys():
            # What train() fills in from the model for keys left null.
            tiny = WAN_CONFIGS["tiny"]
            from_model = {k: getattr(tiny, k) for k in ("text_len", "text_dim", "patch_size", "vae_stride")}
            from_model |= {"latent_channels": tiny.in_dim, "extra_inputs": None}
            instantiate(node.dataset, **{k: v for k, v in from_model.items() if node.dataset.get(k, 0) is None})
    elif group == "bucketing":
        policy = instantiate(node.policy)
        assert policy.batch_size(16) >= 1
        if choice == "cost_model":  # null step budget: the longest S (= m_mem) runs at B = 1
            assert policy.batch_size(node.policy.m_mem) == 1
        assert node.balance in ("cost", "none")
    elif group == "callbacks":
        for cb in (node or {}).values():
            instantiate(cb)
    elif group == "logger":
        if node:
            instantiate(node)
    elif group == "trainer":
        with open_dict(node):
            node.accelerator = "cpu"
            node.devices = 1
            node.precision = "32-true"
        trainer = instantiate(node, logger=False, enable_checkpointing=False)
        assert trainer._accelerator_connector.use_distributed_sampler is False
    elif group == "strategy":
        instantiate(node)
    else:
        module = instantiate(node)
        assert module is not None


def test_cost_model_policy_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="cost_model_path"):
        cost_model_policy(tmp_path / "missing.json", m_mem=2048)


@pytest.mark.parametrize("experiment", _choices("experiment"))
def test_experiments_compose(experiment, tmp_path):
    cfg = _compose([f"experiment={experiment}"], tmp_path)
    # 1.3B fits every GPU (data parallel); 14B is sharded (FSDP2/HSDP).
    want = ("ddp_strategy",) if experiment == "wan2_1_1_3b_480p" else ("fsdp_strategy", "fsdp2_strategy")
    assert cfg.strategy._target_.endswith(want)
    if experiment == "wan2_1_1_3b_480p":
        assert cfg.model.compile is True and cfg.model.activation_checkpointing == "auto"
    assert "shape_benchmark" in cfg.callbacks and "fused_adaln" in cfg.callbacks
    assert cfg.trainer.use_distributed_sampler is False


@pytest.mark.slow  # ~21-45 s on a 2-core CPU: profiles shapes
def test_experiments_run_on_cpu_with_a_tiny_model(tmp_path):
    # The recipe's wiring on CPU: the shape benchmark profiles and derives the policy, the sampler plans
    # with that policy, and the steps train with finite losses.
    cfg = _compose(
        [
            "experiment=wan2_1_1_3b_480p",
            "model=tiny",
            "data=synthetic_tiny",
            "data.dataset.mixture=tiny",  # the recipe pins its 480p mix
            "strategy=auto",
            "trainer=cpu",
            "++trainer.fast_dev_run=2",
            "callbacks.shape_benchmark.max_shapes=2",
            "callbacks.shape_benchmark.batch_sizes=[1,2]",
            "callbacks.shape_benchmark.repeats=1",
            "callbacks.shape_benchmark.warmup=0",
            "m_mem=4096",
        ],
        tmp_path,
    )
    run = build(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    (bench,) = [cb for cb in run.trainer.callbacks if isinstance(cb, ShapeBenchmarkCallback)]
    assert bench.source == "profiled" and bench.policy is not None
    assert run.datamodule.policy is bench.policy  # the sampler is built from it
    assert run.trainer.global_step == 2 and torch.isfinite(run.trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(
    ("bucketing", "fitted"), [("dual_constraint", True), ("equal_token", False), ("cost_model", False)]
)
def test_only_the_dual_constraint_choice_is_refitted_by_the_shape_benchmark(bucketing, fitted, tmp_path):
    overrides = [f"bucketing={bucketing}"]
    if bucketing == "cost_model":
        b, sl = np.meshgrid([1, 2, 4], [16, 64, 120])
        cm = CostModel.fit(b.ravel(), sl.ravel(), (1e-3 + b * 2e-5 * sl).ravel(), form="quadratic")
        (tmp_path / "cm.json").write_text(cm.to_json())
        overrides.append(f"bucketing.policy.cost_model_path={tmp_path / 'cm.json'}")
    run = build(_compose(overrides, tmp_path))
    has_benchmark = any(isinstance(cb, ShapeBenchmarkCallback) for cb in run.trainer.callbacks)
    assert has_benchmark is fitted


def _count_shape_benchmark_inits(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = ShapeBenchmarkCallback.__init__

    def counting_init(self, *args, **kwargs):
        calls.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(ShapeBenchmarkCallback, "__init__", counting_init)
    return calls


def test_a_kept_policy_never_builds_the_shape_benchmark(monkeypatch, tmp_path):
    # bucketing=equal_token sets fit_from_benchmark=false: the callback is skipped before it is built.
    calls = _count_shape_benchmark_inits(monkeypatch)
    run = build(_compose(["bucketing=equal_token"], tmp_path))
    assert not any(isinstance(cb, ShapeBenchmarkCallback) for cb in run.trainer.callbacks)
    assert calls == []


def test_the_default_policy_builds_the_shape_benchmark(monkeypatch, tmp_path):
    calls = _count_shape_benchmark_inits(monkeypatch)
    run = build(_compose([], tmp_path))
    assert sum(isinstance(cb, ShapeBenchmarkCallback) for cb in run.trainer.callbacks) == 1
    assert calls == [1]


def test_equal_token_baseline_trains_with_its_own_policy(tmp_path):
    cfg = _compose(["bucketing=equal_token", "++trainer.fast_dev_run=2"], tmp_path)
    run = build(cfg)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    assert isinstance(run.datamodule.policy, EqualTokenPolicy)


def test_bad_override_gives_hydra_error():
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_adaptiveload.conf", version_base="1.3"):
        with pytest.raises(Exception, match="model"):
            compose(config_name="train", overrides=["model=does_not_exist"])


def test_missing_required_settings_are_named_before_anything_is_built(tmp_path):
    cfg = _compose(["data=manifest", "bucketing=cost_model"], tmp_path)
    with pytest.raises(MissingSettingError) as err:
        build(cfg)
    message = str(err.value)
    # Every missing key, what it is, and the override that supplies it.
    assert "data.dataset.path (a JSONL / CSV / Parquet manifest)" in message
    assert "bucketing.policy.cost_model_path (" in message
    assert "data.dataset.path=/data/train.jsonl" in message
    # Given, the check passes and the next problem is the (missing) file itself.
    cfg = _compose(["data=manifest", f"data.dataset.path={tmp_path / 'nope.jsonl'}"], tmp_path)
    with pytest.raises(Exception) as err:
        build(cfg)
    assert not isinstance(err.value, MissingSettingError)


def test_missing_keys_walk_lists_and_skip_hydra_and_interpolations():
    cfg = OmegaConf.create(
        {"a": "???", "b": {"c": [1, "???", {"d": "???"}], "e": "${a}"}, "hydra": {"job": {"num": "???"}}}
    )
    assert missing_keys(cfg) == ["a", "b.c[1]", "b.c[2].d"]


@pytest.mark.slow  # 3 s on a 2-core CPU under load: off the quick path
def test_console_script_reports_a_missing_setting_in_one_line(tmp_path):
    command = [
        sys.executable,
        "-m",
        "lightning_adaptiveload.train",
        "data=manifest",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("adaptiveload-train: required setting not given: data.dataset.path")


@pytest.mark.slow  # ~22 s on a 2-core CPU
def test_console_script_runs(tmp_path):
    command = [
        sys.executable,
        "-m",
        "lightning_adaptiveload.train",
        "++trainer.max_steps=6",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path}",
        f"callbacks.shape_benchmark.cache_dir={tmp_path / 'cache'}",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Bucket plan" in out and "2 rank(s)" in out
    assert "Shape benchmark (profiled" in out
    assert "Balance report" in out
    # The report has one row per rank of the two-process quickstart.
    report = out[out.index("Balance report") :]
    assert re.search(r"│\s+0 │", report) and re.search(r"│\s+1 │", report)


def test_a_finished_run_destroys_its_process_group(monkeypatch):
    # A group left to the interpreter's exit once aborted a gloo rank after its run had succeeded (exit -6).
    from gloo_ranks import free_port

    from lightning_adaptiveload.cli import train as cli

    def fit(cfg):
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return {}

    monkeypatch.setattr(cli, "train", fit)
    cli._hydra_main(OmegaConf.create({}))
    assert not torch.distributed.is_initialized()


def test_sequence_parallel_degree_is_checked_before_training(tmp_path):
    cfg = _compose(["data.sequence_parallel.enabled=true", "data.sequence_parallel.degrees=[3]"], tmp_path)
    # The tiny model has 4 heads and a node 8 ranks: 3 divides neither.
    with pytest.raises(Exception, match=r"degree=3.*does not divide the heads.*Expected one of \[2, 4\]"):
        build(cfg)


@pytest.mark.parametrize("mode, alltoalls", [("false", 8), ("full", 12), ("selective", 12), ("auto", 12)])
def test_sequence_parallel_counts_the_alltoalls_checkpointing_recomputes(tmp_path, mode, alltoalls):
    cfg = _compose(["data.sequence_parallel.enabled=true", "data.sequence_parallel.degrees=[2]", "callbacks=none",
                    "logger=none", f"model.activation_checkpointing={mode}"], tmp_path)
    assert build(cfg).datamodule.sp_comm.alltoalls_per_layer == alltoalls


def test_sequence_parallel_takes_the_model_sizes_and_trains(tmp_path):
    cfg = _compose(["data.sequence_parallel.enabled=true", "data.sequence_parallel.degrees=[2]", "callbacks=none",
                    "logger=none", "++trainer.fast_dev_run=2"], tmp_path)
    run = build(cfg)
    dm = run.datamodule
    tiny = WAN_CONFIGS["tiny"]
    assert dm.sp_config.degrees == (2,) and dm.sp_config.num_heads == tiny.num_heads
    assert (dm.sp_comm.hidden_dim, dm.sp_comm.num_layers, dm.sp_comm.alltoalls_per_layer) == (tiny.dim, tiny.num_layers, 8)
    assert tuple(dm.sp_patch_size) == tuple(tiny.patch_size)
    run.trainer.fit(run.module, datamodule=run.datamodule)  # one rank: every batch is data parallel
    batch = next(iter(dm.train_dataloader()))
    assert batch["sp_degree"] == 1


def test_sequence_parallel_adds_the_groups_callback_with_the_planned_degrees(tmp_path):
    from lightning_adaptiveload.callbacks.sequence_parallel import UlyssesSequenceParallel

    sp = ["data.sequence_parallel.enabled=true", "data.sequence_parallel.degrees=[2,4]", "callbacks=none", "logger=none"]
    run = build(_compose(sp, tmp_path))
    added = [cb for cb in run.trainer.callbacks if isinstance(cb, UlyssesSequenceParallel)]
    assert len(added) == 1 and added[0].degrees == (2, 4)
    # Off: no callback.
    run = build(_compose(["callbacks=none", "logger=none"], tmp_path))
    assert not any(isinstance(cb, UlyssesSequenceParallel) for cb in run.trainer.callbacks)
    # One the run lists is kept (not doubled) when its degrees agree, refused when they do not.
    target = "+callbacks.sp._target_=lightning_adaptiveload.callbacks.sequence_parallel.UlyssesSequenceParallel"
    run = build(_compose([*sp, target, "+callbacks.sp.degrees=[4,2]"], tmp_path))
    assert [cb.degrees for cb in run.trainer.callbacks if isinstance(cb, UlyssesSequenceParallel)] == [(4, 2)]
    with pytest.raises(Exception, match=r"UlyssesSequenceParallel\(degrees=\[2\]\) does not create the groups the "
                                         r"planner plans: data.sequence_parallel.degrees=\[2, 4\]"):
        build(_compose([*sp, target, "+callbacks.sp.degrees=[2]"], tmp_path))


def test_final_summary_shows_fractions_as_percentages():
    from lightning_adaptiveload.cli.components import format_summary

    text = format_summary({"steps": 5, "tokens_per_s": 12345.6, "mfu": 0.4, "data_wait_frac": 0.0007,
                            "step_time_cv": 0.02, "peak_mem_gb": 28.37})
    assert text == "tokens_per_s 12,346, mfu 40.00%, data_wait_frac 0.07%, step_time_cv 2.00%, peak_mem_gb 28.37"


def test_cuda_allocator_uses_expandable_segments_unless_the_environment_says_otherwise(monkeypatch):
    from lightning_adaptiveload.cli import components as train_mod

    for key in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert train_mod.configure_cuda_allocator() is True
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    assert train_mod.configure_cuda_allocator() is False and os.environ["PYTORCH_ALLOC_CONF"] == "backend:native"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")  # the older name counts too
    assert train_mod.configure_cuda_allocator() is False and "PYTORCH_ALLOC_CONF" not in os.environ
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: leave it alone
    assert train_mod.configure_cuda_allocator() is False and "PYTORCH_ALLOC_CONF" not in os.environ


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_allocator_setting_takes_effect_on_gpu():
    code = ("from lightning_adaptiveload.cli.components import configure_cuda_allocator as c; assert c(); import torch; "
            "x = torch.empty(1 << 20, device='cuda'); "
            "print(any(seg.get('is_expandable') for seg in torch.cuda.memory_snapshot()))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr


def test_compile_options_from_the_command_line(tmp_path):
    cfg = _compose(["model=tiny", "model.compile=true",
                    "model.compile_options={triton.mix_order_reduction_non_strict_mode:true}"], tmp_path)
    module = instantiate(cfg.model)
    assert module.hparams.compile_options == {"triton.mix_order_reduction_non_strict_mode": True}
    assert instantiate(_compose(["model=tiny"], tmp_path).model).hparams.compile_options is None


def _logged_losses(out: Path) -> dict[int, str]:
    """``train/loss`` by step from every CSV the runs under ``out`` logged (text, so equality is bit-exact)."""
    import csv

    losses: dict[int, str] = {}
    for path in sorted(out.glob("logs/version_*/metrics.csv")):
        with open(path) as fh:
            for row in csv.DictReader(fh):
                if row.get("train/loss"):
                    losses[int(row["step"])] = row["train/loss"]
    return losses


@pytest.mark.slow  # 5-54 s on a 2-core CPU (54 s under load)
def test_readme_resume_from_last_ckpt_at_max_steps_logs_the_same_losses(tmp_path):
    # The README quickstart resume: max_steps stops part-way through an epoch, last.ckpt is saved, and the
    # resumed run crosses epoch boundaries. 96 samples: a few steps an epoch.
    # One calibration cache: both runs train the policy the first profile fitted (timings vary run to run).
    common = ["data.dataset.num_samples=96", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
              "callbacks.shape_benchmark.max_shapes=2", "callbacks.shape_benchmark.batch_sizes=[1,2]",
              "callbacks.shape_benchmark.repeats=1", "callbacks.shape_benchmark.warmup=0",
              f"callbacks.shape_benchmark.cache_dir={tmp_path / 'cache'}"]

    def run(out: Path, *overrides: str) -> None:
        cfg = _compose([*common, *overrides], out)
        with open_dict(cfg):
            cfg.callbacks.shape_benchmark.cache_dir = str(tmp_path / "cache")
        train(cfg)

    run(tmp_path / "full", "trainer.max_steps=16")
    for stop in (7, 8):  # the epoch length follows the fitted policy: stop part-way through an epoch
        out = tmp_path / f"resumed{stop}"
        run(out, f"trainer.max_steps={stop}")
        ckpt = out / "checkpoints" / "last.ckpt"
        loops = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]
        if not loops["epoch_loop.batch_progress"]["is_last_batch"]:
            break
    assert loops["epoch_progress"]["current"]["processed"] >= 2  # saved after Lightning counted the epoch
    run(out, "trainer.max_steps=16", f"ckpt_path={ckpt}")
    want, got = _logged_losses(tmp_path / "full"), _logged_losses(out)
    assert len(want) == 16 and got == want


@pytest.mark.slow  # ~10 s on a 2-core CPU
def test_console_script_names_a_truncated_checkpoint_in_one_line(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 3, "state_dict": {"w": torch.zeros(4096)}}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    command = [sys.executable, "-m", "lightning_adaptiveload.train", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"adaptiveload-train: ckpt_path={ckpt}: cannot read the checkpoint (")
    assert "truncated or corrupt" in lines[0] and f"an earlier one in {tmp_path}" in lines[0]


@pytest.mark.slow  # 14 s on a 2-core CPU under load: off the quick path
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gpu_recipe_without_a_gpu_says_to_add_trainer_cpu(tmp_path):
    command = [sys.executable, "-m", "lightning_adaptiveload.train", "experiment=wan2_1_1_3b_480p",
               f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adaptiveload-train: trainer.accelerator=gpu, but this machine has no GPU")
    assert "add `trainer=cpu`" in lines[0]


def test_fixed_batch_sizes_name_an_unlisted_sequence_length(tmp_path):
    with pytest.raises(MissingSettingError, match=r"bucketing.policy.batch_sizes \(\{S: B\}"):
        build(_compose(["bucketing=fixed"], tmp_path))
    # The quickstart's data has S = 16, 32, 64, ...: listing one S is an error naming the others, never B=1.
    cfg = _compose(["bucketing=fixed", "bucketing.policy.batch_sizes={16: 8}", "++trainer.fast_dev_run=2"], tmp_path)
    with pytest.raises(ValueError) as info:
        train(cfg)
    message = str(info.value)
    assert re.match(r"`FixedBatchPolicy` has no batch size for S=\d+ \(unlisted sequence lengths of the data: \[", message)
    assert "`bucketing.policy.default=<B>`" in message and "listed: [16]" in message
    cfg = _compose(["bucketing=fixed", "bucketing.policy.batch_sizes={16: 8}", "bucketing.policy.default=2",
                    "++trainer.fast_dev_run=2"], tmp_path)
    assert train(cfg)["train/loss"] > 0
