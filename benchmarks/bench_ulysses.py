"""Cost of the Ulysses code path on one GPU: WanModel forward + backward with a sequence-parallel group of
degree 1 (shard, the q/k/v and output all-to-alls over NCCL, the output gather: all real, over one rank)
against the plain path, at Wan 2.1 1.3B's width on a video and an image shape.

On one GPU the exchanges move nothing between devices, so the difference is what the SP path adds on
top of attention: the q/k/v concatenation, the permute copies around each all-to-all and NCCL's
local copies. It also checks that both paths give the same loss. Multi-GPU all-to-all bandwidth is
not measured here.

    python benchmarks/bench_ulysses.py [--layers 4] [--iters 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import socket
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _results import append_record

from lightning_adaptiveload.models.wan import WAN_CONFIGS, WanModel
from lightning_adaptiveload.parallel.ulysses import UlyssesGroup

# (batch, token grid): 81-frame 480p video (32,760 tokens) and a batch of 480p images (1,560 tokens).
SHAPES = [(1, (21, 30, 52)), (8, (1, 30, 52))]


def _step_ms(model: WanModel, batch, sequence_parallel, iters: int) -> tuple[float, float, int]:
    x, t, context, target = batch
    times, loss = [], None
    torch.cuda.reset_peak_memory_stats()
    for i in range(iters + 3):  # 3 warm-up steps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, context, sequence_parallel=sequence_parallel)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        loss = loss.detach()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
        model.zero_grad(set_to_none=True)
    return statistics.median(times), loss.item(), torch.cuda.max_memory_allocated()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None, help="JSON result file to append a record to")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = UlyssesGroup(dist.group.WORLD, [0])
    cfg = WAN_CONFIGS["wan2_1_1_3b"]
    torch.manual_seed(0)
    model = WanModel({"preset": "wan2_1_1_3b", "num_layers": args.layers}).cuda()
    torch.nn.init.normal_(model.head.head.weight, std=0.02)  # Wan's zero init would zero the gradients
    rows = []
    print(f"{'B':>3} {'S':>7} {'plain ms':>9} {'SP=1 ms':>9} {'overhead':>9} {'loss equal':>10}")
    for b, grid in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(1)
        f, h, w = grid
        latent = (b, cfg.in_dim, f, 2 * h, 2 * w)
        batch = (
            torch.randn(latent, device="cuda", generator=gen),
            1000 * torch.rand(b, device="cuda", generator=gen),
            torch.randn(b, cfg.text_len, cfg.text_dim, device="cuda", generator=gen),
            torch.randn(latent, device="cuda", generator=gen),
        )
        plain_ms, plain_loss, plain_mem = _step_ms(model, batch, None, args.iters)
        sp_ms, sp_loss, sp_mem = _step_ms(model, batch, group, args.iters)
        row = {
            "batch": b, "grid": list(grid), "seq_len": f * h * w, "plain_ms": plain_ms, "sp1_ms": sp_ms,
            "overhead": sp_ms / plain_ms - 1, "plain_peak_gib": plain_mem / 2**30, "sp1_peak_gib": sp_mem / 2**30,
            "loss_equal": plain_loss == sp_loss,
        }
        rows.append(row)
        print(f"{b:>3} {f * h * w:>7} {plain_ms:>9.2f} {sp_ms:>9.2f} {row['overhead']:>9.2%} {str(row['loss_equal']):>10}")
    result = {
        "what": "WanModel fwd+bwd, bf16 autocast, median of CUDA-event times; SP=1 = Ulysses path over one rank",
        "model": f"wan2_1_1_3b width, {args.layers} blocks", "iters": args.iters,
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
    }
    if args.json:
        append_record(args.json, "bench_ulysses.py", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
