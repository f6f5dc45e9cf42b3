"""Ref2VA packed layout against diffusers' `build_ref2va_packed_sequence` / `build_row_timesteps`, exact equality."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3serve.config import Modality
from h3serve.pipeline.layout import (
    CLOCK_REFERENCE_AUDIO,
    MediaGeometry,
    Reference,
    build_layout,
    build_ref2va_layout,
    validate_references,
    video_time_span,
)
from layout_fixtures import assert_timestep_plan_matches_diffusers
from oracle import oracle

# A reference block as (kind, *sizes): ("image", lh, lw), ("video", frames, lh, lw, audio_latents), ("audio", n).
CASES = {
    # (a) images only, of their own sizes (neither is the target's).
    "two_images": [("image", 8, 12), ("image", 14, 10)],
    # (b) one video with its soundtrack: 56 frames -> 17 latents (span 93.33 > 93 audio latents).
    "video_with_sound": [("video", 17, 10, 16, 93)],
    # 22 frames -> 7 latents: the soundtrack's 37 latents outrun the video's 36.67 units and set the cursor.
    "short_video_with_sound": [("video", 7, 12, 8, 37)],
    # 362 frames -> 107 latents: the sequential span sum parts from numpy's pairwise sum in the last ulp.
    "long_video_with_sound": [("video", 107, 4, 6, 603)],
    # (c) images plus audio: audio between images, and audio first.
    "images_and_audio": [("image", 8, 12), ("audio", 50), ("image", 6, 6)],
    "audio_first": [("audio", 41), ("image", 10, 8)],
    # (d) a video without sound plus an image.
    "silent_video_and_image": [("video", 12, 8, 10, 0), ("image", 8, 12)],
    # Everything at once, in a mixed order, at the limits (3 videos, 3 audios, 6 images: 12 references).
    "mixed_full": [
        ("audio", 20),
        ("video", 7, 6, 8, 37),
        ("image", 4, 6),
        ("video", 2, 4, 4, 0),
        ("image", 6, 4),
        ("audio", 9),
        ("image", 4, 4),
        ("video", 22, 4, 8, 120),
        ("image", 8, 4),
        ("audio", 3),
        ("image", 4, 10),
        ("image", 2, 2),
    ],
}

# (height, width, num_frames) of the generated media.
TARGETS = [(448, 768, 56), (64, 96, 362), (32, 32, 22)]


def ours(spec) -> Reference:
    kind, *sizes = spec
    return {"image": Reference.image, "video": Reference.video, "audio": Reference.audio}[kind](*sizes)


def diffusers_inputs(specs):
    """The reference list and the encoded latents diffusers' layout step reads (only their shapes matter)."""
    refs_module = oracle("diffusers.modular_pipelines.minimax_h3")
    references, condition_latents, audio_latents = [], [], []
    frames = np.zeros((1, 4, 4, 3), dtype=np.uint8)
    for kind, *sizes in specs:
        if kind == "image":
            references.append(refs_module.MiniMaxH3ImageReference(image=frames[0]))
            condition_latents.append(torch.zeros(1, 24, 1, *sizes))
        elif kind == "video":
            f, lh, lw, na = sizes
            sound = torch.zeros(2, 8) if na else None
            references.append(refs_module.MiniMaxH3VideoReference(frames=frames, audio=sound))
            condition_latents.append(torch.zeros(1, 24, f, lh, lw))
            if na:
                audio_latents.append(torch.zeros(2 * na, 32))
        else:
            references.append(refs_module.MiniMaxH3AudioReference(audio=torch.zeros(2, 8)))
            audio_latents.append(torch.zeros(2 * sizes[0], 32))
    return references, condition_latents, audio_latents


def text_tags(specs, seed: int = 0) -> torch.Tensor:
    """Text rows as a reference presentation makes them: a label per reference, a vision block for visual ones."""
    g = torch.Generator().manual_seed(seed)
    tags: list[int] = []
    for kind, *_ in specs:
        tags += [Modality.TEXT] * int(torch.randint(3, 7, (1,), generator=g))
        if kind != "audio":
            tags += [Modality.VIDEO] * int(torch.randint(4, 9, (1,), generator=g))
    tags += [Modality.TEXT] * int(torch.randint(5, 40, (1,), generator=g))
    return torch.tensor(tags)


