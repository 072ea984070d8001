"""Every Python snippet of README.md and docs/*.md runs as written (the blocks of one file in order, in one
namespace, as a reader runs them); every ``adaptiveload-train`` command in README.md and docs/ (fenced,
inline and the README's measured table) composes and builds; and the README's quickstart followed by its
resume line trains on from the quickstart's last.ckpt.

A snippet that names a placeholder path (``/data/...``) must be refused with an error naming that path."""

import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"""["'](/data/[^"']+)["']""")


def _blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block, fences read in order (an opening fence has a language
    or none; the next bare fence closes it)."""
    out, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip() or "text", []
            else:
                out.append((lang, "\n".join(lines) + "\n"))
                lang = None
        elif lang is not None:
            lines.append(line)
    return out


def _python_blocks(text: str) -> list[str]:
    return [code for lang, code in _blocks(text) if lang == "python"]


DOCS = [pytest.param(f, id=f.relative_to(ROOT).as_posix()) for f in FILES if _python_blocks(f.read_text())]


def test_the_snippets_are_found():
    names = {p.id for p in DOCS}
    assert {"README.md", "docs/your_own_model.md", "docs/adaln_kernel.md"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCS)
def test_python_snippets_run_as_written(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a snippet writes (outputs/, lightning_logs/) stays here
    namespace: dict = {"__name__": "__snippet__"}
    for i, block in enumerate(_python_blocks(path.read_text())):
        placeholder = PLACEHOLDER.search(block)
        code = compile(block, f"{path.name}[python block {i}]", "exec")
        if placeholder is None:
            exec(code, namespace)
            continue
        with pytest.raises(Exception) as err:
            exec(code, namespace)
        assert placeholder.group(1) in str(err.value), f"{path.name} block {i}: {err.value!r}"


def _prose(text: str) -> str:
    """``text`` without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _command_lines(text: str, inline: bool = False) -> list[str]:
    """Every ``adaptiveload-train`` line a reader may type: the lines of bash blocks (in page order), then
    (``inline``: the README, whose prose gives the resume line) inline code spans that are whole commands
    (not fragments with ``...``), then the rows of a table whose header says ``command (`adaptiveload-train ... X`)``."""
    lines = []
    for lang, block in _blocks(text):
        if lang in ("bash", "sh"):
            lines += block.replace("\\\n", " ").splitlines()
    prose = _prose(text)
    if inline:
        spans = re.findall(r"`((?:adaptiveload-train|python -m lightning_adaptiveload\.train)\b[^`]*)`", prose)
        lines += [s for s in spans if "..." not in s]
    for table in re.findall(r"^\| command \(`adaptiveload-train \.\.\. (.*?)`\).*?\n((?:\|.*\n)+)", prose, flags=re.M):
        suffix, rows = table
        lines += [f"adaptiveload-train {m} {suffix}" for m in re.findall(r"^\| `([^`]+)` \|", rows, flags=re.M)]
    return lines


def _train_commands(text: str, inline: bool = False) -> list[list[str]]:
    import shlex

    out = []
    for line in _command_lines(text, inline):
        tokens = shlex.split(line, comments=True)
        for i, tok in enumerate(tokens):
            if tok == "adaptiveload-train" or (tok == "lightning_adaptiveload.train" and tokens[i - 1] == "-m"):
                out.append([t for t in tokens[i + 1:] if "=" in t and not t.startswith("-")])
    return out


DOC_COMMANDS = [pytest.param(list(cmd), id=f"{f.name}:{' '.join(cmd) or '(no overrides)'}")
                for f in FILES for cmd in dict.fromkeys(map(tuple, _train_commands(f.read_text(), f.name == "README.md")))]


def test_the_readme_commands_are_found():
    ids = [p.id for p in DOC_COMMANDS if p.id.startswith("README.md:")]
    assert "README.md:(no overrides)" in ids  # the quickstart, `adaptiveload-train` alone
    assert any("ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt" in i for i in ids)  # the resume line
    # A row of the recipes' attention table (docs/attention.md; the README cites its figures).
    assert any(p.id.startswith("attention.md:") and "++model.model.num_layers=4" in p.id for p in DOC_COMMANDS)


@pytest.mark.parametrize("overrides", DOC_COMMANDS)
def test_doc_commands_compose_and_build(overrides, tmp_path):
    from test_examples import CPU, _compose

    from lightning_adaptiveload.train import ConfigError, build

    keys = {o.split("=", 1)[0] for o in CPU}
    # `outputs/<date>/<time>/...` stands for a run's folder (the resume line; run for real below).
    overrides = [o.replace("<date>", "DATE").replace("<time>", "TIME") for o in overrides]
    given = [o for o in overrides if o.split("=", 1)[0] not in keys and not o.startswith("$")]
    cfg = _compose([*given, *CPU], tmp_path)
    missing = next((v for o in given for k, _, v in [o.partition("=")]
                    if k.endswith(("path", "pretrained", "root")) and "/" in v and not Path(v).exists()), None)
    if missing is not None:
        with pytest.raises((ConfigError, FileNotFoundError), match=re.escape(missing)):
            build(cfg)
        return
    run = build(cfg)
    assert run.trainer is not None
    os.environ.pop("PYTORCH_ALLOC_CONF", None)


def _readme_quickstart_and_resume() -> tuple[list[str], list[str]]:
    """The quickstart's overrides (the first ``adaptiveload-train`` of the README) and those of the resume line
    (the first command with a ``ckpt_path``), as the README writes them."""
    commands = _train_commands((ROOT / "README.md").read_text(), inline=True)
    resume = next(c for c in commands if any(o.startswith("ckpt_path=") for o in c))
    return commands[0], resume


@pytest.mark.slow  # ~25 s on a 2-core CPU: the quickstart's 200 steps on one process, then the resume
def test_readme_resume_line_trains_on_after_the_quickstart(tmp_path):
    """The quickstart as written, then the resume line as written with ``outputs/<date>/<time>`` standing for
    the quickstart's output folder: the resume is accepted (it asks for more steps than the checkpoint holds)
    and trains to its own ``trainer.max_steps``. Only the corpus and the profile are made smaller."""
    from test_train import _compose

    from lightning_adaptiveload.train import train

    quickstart, resume = _readme_quickstart_and_resume()
    small = ["data.dataset.num_samples=96", "trainer.enable_progress_bar=false", "callbacks.shape_benchmark.max_shapes=2",
             "callbacks.shape_benchmark.batch_sizes=[1,2]", "callbacks.shape_benchmark.repeats=1",
             "callbacks.shape_benchmark.warmup=0"]  # fmt: skip
    first = tmp_path / "outputs" / "quickstart"
    cfg = _compose([*quickstart, *small], first)
    train(cfg)
    ckpt = first / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == cfg.trainer.max_steps
    given = [o.replace("outputs/<date>/<time>", str(first)) for o in resume]
    assert str(ckpt) in " ".join(given), f"the README's resume line does not name the quickstart's last.ckpt: {resume}"
    cfg = _compose([*given, *small], tmp_path / "resumed")
    train(cfg)
    assert torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == \
        cfg.trainer.max_steps > torch.load(ckpt, weights_only=False)["global_step"]  # fmt: skip
