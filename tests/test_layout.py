"""Packed layout against diffusers' `build_packed_sequence` / `build_row_timesteps`, exact equality."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3serve.config import Modality
from h3serve.pipeline.layout import (
    TASK_ANCHORS,
    MediaGeometry,
    audio_rows_to_latents,
    build_layout,
    patchify_video,
    unpatchify_video,
)
from layout_fixtures import assert_timestep_plan_matches_diffusers
from oracle import oracle

diffusers_before_denoise = oracle("diffusers.modular_pipelines.minimax_h3.before_denoise")
PrepareLayout = diffusers_before_denoise.MiniMaxH3PrepareLayoutStep
SetTimesteps = diffusers_before_denoise.MiniMaxH3SetTimestepsStep
reference_patchify = diffusers_before_denoise.patchify_video_latents

# (height, width, num_frames): the warmup canvas, a portrait one, a tiny square one, the official 16:9 default,
# and long clips (16+ latent frames, where pairwise and sequential sums of the RoPE spans part in the last ulp).
GEOMETRIES = [
    (448, 768, 56),
    (768, 448, 22),
    (32, 32, 124),
    (768, 1344, 124),
    (64, 96, 362),
    (32, 64, 260),
]


def text_tags(num_keyframes: int, seed: int = 0) -> torch.Tensor:
    """Text rows as the keyframe presentation makes them: per keyframe a label then a vision block tagged video."""
    g = torch.Generator().manual_seed(seed)
    tags: list[int] = []
    for _ in range(num_keyframes):
        tags += [Modality.TEXT] * int(torch.randint(3, 7, (1,), generator=g)) + [Modality.VIDEO] * 5
    tags += [Modality.TEXT] * int(torch.randint(5, 40, (1,), generator=g))
    return torch.tensor(tags)


def reference_layout(tags, geometry: MediaGeometry, anchors):
    return PrepareLayout.build_packed_sequence(
        tags,
        geometry.latent_frames,
        geometry.latent_height,
        geometry.latent_width,
        geometry.audio_latents,
        (1, 2, 2),
        2,
        Modality.AUDIO,
        Modality.VIDEO,
        anchors,
    )


@pytest.mark.parametrize("task", sorted(TASK_ANCHORS))
@pytest.mark.parametrize("height,width,num_frames", GEOMETRIES)
def test_layout_matches_reference(task, height, width, num_frames):
    anchors = TASK_ANCHORS[task]
    tags = text_tags(len(anchors), seed=num_frames)
    geometry = MediaGeometry.from_pixels(height, width, num_frames)
    layout = build_layout(tags, geometry, anchors)
    pos, ref_tags, v_idx, a_idx, t_idx, n_cond_v, n_cond_a = reference_layout(tags, geometry, anchors)

    assert torch.equal(layout.token_tags, ref_tags)
    assert torch.equal(layout.video_indices, v_idx)
    assert torch.equal(layout.audio_indices, a_idx)
    assert torch.equal(layout.text_indices, t_idx)
    assert layout.num_condition_video_rows == n_cond_v and n_cond_a == 0
    assert layout.position_ids.dtype == torch.float64
    assert torch.equal(layout.position_ids, pos), (layout.position_ids - pos).abs().max()
    assert torch.equal(layout.rope_positions(), pos.to(torch.float32))


@pytest.mark.parametrize("task", sorted(TASK_ANCHORS))
def test_timestep_plan_matches_reference(task):
    anchors = TASK_ANCHORS[task]
    tags = text_tags(len(anchors))
    layout = build_layout(tags, MediaGeometry.from_pixels(64, 96, 124), anchors)
    assert layout.num_condition_audio_rows == 0
    assert_timestep_plan_matches_diffusers(layout)


def test_layout_structure_and_positions():
    """Facts of docs/model.md §1/§2 checked directly, independent of the reference code."""
    tags = text_tags(2)
    g = MediaGeometry.from_pixels(448, 768, 56)
    assert (g.latent_frames, g.latent_height, g.latent_width, g.audio_latents) == (17, 28, 48, 93)
    layout = build_layout(tags, g, ("first", "last"))
    n_text, rows = len(tags), 14 * 24
    assert layout.token_tags.shape[0] == n_text + 2 * rows + 2 * 93 + 17 * rows
    pos = layout.position_ids
    # Text rows at (i, 0, 0); the media clock starts right after them.
    assert torch.equal(pos[:n_text, 0], torch.arange(n_text, dtype=torch.float64))
    assert not pos[:n_text, 1:].any()
    video = pos[layout.video_indices[2 * rows :]].reshape(17, rows, 3)
    frame_t = video[:, 0, 0] - n_text
    assert frame_t[0] == 0 and abs(frame_t[1] - 5 / 3) < 1e-12 and abs(frame_t[2] - 5 / 3 * 5) < 1e-12
    # Aspect-normalised grid: h = 3.780 + 1.7457 k, w = -4.949 + 1.7457 k (docs/model.md §2).
    assert abs(video[0, 0, 1] - 3.780) < 1e-3 and abs(video[0, 0, 2] + 4.949) < 1e-3
    assert abs(video[0, 1, 2] - video[0, 0, 2] - 1.7457) < 1e-4
    # Keyframes: first at the media origin, last at the time of the last pixel frame, (5/3) * (56 - 1).
    first = pos[layout.video_indices[:rows]]
    last = pos[layout.video_indices[rows : 2 * rows]]
    assert (first[:, 0] == n_text).all()
    assert torch.allclose(last[:, 0] - n_text, torch.tensor(5 / 3 * 55, dtype=torch.float64), atol=1e-9, rtol=0)
    assert torch.equal(last[:, 1:], video[-1, :, 1:])
    assert torch.equal(first[:, 1:], video[0, :, 1:])
    # Audio: L then R, one unit per latent, w at the grid's extremes, no height.
    audio = pos[layout.audio_indices].reshape(2, 93, 3)
    assert torch.equal(audio[0, :, 0] - n_text, torch.arange(93, dtype=torch.float64))
    assert torch.equal(audio[0, :, 0], audio[1, :, 0])
    assert (audio[0, :, 2] == video[0, :, 2].min()).all() and (audio[1, :, 2] == video[0, :, 2].max()).all()
    assert not audio[..., 1].any()
    # Every row is scattered exactly once.
    all_idx = torch.cat([layout.text_indices, layout.video_indices, layout.audio_indices]).sort().values
    assert torch.equal(all_idx, torch.arange(layout.token_tags.shape[0]))


def test_layout_rejects_bad_input():
    g = MediaGeometry.from_pixels(64, 64, 22)
    with pytest.raises(ValueError, match="anchor"):
        build_layout([1, 1], g, ("middle",))
    with pytest.raises(ValueError, match="17n\\+5"):
        MediaGeometry.from_pixels(64, 64, 23)
    with pytest.raises(ValueError, match="patch"):
        build_layout([1], MediaGeometry(2, 3, 4, 5), ())


def test_patchify_round_trip_and_reference():
    g = MediaGeometry.from_pixels(64, 96, 22)
    latents = torch.randn(1, 24, g.latent_frames, g.latent_height, g.latent_width)
    rows = patchify_video(latents)
    assert torch.equal(rows, reference_patchify(latents, (1, 2, 2)))
    assert torch.equal(unpatchify_video(rows, g), latents)
    # Channel-major rows: the first Na rows are the left channel, the next Na the right one.
    rows = torch.randn(22, 32)
    audio = audio_rows_to_latents(rows)
    assert audio.shape == (2, 32, 11)
    assert torch.equal(audio[0], rows[:11].T) and torch.equal(audio[1], rows[11:].T)


def test_spatial_grid_is_numpy_float64():
    """The grid must be numpy's endpoint=False linspace; torch.linspace differs by an ulp somewhere."""
    from h3serve.pipeline.layout import spatial_grid

    grid = spatial_grid(48, 2, np.sqrt(28 * 48))
    r = 48 / np.sqrt(28 * 48)
    expected = ((1 - r) / 2 + np.arange(24) * (r / 24)) * 32
    assert grid.dtype == np.float64
    np.testing.assert_allclose(grid, expected, rtol=0, atol=1e-12)
