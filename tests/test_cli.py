"""`adaptiveload-train` as a user meets it: fast --help, checks before building, errors in the form of
the command line, one error report per multi-rank failure, and every command of README.md."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from hydra_compose import compose_train
from omegaconf import OmegaConf

import lightning_adaptiveload as package
from lightning_adaptiveload.callbacks.balance_monitor import BalanceMonitor
from lightning_adaptiveload.cli.checks import ConfigError, as_overrides
from lightning_adaptiveload.cli.train import build, train

ROOT = Path(package.__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
README = ROOT / "README.md"


_compose = functools.partial(compose_train, from_package=True)


class FailOnRank(pl.Callback):
    """Raises a ValueError at ``step`` on ``rank`` (all ranks when ``rank`` is None); used by a subprocess."""

    def __init__(self, rank: int | None = 1, step: int = 2, message: str = "boom") -> None:
        self.rank, self.step, self.message = rank, step, message

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            raise ValueError(f"{self.message} on rank {trainer.global_rank}")


# --- --help and typos before heavy imports -----------------------------------------------------

_PROBE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("adaptiveload_train_cli", {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
sys.argv = ["adaptiveload-train", *{argv!r}]
try:
    spec.loader.exec_module(module)
    module.main()
except SystemExit:
    pass
print("HEAVY:", sorted(m for m in ("torch", "lightning", "numpy") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["--help"], ["trainer.max_stepz=3"], ["modle=tiny"]])
def test_help_and_config_typos_are_answered_before_torch_is_imported(argv):
    # train.py loaded on its own (the package __init__ re-exports the whole library, see the next test).
    probe = _PROBE.format(path=str(ROOT / "lightning_adaptiveload" / "cli" / "train.py"), argv=argv)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "HEAVY: []" in proc.stdout, proc.stdout + proc.stderr
    if argv == ["--help"]:
        assert "== Configuration groups ==" in proc.stdout
    else:
        assert re.search(r"max_stepz|modle", proc.stderr), proc.stderr


@pytest.mark.parametrize("typo, fix", [
    ("trainer.max_step=3", "did you mean `trainer.max_steps=3`?"),
    ("modle=tiny", "did you mean `model=tiny`?"),
    ("trainer.accumulate_grad_batches=2", "add it with `+trainer.accumulate_grad_batches=2`."),
])
def test_an_unknown_key_is_answered_with_a_fix_that_composes(typo, fix, tmp_path):
    from lightning_adaptiveload.cli.checks import check_overrides

    with pytest.raises(ConfigError) as err:
        check_overrides([typo, "trainer.devices=1"], str(ROOT / "conf"))
    message = str(err.value)
    assert message.startswith(f"`{typo.split('=')[0]}` is not ") and message.endswith(fix) and "\n" not in message
    suggested = re.search(r"`([^`]+)`[?.]$", message)[1]
    cfg = _compose([suggested], tmp_path)  # the suggestion is a valid override (Hydra's `+trainer.max_step` is not)
    assert OmegaConf.select(cfg, suggested.lstrip("+").split("=")[0]) is not None
    check_overrides([suggested, "trainer.devices=1"], str(ROOT / "conf"))  # and passes the check


def test_console_script_import_stays_light():
    """What ``adaptiveload-train --help`` imports through the package (``lightning_adaptiveload/__init__``)."""
    probe = "import sys, lightning_adaptiveload; print('torch' in sys.modules)"
    eager = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if eager.stdout.strip() == "True":
        pytest.skip("lightning_adaptiveload/__init__.py imports torch eagerly: --help stays slow until it is lazy")
    argv = ["--help"]
    probe = (
        "import sys\nsys.argv = ['adaptiveload-train', '--help']\nfrom lightning_adaptiveload.cli.train import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('HEAVY:', sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120)
    assert "HEAVY: []" in proc.stdout, proc.stdout + proc.stderr


# --- checks before anything is built ------------------------------------------------------------


def test_missing_ckpt_path_is_one_line_naming_the_setting_before_anything_is_built(tmp_path):
    missing = tmp_path / "nope.ckpt"
    # A broken model target proves nothing was instantiated before the check.
    cfg = _compose([f"ckpt_path={missing}", "model._target_=does.not.Exist"], tmp_path)
    with pytest.raises(ConfigError) as err:
        build(cfg)
    message = str(err.value)
    assert message.startswith(f"ckpt_path={missing}: no such file")
    assert "\n" not in message and "leave ckpt_path out" in message


def test_resuming_a_finished_run_says_which_setting_to_raise(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    torch.save({"global_step": 200, "epoch": 3, "state_dict": {}}, ckpt)
    cfg = _compose([f"ckpt_path={ckpt}", "trainer.max_steps=200"], tmp_path)
    with pytest.raises(ConfigError, match=r"saved at step 200 and trainer.max_steps=200") as err:
        build(cfg)
    assert "trainer.max_steps=400" in str(err.value)
    # Steps left: the check passes and the run is built.
    cfg = _compose([f"ckpt_path={ckpt}", "trainer.max_steps=201", "callbacks=none"], tmp_path)
    assert build(cfg).trainer.max_steps == 201


# --- errors in the form of the command line -----------------------------------------------------


def test_as_overrides_rewrites_python_arguments_of_a_node():
    msg = "`ManifestDataset(on_bad_row='skp')` is not valid. Expected one of ('error', 'skip')."
    assert as_overrides(msg, "data.dataset", ["on_bad_row", "path"], "ManifestDataset") == (
        "`data.dataset.on_bad_row=skp` is not valid. Expected one of ('error', 'skip')."
    )
    msg = "row 3: height=-1. Fix the row, or pass `on_bad_row='skip'` to skip it; patch_size=(1, 2, 2), x=None"
    assert as_overrides(msg, "data.dataset", ["on_bad_row", "patch_size", "x"]) == (
        "row 3: height=-1. Fix the row, or pass `data.dataset.on_bad_row=skip` to skip it; "
        "data.dataset.patch_size=[1,2,2], data.dataset.x=null"
    )
    # Dicts become a quoted Hydra dict, `...` stays a placeholder (never Python's `Ellipsis`).
    msg = "`P(batch_sizes={16: 8, 64: <B>})`, `P(batch_sizes={16: 8})` or `P(batch_sizes=...)`"
    assert as_overrides(msg, "bucketing.policy", ["batch_sizes"], "P") == (
        "`bucketing.policy.batch_sizes='{16: 8, 64: <B>}'`, `bucketing.policy.batch_sizes='{16: 8}'` or "
        "`bucketing.policy.batch_sizes=...`"
    )


@pytest.mark.parametrize(("overrides", "live"), [
    ([], "m_mem"),  # the shape benchmark's budget is the top-level m_mem
    (["~callbacks.shape_benchmark"], "m_mem"),  # so is the kept policy's
    (["bucketing.fit_from_benchmark=false", "bucketing.policy.m_mem=64"], "bucketing.policy.m_mem"),  # set itself
    (["callbacks.shape_benchmark.m_mem=64"], "callbacks.shape_benchmark.m_mem"),
])
def test_oversize_error_names_the_m_mem_setting_that_is_live(tmp_path, overrides, live):
    from lightning_adaptiveload.bucketing.sampler import oversize_error
    from lightning_adaptiveload.cli.checks import as_cli_error, live_m_mem

    cfg = _compose(overrides, tmp_path)
    run = build(cfg)
    assert live_m_mem(cfg, run.trainer.callbacks) == live
    err = oversize_error(np.array([16, 120]), 64, "error", grids=np.array([[1, 4, 4], [5, 4, 6]]))
    message = str(as_cli_error(err, run.nodes, live))
    assert f"Raise `{live}` (or enable" in message and "`bucketing.policy.oversize=skip` to leave them out" in message
    assert "on the policy" not in message


def _m_mem_values(cfg) -> tuple:
    """(top-level, policy, shape benchmark) ``m_mem`` of a composed config, resolved."""
    bench = (cfg.callbacks or {}).get("shape_benchmark")
    return cfg.m_mem, cfg.bucketing.policy.get("m_mem"), None if bench is None else bench.m_mem


@pytest.mark.parametrize(("overrides", "values"), [
    ([], (None, 2048, 4096)),  # the quickstart: as before the top-level m_mem (CPU benchmark 4096, policy 2048)
    (["callbacks=gpu"], (None, 2048, None)),  # GPUs: derived from measured peak memory
    (["m_mem=3000"], (3000, 3000, 3000)),
    (["m_mem=3000", "callbacks=gpu"], (3000, 3000, 3000)),
    (["m_mem=3000", "experiment=wan2_1_1_3b_480p"], (3000, 3000, 3000)),
    (["m_mem=3000", "bucketing=cost_model", "bucketing.policy.cost_model_path=cm.json"], (3000, 3000, 3000)),
])
def test_one_m_mem_reaches_the_policy_and_the_shape_benchmark(tmp_path, overrides, values):
    assert _m_mem_values(_compose(overrides, tmp_path)) == values


def test_quickstart_keeps_its_batch_sizes(tmp_path):
    # The kept policy (fit_from_benchmark=false) plans the quickstart's batches as before m_mem was one setting.
    run = build(_compose(["bucketing.fit_from_benchmark=false"], tmp_path))
    assert run.datamodule.policy.m_mem == 2048
    sizes = run.datamodule.policy.batch_sizes(np.array([16, 64, 72, 120]))
    assert sizes.tolist() == [112, 7, 5, 2]
    (bench,) = [cb for cb in build(_compose([], tmp_path)).trainer.callbacks if type(cb).__name__ == "ShapeBenchmarkCallback"]
    assert bench.settings.m_mem == 4096


def test_policy_m_mem_is_refused_while_the_shape_benchmark_replaces_the_policy(tmp_path):
    with pytest.raises(ConfigError) as err:
        build(_compose(["bucketing.policy.m_mem=3000"], tmp_path))
    assert str(err.value) == (
        "`bucketing.policy.m_mem=3000` is never used: callbacks.shape_benchmark (ShapeBenchmarkCallback) replaces "
        "the policy with the one it fits, with the budget of the top-level `m_mem`; set `m_mem=3000` instead "
        "(or `bucketing.fit_from_benchmark=false` to keep this policy)."
    )
    # Kept policies take it: fit_from_benchmark=false, no shape benchmark, or a disabled one.
    for extra in (["bucketing.fit_from_benchmark=false"], ["callbacks=none"], ["callbacks.shape_benchmark.enabled=false"]):
        assert build(_compose(["bucketing.policy.m_mem=3000", *extra], tmp_path)).datamodule.policy.m_mem == 3000
    run = build(_compose(["m_mem=3000", "bucketing=equal_token"], tmp_path))  # the baseline: no m_mem, no benchmark
    assert type(run.datamodule.policy).__name__ == "EqualTokenPolicy"


def test_policy_m_mem_refusal_is_one_line_on_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightning_adaptiveload.train", "bucketing.policy.m_mem=3000",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("adaptiveload-train: `bucketing.policy.m_mem=3000` is never used") and \
        proc.stderr.count("\n") == 1 and "set `m_mem=3000` instead" in proc.stderr, proc.stderr


def test_out_of_memory_is_one_line_with_advice(tmp_path, capsys, monkeypatch):
    import threading

    from lightning_adaptiveload.cli import errors

    monkeypatch.setattr(errors, "_reported", threading.Event())  # one report per process: this test's
    errors.forget_run()
    try:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: the CPU allocator's own refusal
    except RuntimeError as err:
        refused = err
    for overrides, m_mem in (([], "m_mem"), (["~callbacks.shape_benchmark"], "m_mem"),
                             (["callbacks=none", "bucketing.policy.m_mem=4096"], "bucketing.policy.m_mem")):
        cfg = _compose(overrides, tmp_path)
        errors._running["trainer"] = build(cfg).trainer
        errors._reported.clear()
        with pytest.raises(SystemExit) as info:
            errors.exit_on_error(refused, cfg)
        out = capsys.readouterr().err
        assert info.value.code == 1 and out.count("\n") == 1, out
        assert out.startswith("adaptiveload-train: out of CPU memory (an allocation of 4,294,967,296.00 GiB failed). "
                              f"Lower the tokens per batch (`{m_mem}`")
        assert "`data.datamodule.num_workers`" in out and "Traceback" not in out
    errors.forget_run()


def test_fixed_batch_error_is_the_override_with_the_table_to_fill_in(tmp_path):
    from lightning_adaptiveload.bucketing.policy import FixedBatchPolicy

    cfg = _compose(["bucketing=fixed", "bucketing.policy.batch_sizes={16: 8}"], tmp_path)
    with pytest.raises(ValueError) as err:
        FixedBatchPolicy({16: 8}).batch_sizes(np.array([16, 64, 120]))
    message = as_overrides(str(err.value), "bucketing.policy", list(cfg.bucketing.policy.keys()), "FixedBatchPolicy")
    assert "List every S, e.g. `bucketing.policy.batch_sizes='{16: 8, 64: <B>, 120: <B>}'`" in message
    assert "Ellipsis" not in message and "`bucketing.policy.default=<B>`" in message


def _manifest(tmp_path: Path, rows: list[str]) -> Path:
    (tmp_path / "a.pt").write_bytes(b"")
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_dataset_argument_errors_print_the_override(tmp_path):
    good = '{"path": "a.pt", "num_frames": 1, "height": 64, "width": 64}'
    manifest = _manifest(tmp_path, [good])
    cfg = _compose(["data=manifest", f"data.dataset.path={manifest}", "data.dataset.on_bad_row=skp"], tmp_path)
    with pytest.raises(ConfigError) as err:
        build(cfg)
    assert "data.dataset.on_bad_row=skp" in str(err.value) and "on_bad_row='skp'" not in str(err.value)
    bad = '{"path": "a.pt", "num_frames": 1, "height": -1, "width": 64}'
    manifest = _manifest(tmp_path, [good, bad])
    cfg = _compose(["data=manifest", f"data.dataset.path={manifest}"], tmp_path)
    with pytest.raises(ConfigError) as err:
        build(cfg)
    assert "data.dataset.on_bad_row=skip" in str(err.value), err.value


def test_errors_raised_in_fit_name_the_override(tmp_path, monkeypatch):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    def fit(self, *args, **kwargs):
        raise MisconfigurationException(
            "`Trainer(use_distributed_sampler=True)` would replace the batch sampler; "
            "set `Trainer(use_distributed_sampler=False)`."
        )

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    with pytest.raises(ConfigError) as err:
        train(_compose(["callbacks=none", "logger=none"], tmp_path))
    assert str(err.value) == (
        "`trainer.use_distributed_sampler=true` would replace the batch sampler; "
        "set `trainer.use_distributed_sampler=false`."
    )


def test_library_error_in_python_form_is_translated_to_the_override(tmp_path):
    # The sampler says `DualConstraintPolicy(oversize='skip')`; the command line names the override.
    cfg = _compose(["callbacks=none", "logger=none", "m_mem=16"], tmp_path)
    with pytest.raises(ConfigError) as err:
        train(cfg)
    message = str(err.value)
    assert "set `bucketing.policy.oversize=skip` to leave them out" in message, message
    assert "DualConstraintPolicy(oversize=" not in message


@pytest.mark.slow  # ~24 s on a 2-core CPU: two ranks in subprocesses
def test_sequence_parallel_settings_are_named_as_the_config_node(tmp_path):
    # The library says `sequence_parallel`: ...; the command line names data.sequence_parallel.
    cfg = _compose(["callbacks=none", "logger=none", "data.sequence_parallel.enabled=true",
                    "data.sequence_parallel.degrees=[3]"], tmp_path)
    with pytest.raises(ConfigError, match=r"^`data.sequence_parallel`: .*degree=3"):
        build(cfg)


@pytest.mark.slow  # 20 s on a 2-core CPU under load: off the quick path
def test_multi_rank_failure_is_reported_once_by_rank_0_last(tmp_path):
    command = [
        sys.executable,
        "-m",
        "lightning_adaptiveload.train",
        "++trainer.max_steps=6",
        "trainer.devices=2",
        "trainer.enable_progress_bar=false",
        "~callbacks.shape_benchmark",
        "~callbacks.balance_monitor",
        "+callbacks.fail._target_=test_cli.FailOnRank",
        f"hydra.run.dir={tmp_path}",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS / "helpers"), str(ROOT)]))
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == "adaptiveload-train: rank 1: boom on rank 1", out[-3000:]
    assert out.count("boom") == 1
    assert "Traceback" not in out and "Connection closed by peer" not in out


# --- what train() prints and passes on ----------------------------------------------------------


def test_plan_printed_once_by_the_datamodule_and_print_plan_passed_on(tmp_path, capsys):
    run = build(_compose(["print_plan=false", "callbacks=none"], tmp_path))
    if not hasattr(run.datamodule, "print_plan"):
        pytest.skip("this DataModule has no print_plan")
    assert run.datamodule.print_plan is False
    train(_compose(["++trainer.max_steps=2", "callbacks=none", "logger=none"], tmp_path))
    assert capsys.readouterr().out.count("Bucket plan") == 1


def test_final_metrics_come_from_the_balance_monitor_summary(tmp_path, caplog, monkeypatch):
    summary = {"step_time_cv": 0.1234, "bubble": 0.05, "tokens_per_s": 1000.0, "steps": 2.0}
    monkeypatch.setattr(BalanceMonitor, "summary", lambda self: dict(summary))
    overrides = ["++trainer.max_steps=2", "~callbacks.shape_benchmark", "logger=none"]
    cfg = _compose([*overrides, "++callbacks.balance_monitor.print_report=false"], tmp_path)
    with caplog.at_level(logging.INFO):
        metrics = train(cfg)
    assert metrics["balance/step_time_cv"] == 0.1234 and metrics["balance/bubble"] == 0.05
    final = caplog.text[caplog.text.index("Final metrics") :]
    assert "train/loss at step 2 (the last logged value)" in final
    assert "balance, means over 2 steps: step_time_cv 12.34%, bubble 5.00%, tokens_per_s 1,000" in final


@pytest.mark.slow  # ~10 s on a 2-core CPU: a 3-step fit
def test_metrics_json_names_a_prediction_without_cost_model_as_b_s_p(tmp_path):
    # The equal-token baseline has no cost model: its per-shape "prediction" is B·S^2, not seconds.
    cfg = _compose(["bucketing=equal_token", "++trainer.max_steps=3", "logger=none", "print_plan=false",
                    "++callbacks.balance_monitor.print_report=false"], tmp_path)
    train(cfg)
    written = json.loads((tmp_path / "metrics.json").read_text())
    rows = written["per_shape"]
    assert rows and all(r["predicted_B_S^2"] == r["B"] * r["S"] ** 2 for r in rows)
    # Every counted step too, one row each (the monitor counts all 3: no warm-up steps configured).
    assert len(written["steps"]) == written["balance/steps"] == 3
    assert all(r["step_s"] > 0 and r["B"] * r["S"] > 0 for r in written["steps"])
    assert not any("predicted" in r or "measured_over_predicted" in r for r in rows)


def test_cpu_manifest_defaults_and_the_gpu_recipes_set_more(tmp_path):
    cfg = _compose(["data=manifest", "data.dataset.path=x.jsonl"], tmp_path)
    assert cfg.data.datamodule.num_workers <= 2 and cfg.data.datamodule.pin_memory is False
    for experiment in ("wan2_1_1_3b_480p", "wan2_1_14b_720p"):
        recipe = _compose([f"experiment={experiment}", "data=manifest", "data.dataset.path=x.jsonl"], tmp_path)
        assert recipe.data.datamodule.num_workers >= 4 and recipe.data.datamodule.pin_memory is True


def test_world_size_warnings(tmp_path):
    cores = os.cpu_count() or 1
    cfg = _compose(["callbacks=none", "logger=none"], tmp_path, devices=cores + 1)
    with pytest.warns(UserWarning, match=rf"trainer.devices={cores + 1} CPU processes on {cores} core"):
        build(cfg)
    cfg = _compose(["callbacks=none", "logger=none", "data.dataset.num_samples=1"], tmp_path, devices=2)
    with pytest.warns(UserWarning, match=r"2 ranks for 1 sample"):
        build(cfg)


# --- every command of README.md -----------------------------------------------------------------


def readme_commands(text: str) -> list[list[str]]:
    """The overrides of every ``adaptiveload-train ...`` command in the fenced code blocks of ``text``."""
    commands = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            for part in re.split(r"&&|\|\||;|\|", line):
                tokens = shlex.split(part, comments=True)
                if tokens and tokens[0] == "adaptiveload-train":
                    commands.append(tokens[1:])
    return commands


def test_readme_commands_are_extracted():
    text = "x\n```bash\npip install . && adaptiveload-train a=1 b=2   # note\nadaptiveload-simulate x\n```\n"
    assert readme_commands(text) == [["a=1", "b=2"]]


_COMMANDS = readme_commands(README.read_text()) if README.is_file() else []
# Keep README runs short: two steps, few profiled shapes.
_FAST = {
    "callbacks.shape_benchmark.max_shapes": "2",
    "callbacks.shape_benchmark.batch_sizes": "[1,2]",
    "callbacks.shape_benchmark.repeats": "1",
    "callbacks.shape_benchmark.warmup": "0",
}


def test_readme_has_train_commands():
    assert _COMMANDS, f"no `adaptiveload-train` command in the code blocks of {README}"


def _missing_file(overrides: list[str]) -> str | None:
    """The first path-valued override (``...path=`` / ``ckpt_path=``) naming a file that does not exist."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~").endswith("path") and value not in ("", "null") and not Path(value).exists():
            return value
    return None


