"""Write random latent files and a manifest for a named shape mixture, to try real-file loading without a VAE.

Each sample becomes ``<out>/latents/<index>.safetensors`` holding ``"latents"`` ``[C, f, h, w]`` (the
VAE latent of its pixel shape) and ``"context"`` ``[L, text_dim]`` with a random caption length
``L <= text_len`` (ManifestDataset zero-pads it, as Wan does for umT5 outputs). The manifest lists
``path, num_frames, height, width, caption`` with pixel sizes, exactly what a real pipeline writes
after encoding its media. Tensors are those of ``SyntheticMixedDataset`` with the same seed.

    python examples/make_latent_manifest.py --out /tmp/latents                      # tiny, 64 samples
    python examples/make_latent_manifest.py --out /data/wan --mixture wan_480p \\
        --num-samples 256 --text-len 512 --text-dim 4096 --dtype bfloat16
    adaptiveload-train data=manifest data.dataset.path=/tmp/latents/manifest.jsonl    # the tiny one
    adaptiveload-train experiment=wan2_1_1_3b_480p data=manifest data.dataset.path=/data/wan/manifest.jsonl

Sizes at float32: an 81-frame 480p sample is 16x21x60x104 = 8.4 MB of latents (+ 8 MB of
512x4096 context); an 81-frame 720p one 19.4 MB. ``--dtype bfloat16`` halves that.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table
from safetensors.torch import save_file

from lightning_adaptiveload.data import MIXTURES, ManifestDataset, SyntheticMixedDataset

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("latent_manifest"), help="output directory")
    parser.add_argument("--mixture", default="tiny", choices=sorted(MIXTURES), help="named shape mixture")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latent-channels", type=int, default=16)
    parser.add_argument("--text-len", type=int, default=16, help="max context length (Wan 2.1: 512)")
    parser.add_argument("--text-dim", type=int, default=32, help="context size (Wan 2.1: 4096)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype stored on disk")
    parser.add_argument(
        "--format", default="jsonl", choices=["jsonl", "csv", "parquet"], help="manifest format"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing manifest")
    return parser.parse_args(argv)


def _write_manifest(rows: list[dict], path: Path, fmt: str) -> None:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return
    table = pa.Table.from_pylist(rows)
    if fmt == "csv":
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, path)
    else:
        import pyarrow.parquet as pq

        pq.write_table(table, path)


def main(argv: list[str] | None = None) -> Path:
    """Write the files; return the manifest path."""
    args = parse_args(argv)
    console = Console()
    manifest = args.out / f"manifest.{args.format}"
    if manifest.exists() and not args.overwrite:
        raise SystemExit(f"{manifest} exists. Pass --overwrite to replace it, or choose another --out.")
    ds = SyntheticMixedDataset(
        args.num_samples,
        args.mixture,
        latent_channels=args.latent_channels,
        text_len=args.text_len,
        text_dim=args.text_dim,
        seed=args.seed,
    )
    pixels = ds.pixel_shapes()
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    latent_elems = args.latent_channels * np.prod(ds.token_grids() * np.asarray(ds.patch_size), axis=1)
    total = int((latent_elems.sum() + args.num_samples * args.text_len * args.text_dim) * itemsize)
    console.print(
        f"Writing {args.num_samples} samples of mixture {args.mixture!r} (~{total / 2**20:.1f} MiB) to {args.out}"
    )

    (args.out / "latents").mkdir(parents=True, exist_ok=True)
    # Caption lengths vary like real tokenised captions; a separate stream keeps tensors identical
    # to SyntheticMixedDataset's for the same seed.
    lengths = np.random.default_rng([args.seed, 2]).integers(1, args.text_len + 1, args.num_samples)
    rows = []
    for i in track(range(args.num_samples), description="latents", console=console):
        item = ds[i]
        rel = f"latents/{i:07d}.safetensors"
        context = item["context"][: int(lengths[i])]
        save_file({"latents": item["latents"].to(dtype), "context": context.to(dtype)}, str(args.out / rel))
        frames, height, width = (int(v) for v in pixels[i])
        caption = f"synthetic sample {i}: {frames} frame(s) at {width}x{height}"
        rows.append({"path": rel, "num_frames": frames, "height": height, "width": width, "caption": caption})
    _write_manifest(rows, manifest, args.format)

    # Read it back the way training will, so a broken write fails here rather than in a run.
    loaded = ManifestDataset(
        manifest, latent_channels=args.latent_channels, text_len=args.text_len, text_dim=args.text_dim
    )
    table = Table(title=f"{manifest} ({len(loaded)} samples)")
    for col in ("frames x H x W", "token grid", "tokens S", "samples"):
        table.add_column(col, justify="right")
    for row in ds.describe():
        if row["count"]:
            shape = f"{row['num_frames']} x {row['height']} x {row['width']}"
            table.add_row(shape, str(row["token_grid"]), f"{row['seq_len']:,}", str(row["count"]))
    console.print(table)
    # The default model (tiny) takes the default text sizes; umT5-sized contexts need a Wan 2.1 recipe.
    recipe = "experiment=wan2_1_14b_720p " if "720p" in args.mixture else "experiment=wan2_1_1_3b_480p "
    model = recipe if args.text_dim == 4096 else ""
    console.print(f"Train on it: adaptiveload-train {model}data=manifest data.dataset.path={manifest.resolve()}",
                  soft_wrap=True)
    return manifest


if __name__ == "__main__":
    main()
