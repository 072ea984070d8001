"""Launch-plan sweep for the fused AdaLN kernels: the same shapes as ``bench_adaln.py`` (ours only,
CUDA-graph GPU time), once per setting of the kernels' tuning environment variables.

Every setting is also checked against the first one: y and dx must be bitwise equal (each
row is computed the same way whatever CTA runs it) and the modulation gradient close (its partial
sums are grouped differently).

    python benchmarks/sweep_adaln.py --out benchmarks/results/adaln_tuning/sweep \\
        --config base: --config cyclic:ADALN_FWD_CYCLIC=1,ADALN_BWD_CYCLIC=1
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from bench_adaln import DTYPES, SHAPES, _graph_ms, copy_bandwidth

from lightning_adaptiveload.ops import adaln

KNOBS = ("ADALN_FWD_WAVES", "ADALN_BWD_WAVES", "ADALN_FWD_CYCLIC", "ADALN_BWD_CYCLIC", "ADALN_F32_ROWPACK_D")


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    name, _, assigns = text.partition(":")
    env = {}
    for item in filter(None, assigns.split(",")):
        key, _, value = item.partition("=")
        if key not in KNOBS:
            raise SystemExit(f"--config {text!r}: unknown knob {key!r}; expected one of {', '.join(KNOBS)}")
        env[key] = value
    return name, env


def run_case(B, N, D, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, N, D, device="cuda", dtype=dtype, generator=g).requires_grad_()
    e = (torch.randn(B, 6, D, device="cuda", generator=g) * 0.1).requires_grad_()
    gy = torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def fwd():
        ch = e.chunk(6, dim=1)
        return adaln(x, ch[1], ch[0], out_dtype=torch.bfloat16)

    def fwd_bwd():
        return torch.autograd.grad(fwd(), (x, e), gy)

    with torch.no_grad():
        y = fwd()
    dx, de = fwd_bwd()
    with torch.no_grad():
        t_fwd = _graph_ms(fwd)
    t_fb = _graph_ms(fwd_bwd)
    return t_fwd, t_fb, (y, dx, de)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", action="append", required=True, help="name:KNOB=V,KNOB=V (repeatable)")
    args = parser.parse_args()
    configs = [parse_config(c) for c in args.config]
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    rows = []
    for B, N, D in SHAPES:
        for dname, dtype in DTYPES.items():
            elems = B * N * D
            xs = torch.empty((), dtype=dtype).element_size()
            mod = 2 * B * D * 4
            fwd_bytes = elems * (xs + 2) + mod + 8 * B * N
            fb_bytes = fwd_bytes + elems * (2 + xs + xs) + 2 * mod + 8 * B * N
            first = None
            for name, env in configs:
                for k in KNOBS:
                    os.environ.pop(k, None)
                os.environ.update(env)
                t_fwd, t_fb, outs = run_case(B, N, D, dtype)
                if first is None:
                    first = outs
                    same, de_err = True, 0.0
                else:
                    same = all(torch.equal(a, b) for a, b in zip(outs[:2], first[:2], strict=True))
                    de_err = ((outs[2] - first[2]).abs().max() / first[2].abs().max()).item()
                row = {
                    "B": B,
                    "N": N,
                    "D": D,
                    "x_dtype": dname,
                    "config": name,
                    "env": env,
                    "fwd_ms": t_fwd,
                    "fwd_bwd_ms": t_fb,
                    "fwd_frac_copy_bw": fwd_bytes / (t_fwd * 1e-3) / bw,
                    "fwd_bwd_frac_copy_bw": fb_bytes / (t_fb * 1e-3) / bw,
                    "y_dx_bitwise_equal_to_first": same,
                    "de_rel_diff_to_first": de_err,
                }
                rows.append(row)
                print(
                    f"{str((B, N, D)):>18} {dname:>4} {name:>14} fwd {t_fwd:7.4f} ms {100 * row['fwd_frac_copy_bw']:5.1f}%"
                    f"  f+b {t_fb:7.4f} ms {100 * row['fwd_bwd_frac_copy_bw']:5.1f}%  same={same} de={de_err:.1e}",
                    flush=True,
                )
                with open(args.out + ".json", "w") as f:
                    json.dump(
                        {
                            "meta": {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbps": bw / 1e9},
                            "rows": rows,
                        },
                        f,
                        indent=1,
                    )
            del first
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