def reference_layout(tags, specs, geometry: MediaGeometry):
    before_denoise = oracle("diffusers.modular_pipelines.minimax_h3.before_denoise")
    references, condition_latents, audio_latents = diffusers_inputs(specs)
    return before_denoise.MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        tags,
        references,
        condition_latents,
        audio_latents,
        geometry.latent_frames,
        geometry.latent_height,
        geometry.latent_width,
        geometry.audio_latents,
        (1, 2, 2),
        2,
        Modality.AUDIO,
        Modality.VIDEO,
    )


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("height,width,num_frames", TARGETS)
def test_ref2va_layout_matches_reference(case, height, width, num_frames):
    oracle("diffusers")
    specs = CASES[case]
    tags = text_tags(specs, seed=num_frames + len(specs))
    geometry = MediaGeometry.from_pixels(height, width, num_frames)
    layout = build_ref2va_layout(tags, [ours(s) for s in specs], geometry)
    pos, ref_tags, v_idx, a_idx, t_idx, n_ref_v, n_ref_a = reference_layout(tags, specs, geometry)

    assert layout.token_tags.shape == ref_tags.shape == (pos.shape[0],)
    assert torch.equal(layout.token_tags, ref_tags)
    assert torch.equal(layout.video_indices, v_idx)
    assert torch.equal(layout.audio_indices, a_idx)
    assert torch.equal(layout.text_indices, t_idx)
    assert layout.num_condition_video_rows == n_ref_v
    assert layout.num_condition_audio_rows == n_ref_a
    assert layout.position_ids.dtype == torch.float64
    assert torch.equal(layout.position_ids, pos), (layout.position_ids - pos).abs().max()
    assert torch.equal(layout.rope_positions(), pos.to(torch.float32))
    # The target rows are what the base layout calls the generated rows.
    assert layout.num_video_rows == v_idx.numel() - n_ref_v
    assert layout.num_audio_rows == a_idx.numel() - n_ref_a


@pytest.mark.parametrize("case", sorted(CASES))
def test_ref2va_timestep_plan_matches_reference(case):
    oracle("diffusers")
    specs = CASES[case]
    layout = build_ref2va_layout(text_tags(specs), [ours(s) for s in specs], MediaGeometry.from_pixels(64, 96, 124))
    assert_timestep_plan_matches_diffusers(layout, extra_pairs=[(1.0, 1.0), (0.3, 1.0)])


def test_ref2va_clocks_and_cursor():
    """Facts of docs/model.md §1/§2 checked directly, independent of the reference code."""
    refs = [Reference.image(8, 12), Reference.audio(50), Reference.video(7, 12, 8, 37), Reference.video(17, 4, 4)]
    g = MediaGeometry.from_pixels(448, 768, 56)
    tags = torch.full((20,), Modality.TEXT)
    layout = build_ref2va_layout(tags, refs, g)
    n_img, n_vid1, n_vid2 = 4 * 6, 7 * 6 * 4, 17 * 2 * 2
    assert layout.num_reference_video_rows == n_img + n_vid1 + n_vid2
    assert layout.num_reference_audio_rows == 2 * 50 + 2 * 37
    seq = 20 + n_img + 100 + 74 + n_vid1 + n_vid2 + 2 * 93 + 17 * 14 * 24
    assert layout.token_tags.shape == (seq,) and layout.row_clock.shape == (seq,)

    # Row order: text | image | audio | soundtrack, video | silent video | target audio | target video.
    pos, clock = layout.position_ids, layout.row_clock
    image, audio, sound = slice(20, 44), slice(44, 144), slice(144, 218)
    assert torch.equal(layout.video_indices[:n_img], torch.arange(20, 44))
    assert torch.equal(layout.audio_indices[:100], torch.arange(44, 144))
    assert torch.equal(layout.audio_indices[100:174], torch.arange(144, 218))
    assert (layout.token_tags[image] == Modality.VIDEO).all() and (layout.token_tags[sound] == Modality.AUDIO).all()

    # Cursor: image at 20 (+1), audio at 21 (+50), video+soundtrack at 71 (+max(37, 36.67) = 37), silent video at
    # 108 (+ its span), target at 108 + span(17).
    assert (pos[image, 0] == 20).all()
    assert torch.equal(pos[audio, 0], (21 + torch.arange(50, dtype=torch.float64)).repeat(2))
    assert torch.equal(pos[sound, 0][:37], 71 + torch.arange(37, dtype=torch.float64))
    assert pos[218, 0] == 71  # the video's first frame shares its soundtrack's origin
    silent = layout.video_indices[n_img + n_vid1 : n_img + n_vid1 + n_vid2]
    assert pos[silent[0], 0] == 108
    target_origin = 108 + video_time_span(17)
    assert abs(target_origin - (108 + 5 / 3 * 56)) < 1e-9
    assert (pos[layout.audio_indices[174], 0]) == target_origin
    assert pos[layout.video_indices[layout.num_condition_video_rows], 0] == target_origin
    # The standalone audio sits on the target's w extremes; the soundtrack on its own video's.
    target_w = pos[layout.video_indices[layout.num_condition_video_rows :], 2]
    assert pos[44, 2] == target_w.min() and pos[143, 2] == target_w.max()
    video_w = pos[218 : 218 + 24, 2]
    assert pos[144, 2] == video_w.min() and pos[217, 2] == video_w.max() and video_w.min() != target_w.min()

    # Clocks: reference video on the conditioning floor, reference audio clean at 1.0, up to four timesteps.
    assert (clock[layout.audio_indices[:174]] == CLOCK_REFERENCE_AUDIO).all()
    values, idx = layout.timestep_plan(0.4, 0.7)
    assert torch.equal(values, torch.tensor([0.4, 0.7, 0.999, 1.0], dtype=torch.float32))
    per_row = values[idx]
    assert (per_row[:20] == values[0]).all()
    assert (per_row[layout.video_indices[: layout.num_condition_video_rows]] == values[2]).all()
    assert (per_row[layout.audio_indices[:174]] == 1.0).all()
    assert (per_row[layout.audio_indices[174:]] == values[1]).all()
    assert (per_row[layout.video_indices[layout.num_condition_video_rows :]] == values[0]).all()
    all_idx = torch.cat([layout.text_indices, layout.video_indices, layout.audio_indices]).sort().values
    assert torch.equal(all_idx, torch.arange(seq))


