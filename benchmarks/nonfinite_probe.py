"""Where does a run's first non-finite value come from? Per step: the loss, the gradient norm and the
parameters whose gradients or values are not finite.

Runs the composition of ``bench_speed.py`` (``adaptiveload-train``, ``bucketing=fixed`` with the given
shapes interleaved, one setting) for ``--steps`` steps. Before each optimizer step (after backward,
before clipping) it records the total gradient norm and the names of the first parameters with a
non-finite gradient; after it, the first parameters with a non-finite value. The run stops
``--after`` steps past the first non-finite loss or gradient.

    python benchmarks/nonfinite_probe.py --out benchmarks/results/nonfinite_probe_h200x1.json
    python benchmarks/nonfinite_probe.py --model tiny --shapes 2x1x4x4,1x3x4x6 --accelerator cpu \\
        --setting eager_full --steps 4 --out /tmp/nonfinite.json                           # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, append_record, run_info  # noqa: E402
from bench_e2e import _compose  # noqa: E402
from bench_speed import SETTINGS, _overrides, _parse_shapes  # noqa: E402

DEFAULT_SHAPES = "24x1x30x52,4x5x30x52,2x9x30x52,1x13x30x52,1x21x30x52"  # the 1.3B recipe's 480p plan


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="wan2_1_1_3b", help="conf/model choice")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="B x token grid (f x h x w), comma-separated")
    p.add_argument("--setting", default="compiled_none", help=f"one of {list(SETTINGS)}")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--after", type=int, default=2, help="steps run past the first non-finite value")
    p.add_argument("--names", type=int, default=8, help="parameter names recorded per step")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--no-cudnn-attention", action="store_true",
                   help="turn off cuDNN's SDPA backend (torch.backends.cuda.enable_cudnn_sdp(False))")
    p.add_argument("--out", default=str(RESULTS / "nonfinite_probe.json"), help="JSON result file (record appended)")
    args = p.parse_args(argv)
    if args.setting not in SETTINGS:
        p.error(f"--setting {args.setting!r} is not valid; expected one of {list(SETTINGS)}")
    if args.steps < 1 or args.after < 0 or args.names < 0:
        p.error("--steps must be >= 1; --after and --names >= 0")
    return args


def _probe(names: int, after: int):
    import torch
    from lightning.pytorch import Callback

    def bad(params, attr):
        out = []
        for name, p in params:
            t = p.grad if attr == "grad" else p
            if t is not None and not bool(torch.isfinite(t).all()):
                out.append(name)
                if len(out) >= names:
                    break
        return out

    class Probe(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.first_bad: int | None = None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            per = sorted(((float(p.grad.norm()), n) for n, p in pl_module.named_parameters() if p.grad is not None),
                         reverse=True)[:names]
            self._grad = {"grad_norm": norm, "nonfinite_grads": bad(pl_module.named_parameters(), "grad"),
                          "largest_grads": [[n, v] for v, n in per]}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            b, s = (int(v) for v in pl_module.batch_shape(batch))
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            row = {"step": trainer.global_step - 1, "batch_size": b, "seq_len": s,
                   "loss": float(loss.detach().float().cpu()), **getattr(self, "_grad", {}),
                   "nonfinite_params": bad(pl_module.named_parameters(), "param")}
            self._grad = {}
            self.rows.append(row)
            if self.first_bad is None and (not math.isfinite(row["loss"]) or row.get("nonfinite_grads")
                                           or not math.isfinite(row.get("grad_norm", 0.0))):
                self.first_bad = row["step"]
            if self.first_bad is not None and row["step"] >= self.first_bad + after:
                trainer.should_stop = True

    return Probe()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from lightning_adaptiveload.train import build, configure_cuda_allocator

    configure_cuda_allocator()
    import torch

    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)

    shapes = _parse_shapes(args.shapes)
    out = Path(args.out)
    ov = _overrides(args, args.setting, shapes, args.steps, 0, out.parent / (out.stem + "_runs"))
    run = build(_compose(ov))
    probe = _probe(args.names, args.after)
    run.trainer.callbacks.append(probe)
    run.trainer.fit(run.module, datamodule=run.datamodule)
    result = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "how": __doc__.split("\n\n")[1].replace("\n", " "), "model": args.model, "shapes": args.shapes,
                       "setting": args.setting, "overrides": args.override,
                       "cudnn_attention": not args.no_cudnn_attention, "seed": args.seed,
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                       "torch": torch.__version__},
              "first_nonfinite_step": probe.first_bad, "rows": probe.rows}
    append_record(out, "nonfinite_probe.py", result, run_info())
    for r in probe.rows:
        print(f"step {r['step']:3d} {r['batch_size']}x{r['seq_len']}: loss {r['loss']:.4f} "
              f"grad norm {r.get('grad_norm', float('nan')):.4g} largest {r.get('largest_grads', [])[:3]} "
              f"bad grads {r.get('nonfinite_grads', [])[:3]} "
              f"bad params {r['nonfinite_params'][:3]}", flush=True)
    print(f"first non-finite step: {probe.first_bad}; appended to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