@pytest.mark.slow  # 7 s on a 2-core CPU under load: off the quick path
@pytest.mark.parametrize("overrides", _COMMANDS, ids=[" ".join(c) or "<no overrides>" for c in _COMMANDS])
def test_readme_command_composes_and_runs_on_cpu(overrides, tmp_path):
    cfg = _compose(overrides, tmp_path)
    gpu = cfg.trainer.get("accelerator") not in ("cpu", "auto") or cfg.get("model", {}).get("model", {}).get(
        "preset", "tiny"
    ) != "tiny"
    missing = _missing_file(overrides)
    extra = [f"{k}={v}" for k, v in _FAST.items() if cfg.callbacks and "shape_benchmark" in cfg.callbacks]
    if gpu:
        # Compose, and build everything on CPU (the model is built lazily in configure_model, so a
        # 14B preset costs nothing here).
        extra += ["trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.num_nodes=1", "strategy=auto"]
    else:
        extra += ["++trainer.max_steps=2"]
    cfg = _compose([*overrides, *extra], tmp_path)
    if missing is not None:
        # A placeholder path (/data/train.jsonl): the command is refused in one line naming it.
        with pytest.raises((ConfigError, FileNotFoundError), match=re.escape(missing)):
            build(cfg)
        return
    if gpu:
        run = build(cfg)
        assert run.datamodule is not None and run.trainer is not None
    else:
        assert "train/loss" in train(cfg)


