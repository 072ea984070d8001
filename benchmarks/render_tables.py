"""Print the markdown tables of README.md and docs/benchmarks.md from the result files in benchmarks/results/,
and the figures the prose cites (``figures()``; tests/test_numbers.py checks both against the documents).

    python benchmarks/render_tables.py            # all tables
    python benchmarks/render_tables.py recipes    # one of: recipes, speed, simulate, adaln, sampler, breakdown
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, load_result, read_records  # noqa: E402


def _pct(v: float) -> str:
    return "failed" if math.isnan(v) else f"{v:.1%}"


def _ms(v: float) -> str:
    return "failed" if math.isnan(v) else f"{v:.3f}"


#: The quickstart's pooled figures take every pair recorded since then (the closed loop's checks and this
#: benchmark's alternating pairs as they are now).
QUICKSTART_POOLED_SINCE = "2026-12-04T18:26"
# bench_adaln.py's reference row is not a peer: say so where it appears.
PROVIDER_LABELS = {"same_bytes": "same bytes, no math (reference)"}


def adaln() -> str:
    """The latest run in ``adaln.csv`` (its rows share one commit and date)."""
    rows = list(csv.DictReader((RESULTS / "adaln.csv").open()))
    latest = max((r["date"], r["commit"]) for r in rows)
    rows = [r for r in rows if (r["date"], r["commit"]) == latest]
    meta = rows[0]
    out = [
        f"{meta['hardware']}, torch {meta['torch']}, copy bandwidth {float(meta['copy_bandwidth_gbps']):,.0f} GB/s "
        "(measured in the same run). Times in ms (CUDA-graph replay); % = fraction of copy bandwidth; "
        f"cold = every call's inputs evicted from L2 ({float(meta.get('l2_cache_mb') or 0):.0f} MiB) first.",
        "",
        "| shape (B, N, D) | x | provider | fwd ms | fwd % | fwd+bwd ms | fwd+bwd % | fwd % cold | fwd+bwd % cold "
        "| activations kept (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # "-": not measured (result files from before the cold columns, or a run with --l2 warm / cold);
    # "failed": measured and failed.
    modes = meta.get("l2") or ("both" if meta.get("fwd_frac_copy_bw_cold") else "warm")
    warm, cold = modes != "cold", modes != "warm"

    def cell(r: dict, key: str, fmt, measured: bool) -> str:
        return fmt(float(r[key])) if measured and r.get(key) else "-"

    for r in rows:
        act = float(r["activation_mb"])
        provider = PROVIDER_LABELS.get(r["provider"], r["provider"])
        out.append(
            f"| ({r['B']}, {r['N']}, {r['D']}) | {r['x_dtype']} | {provider} | "
            f"{cell(r, 'fwd_ms', _ms, warm)} | {cell(r, 'fwd_frac_copy_bw', _pct, warm)} | "
            f"{cell(r, 'fwd_bwd_ms', _ms, warm)} | {cell(r, 'fwd_bwd_frac_copy_bw', _pct, warm)} | "
            f"{cell(r, 'fwd_frac_copy_bw_cold', _pct, cold)} | {cell(r, 'fwd_bwd_frac_copy_bw_cold', _pct, cold)} | "
            f"{'-' if math.isnan(act) else f'{act:.1f}'} |"
        )
    return "\n".join(out)


def sampler() -> str:
    d = load_result(RESULTS / "sampler.json")
    out = [
        "| samples | ranks | build s | plan s | resume re-plan s | heap MB (plan / resume) | steps | predicted compute CV |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['samples']:,} | {r['world_size']} | {r['build_s']:.2f} | {r['plan_s']:.2f} | "
            f"{r['resume_replan_s']:.2f} | {r['peak_heap_plan_mb']:.0f} / {r['peak_heap_resume_mb']:.0f} | "
            f"{r['steps']:,} | {r['predicted_compute_cv']:.2%} |"
        )
    out.append(f"\nWhole process peak RSS: {d['process_peak_rss_mb']:,.0f} MB.")
    return "\n".join(out)


def breakdown() -> str:
    """The records of ``step_breakdown_h200x1.json`` measured at the last record's commit (one session: the
    project's Wan beside diffusers' at the same shapes), each in step_breakdown.py's own table under its model."""
    from step_breakdown import table

    records = [r for r in read_records(RESULTS / "step_breakdown_h200x1.json") if r.get("benchmark") == "step_breakdown.py"]
    session = [r for r in records if r["commit"] == records[-1]["commit"]]
    return "\n\n".join(f"`--model {r['result']['meta']['model']}` (`{r['result']['meta']['setting']}`"
                         + "".join(f", `{o}`" for o in r["result"]["meta"].get("overrides", [])) + f", {_short(r['commit'])}):\n\n"
                         + table(r["result"]) for r in session)


