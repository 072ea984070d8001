"""Every measured number in README.md, docs/ and examples/ comes from benchmarks/results/.

The README's measured table and the tables of docs/benchmarks.md are generated (benchmarks/render_tables.py)
and must equal what it renders now; the figures the prose cites are checked against the records by name
(``render_tables.figures()``); and every tokens/s or MFU figure of these pages must be a value some
result record holds, so a number typed in by hand or left behind by a newer run fails here."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ["README.md", "examples/README.md", *sorted(
    p.relative_to(ROOT).as_posix() for p in [*(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*/README.md")])]

# (page, text with {figure} names): the rendered text must be on the page (whitespace-insensitive).
CLAIMS = [
    ("docs/benchmarks.md", "trains an epoch {per_bucket_over_selective}× faster than `selective`"),
    ("README.md", "training ran at {train_sm_mhz} MHz SM clock"),
    ("docs/benchmarks.md", "training was slower: {mix_order_on.mfu}% MFU on the mixed corpus"),
    ("README.md", "measured/predicted from {closed_loop.before} to {closed_loop.after} per shape"),
    ("README.md", "within {closed_loop.epoch_error} of the measured one"),
    ("README.md", "{closed_loop.on} tokens/s against {closed_loop.off} with it off"),
    ("README.md", "{quickstart.pairs}× tokens/s, median {quickstart.median}×"),
    ("README.md", "{quickstart_load.pairs}×, median {quickstart_load.median}×"),
    ("README.md", "with the waits: {quickstart.pooled} quiet and {quickstart_load.pooled} beside the job"),
    ("README.md", "gives {quickstart.pooled_steps} quiet and {quickstart_load.pooled_steps} beside the job"),
    ("README.md", "cost-balanced steps {simulate.gain} tokens/s over equal-token batches at {simulate.ranks} ranks"),
    ("docs/benchmarks.md", "profile took {mixed.profile_s} s on one H200, {mixed.compile_s} s of it compiling"),
    ("docs/benchmarks.md", "`selective`); {diffusers_mixed.profile_s} s for diffusers' Wan"),
    ("docs/benchmarks.md", "(diffusers' Wan, {diffusers_mixed.worst_shape})"),
    ("examples/README.md", "{speed.compiled_none} MFU compiled without checkpointing against {speed.eager_full} eager"),
    ("examples/README.md", "trained the 480p mix at {r480.mfu}% MFU, {r480.tokens_per_s} tokens/s"),
    ("examples/wan2_1_1_3b_480p/README.md", "the 480p mix profiled in {r480.profile_s} s and trained at "
     "{r480.tokens_per_s} tokens/s, {r480.mfu}% MFU ({r480.steps} steps after {r480.warmup} warm-up)"),
    ("examples/wan2_1_1_3b_480p/README.md", "the profile took {mixed.profile_s} s ({mixed.compile_s} s of it compiling"),
    ("examples/wan2_1_1_3b_480p/README.md", "training ran at {mixed.mfu}% MFU over {mixed.steps} steps "
     "(per shape {mixed.shape_mfu}; the SM clock averaged {mixed.sm_mhz} MHz"),
    ("examples/wan2_1_1_3b_480p/README.md", "trains an epoch {per_bucket_over_selective}× faster"),
    ("examples/wan2_1_1_3b_480p/README.md", "trained at {diffusers_mixed.mfu}% MFU compiled and "
     "{diffusers_mixed_eager_fused.mfu}% eager"),
    ("examples/wan2_1_14b_720p/README.md", "profile {wan14b.profile_s} s ({wan14b.compile_s} s compiling"),
    ("examples/wan2_1_14b_720p/README.md", "training {wan14b.tokens_per_s} tokens/s, {wan14b.tflops} model TFLOP/s, "
     "{wan14b.mfu}% MFU (per shape {wan14b.shape_mfu}; {wan14b.steps} steps after {wan14b.warmup}"),
    ("examples/wan2_1_14b_720p/README.md", "mix-order reduction on, {wan14b.before}"),
    ("examples/wan2_1_14b_720p/README.md", "planning 10M samples took {sampler.plan_10m_s} s at 8 and 1,024 ranks "
     "and {sampler.rss_mb} MB"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tables():
    return load_benchmark("render_tables")


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _generated(text: str) -> dict[str, str]:
    """``<!-- name -->`` ... ``<!-- /name -->`` blocks of a page, by name."""
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"<!-- (\w+) -->\n(.*?)\n<!-- /\1 -->", text, re.S)}


def test_readme_measured_table_is_generated(tables):
    blocks = _generated((ROOT / "README.md").read_text())
    for name in ("peers",):
        assert blocks.get(name) == tables.TABLES[name](), f"README.md: run `python benchmarks/render_tables.py {name}`"


@pytest.mark.parametrize("page, names", [
    ("docs/benchmarks.md", {"recipes", "speed", "simulate", "adaln", "sampler", "breakdown", "closed_loop",
                            "quickstart"}),
    ("docs/attention.md", {"attention", "fidelity"}),
])  # fmt: skip
def test_docs_tables_are_generated(tables, page, names):
    blocks = _generated((ROOT / page).read_text())
    assert names <= blocks.keys()
    for name, block in blocks.items():
        assert block == tables.TABLES[name](), f"{page} <!-- {name} -->: run render_tables.py {name}"


@pytest.mark.parametrize("page, template", CLAIMS, ids=[f"{p}:{t[:40]}" for p, t in CLAIMS])
def test_cited_figures_match_the_records(tables, page, template):
    figures = tables.figures()
    expected = re.sub(r"\{([a-z0-9_.]+)\}", lambda m: figures[m.group(1)], template)
    assert _flat(expected) in _flat((ROOT / page).read_text()), f"{page} should say: {expected}"


def _recorded_values() -> set[float]:
    """Every number in the result files, as printed: as it is, rounded to 0-2 decimals, and fractions as %."""
    out: set[float] = set()

    def add(v: float) -> None:
        if v != v or abs(v) == float("inf"):
            return
        for x in (v, 100 * v):
            out.update({round(x, 2), round(x, 1), float(round(x))})

    def walk(x) -> None:
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            add(float(x))
        elif isinstance(x, str):
            if re.fullmatch(r"-?\d*\.?\d+(e-?\d+)?", x):
                add(float(x))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for p in RESULTS.iterdir():
        if p.suffix == ".json":
            walk(json.loads(p.read_text()))
        elif p.suffix == ".csv":
            walk(list(csv.DictReader(p.open())))
    return out


# "21,423 tokens/s", "21,423 tok/s", "45.5% MFU", "MFU 45.5%", and the table cells of generated blocks.
CITED = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*(?:tokens/s|tok/s)|(\d+(?:\.\d+)?)%\s*MFU|MFU\s*(\d+(?:\.\d+)?)%")


@pytest.mark.parametrize("page", PAGES)
def test_measured_numbers_come_from_result_files(page):
    values = _recorded_values()
    text = (ROOT / page).read_text()
    cited = [next(g for g in m.groups() if g) for m in CITED.finditer(text)]
    assert cited or page != "README.md"
    unknown = sorted({c for c in cited if float(c.replace(",", "")) not in values})
    assert not unknown, f"{page} cites figures no record in benchmarks/results/ holds: {unknown}"