def test_simulate_takes_m_mem_from_a_calibration_file_unless_given(tmp_path, capsys):
    from lightning_adaptiveload.calibration.costmodel import CostModel
    from lightning_adaptiveload.calibration.profile import Measurement
    from lightning_adaptiveload.calibration.record import Calibration
    from lightning_adaptiveload.cli.simulate import main as simulate

    cal = Calibration(key={"model": "x"}, cost_model=CostModel("quadratic", {"a": 0.01, "c1": 1e-6, "c2": 1e-10}),
                      measurements=[Measurement(1, (1, 2, 2), 4, 0.01, 1000, "ok", 3, 0.05)])
    record = tmp_path / "shape_benchmark.json"
    record.write_text(json.dumps({**cal.to_dict(), "derived": {"m_mem": 40_000}}))
    argv = ["--mixture", "wan_480p", "--num-samples", "2000", "--world-sizes", "8", "--cost-model", str(record)]
    assert simulate(argv) == 0
    out = capsys.readouterr().out
    assert f"M_mem = 40,000 tokens (derived.m_mem of --cost-model {record})" in out
    assert "EqualTokenPolicy(max_tokens=40000)" in out
    assert simulate([*argv, "--m-mem", "50000"]) == 0
    assert "M_mem = 50,000 tokens (--m-mem)" in capsys.readouterr().out
    plain = tmp_path / "cm.json"  # a CostModel file carries no M_mem: the default
    plain.write_text(cal.cost_model.to_json())
    assert simulate([*argv[:-1], str(plain)]) == 0
    assert "M_mem = 65,520 tokens (default: max(65520, longest S))" in capsys.readouterr().out