# The README's measured table: each row names the record (by its log in ``source.files``) that gives its
# figures; a row whose profile was re-measured under the current profile rules names that record apart.
RECIPE_ROWS = [
    ("experiment=wan2_1_1_3b_480p", "480p images + clips", "recipe_wan2_1_1_3b_480p_h200x1_fusion_off.log", None),
    ("experiment=wan2_1_1_3b_480p data.dataset.mixture=wan_mixed_480p_720p",
     "480p + 720p (720p clips in `selective`, the rest `none`)", "recipe_mixed_profile_fix_h200x1.log", None),
    ("experiment=wan2_1_1_3b_480p model=diffusers_wan2_1_1_3b model.compile=true", "480p (diffusers' Wan)",
     "recipe_diffusers_480p_compiled_fusion_off_h200x1.log", None),
    ("experiment=wan2_1_1_3b_480p model=diffusers_wan2_1_1_3b model.compile=true data.dataset.mixture=wan_mixed_480p_720p",
     "480p + 720p (diffusers' Wan)", "recipe_diffusers_mixed_compiled_h200x1.log",
     "recipe_diffusers_mixed_compiled_profile_fix_h200x1.log"),
    ("experiment=wan2_1_14b_720p ++model.model.num_layers=4 strategy=fsdp2 trainer.num_nodes=1",
     "480p + 720p, 14B at 4 of 40 blocks", "recipe_wan14b_4blocks_fusion_off_h200x1.log", None),
]  # fmt: skip


def recipe_record(log: str) -> dict:
    """The record of ``recipes.json`` summarised from ``log`` (or, for a run ``device/gpu_recipe.sh`` recorded,
    named after it: ``NAME`` of ``recipe_NAME.log``)."""
    for r in reversed(read_records(RESULTS / "recipes.json")):
        if log in r.get("source", {}).get("files", []) or f"recipe_{r['result'].get('name')}.log" == log:
            return r
    raise KeyError(f"no record of recipes.json was summarised from {log}")


def _short(commit: str) -> str:
    return commit.split()[0][:7]


def recipes() -> str:
    out = [
        "| command (`adaptiveload-train ... trainer.devices=1`) | corpus | profile | tokens/s | MFU | steps (warm-up) "
        "| commit |",
        "|---|---|---|---|---|---|---|",
    ]
    for command, corpus, log, profile_log in RECIPE_ROWS:
        r = recipe_record(log)
        t = r["result"]["log_summary"]["training"]
        p = recipe_record(profile_log or log)["result"]["log_summary"]["calibration"]
        commits = _short(r["commit"]) + (" (profile: a later run of the same command)" if profile_log else "")
        out.append(
            f"| `{command}` | {corpus} | {p['profile_s']} s | {t['tokens_per_s']:,} | {t['mfu_pct']}% "
            f"| {t['measured_steps']} ({t['warmup_steps']}) | {commits} |"
        )
    return "\n".join(out)


