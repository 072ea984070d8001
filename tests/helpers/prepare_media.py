"""Test media and tiny random encoders, made in the test (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

WORDS = ["a", "cat", "dog", "red", "blue", "car", "runs", "on", "the", "street", "sofa", "clip", "image"]


def save_tiny_vae(folder: Path) -> Path:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    vae.save_pretrained(folder)
    return folder


def save_tiny_text_encoder(folder: Path, d_model: int = 32) -> tuple[Path, Path]:
    """A 2-layer random UMT5 encoder and a WordLevel tokenizer that appends ``</s>`` like umT5's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder / "tokenizer")
    torch.manual_seed(0)
    config = UMT5Config(vocab_size=len(vocab), d_model=d_model, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, dropout_rate=0.0)  # fmt: skip
    UMT5EncoderModel(config).save_pretrained(folder / "text_encoder")
    return folder / "text_encoder", folder / "tokenizer"


def write_video(path: Path, frames: int, height: int = 64, width: int = 64, seed: int = 0) -> Path:
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        base = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        for i in range(frames):
            img = np.roll(base, 2 * i, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_image(path: Path, height: int = 64, width: int = 64, seed: int = 0) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def write_zero_frame_video(path: Path) -> Path:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        container.start_encoding()  # writes the header: a valid container whose video stream has no frames
        for packet in stream.encode():
            container.mux(packet)
    return path


def caption(i: int) -> str:
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS, size=int(rng.integers(2, 8))))


