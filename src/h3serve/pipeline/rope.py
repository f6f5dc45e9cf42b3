"""The RoPE clock and grid of the packed sequence: where in (t, h, w) a row of each kind sits.

Time is one clock for every modality: a text row per unit, then the media, 40 units per second (one per audio latent,
(5/3) * m per latent frame). Height and width are aspect-normalised axes centred near 16. Positions are float64 and
rounded once, to float32, where the DiT consumes them (`PackedLayout.rope_positions`).

Each sum below runs in the reference's order, which is part of the released numbers: a sequential and a pairwise
sum of the same spans part in the last ulp from 16 latent frames on, and the DiT's RoPE sees that ulp.
"""

from __future__ import annotations

import numpy as np

# One latent frame spans (5/3) * m RoPE time units, m following the VAE's 1, 4, 4, 4, 4 pixel-frame grouping:
# 40 units per second at 24 fps, the same clock as the 40 Hz audio latents (one unit each).
ROPE_FRAME_UNITS = 5.0 / 3.0
ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32


def spatial_grid(dim: int, patch: int, sqrt_area: float) -> np.ndarray:
    """One aspect-normalised RoPE axis: `dim // patch` points, float64, centred near 16.

    numpy on purpose: `np.linspace(endpoint=False)` is `start + k * step` and `torch.linspace` differs from it by an
    ulp, which the released positions do not forgive. The stop is written `left + ratio`, as the reference does.
    """
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    return np.linspace(left, left + ratio, dim // patch, endpoint=False) * ROPE_SPATIAL_SCALE


def frame_grid(latent_height: int, latent_width: int, patch_h: int, patch_w: int) -> tuple[np.ndarray, np.ndarray]:
    """The (h, w) positions of one latent frame's rows, row-major, (rows_per_frame, 2); and its w axis."""
    sqrt_area = np.sqrt(latent_height * latent_width)
    h_grid = spatial_grid(latent_height, patch_h, sqrt_area)
    w_grid = spatial_grid(latent_width, patch_w, sqrt_area)
    hh, ww = np.meshgrid(h_grid, w_grid, indexing="ij")
    return np.stack([hh.reshape(-1), ww.reshape(-1)], axis=-1), w_grid


def frame_times(num_latent_frames: int, origin: float) -> np.ndarray:
    """RoPE time of every latent frame: origin, then steps of (5/3) * (1, 4, 4, 4, 4, 1, 4, ...), summed in order."""
    spans = np.array(
        [ROPE_FRAME_UNITS * ROPE_FRAMES_PER_LATENT[k % len(ROPE_FRAMES_PER_LATENT)] for k in range(num_latent_frames)],
        dtype=np.float64,
    )
    return origin + np.concatenate([np.zeros(1), np.cumsum(spans[:-1])])


def last_frame_time(num_latent_frames: int, origin: float) -> float:
    """RoPE time of a "last" keyframe: the time of the last *pixel* frame, origin + (5/3) * (num_frames - 1).

    Computed as the reference does, all spans summed with numpy's pairwise `sum`, minus one 5/3; a sequential
    sum of the same series differs in the last ulp from 16 latent frames on.
    """
    spans = np.ones(num_latent_frames, dtype=np.float64) * ROPE_FRAME_UNITS
    for offset, m in enumerate(ROPE_FRAMES_PER_LATENT):
        spans[offset :: len(ROPE_FRAMES_PER_LATENT)] *= m
    return float(origin) + float(spans.sum()) - ROPE_FRAME_UNITS


def video_time_span(num_latent_frames: int) -> float:
    """RoPE time a Ref2VA reference video occupies: (5/3) * (1 + 4 + 4 + 4 + 4 + 1 + ...), summed in order.

    A sequential float64 sum, as the reference advances its cursor; `last_frame_time`'s pairwise sum of the same
    series differs from it in the last ulp from 16 latent frames on.
    """
    span = 0.0
    for k in range(num_latent_frames):
        span += ROPE_FRAME_UNITS * ROPE_FRAMES_PER_LATENT[k % len(ROPE_FRAMES_PER_LATENT)]
    return span
