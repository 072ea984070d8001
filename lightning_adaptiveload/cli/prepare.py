"""``adaptiveload-prepare``: encode a corpus of images and videos into indexed latent shards.

Single process::

    adaptiveload-prepare /data/captions.jsonl /data/wan480p \\
        --vae Wan-AI/Wan2.1-T2V-1.3B-Diffusers --text-encoder Wan-AI/Wan2.1-T2V-1.3B-Diffusers

Data parallel (each rank encodes its share of the shards, rank 0 merges the index)::

    torchrun --nproc-per-node 8 -m lightning_adaptiveload.cli.prepare /data/captions.jsonl /data/wan480p ...

Rerunning the same command after a crash keeps finished shards and encodes the rest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_adaptiveload.prepare.buckets import BucketRules
from lightning_adaptiveload.prepare.pipeline import PrepareError, Preparer, format_summary

_CONF = Path(__file__).resolve().parent.parent / "conf" / "prepare"


def _conf_dir() -> Path:
    """conf/ ships as ``lightning_adaptiveload.conf`` in a wheel and sits beside the package in a checkout."""
    try:
        import lightning_adaptiveload.conf as conf

        return Path(conf.__file__).parent / "prepare"
    except ImportError:
        return _CONF


def load_rules(name_or_path: str) -> BucketRules:
    """Bucket rules from a YAML file, or a name in ``conf/prepare/`` (``wan2_1_480p``, ``tiny``)."""
    from omegaconf import OmegaConf

    path = Path(name_or_path)
    if not path.is_file():
        path = _conf_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in _conf_dir().glob("*.yaml"))
        raise FileNotFoundError(f"`--buckets {name_or_path}`: no such file or preset. Presets: {known}.")
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return BucketRules(**cfg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adaptiveload-prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("input", help="manifest (.jsonl/.csv/.parquet with path, caption) or a folder of media")
    p.add_argument("output", help="output folder (shards/, index.parquet, summary.json, skipped.jsonl)")
    p.add_argument("--vae", required=True, help="AutoencoderKLWan: local folder or hub id")
    p.add_argument("--text-encoder", required=True, help="UMT5EncoderModel: local folder or hub id")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: --text-encoder)")
    p.add_argument("--buckets", default="wan2_1_480p", help="bucket YAML file or preset in conf/prepare/")
    p.add_argument("--root", default=None, help="relative manifest paths resolve here (default: its folder)")
    p.add_argument("--text-len", type=int, default=512, help="caption token limit (Wan 2.1: 512)")
    p.add_argument("--batch-size", type=int, default=1, help="samples of one bucket per VAE call")
    p.add_argument("--samples-per-shard", type=int, default=256, help="inputs per shard")
    p.add_argument("--num-workers", type=int, default=4, help="decoding processes per rank")
    p.add_argument("--device", default="auto", help="auto: cuda:LOCAL_RANK if available, else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="encoder compute dtype (auto: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    p.add_argument("--store-dtype", default="float16", choices=["float16", "float32"])
    p.add_argument("--missing-caption", default="skip", choices=["skip", "empty"])
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world > 1 and not torch.distributed.is_initialized():
        # gloo for the final barrier only: ranks finish at different times, hours apart on big corpora.
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(days=7))
    device = args.device
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    from lightning_adaptiveload.prepare.encoders import UMT5TextEncoder, WanVaeEncoder
    from lightning_adaptiveload.prepare.inputs import read_inputs

    try:
        rules = load_rules(args.buckets)
        items = read_inputs(args.input, args.root)
        vae = WanVaeEncoder.load(args.vae, device=device, dtype=dtype)
        text = UMT5TextEncoder.load(args.text_encoder, args.tokenizer, text_len=args.text_len, device=device,
                                    dtype=dtype)  # fmt: skip
        preparer = Preparer(
            args.output,
            rules,
            vae,
            text,
            samples_per_shard=args.samples_per_shard,
            batch_size=args.batch_size,
            num_workers=args.num_workers,
            store_dtype=args.store_dtype,
            missing_caption=args.missing_caption,
            rank=rank,
            world_size=world,
            encoder_names={"vae": args.vae, "text_encoder": args.text_encoder,
                           "tokenizer": args.tokenizer or args.text_encoder, "compute_dtype": dtype_name},
            progress=not args.no_progress,
        )  # fmt: skip
        result = preparer.run(items)
        print(
            f"rank {rank}/{world}: {result.chunks_done} shard(s) encoded, {result.chunks_skipped} already finished, "
            f"{result.samples} samples, skipped {dict(result.skipped)}",
            file=sys.stderr,
        )
        if world > 1:
            torch.distributed.barrier()
        if rank == 0:
            summary = preparer.merge(len(items))
            print(format_summary(summary))
            print(json.dumps({"index": str(Path(args.output) / "index.parquet"), "samples": summary["samples"]}))
    except (ValueError, FileNotFoundError, PrepareError) as err:
        print(f"adaptiveload-prepare: {err}", file=sys.stderr)
        return 1
    finally:
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
