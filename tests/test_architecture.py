"""The package's import graph: no cycles, and nothing imports a higher layer, lazily or not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lightning_adaptiveload"
PKG = "lightning_adaptiveload"
# Package data shipped inside the package (conf/ and csrc/ at the repository root), not code.
DATA_PACKAGES = (f"{PKG}.conf", f"{PKG}.csrc")

# Lower layers never import higher ones (DESIGN.md, "Dependency direction"). Modules of one layer
# may import each other as long as the graph stays acyclic.
LAYERS: list[tuple[str, ...]] = [
    ("_checks", "geometry", "bucketing.metrics", "ops"),
    ("bucketing",),
    ("calibration",),
    ("reporting",),
    # parallel.fsdp and parallel.pretrained are model-agnostic torch.distributed / safetensors code
    # that models' configure_model calls (meta build, fully_shard, shard-wise init and loading);
    # they import nothing of the package above ops, so they sit with models, not above it.
    ("data", "models", "modules", "parallel.fsdp", "parallel.pretrained"),
    ("callbacks", "integrations", "parallel", "strategies", "factories", "prepare"),
    ("cli", "train"),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Package modules imported anywhere in the file (function bodies included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith(DATA_PACKAGES):
                continue
            if name.startswith(PKG + ".") or name == PKG:
                # `from pkg.sub import thing`: the submodule if `thing` is one, else the package.
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(p, known) - {m} for m, p in mods.items()}


def _layer(module: str) -> int | None:
    rel = module[len(PKG) + 1:] if module != PKG else ""
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (rel == name or rel.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def test_every_module_has_a_layer():
    missing = [m for m in _modules() if m != PKG and _layer(m) is None]
    assert not missing, f"assign these modules a layer in tests/test_architecture.py: {missing}"


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n == PKG:
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if state.get(n) is None:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if state.get(m) is None and m != PKG:
            visit(m)


def test_no_upward_imports():
    upward = []
    for m, deps in _graph().items():
        if m == PKG:
            continue
        for d in deps:
            if d == PKG:
                upward.append(f"{m} -> {d} (the package root re-exports everything)")
            elif _layer(d) > _layer(m):
                upward.append(f"{m} (layer {_layer(m)}) -> {d} (layer {_layer(d)})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_the_checker_sees_lazy_imports(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from lightning_adaptiveload.calibration.derive import derive_policy\n")
    assert _imports(f, set(_modules())) == {"lightning_adaptiveload.calibration.derive"}


@pytest.mark.slow  # 11 s on a 2-core CPU under load: off the quick path
def test_public_names_resolve_lazily():
    import subprocess
    import sys

    code = ("import sys, lightning_adaptiveload as la; assert 'torch' not in sys.modules, 'eager torch import'; "
            "missing = [n for n in la.__all__ if getattr(la, n, None) is None]; assert not missing, missing")
    subprocess.run([sys.executable, "-c", code], check=True)
