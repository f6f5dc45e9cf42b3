"""H3's two sigma schedules and the data-ward Euler update.

Conventions (both differ from diffusers' FlowMatch): t = 1 - sigma and t = 1 means clean; the DiT predicts a
data-ward velocity, x0 = x_t + sigma * v. `num_points` counts grid points including the terminal sigma = 0, so
it drives num_points - 1 forwards. Video and audio have their own shift and advance by the same index inside one
forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from h3serve.config import AUDIO_SHIFT, VIDEO_SHIFT


def check_positions(positions: tuple[float, ...]) -> None:
    """ValueError unless `positions` is a grid of unshifted sigmas: at least 2, strictly decreasing, within (0, 1]
    apart from the terminal 0."""
    if len(positions) < 2:
        raise ValueError(f"sigma positions need at least 2 points (the last the terminal 0), got {len(positions)}")
    if positions[-1] != 0.0 or not 0.0 < positions[0] <= 1.0:
        raise ValueError(f"sigma positions must start in (0, 1] and end at 0, got {list(positions)}")
    if any(b >= a for a, b in itertools.pairwise(positions)):
        raise ValueError(f"sigma positions must decrease strictly, got {list(positions)}")


def shifted_sigmas(num_points: int, shift: float, positions: tuple[float, ...] | None = None) -> torch.Tensor:
    """`linspace(1, 0, num_points)` (or the given unshifted `positions`, as a distilled adapter's own grid) pushed
    through sigma' = s*b / (1 + (s-1)*b), float32 on the CPU.

    Consecutive float32 collisions the shift creates near sigma = 1 are collapsed (only at absurd step counts).
    """
    if num_points < 2:
        raise ValueError(f"num_points must be >= 2 (grid points including the terminal 0), got {num_points}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if positions is None:
        base = torch.linspace(1.0, 0.0, int(num_points), dtype=torch.float32)
    else:
        check_positions(positions)
        if len(positions) != num_points:
            raise ValueError(f"{len(positions)} sigma positions for {num_points} grid points")
        base = torch.tensor(positions, dtype=torch.float32)
    return torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))


@dataclass(frozen=True)
class Schedule:
    """One modality's grid: sigmas (N,) ending at 0 and timesteps (N-1,) = 1 - sigmas[:-1], float32 CPU."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @classmethod
    def shifted(cls, num_points: int, shift: float, positions: tuple[float, ...] | None = None) -> Schedule:
        sigmas = shifted_sigmas(num_points, shift, positions)
        return cls(sigmas=sigmas, timesteps=1.0 - sigmas[:-1])

    def __len__(self) -> int:
        return int(self.timesteps.shape[0])


@dataclass(frozen=True)
class DualSchedule:
    video: Schedule
    audio: Schedule

    @classmethod
    def build(
        cls,
        num_points: int,
        video_shift: float = VIDEO_SHIFT,
        audio_shift: float = AUDIO_SHIFT,
        positions: tuple[float, ...] | None = None,
    ) -> DualSchedule:
        """Both grids: `num_points` evenly spaced unshifted sigmas, or the given `positions` (a distilled adapter's
        own grid, e.g. FastH3's 0.999, 0.749, 0.5, 0.25, 0), each modality with its shift."""
        video = Schedule.shifted(num_points, video_shift, positions)
        audio = Schedule.shifted(num_points, audio_shift, positions)
        if len(video) != len(audio):
            # Both modalities step by the same index; a collapsed grid point in one of them would desynchronise them.
            raise ValueError(
                f"steps={num_points} with video_shift={video_shift:g} and audio_shift={audio_shift:g} collapses the "
                f"shifted grids to different lengths (video {len(video) + 1}, audio {len(audio) + 1} distinct "
                f"points); use fewer steps or shifts nearer the released 12 and 3"
            )
        return cls(video=video, audio=audio)

    @property
    def num_steps(self) -> int:
        """Model forwards: one per timestep."""
        return len(self.video)


def clean_estimate(x: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The data-ward estimate of the clean sample, x0 = x + (1 - t) v in float32, t the timestep the DiT saw (what
    `euler_step` blends toward, and what a preview decodes: `pipeline.preview`). `x` is not modified."""
    return x.float() + (1 - t.to(x.device, torch.float32)) * velocity.float()


def euler_step(
    x: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """One data-ward Euler step in float32.

    x0 takes its sigma from the timestep the DiT saw (1 - t), while the blend ratio uses the grid sigmas: for
    sigma < 0.5 the float32 round trip 1 - (1 - sigma) is inexact, and the released sampler keeps the two apart.
    """
    x = x.float()
    x0 = clean_estimate(x, velocity, t)
    ratio = sigma_next.to(x.device, torch.float32) / sigma.to(x.device, torch.float32)
    return ratio * x + (1.0 - ratio) * x0