def test_simulate_takes_the_checkpointing_tiers_from_a_calibration_file(tmp_path, capsys):
    from lightning_adaptiveload.calibration.costmodel import CostModel
    from lightning_adaptiveload.calibration.derive import ModeTier
    from lightning_adaptiveload.calibration.profile import Measurement
    from lightning_adaptiveload.calibration.record import Calibration
    from lightning_adaptiveload.cli.simulate import main as simulate

    tiers = [ModeTier("none", 32760, 1.0), ModeTier("selective", 75600, 1.2)]
    cal = Calibration(key={"model": "x"}, cost_model=CostModel("quadratic", {"a": 0.01, "c1": 1e-6, "c2": 1e-10}),
                      measurements=[Measurement(1, (1, 2, 2), 4, 0.01, 1000, "ok", 3, 0.05)],
                      extra={"checkpointing": {"tiers": [t.to_dict() for t in tiers]}})
    record = tmp_path / "shape_benchmark.json"
    derived = {"m_mem": 90_000, "tiers": [{"mode": "none", "m_mem": 40_000}, {"mode": "selective", "m_mem": 90_000}]}
    record.write_text(json.dumps({**cal.to_dict(), "derived": derived}))
    out_json = tmp_path / "sim.json"
    argv = ["--mixture", "wan_mixed_480p_720p", "--num-samples", "2000", "--world-sizes", "8", "--cost-model",
            str(record), "--json", str(out_json)]
    assert simulate(argv) == 0
    out = capsys.readouterr().out
    assert "M_mem = 90,000 tokens" in out and "0 samples above it" in out  # 720p clips train in 'selective'
    assert "checkpointing per bucket: 'none' up to S=32,760 (M_mem 40,000), 'selective' up to S=75,600" in out
    assert "TieredPolicy(" in out