def figures() -> dict[str, str]:
    """The figures README.md, docs/ and examples/ cite in prose, by name, formatted as they are printed."""
    f: dict[str, str] = {}
    names = ("r480", "mixed", "diffusers480", "diffusers_mixed", "wan14b")
    for name, (_, _, log, profile_log) in zip(names, RECIPE_ROWS, strict=True):
        r = recipe_record(log)["result"]
        t, c = r["log_summary"]["training"], recipe_record(profile_log or log)["result"]["log_summary"]["calibration"]
        f.update({f"{name}.tokens_per_s": f"{t['tokens_per_s']:,}", f"{name}.mfu": f"{t['mfu_pct']}",
                  f"{name}.tflops": f"{t['model_tflops_per_gpu']}", f"{name}.profile_s": f"{c['profile_s']}",
                  f"{name}.compile_s": f"{c['compile_s']:.0f}", f"{name}.steps": f"{t['measured_steps']}",
                  f"{name}.warmup": f"{t['warmup_steps']}", f"{name}.date": recipe_record(log)["date"][:10]})  # fmt: skip
        per_shape = next((tb for tb in r["log_summary"].get("tables", []) if tb["title"].startswith("Per batch shape")), None)
        if per_shape:
            mfu = [row[per_shape["columns"].index("MFU")] for row in per_shape["rows"]]
            f[f"{name}.shape_mfu"] = f"{min(mfu)}–{max(mfu)}%"
    clocks = [recipe_record(log)["result"]["log_summary"]["training"].get("sm_clock_mhz") for _, _, log, _ in RECIPE_ROWS]
    eager = recipe_record("recipe_diffusers_mixed_eager_fused_h200x1.log")["result"]["log_summary"]["training"]
    f["diffusers_mixed_eager_fused.mfu"] = f"{eager['mfu_pct']}"
    f["mixed.sm_mhz"] = f"{recipe_record(RECIPE_ROWS[1][2])['result']['log_summary']['training']['sm_clock_mhz']:,}"
    row = recipe_record(RECIPE_ROWS[4][2])
    before = [r["result"]["training"]["mfu_pct"] for r in read_records(RESULTS / "recipes.json")
              if sorted(r["command"].split()) == sorted(row["command"].split()) and RECIPE_ROWS[4][2] not in r["source"]["files"]
              and r["result"].get("training", {}).get("mfu_pct")]
    f["wan14b.before"] = " and ".join(f"{m:.1f}%" for m in sorted(before, reverse=True))
    sp = read_records(RESULTS / "speed.json")[0]["result"]["settings"]
    for name in ("compiled_none", "eager_full"):
        mfu = [100 * r["mfu"] for r in sp[name]["per_shape"].values()]
        f[f"speed.{name}"] = f"{min(mfu):.1f}–{max(mfu):.1f}%" if name == "compiled_none" else f"{min(mfu):.0f}–{max(mfu):.0f}%"
    sa = load_result(RESULTS / "sampler.json")
    plan = [r["plan_s"] for r in sa["rows"] if r["samples"] == 10_000_000]
    f["sampler.plan_10m_s"] = f"{min(plan):.2f}–{max(plan):.2f}"
    f["sampler.rss_mb"] = f"{sa['process_peak_rss_mb']:,.0f}"
    fix = recipe_record("recipe_diffusers_mixed_compiled_profile_fix_h200x1.log")["result"]["log_summary"]
    table = next(tb for tb in fix["tables"] if tb["title"].startswith("Per batch shape"))
    col = {c: i for i, c in enumerate(table["columns"])}
    worst = max(table["rows"], key=lambda row: row[col["measured / predicted"]])
    f["diffusers_mixed.worst_shape"] = (f"{worst[col['B']]} × {worst[col['S']]:,}: measured {worst[col['mean step s']]:.2f} s, "
                                        f"predicted {worst[col['predicted s']]:.2f} s")  # fmt: skip
    f["train_sm_mhz"] = f"{min(c for c in clocks if c):,}–{max(c for c in clocks if c):,}"
    recipes_ = read_records(RESULTS / "recipes.json")
    modes = next(r["result"] for r in recipes_ if r["result"].get("name") == "mode_comparison_2026_12_02_fusion_off")
    f["per_bucket_over_selective"] = f"{modes['per_bucket']['epoch_tokens_per_s'] / modes['selective']['epoch_tokens_per_s']:.2f}"
    on = recipe_record("recipe_mixed_fusion_on_slices_h200x1.log")["result"]["log_summary"]["training"]
    f["mix_order_on.mfu"] = f"{on['mfu_pct']}"
    cl = load_result(RESULTS / "closed_loop.json", benchmark="bench_closed_loop.py")
    first = cl["on"]["decisions"][-1]  # the last check: the most steps
    f["closed_loop.before"] = f"{min(first['ratio_before']):.2f}–{max(first['ratio_before']):.2f}"
    f["closed_loop.after"] = f"{min(first['ratio_after']):.2f}–{max(first['ratio_after']):.2f}"
    f["closed_loop.epoch_error"] = f"{abs(cl['predicted_over_measured_epoch'] - 1):.1%}"
    f["closed_loop.on"] = f"{cl['on']['tokens_per_s']:,.0f}"
    f["closed_loop.off"] = f"{cl['off']['tokens_per_s']:,.0f}"
    # A record marked ``disturbed`` (another job ran beside it unlabelled) or ``reverted`` (it measured a change
    # that did not stay), or one with ``extra`` overrides (a variant of the README's two commands), is kept as
    # data, not cited.
    cited = [r for r in read_records(RESULTS / "quickstart_cpu.json") if "ratio_per_pair" in r["result"]
             and not r["result"].get("disturbed") and not r["result"].get("reverted")
             and not r["result"].get("extra")]
    runs = [r["result"] for r in cited]
    pooled = [r["result"] for r in cited if r["date"] >= QUICKSTART_POOLED_SINCE]
    for name, loaded in (("quickstart", False), ("quickstart_load", True)):  # the last quiet / loaded record
        q = [r for r in runs if bool(r.get("load")) == loaded][-1]
        f[f"{name}.pairs"] = ", ".join(f"{x:.2f}" for x in q["ratio_per_pair"])
        f[f"{name}.median"] = f"{q['ratio_median']:.2f}"
        # Every pair since the closed loop's checks landed that compares what the latest record compares (the
        # steps' own time, or with the waits between steps): one host's spread is larger than one series can average.
        ratios = [x for r in pooled if bool(r.get("load")) == loaded and _basis(r) == _basis(q)
                  for x in r["ratio_per_pair"]]
        f[f"{name}.pooled"] = _pooled(ratios)
        # Over the steps' own time, which every record has: the longer series.
        f[f"{name}.pooled_steps"] = _pooled([x for r in pooled if bool(r.get("load")) == loaded
                                             for x in _steps_ratios(r)])
    sim = load_result(RESULTS / "simulate.json")
    gains = _simulated_gains(sim)
    f["simulate.gain"] = f"{min(gains.values()):+.1%}" if len({f'{g:.1%}' for g in gains.values()}) == 1 else \
        f"{min(gains.values()):+.1%} to {max(gains.values()):+.1%}"  # fmt: skip
    f["simulate.ranks"] = f"{min(gains)}–{max(gains)}"
    return f


