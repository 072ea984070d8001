"""Named shape mixtures for :class:`~lightning_adaptiveload.data.synthetic.SyntheticMixedDataset`.

A mixture is a list of ``{num_frames, height, width, weight}`` entries in pixels (images have
``num_frames=1``); ``weight`` is the share of *samples* with that shape (weights are normalised).
Token counts below assume Wan 2.1's VAE stride (4, 8, 8) and patch (1, 2, 2): a 832x480 frame is
30x52 = 1,560 tokens per latent frame, 1280x720 is 45x80 = 3,600, and F frames give
``1 + (F - 1) // 4`` latent frames (17 → 5, 33 → 9, 49 → 13, 81 → 21).
"""

from __future__ import annotations

import copy

MIXTURES: dict[str, list[dict[str, float]]] = {
    # CPU quickstart for the "tiny" model: S from 16 to 120 tokens, so a step takes milliseconds
    # but bucketing still sees a 7.5x spread of sequence lengths.
    "tiny": [
        {"num_frames": 1, "height": 64, "width": 64, "weight": 0.3},  # (1, 4, 4) = 16 tokens
        {"num_frames": 1, "height": 128, "width": 128, "weight": 0.2},  # (1, 8, 8) = 64 tokens
        {"num_frames": 9, "height": 64, "width": 96, "weight": 0.3},  # (3, 4, 6) = 72 tokens
        {"num_frames": 17, "height": 64, "width": 96, "weight": 0.2},  # (5, 4, 6) = 120 tokens
    ],
    # A mixed image + video corpus in the spirit of the AdaptiveLoad paper's Wan 2.1 data: images
    # are 40% of samples but ~5% of tokens; 81-frame clips are 18% of samples and ~48% of tokens
    # (mean S = 17,494). The weights are illustrative (the paper does not publish its exact mix);
    # S spans 48x, from 1,560 to 75,600 tokens.
    "wan_mixed_480p_720p": [
        {"num_frames": 1, "height": 480, "width": 832, "weight": 0.30},  # (1, 30, 52) = 1,560
        {"num_frames": 1, "height": 720, "width": 1280, "weight": 0.10},  # (1, 45, 80) = 3,600
        {"num_frames": 17, "height": 480, "width": 832, "weight": 0.10},  # (5, 30, 52) = 7,800
        {"num_frames": 33, "height": 480, "width": 832, "weight": 0.10},  # (9, 30, 52) = 14,040
        {"num_frames": 49, "height": 480, "width": 832, "weight": 0.08},  # (13, 30, 52) = 20,280
        {"num_frames": 81, "height": 480, "width": 832, "weight": 0.12},  # (21, 30, 52) = 32,760
        {"num_frames": 17, "height": 720, "width": 1280, "weight": 0.05},  # (5, 45, 80) = 18,000
        {"num_frames": 33, "height": 720, "width": 1280, "weight": 0.05},  # (9, 45, 80) = 32,400
        {"num_frames": 49, "height": 720, "width": 1280, "weight": 0.04},  # (13, 45, 80) = 46,800
        {"num_frames": 81, "height": 720, "width": 1280, "weight": 0.06},  # (21, 45, 80) = 75,600
    ],
    # 480p only (Wan 2.1 1.3B's native resolution): S from 1,560 to 32,760 tokens; images are 40%
    # of samples and 5% of tokens, 81-frame clips 20% of samples and 53% of tokens (mean S = 12,480).
    "wan_480p": [
        {"num_frames": 1, "height": 480, "width": 832, "weight": 0.40},  # (1, 30, 52) = 1,560
        {"num_frames": 17, "height": 480, "width": 832, "weight": 0.15},  # (5, 30, 52) = 7,800
        {"num_frames": 33, "height": 480, "width": 832, "weight": 0.15},  # (9, 30, 52) = 14,040
        {"num_frames": 49, "height": 480, "width": 832, "weight": 0.10},  # (13, 30, 52) = 20,280
        {"num_frames": 81, "height": 480, "width": 832, "weight": 0.20},  # (21, 30, 52) = 32,760
    ],
}


def get_mixture(name: str) -> list[dict[str, float]]:
    """Return a copy of the named mixture (safe to modify).

    Raises:
        ValueError: if ``name`` is not one of :data:`MIXTURES`.
    """
    if name not in MIXTURES:
        raise ValueError(f"`get_mixture({name!r})`: unknown mixture. Expected one of {sorted(MIXTURES)}.")
    return copy.deepcopy(MIXTURES[name])
