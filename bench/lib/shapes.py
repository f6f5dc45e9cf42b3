"""The packed shapes the DiT benchmarks measure, and their inputs: a real T2VA layout (`h3serve.pipeline.layout`) with
random latents and text states from fixed seeds, and one forward as the engine runs it."""

from __future__ import annotations

import torch

from h3serve.config import Modality
from h3serve.pipeline.layout import MediaGeometry, build_layout

SHAPE = {"height": 448, "width": 768, "frames": 56, "text": 537, "other_text": 300}
TINY_SHAPE = {"height": 128, "width": 224, "frames": 22, "text": 20, "other_text": 12}
# The released default request (1344x768, 124 frames = 5 s at 24 fps), with the reference's 537 text rows.
DEFAULT_SHAPE = {"height": 768, "width": 1344, "frames": 124, "text": 537, "other_text": 300}
TINY_DEFAULT_SHAPE = {"height": 224, "width": 384, "frames": 39, "text": 20, "other_text": 12}
SHAPES = {"reference": (SHAPE, TINY_SHAPE), "default": (DEFAULT_SHAPE, TINY_DEFAULT_SHAPE)}
# --warmup, --iters when not given: a default-shape forward takes ~6 s, so fewer there.
TIMING = {"reference": (2, 5), "default": (1, 3)}


def t2va_layout(shape: dict, n_text: int):
    """The T2VA layout of `shape` with `n_text` text rows, and its timesteps at (video 0.6, audio 0.3)."""
    geometry = MediaGeometry.from_pixels(shape["height"], shape["width"], shape["frames"])
    layout = build_layout([int(Modality.TEXT)] * n_text, geometry, ())
    timesteps, t_index = layout.timestep_plan(0.6, 0.3)
    return layout, timesteps, t_index


def inputs(dit, n_text: int, shape: dict, dev: str, seed: int = 0) -> dict:
    """A real T2VA layout with `n_text` text rows; random latents and text states."""
    cfg = dit.config
    layout, timesteps, t_index = t2va_layout(shape, n_text)
    with torch.no_grad():
        text = dit.refine_text(text_states(n_text, cfg.text_dim, seed).to(dev))
        rope = dit.rope(layout.rope_positions().to(dev))
    return {
        "video": torch.randn(
            layout.num_video_rows, cfg.video_patch_dim, generator=torch.Generator().manual_seed(seed + 100)
        ).to(dev),
        "audio": torch.randn(
            layout.num_audio_rows, cfg.audio_latents_dim, generator=torch.Generator().manual_seed(seed + 200)
        ).to(dev),
        "text": text,
        "timesteps": timesteps.to(dev),
        "timestep_indices": t_index.to(dev),
        "token_tags": layout.token_tags.to(dev),
        "rope": rope,
        "video_indices": layout.video_indices.to(dev),
        "audio_indices": layout.audio_indices.to(dev),
        "text_indices": layout.text_indices.to(dev),
        "text_states_seed": seed,
        "layout": layout,
    }


def text_states(n: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def forward(dit, x: dict):
    """One forward as the engine runs it: with the blocks' AdaLN tables made ahead of time (`x["tables"]`)."""
    return dit(
        x["video"], x["audio"], x["text"], x["timesteps"], x["timestep_indices"], x["token_tags"], x["rope"],
        x["video_indices"], x["audio_indices"], x["text_indices"], x.get("tables"),
    )  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
