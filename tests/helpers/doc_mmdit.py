"""The own MMDiT of ``docs/your_own_model.md`` ("Your own MMDiT"), executed from the doc itself so tests run what
the doc shows: ``namespace()`` holds ``JointBlock``, ``TinyMMDiT`` and ``MyMMDiT``; ``glue_lines()`` counts the
glue block's code lines (neither blank nor comment)."""

from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "your_own_model.md"
SECTION = "### Your own MMDiT"


def _blocks() -> list[str]:
    text = DOC.read_text().split(SECTION, 1)[1].split("\n### ", 1)[0]
    return [part.split("\n```", 1)[0] for part in text.split("```python\n")[1:]]


def namespace() -> dict:
    """The network and glue blocks (the first two of the section) run in one fresh namespace."""
    ns: dict = {"__name__": "doc_mmdit"}
    for i, block in enumerate(_blocks()[:2]):
        exec(compile(block, f"{DOC.name}[{SECTION} block {i}]", "exec"), ns)
    return ns


def glue_lines() -> list[str]:
    return [line for line in _blocks()[1].splitlines() if line.strip() and not line.strip().startswith("#")]
