"""Every command and every override row of ``examples/*/README.md`` composes with its recipe and builds
(on CPU: the model is built lazily in ``configure_model``, so a 14B preset costs nothing here)."""

import functools
import re
import shlex
from pathlib import Path

import pytest
from hydra_compose import compose_train

from lightning_adaptiveload.train import ConfigError, build

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
# On CPU: one device, no GPU precision, the recipes' multi-node settings folded to one process.
CPU = ["trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.num_nodes=1", "trainer.devices=1",
       "strategy=auto"]


def _commands(text: str) -> list[list[str]]:
    """Overrides of every ``adaptiveload-train`` command and ``-m lightning_adaptiveload.train`` launch."""
    out = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        tokens = shlex.split(block.replace("\\\n", " "), comments=True)
        for i, tok in enumerate(tokens):
            if tok == "adaptiveload-train" or (tok == "lightning_adaptiveload.train" and tokens[i - 1] == "-m"):
                out.append([t for t in tokens[i + 1:] if "=" in t and not t.startswith("-")])
    return out


def _rows(text: str) -> list[tuple[str, list[str]]]:
    """``(setting, overrides)`` of every row of the override table (backticked cells)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1].startswith("`"):
            first = re.match(r"`([^`]*)`", cells[1]).group(1)
            rows.append((cells[0], shlex.split(first)))
    return rows


CASES = []
for readme in sorted(ROOT.glob("examples/*/README.md")):
    text = readme.read_text()
    commands = _commands(text)
    assert commands, f"{readme}: no adaptiveload-train command"
    name = readme.parent.name
    for i, cmd in enumerate(commands):
        CASES.append(pytest.param(cmd, id=f"{name}-command{i}"))
    for setting, overrides in _rows(text):
        CASES.append(pytest.param(commands[0] + overrides, id=f"{name}-{setting}"))


def test_the_example_tables_are_read():
    ids = [c.id for c in CASES]
    assert any("equal-token baseline" in i for i in ids) and any("480p + 720p corpus" in i for i in ids)
    assert len([i for i in ids if i.startswith("wan2_1_1_3b_480p-")]) >= 12


_compose = functools.partial(compose_train, devices=None)


@pytest.mark.parametrize("overrides", CASES)
def test_example_command_or_row_composes_and_builds(overrides, tmp_path):
    # The last value of a key wins in Hydra only through `++`; drop the recipe's own values the CPU run replaces.
    keys = {o.split("=", 1)[0] for o in CPU}
    given = [o for o in overrides if o.split("=", 1)[0] not in keys]
    cfg = _compose([*given, *CPU], tmp_path)
    placeholder = next((v for o in given for k, _, v in [o.partition("=")]
                        if k.endswith(("path", "pretrained")) and "/" in v and not Path(v).exists()), None)
    if placeholder is not None:
        # A placeholder path (/data/..., outputs/run/...): refused in one line naming it.
        with pytest.raises((ConfigError, FileNotFoundError), match=re.escape(placeholder)):
            build(cfg)
        return
    run = build(cfg)
    assert run.trainer is not None and run.datamodule is not None
