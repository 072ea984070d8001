"""The cost model of an MMDiT with and without ``attention_tokens``: the own MMDiT of ``docs/your_own_model.md``
profiled by ``ShapeBenchmarkCallback`` through ``Trainer.fit`` (CPU), per text length L.

Each L is profiled once, with the module's ``attention_tokens`` (S + L); the same measurements are then fitted
twice: in attention tokens (what the calibration does) and in video tokens only (the fit without the protocol
member), so the difference between the two is the fit's, not the noise of two profiles. Reported per setting:
the fit's held-out median relative error (leave one shape out: the calibration's own quality figure) and,
leaving one sequence length out at a time (its every batch size predicted by a fit of the other lengths), the
median and the largest per-length error: a bucket mispredicted.

    python benchmarks/bench_mmdit_costmodel.py                      # L = 32 and 128, ~2-3 minutes on 2 cores
    python benchmarks/bench_mmdit_costmodel.py --text-lens 16 --time-budget 5 --out /tmp/mmdit.json   # quick
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "your_own_model.md"
SECTION = "### Your own MMDiT"
# Images and clips with S = 16 .. 864 video tokens (vae stride (4, 8, 8), patch (1, 2, 2)).
MIXTURE = [
    {"num_frames": 1, "height": 64, "width": 64, "weight": 0.25},  # (1, 4, 4) = 16
    {"num_frames": 1, "height": 128, "width": 128, "weight": 0.2},  # (1, 8, 8) = 64
    {"num_frames": 1, "height": 256, "width": 256, "weight": 0.15},  # (1, 16, 16) = 256
    {"num_frames": 9, "height": 128, "width": 128, "weight": 0.15},  # (3, 8, 8) = 192
    {"num_frames": 17, "height": 128, "width": 192, "weight": 0.15},  # (5, 8, 12) = 480
    {"num_frames": 33, "height": 128, "width": 192, "weight": 0.1},  # (9, 8, 12) = 864
]


def doc_model() -> dict:
    """``TinyMMDiT`` and ``MyMMDiT`` as the doc defines them (its section's first two Python blocks)."""
    text = DOC.read_text().split(SECTION, 1)[1].split("\n### ", 1)[0]
    ns: dict = {"__name__": "doc_mmdit"}
    for block in [part.split("\n```", 1)[0] for part in text.split("```python\n")[1:]][:2]:
        exec(compile(block, str(DOC), "exec"), ns)
    return ns


def _errors(cm_fit, b: np.ndarray, s: np.ndarray, t: np.ndarray) -> dict[str, float]:
    """Leave one sequence length out: each length's batches predicted by a fit of the other lengths."""
    per_length = {}
    for v in np.unique(s):
        keep = s != v
        cm = cm_fit(b[keep], s[keep], t[keep])
        per_length[int(v)] = float(np.median(np.abs(np.asarray(cm.predict(b[~keep], s[~keep])) / t[~keep] - 1)))
    return {"per_length": per_length, "median": float(np.median(list(per_length.values()))),
            "max": float(max(per_length.values()))}


def run_one(ns: dict, text_len: int, args: argparse.Namespace, work: Path) -> dict:
    import lightning as L

    from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
    from lightning_adaptiveload.calibration.costmodel import CostModel
    from lightning_adaptiveload.callbacks.shape_benchmark import ShapeBenchmarkCallback
    from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

    module = ns["MyMMDiT"](text_len=text_len, channels=4, text_dim=8, dim=args.dim, heads=args.heads,
                           depth=args.depth)
    dataset = SyntheticMixedDataset(256, MIXTURE, latent_channels=4, text_len=text_len, text_dim=8)
    datamodule = AdaptiveLoadDataModule(dataset, DualConstraintPolicy(m_mem=4096, m_comp=4096 * 1024, p=2))
    cb = ShapeBenchmarkCallback(max_shapes=6, repeats=args.repeats, warmup=args.warmup, converge_rel=0.0,
                                time_budget_s=args.time_budget, form="quadratic", m_mem=4096,
                                save_dir=work / f"L{text_len}", closed_loop=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        default_root_dir=work, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=datamodule)
    ok = [m for m in cb.calibration.measurements if m.status == "ok"]
    b, s, t = (np.array([getattr(m, k) for m in ok], dtype=np.float64) for k in ("batch_size", "seq_len", "time_s"))
    table = cb.calibration.cost_model.attention_tokens
    out = {"text_len": text_len, "shapes": len(ok), "profile_seconds": cb.calibration.profile_seconds,
           "median_step_spread": float(np.median([m.spread for m in ok if m.spread is not None] or [np.nan])),
           "points": [[int(bb), int(ss), float(tt)] for bb, ss, tt in zip(b, s, t, strict=True)]}
    for name, mapping in (("with_attention_tokens", table), ("video_tokens_only", None)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = CostModel.fit(b, s, t, form="quadratic", attention_tokens=mapping)
            lolo = _errors(lambda bb, ss, tt, m=mapping: CostModel.fit(bb, ss, tt, form="quadratic",
                                                                         attention_tokens=m), b, s, t)
        out[name] = {"cost_model": str(cm), "heldout_median_rel_error": cm.quality["heldout_median_rel_error"],
                     "leave_one_length_out": lolo}
        print(f"L={text_len:4d} {name:22s} held-out median {cm.quality['heldout_median_rel_error']:6.1%} | "
              f"leave-one-length-out median {lolo['median']:6.1%}, worst length {lolo['max']:6.1%}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text-lens", default="32,128", help="comma-separated text lengths L")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--time-budget", type=float, default=40.0, help="ShapeBenchmarkCallback(time_budget_s) per L")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings on a shared CPU)")
    p.add_argument("--note", default="CPU shared with other jobs while this ran; timings are noisy",
                   help="how quiet the machine was, stored with the record (with the 1-minute load average before and after each L)")
    p.add_argument("--out", type=Path, default=RESULTS / "mmdit_costmodel.json")
    args = p.parse_args(argv)
    try:
        lens = [int(v) for v in args.text_lens.split(",")]
    except ValueError:
        p.error(f"--text-lens {args.text_lens!r}: expected comma-separated integers, e.g. 32,128")
    import torch

    torch.set_num_threads(args.threads)
    run, ns = run_info(), doc_model()
    settings = {k: getattr(args, k) for k in ("dim", "heads", "depth", "repeats", "warmup", "time_budget", "threads")}
    result = {"model": "docs/your_own_model.md TinyMMDiT + MyMMDiT", **settings, "mixture": MIXTURE, "form": "quadratic",
              "note": args.note, "how": "one ShapeBenchmarkCallback profile per L through Trainer.fit (CPU); its "
              "measurements fitted with and without the attention-token table", "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for text_len in lens:
            load = os.getloadavg()[0]
            result["runs"].append({**run_one(ns, text_len, args, Path(tmp)),
                                   "load_average_1min": [load, os.getloadavg()[0]], "cpu_cores": os.cpu_count()})
            append_record(args.out, "bench_mmdit_costmodel.py", result, run)  # a cut-short run keeps what it measured
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
