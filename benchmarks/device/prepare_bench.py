"""``gpu_prepare.sh``'s benchmark: adaptiveload-prepare with the full-size Wan 2.1 VAE on one rank per GPU.

    python benchmarks/device/prepare_bench.py WORK NUM_CLIPS BATCH OUT.json     # or under torchrun

See ``gpu_prepare.sh`` for what is measured; appends a record to OUT.json (a result file).
"""

import json
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import append_record  # noqa: E402

FRAMES, HEIGHT, WIDTH = 33, 480, 832
WORDS = ["a", "cat", "dog", "red", "blue", "car", "runs", "on", "the", "street", "at", "night", "slowly"]


def write_clip(args):
    import av

    path, seed = args
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    base = rng.integers(0, 255, 3)
    with av.open(path, "w") as c:
        s = c.add_stream("mpeg4", rate=16)
        s.width, s.height, s.pix_fmt, s.bit_rate = WIDTH, HEIGHT, "yuv420p", 4_000_000
        for t in range(FRAMES):
            img = ((xx[..., None] * (1 + t % 3) + yy[..., None] + base + 7 * t) % 256).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def tiny_text_encoder(device):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    from lightning_adaptiveload.prepare.encoders import UMT5TextEncoder

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    cfg = UMT5Config(vocab_size=len(vocab), d_model=4096, d_kv=64, d_ff=1024, num_layers=2, num_heads=8, dropout_rate=0.0)
    return UMT5TextEncoder(UMT5EncoderModel(cfg).to(device, torch.bfloat16), fast, text_len=512)


def main():
    work, num_clips, batch, out_json = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if world > 1:
        torch.distributed.init_process_group("gloo")
    try:
        import av  # noqa: F401
        have_av = True
    except ImportError:
        have_av = False
    clips = work / "clips"
    if rank == 0 and have_av:
        clips.mkdir()
        t = time.perf_counter()
        with Pool(min(16, os.cpu_count() or 1)) as pool:
            pool.map(write_clip, [(str(clips / f"clip{i:04d}.mp4"), i) for i in range(num_clips)])
        rng = np.random.default_rng(0)
        rows = [{"path": f"clips/clip{i:04d}.mp4", "caption": " ".join(rng.choice(WORDS, 12))} for i in range(num_clips)]
        (work / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"generated {num_clips} clips in {time.perf_counter() - t:.1f} s", flush=True)
    if world > 1:
        torch.distributed.barrier()

    import diffusers
    from diffusers import AutoencoderKLWan

    from lightning_adaptiveload.prepare import BucketRules, Preparer, WanVaeEncoder, read_inputs

    torch.manual_seed(0)
    vae = WanVaeEncoder(AutoencoderKLWan().to(device, torch.bfloat16))  # default config = Wan 2.1's VAE
    text = tiny_text_encoder(device)
    # VAE alone on pre-made pixels: warm-up (cuDNN picks algorithms), then timed.
    vae_only = {}
    for b, reps in ((1, 3), (batch, 2)):
        pixels = torch.rand(b, 3, FRAMES, HEIGHT, WIDTH, device=device, dtype=torch.bfloat16) * 2 - 1
        vae(pixels)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            vae(pixels)
        torch.cuda.synchronize()
        vae_only[str(b)] = b * reps / (time.perf_counter() - t)
    torch.cuda.reset_peak_memory_stats(device)
    e2e = None
    if have_av:
        workers = max(1, min(8, (os.cpu_count() or 2) // world - 1))
        prep = Preparer(work / "out", BucketRules(resolutions=[(HEIGHT, WIDTH)], frame_buckets=[FRAMES]), vae, text,
                        samples_per_shard=16, batch_size=batch, num_workers=workers, rank=rank, world_size=world,
                        encoder_names={"vae": "random AutoencoderKLWan()", "text_encoder": "tiny random UMT5"},
                        progress=rank == 0)
        items = read_inputs(work / "manifest.jsonl")
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = prep.run(items)
        torch.cuda.synchronize()
        mine = {"rank": rank, "clips": result.samples, "seconds": time.perf_counter() - t,
                "skipped": dict(result.skipped)}
        gathered = [None] * world
        if world > 1:
            torch.distributed.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if rank == 0:
            summary = prep.merge(len(items))
            per_gpu = [g["clips"] / g["seconds"] for g in gathered]
            e2e = {"per_rank": gathered, "clips_per_s_per_gpu": per_gpu,
                   "mean_clips_per_s_per_gpu": sum(per_gpu) / len(per_gpu),
                   "clips_written": summary["samples"], "tokens_written": summary["tokens"],
                   "decode_workers_per_rank": workers,
                   "shard_bytes": sum(p.stat().st_size for p in (work / "out" / "shards").glob("*.tar"))}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if rank == 0:
        out = {
            "what": "adaptiveload-prepare encoding throughput, FULL-SIZE Wan 2.1 VAE architecture with random weights",
            "device": torch.cuda.get_device_name(device), "gpus": world, "clips": num_clips,
            "clip": {"frames": FRAMES, "height": HEIGHT, "width": WIDTH, "codec": "mpeg4 (PyAV)"},
            "vae": "diffusers AutoencoderKLWan() default config (Wan 2.1), random weights, bfloat16",
            "text_encoder": "tiny random UMT5 (2 layers, d_model 4096, word-level tokenizer), bfloat16: NOT umT5-XXL",
            "batch_size": batch, "pyav": have_av,
            "end_to_end": e2e if have_av else "skipped: PyAV not installed, no clips could be written or decoded",
            "vae_only_clips_per_s_by_batch": vae_only,
            "peak_gpu_memory_gib_rank0_end_to_end": peak,
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        append_record(out_json, "device/gpu_prepare.sh", out)
        print(json.dumps(out, indent=1))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
