"""Dual schedule and Euler step against diffusers' MiniMaxH3Scheduler, with the released scheduler configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from h3serve.config import AUDIO_SHIFT, VIDEO_SHIFT
from h3serve.pipeline.schedule import DualSchedule, Schedule, euler_step
from oracle import oracle

MiniMaxH3Scheduler = oracle("diffusers").MiniMaxH3Scheduler
REFERENCE = Path(__file__).parent / "data" / "reference"


def released_shift(folder: str) -> float:
    return json.loads((REFERENCE / folder / "scheduler_config.json").read_text())["shift"]


def test_default_shifts_are_the_released_ones():
    assert released_shift("scheduler") == VIDEO_SHIFT
    assert released_shift("audio_scheduler") == AUDIO_SHIFT
    index = json.loads((REFERENCE / "FL2VA" / "model_index.json").read_text())
    assert index["_minimax_h3"]["sigma_shift_scales"] == {"video": VIDEO_SHIFT, "audio": AUDIO_SHIFT}


@pytest.mark.parametrize("num_points", [2, 3, 5, 30, 50, 200])
@pytest.mark.parametrize("shift", [VIDEO_SHIFT, AUDIO_SHIFT, 1.0, 6.0, 0.5])
def test_sigmas_and_timesteps_match_reference(num_points, shift):
    ref = MiniMaxH3Scheduler(shift=shift)
    ref.set_timesteps(num_points)
    ours = Schedule.shifted(num_points, shift)
    assert ours.sigmas.dtype == torch.float32 and ours.timesteps.dtype == torch.float32
    assert torch.equal(ours.sigmas, ref.sigmas)
    assert torch.equal(ours.timesteps, ref.timesteps)
    assert len(ours) == num_points - 1  # N grid points -> N - 1 forwards
    assert ours.sigmas[0] == 1 and ours.sigmas[-1] == 0


def test_documented_values():
    """docs/model.md §4: with N = 50, video sigmas 1, .99827, ... .2, 0 and audio 1, .9931, ... .05882, 0."""
    s = DualSchedule.build(50)
    assert s.num_steps == 49
    assert abs(s.video.sigmas[1] - 0.99827) < 1e-5 and abs(s.video.sigmas[-2] - 0.2) < 1e-6
    assert abs(s.audio.sigmas[1] - 0.9931) < 1e-4 and abs(s.audio.sigmas[-2] - 0.05882) < 1e-5
    assert torch.equal(s.video.timesteps, 1 - s.video.sigmas[:-1])


@pytest.mark.parametrize("shift", [VIDEO_SHIFT, AUDIO_SHIFT])
def test_euler_step_matches_reference_bitwise(shift):
    ref = MiniMaxH3Scheduler(shift=shift)
    ref.set_timesteps(12)
    ours = Schedule.shifted(12, shift)
    g = torch.Generator().manual_seed(0)
    x_ref = x_ours = torch.randn(37, 16, generator=g)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(37, 16, generator=g) * 2
        x_ref = ref.step(v, t, x_ref, return_dict=False)[0]
        x_ours = euler_step(x_ours, v, ours.timesteps[i], ours.sigmas[i], ours.sigmas[i + 1])
        assert torch.equal(x_ours, x_ref), i


def test_euler_step_is_data_ward():
    """A velocity that points exactly at the data lands on it at the last step (sigma_next = 0)."""
    x0, eps = torch.randn(5, 3), torch.randn(5, 3)
    s = Schedule.shifted(4, 3.0)
    t, sigma = s.timesteps[-1], s.sigmas[-2]
    x_t = (1 - sigma) * x0 + sigma * eps
    out = euler_step(x_t, x0 - eps, t, sigma, s.sigmas[-1])
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_points,shift", [(1, 12.0), (0, 3.0), (5, 0.0), (5, -1.0)])
def test_invalid_schedules(num_points, shift):
    with pytest.raises(ValueError, match=r"num_points|shift"):
        Schedule.shifted(num_points, shift)
