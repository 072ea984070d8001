"""Step 1 of ``gpu_data_wait.sh``: write the synthetic sharded corpus with the package's own writer.

    python benchmarks/device/data_wait_corpus.py ROOT SAMPLES VIDEO_FRAC VIDEO IMAGE TEXT GRID_HW

VIDEO, IMAGE and TEXT are comma-separated latent / context shapes, GRID_HW the token grid's "h,w".
Writes the shards, ``index.parquet`` and ``corpus.json`` (what was written) under ROOT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_shards import write_corpus  # noqa: E402  (the loading benchmark's writer: one corpus format)


def main(argv: list[str]) -> None:
    root, n, video_frac = Path(argv[0]), int(argv[1]), float(argv[2])
    video, image, text = (tuple(int(v) for v in a.split(",")) for a in argv[3:6])
    gh, gw = (int(v) for v in argv[6].split(","))
    rng = np.random.default_rng(0)
    # One random array per kind, written for every sample: the bytes read are what matters here.
    arrays = {"video": rng.standard_normal(video).astype(np.float16),
              "image": rng.standard_normal(image).astype(np.float16)}
    context = rng.standard_normal(text).astype(np.float16)
    is_video = rng.random(n) < video_frac
    written = write_corpus(root, [arrays["video" if v else "image"] for v in is_video], context, (gh, gw), evict=True)
    shards, size = written["shards"], written["shard_bytes"]
    info = {"samples": n, "videos": int(is_video.sum()), "images": int(n - is_video.sum()), "video_latents": video,
            "image_latents": image, "context": text, "stored": "float16", "shards": len(shards), "shard_bytes": size,
            "write_s": written["write_s"]}
    (root / "corpus.json").write_text(json.dumps(info))
    print(f"corpus: {json.dumps(info)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