def test_the_console_script_leaves_out_only_torchs_deprecations_of_lightnings_calls():
    from lightning_adaptiveload.cli import train as cli_train

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cli_train.quiet_upstream_deprecations()  # what main() does first
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and "
                      "treespec.is_leaf()` instead.", FutureWarning, stacklevel=1)
        warnings.warn("torch.distributed.nn.functional.all_gather is deprecated, use "
                      "torch.distributed._functional_collectives.all_gather_single instead.", FutureWarning,
                      stacklevel=1)
        warnings.warn("torch.distributed.nn.functional.broadcast is deprecated", FutureWarning,  # not ours to hide
                      stacklevel=1)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", UserWarning,  # another category stays
                      stacklevel=1)
    assert [(type(w.message), str(w.message)) for w in seen] == [
        (FutureWarning, "torch.distributed.nn.functional.broadcast is deprecated"),
        (UserWarning, "`isinstance(treespec, LeafSpec)` is deprecated"),
    ]


@pytest.mark.slow  # ~25 s on a 2-core CPU: the quickstart's two ranks for a few steps
def test_the_quickstart_prints_no_deprecation_of_lightnings_torch_calls(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightning_adaptiveload.train", "trainer.max_steps=3",
                           f"output_dir={tmp_path}", f"hydra.run.dir={tmp_path}",
                           f"callbacks.shape_benchmark.cache_dir={tmp_path / 'cache'}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "Final metrics" in out
    assert "LeafSpec" not in out and "functional.all_gather is deprecated" not in out
