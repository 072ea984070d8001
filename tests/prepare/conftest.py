"""Fixtures: tiny random Wan VAE and umT5 saved as local folders, and a small generated media corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prepare_media import caption, save_tiny_text_encoder, save_tiny_vae, write_image, write_video


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these convolutions are tiny, and on a shared 2-core CI box two threads per
    process oversubscribe the cores (measured 10x slower for the tiny VAE's encode)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def encoders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoders")
    vae = save_tiny_vae(root / "vae")
    text, tokenizer = save_tiny_text_encoder(root)
    return {"vae": str(vae), "text_encoder": str(text), "tokenizer": str(tokenizer)}


@pytest.fixture(scope="session")
def good_corpus(tmp_path_factory) -> Path:
    """10 good inputs: 6 videos (9, 13, 17 frames; 64x64 and 48x80) and 4 images, and a JSONL manifest."""
    root = tmp_path_factory.mktemp("corpus")
    rows = []
    for i, (frames, h, w) in enumerate([(9, 64, 64), (13, 64, 64), (17, 64, 64), (17, 48, 80), (9, 64, 64),
                                        (17, 64, 64)]):  # fmt: skip
        write_video(root / f"clip{i}.mp4", frames, h, w, seed=i)
        rows.append({"path": f"clip{i}.mp4", "caption": caption(i)})
    for i, (h, w) in enumerate([(64, 64), (40, 72), (72, 40), (64, 64)]):
        write_image(root / f"img{i}.png", h, w, seed=10 + i)
        rows.append({"path": f"img{i}.png", "caption": caption(10 + i)})
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root