def _pooled(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}× over {len(ratios)} pairs ({sum(x >= 1 for x in ratios)} at or above 1.00×)"


def _steps_ratios(result: dict) -> list[float]:
    """A ``bench_quickstart.py`` record's per-pair ratios over the steps' own time."""
    return result["ratio_per_pair_steps"] if _basis(result) == "wall" else result["ratio_per_pair"]


def _basis(result: dict) -> str:
    """What a ``bench_quickstart.py`` record's ratios compare: ``"wall"`` (tokens/s with the waits between steps)
    or ``"steps"`` (over the steps' own time: the records before the ``basis`` key)."""
    return result.get("basis", "steps")


def _simulated_gains(sim: list[dict]) -> dict[int, float]:
    """Cost-balanced steps over equal-token batches, tokens/s, per simulated world size above 1."""
    by = {(r["name"], r["world_size"]): r["tokens_per_s"] for r in sim}
    return {w: by[("dual-constraint + balance", w)] / by[("equal-token", w)] - 1
            for (n, w) in by if n == "equal-token" and w > 1}  # fmt: skip


def _gain(x: float) -> str:
    return f"{0.0 if abs(x) < 5e-4 else x:+.1%}"


def simulate() -> str:
    sim = load_result(RESULTS / "simulate.json")
    by = {(r["name"], r["world_size"]): r for r in sim}
    out = ["| ranks | equal-token compute CV | dual constraint (derived) | + cost-balanced steps |", "|---|---|---|---|"]
    for w in sorted({w for _, w in by}):
        eq, dual, bal = by[("equal-token", w)], by[("dual-constraint", w)], by[("dual-constraint + balance", w)]
        out.append(f"| {w} | {eq['compute_cv']:.1%} | {_gain(dual['tokens_per_s'] / eq['tokens_per_s'] - 1)} | "
                   f"{_gain(bal['tokens_per_s'] / eq['tokens_per_s'] - 1)} (CV {bal['compute_cv']:.1%}) |")  # fmt: skip
    return "\n".join(out)


