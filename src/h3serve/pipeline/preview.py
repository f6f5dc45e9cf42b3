"""Previews of a render in progress: at chosen forwards, the sampler's current estimate of the clean video latents
(for this data-ward flow-matching sampler, the state plus (1 - t) times the velocity: `schedule.clean_estimate`,
what the Euler step blends toward) decoded by the real video decoder: the video's first `PREVIEW_LATENTS` latents as
one window (at the decoder's own tiles: 3 of a decode window's 7 latents, the first 9 frames), as a strip of a few
frames in one PNG.

When: the first preview after half an interval (`every // 2` forwards, at least 1), then every `every` forwards, never
after the last forward (the render itself follows). At the released default request a forward takes seconds, so a
preview every 5 forwards shows the first one after 2 (a bad prompt is visible early) and then every 5.

A preview only reads the state: the render's numbers are the same bits with or without previews (tested). Its time
is counted in the render's timings (`previews`).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from h3serve.model.video_vae import VideoVAE
from h3serve.pipeline.decode import video_latents
from h3serve.pipeline.layout import PackedLayout
from h3serve.pipeline.video_decode import decode_window

PREVIEW_LATENTS = 3  # latents decoded for a preview: cheap (a decode window reads 7) and still a few frames of motion
STRIP_FRAMES = 4  # frames of the first window shown side by side
FRAME_WIDTH = 256  # pixels each frame is scaled to (height by the canvas's aspect), at most the canvas's own


@dataclass(frozen=True)
class Preview:
    """One preview: after `forward` of `forwards` (1-based), a PNG strip of the first window's frames."""

    forward: int
    forwards: int
    png: bytes
    width: int
    height: int
    seconds: float  # what making it took (decode and encode)


def due(forward: int, forwards: int, every: int) -> bool:
    """Whether a preview is made after `forward` (1-based): the first after `max(1, every // 2)`, then every `every`
    forwards, never after the last (the render itself follows)."""
    first = max(1, every // 2)
    return every > 0 and first <= forward < forwards and (forward - first) % every == 0


@torch.no_grad()
def make_preview(
    vae: VideoVAE,
    video_rows: torch.Tensor,
    layout: PackedLayout,
    autocast: torch.dtype | None,
    forward: int,
    forwards: int,
) -> Preview:
    """The first `PREVIEW_LATENTS` latents of `video_rows` (every video row of the layout, condition rows first, as
    the denoise loop holds them, with the generated ones replaced by their clean estimate) decoded as one window, as a
    PNG strip."""
    if video_rows.is_cuda:  # the forward queued before it finishes first: a preview's time is its own
        torch.cuda.synchronize(video_rows.device)
    start = time.perf_counter()
    z = video_latents(vae, video_rows, layout)[:, :, :PREVIEW_LATENTS]
    head = decode_window(vae, z, autocast_dtype=autocast)[:, :, vae.cfg.frame_pre_padding :]
    frames = vae.output_to_rgb(head.float())[0].cpu().numpy()  # (F, H, W, 3)
    picks = np.linspace(0, len(frames) - 1, num=min(STRIP_FRAMES, len(frames))).round().astype(int)
    height, width = frames.shape[1:3]
    w = min(FRAME_WIDTH, width)
    h = max(1, round(height * w / width))
    tiles = [Image.fromarray(frames[i]).resize((w, h), Image.Resampling.BILINEAR) for i in picks]
    strip = Image.new("RGB", (w * len(tiles), h))
    for k, tile in enumerate(tiles):
        strip.paste(tile, (k * w, 0))
    out = io.BytesIO()
    strip.save(out, format="PNG")
    return Preview(forward, forwards, out.getvalue(), strip.width, strip.height, time.perf_counter() - start)
