"""Checks shared by the layout tests of the base modes and of ref2va."""

from __future__ import annotations

import torch


def assert_timestep_plan_matches_diffusers(layout, extra_pairs=()) -> None:
    """`layout.timestep_plan(t_v, t_a)` equals diffusers' `build_row_timesteps` (distinct values and every row's
    index) for every step of the released schedules (30 points, video shift 12, audio shift 3) and the edge pairs:
    equal clocks, a video clock above the 0.999 conditioning floor, and `extra_pairs`."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    video, audio = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video.set_timesteps(30)
    audio.set_timesteps(30)
    pairs = [
        *zip(video.timesteps.tolist(), audio.timesteps.tolist(), strict=True),
        (0.5, 0.5),
        (0.9995, 0.2),
        (0.999, 0.999),
        *extra_pairs,
    ]
    for t_v, t_a in pairs:
        ref_t, ref_idx = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_indices,
            layout.audio_indices,
            layout.num_condition_video_rows,
            layout.num_condition_audio_rows,
            layout.num_text,
            float(t_v),
            float(t_a),
            max(float(t_v), 0.999),
            1.0,
        )
        ours_t, ours_idx = layout.timestep_plan(t_v, t_a)
        assert torch.equal(ours_t, ref_t), (t_v, t_a)
        assert torch.equal(ours_idx, ref_idx), (t_v, t_a)