def test_sequential_span_differs_from_pairwise():
    """The cursor's span sum is sequential; the "last" keyframe's is pairwise. They part from 16 frames on."""

    def pairwise(n):
        return float(np.array([5 / 3 * (1, 4, 4, 4, 4)[k % 5] for k in range(n)], dtype=np.float64).sum())

    assert all(video_time_span(n) == pairwise(n) for n in range(1, 16))
    assert any(video_time_span(n) != pairwise(n) for n in range(16, 120))
    assert video_time_span(107) != pairwise(107)  # the long video of CASES


def test_base_modes_keep_their_shape():
    layout = build_layout([1, 1, 1], MediaGeometry.from_pixels(64, 64, 22), ("first",))
    assert layout.references == () and layout.num_condition_audio_rows == 0
    assert layout.num_condition_video_rows == layout.rows_per_frame
    assert len(layout.timestep_plan(0.5, 0.3)[0]) == 3


def images(n):
    return [Reference.image(4, 4)] * n


@pytest.mark.parametrize(
    "refs,match",
    [
        ([], "at least one reference"),
        (images(10), r"references\[9\] is one image reference too many: at most 9 image"),
        ([Reference.video(2, 4, 4)] * 4, r"references\[3\] is one video reference too many: at most 3 video"),
        ([*images(1), *[Reference.audio(5)] * 4], r"references\[4\] is one audio reference too many: at most 3 audio"),
        ([*images(9), *[Reference.video(2, 4, 4)] * 3, Reference.audio(5)], r"references\[12\] .*at most 12"),
        ([Reference.audio(5)], r"references\[0\] is audio.*only reference"),
        ([Reference.audio(5)] * 3, "only reference"),
        ([Reference("image", 2, 4, 4)], r"references\[0\] \('image'\): an image reference is one latent frame"),
        ([*images(1), Reference("image", 1, 4, 4, 3)], r"references\[1\] \('image'\).*without audio"),
        ([*images(1), Reference.image(5, 4)], r"references\[1\] \('image'\).*patch"),
        ([Reference.video(0, 4, 4)], r"references\[0\] \('video'\).*latent frame"),
        ([*images(1), Reference.audio(0)], r"references\[1\] \('audio'\).*audio latent"),
        ([Reference("sketch", 1, 4, 4)], r"references\[0\] \('sketch'\)"),
        ([*images(1), ("image", 4, 4)], r"references\[1\] must be a Reference"),
    ],
)
def test_references_refused(refs, match):
    with pytest.raises(ValueError, match=match):
        validate_references(refs)
    with pytest.raises(ValueError, match=match):
        build_ref2va_layout([1, 1], refs, MediaGeometry.from_pixels(64, 64, 22))


def test_references_at_the_limits_accepted():
    ok = [*images(9), Reference.video(2, 4, 4), Reference.audio(5), Reference.audio(5)]
    assert validate_references(ok) == tuple(ok)
    assert validate_references([Reference.audio(5), Reference.video(2, 4, 4, 0)])
