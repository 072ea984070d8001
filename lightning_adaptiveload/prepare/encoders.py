"""The Wan 2.1 VAE and umT5 text encoder, as ``adaptiveload-prepare`` calls them.

Both wrap the real implementations (``diffusers.AutoencoderKLWan``,
``transformers.UMT5EncoderModel``) and reproduce what Wan 2.1 feeds its DiT:

* latents are the posterior mean, normalised per channel with the VAE config's ``latents_mean`` /
  ``latents_std`` (``(mu - mean) / std``; Wan's pipelines undo exactly this before decoding);
* text context is the encoder's last hidden state at the caption's tokens only (padding dropped;
  the dataset zero-pads to ``text_len`` at load time, as Wan pads umT5 outputs). Captions are
  tokenised with truncation to ``text_len`` tokens and the tokenizer's special tokens.
"""

from __future__ import annotations

import functools
import hashlib
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def load_pretrained(loader: Callable[..., Any], path: str, subfolder: str, option: str, **kwargs: Any) -> Any:
    """``loader(path)``, else ``loader(path, subfolder=subfolder)`` (a Diffusers repo's part).

    Raises:
        ValueError: neither loads; one line naming ``option`` and its value, whether it is a local
            directory, the loader's first error and the fix (an unreachable hub: pass a local directory).
    """
    offline = None if Path(path).expanduser().is_dir() else hub_unreachable()
    if offline is not None:  # the local hub cache only: an unreachable hub would cost minutes of retries
        if not _in_hub_cache(path):
            raise ValueError(
                f"{option} {path}: not a local directory nor in the hub cache, and the model hub is not reachable "
                f"({offline}). Pass a local directory with the downloaded model (e.g. `hf download {path} --local-dir "
                "DIR` where the hub is reachable), or set HF_ENDPOINT to a reachable mirror."
            )
        kwargs = {**kwargs, "local_files_only": True}
    try:
        return loader(path, **kwargs)
    except (OSError, ValueError) as first:
        try:
            return loader(path, subfolder=subfolder, **kwargs)
        except (OSError, ValueError):
            pass
        cause = " ".join(str(first).split()) or type(first).__name__
        if Path(path).expanduser().is_dir():
            raise ValueError(
                f"{option} {path}: cannot load it from this directory ({cause}). Pass the directory of a Diffusers "
                f"Wan 2.1 repo (with a `{subfolder}/` folder) or of the {subfolder} itself."
            ) from None
        if offline is not None:
            raise ValueError(
                f"{option} {path}: the hub cache has it but it does not load from there ({cause}), and the model hub "
                f"is not reachable ({offline}). Pass a local directory with the downloaded model."
            ) from None
        raise ValueError(
            f"{option} {path}: not a local directory, and the model hub did not provide it ({cause}). Pass a local "
            "directory with the downloaded model (download it where the hub is reachable), or check the name."
        ) from None


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local hub cache holds a snapshot of ``repo_id`` (no network)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or not a repo id at all (e.g. a mistyped local path)
        return False
    return True


@functools.cache
def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the model hub cannot be reached (``HF_HUB_OFFLINE`` set, or no answer from ``HF_ENDPOINT`` within
    ``timeout_s``), or ``None`` when it answers. Checked once per process: without it an unreachable hub costs
    each model part five retries with backoff (~30 s) before its error."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout_s)
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as err:  # URLError, timeouts, refused connections, a malformed endpoint
        reason = getattr(err, "reason", err)
        return f"{constants.ENDPOINT}: {reason}"
    return None


def caption_hash(caption: str) -> str:
    """blake2b-64 hex of a caption (what the index stores to find duplicates without the text)."""
    return hashlib.blake2b(caption.encode("utf-8"), digest_size=8).hexdigest()


def clean_caption(caption: str) -> str:
    """Collapse whitespace runs and strip (Wan's pipelines also fix mojibake with ftfy; we do not)."""
    return re.sub(r"\s+", " ", caption).strip()


class WanVaeEncoder:
    """``pixels [B, 3, F, H, W]`` in [-1, 1] → normalised Wan latents ``[B, z_dim, 1 + (F-1)//4, H/8, W/8]``.

    Args:
        vae: an ``AutoencoderKLWan`` (already on its device and dtype).

    Example::

        enc = WanVaeEncoder.load("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", device="cuda", dtype=torch.bfloat16)
        latents = enc(pixels)
    """

    def __init__(self, vae: torch.nn.Module) -> None:
        self.vae = vae.eval().requires_grad_(False)
        config = vae.config
        self.z_dim = int(config.z_dim)
        self.mean = torch.tensor(config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
        if self.mean.shape[1] != self.z_dim or self.std.shape[1] != self.z_dim:
            raise ValueError(
                f"VAE config has z_dim={self.z_dim} but {self.mean.shape[1]} latents_mean / {self.std.shape[1]} "
                "latents_std values; expected one per latent channel."
            )

    @classmethod
    def load(
        cls, name_or_path: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> WanVaeEncoder:
        """Load from a local folder or hub id (a Diffusers repo's ``vae`` subfolder is found by itself)."""
        from diffusers import AutoencoderKLWan

        vae = load_pretrained(AutoencoderKLWan.from_pretrained, name_or_path, "vae", "--vae", torch_dtype=dtype)
        return cls(vae.to(device))

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.to(self.device, self.dtype, non_blocking=True)
        mu = self.vae.encode(x).latent_dist.mode().float()
        return (mu - self.mean.to(mu.device)) / self.std.to(mu.device)


class UMT5TextEncoder:
    """Captions → one ``[L_i, d_model]`` context per caption (L_i = its tokens, at most ``text_len``).

    Args:
        model: a ``UMT5EncoderModel`` (or any encoder returning ``last_hidden_state``).
        tokenizer: its tokenizer.
        text_len: truncation length (Wan 2.1: 512).

    Example::

        enc = UMT5TextEncoder.load("google/umt5-xxl", "google/umt5-xxl", device="cuda", dtype=torch.bfloat16)
        contexts = enc(["a cat on a sofa"])  # [tensor[L, 4096]]
    """

    def __init__(self, model: torch.nn.Module, tokenizer, text_len: int = 512) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.text_len = int(text_len)
        self.dim = int(model.config.d_model)

    @classmethod
    def load(
        cls,
        model_path: str,
        tokenizer_path: str | None = None,
        *,
        text_len: int = 512,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> UMT5TextEncoder:
        """Load from local folders or hub ids (a Diffusers repo's ``text_encoder`` / ``tokenizer`` too)."""
        from transformers import AutoTokenizer, UMT5EncoderModel

        model = load_pretrained(UMT5EncoderModel.from_pretrained, model_path, "text_encoder", "--text-encoder",
                                dtype=dtype)
        tokenizer = load_pretrained(AutoTokenizer.from_pretrained, tokenizer_path or model_path, "tokenizer",
                                    "--tokenizer" if tokenizer_path else "--text-encoder")
        return cls(model.to(device), tokenizer, text_len)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def __call__(self, captions: Sequence[str]) -> list[torch.Tensor]:
        tokens = self.tokenizer(
            [clean_caption(c) for c in captions],
            padding="longest",
            max_length=self.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids = tokens.input_ids.to(self.device)
        mask = tokens.attention_mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        lengths = mask.sum(dim=1).tolist()
        return [h[: int(n)] for h, n in zip(hidden, lengths, strict=True)]