def speed() -> str:
    """The per-shape settings of the first record of ``speed.json`` (eager, compiled, checkpointing modes)."""
    d = read_records(RESULTS / "speed.json")[0]["result"]
    out = ["| setting | B×S | steps | step ms | tokens/s | model TFLOP/s | MFU | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for name, entry in d["settings"].items():
        for shape, r in entry.get("per_shape", {}).items():
            out.append(f"| {name} | {shape} | {r['steps']} | {1e3 * r['step_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
                       f"{r['tflops_per_gpu']:.0f} | {r['mfu']:.1%} | {r['peak_gib']:.1f} |")  # fmt: skip
    return "\n".join(out)


def peers() -> str:
    """The README's headline: the last ``bench_peers.py`` record, the recipe beside the peers' setups."""
    from bench_peers import peer_overrides

    r = read_records(RESULTS / "peers.json")[-1]
    res = r["result"]
    labels = {"recipe": "the recipe (calibrated buckets, cost-balanced steps, compiled blocks, attention=auto)",
              "batch1": "diffusers' Wan eager, full recomputation, 1 sample a step (DiffSynth-style)",
              "equal_token": f"the same, equal-token batches of {res['max_tokens']:,} tokens (musubi / Open-Sora style)"}
    out = ["| setup | overrides | tokens/s | MFU | recipe's speed-up |", "|---|---|---|---|---|"]
    for setup in ("recipe", *res["recipe_over"]):
        run = res[setup]
        extra = "" if setup == "recipe" else " ".join(peer_overrides(setup, res["peer_model"], res["max_tokens"]))
        gain = 1.0 if setup == "recipe" else res["recipe_over"][setup]
        out.append(f"| {labels[setup]} | {'`' + extra + '`' if extra else '-'} | {run['epoch_tokens_per_s']:,.0f} "
                   f"| {run['epoch_mfu']:.1%} | {gain:.2f}x |")
    return "\n".join(out)


ATTENTION_ROWS = {  # bench_attention.py --name (benchmarks/device/gpu_attention.sh's RECIPES) -> the recipe's overrides
    "480p": "experiment=wan2_1_1_3b_480p",
    "mixed": "experiment=wan2_1_1_3b_480p data.dataset.mixture=wan_mixed_480p_720p",
    "diffusers480p": "experiment=wan2_1_1_3b_480p model=diffusers_wan2_1_1_3b model.compile=true",
    "14b": "experiment=wan2_1_14b_720p ++model.model.num_layers=4 strategy=fsdp2 trainer.num_nodes=1",
}


def attention() -> str:
    """docs/attention.md: the last ``bench_attention.py`` record of each recipe, sdpa beside auto."""
    last = {r["result"]["name"]: r for r in read_records(RESULTS / "attention.json") if r["result"].get("what") == "recipe"}
    out = ["| command (`adaptiveload-train ... trainer.devices=1`) | steps | sdpa tokens/s (MFU) | auto tokens/s (MFU) "
           "| epoch MFU sdpa → auto | auto / sdpa | commit |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, overrides in ATTENTION_ROWS.items():
        if name not in last:
            continue
        res, commit = last[name]["result"], _short(last[name]["commit"])
        sdpa, auto = res["sdpa"], res["auto"]
        steps = next(o.split("=")[1] for o in res["overrides"] if o.startswith("trainer.max_steps="))
        out.append(f"| `{overrides}` | {steps} | {sdpa['tokens_per_s']:,.0f} ({sdpa['mfu']:.1%}) "
                   f"| {auto['tokens_per_s']:,.0f} ({auto['mfu']:.1%}) | {sdpa['epoch_mfu']:.1%} → {auto['epoch_mfu']:.1%} "
                   f"| {res['auto_over_sdpa_tokens_per_s']:.2f}x | {commit} |")  # fmt: skip
    return "\n".join(out)


def _backend(run: dict) -> str:
    """The attention ``auto`` chose, from the run's logged choice (``sdpa`` when FA4 did not import)."""
    line = (run.get("attention") or [""])[-1]
    return "fa4" if "fa4 at" in line else "sdpa" if line else "not recorded"


def _band(per_shape: list[dict], min_steps: int) -> str:
    r = [p["measured_over_predicted"] for p in per_shape
         if p["steps"] >= min_steps and p["measured_over_predicted"] is not None]
    return f"{min(r):.2f}–{max(r):.2f} ({len(r)})" if r else "–"


def closed_loop() -> str:
    """docs/benchmarks.md: every ``bench_closed_loop.py`` record, the closed loop off beside on."""
    out = ["| recipe | GPU | attention | steps | start | off: tokens/s (MFU) | on: tokens/s (MFU) | on / off: tokens/s, MFU | measured/predicted "
           "per shape, off → on (shapes with >= 3 steps) | on, 1-2 steps | on: predicted / measured epoch | commit |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for rec in read_records(RESULTS / "closed_loop.json"):
        if rec["benchmark"] != "bench_closed_loop.py":
            continue
        res, off, on = rec["result"], rec["result"]["off"], rec["result"]["on"]
        steps = next(o.split("=")[1] for o in res["overrides"] if o.startswith("trainer.max_steps="))
        mfu = {k: f" ({r['mfu']:.1%})" if r.get("mfu") else "" for k, r in (("off", off), ("on", on))}
        few = [p["measured_over_predicted"] for p in on["per_shape"]
               if p["steps"] < 3 and p["measured_over_predicted"] is not None]
        few_s = f"{min(few):.2f}–{max(few):.2f} ({len(few)})" if few else "–"
        ratio = f"{res['on_over_off_tokens_per_s']:.3f}" + (f", {on['mfu'] / off['mfu']:.3f}" if off.get("mfu") else "")
        # Where both runs profile, both have compiled every shape before step 1; a run from the cache compiles
        # each shape inside the measured steps the first time it is drawn.
        start = "both profile" if "callbacks.shape_benchmark.force=true" in res["overrides"] else "off profiles, on from cache"
        if res.get("note", "").startswith("cut off"):
            start += f" (pair 1 of {res['pairs']}, cut off)"
        if res.get("first") == "on":
            start += ", on first"
        gpu = "H100" if "H100" in rec["hardware"] else "H200"  # the device lends either; they compare only within a card
        out.append(f"| {res['name']} | {gpu} | {_backend(off)} | {steps} | {start} | {off['tokens_per_s']:,.0f}{mfu['off']} "
                   f"| {on['tokens_per_s']:,.0f}{mfu['on']} | {ratio} "
                   f"| {_band(off['per_shape'], 3)} → {_band(on['per_shape'], 3)} | {few_s} "
                   f"| {res['predicted_over_measured_epoch']:.3f} | {_short(rec['commit'])} |")  # fmt: skip
    return "\n".join(out)


def quickstart() -> str:
    """docs/benchmarks.md: every ``bench_quickstart.py`` record with per-pair ratios (quiet and loaded)."""
    out = ["| date | machine | tokens/s over | quickstart / equal-token tokens/s per pair | median | the run's own line: "
           "gain over equal-token, corrected (as profiled) | measured/predicted per shape after correction, worst run "
           "| commit |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for rec in read_records(RESULTS / "quickstart_cpu.json"):
        res = rec["result"]
        if "ratio_per_pair" not in res:
            continue
        machine = "beside a CPU-bound job" if res.get("load") else "quiet"
        if res.get("disturbed"):
            machine = "disturbed (see the record)"
        if res.get("reverted"):
            machine += ", a change since reverted (see the record)"
        gain = "–"
        if res.get("gain_over_equal_token_corrected_median") is not None:
            gain = f"{res['gain_over_equal_token_corrected_median']:+.1%}"
            if res.get("gain_over_equal_token_predicted_median") is not None:
                gain += f" ({res['gain_over_equal_token_predicted_median']:+.1%})"
        # (None: a shape that bounded fewer than 3 steps, so it has no time of its own)
        bands = [[p["measured_over_predicted"] for p in r["per_shape"]
                  if p["steps"] >= 3 and p["measured_over_predicted"] is not None]
                 for r in res.get("runs", []) if r["kind"] == "quickstart"]
        worst = max((b for b in bands if b), key=lambda b: max(abs(x - 1) for x in b), default=None)
        worst_s = f"{min(worst):.2f}–{max(worst):.2f}" if worst else "–"
        basis = "steps and waits" if _basis(res) == "wall" else "steps"
        out.append(f"| {rec['date'][:16].replace('T', ' ')} | {machine} | {basis} | "
                   f"{', '.join(f'{x:.2f}' for x in res['ratio_per_pair'])} | {res['ratio_median']:.2f} | {gain} "
                   f"| {worst_s} | {_short(rec['commit'])} |")
    return "\n".join(out)


def fidelity() -> str:
    """docs/attention.md: the last ``bench_fidelity.py`` record, every pair of runs."""
    rec = read_records(RESULTS / "fidelity.json")[-1]
    res = rec["result"]
    out = ["| runs | mean per-step \\|Δloss\\| / loss | the same over the first quarter of the steps "
           "| last-half mean loss, relative difference | commit |",
           "|---|---|---|---|---|"]
    for p in res["pairwise"]:
        (i, j), (a, b) = p["runs"], p["backends"]
        out.append(f"| {a} (run {i + 1}) vs {b} (run {j + 1}) | {p['mean_rel_diff']:.2e} "
                   f"| {p['first_quarter_mean_rel_diff']:.2e} | {p['tail_mean_rel_diff']:.2e} "
                   f"| {_short(rec['commit'])} |")
    return "\n".join(out)


TABLES = {"peers": peers, "attention": attention, "recipes": recipes, "speed": speed, "simulate": simulate, "adaln": adaln, "sampler": sampler,
          "breakdown": breakdown, "closed_loop": closed_loop, "quickstart": quickstart, "fidelity": fidelity}  # fmt: skip

if __name__ == "__main__":
    for name in sys.argv[1:] or list(TABLES):
        print(f"<!-- {name} -->\n{TABLES[name]()}\n")
