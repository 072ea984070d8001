"""Every Python snippet of README.md and docs/*.md runs as written (the blocks of one file in order, in one
namespace, as a reader runs them), and every ``adaptiveload-train`` command in docs/ composes and builds.

A snippet that names a placeholder path (``/data/...``) must be refused with an error naming that path."""

import os
import re
from pathlib import Path

import pytest

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


def _train_commands(text: str) -> list[list[str]]:
    import shlex

    out = []
    for lang, block in _blocks(text):
        if lang not in ("bash", "sh"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            for i, tok in enumerate(tokens):
                if tok == "adaptiveload-train" or (tok == "lightning_adaptiveload.train" and tokens[i - 1] == "-m"):
                    out.append([t for t in tokens[i + 1:] if "=" in t and not t.startswith("-")])
    return out


DOC_COMMANDS = [pytest.param(cmd, id=f"{f.name}:{' '.join(cmd)}") for f in FILES[1:] for cmd in _train_commands(f.read_text())]


@pytest.mark.parametrize("overrides", DOC_COMMANDS)
def test_doc_commands_compose_and_build(overrides, tmp_path):
    from test_examples import CPU, _compose

    from lightning_adaptiveload.train import ConfigError, build

    keys = {o.split("=", 1)[0] for o in CPU}
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
