"""Per-channel latent normalisation shared by both VAEs and the keyframe path: z_norm = (z - mean) / std.

Channels are at dim 1 of a latent of any rank ((B, C, N) audio, (B, C, T, H, W) video). The statistics come from
the VAE configs (24 values for video, 32 for audio) and are applied in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _stats(z: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, -1) + (1,) * (z.ndim - 2)
    m = torch.as_tensor(mean, dtype=torch.float32, device=z.device).view(shape)
    s = torch.as_tensor(std, dtype=torch.float32, device=z.device).view(shape)
    return m, s


def normalize(z: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """VAE latent -> the space the transformer works in."""
    m, s = _stats(z, mean, std)
    return (z - m) / s


def denormalize(z: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """The transformer's latent -> what the VAE decoder takes."""
    m, s = _stats(z, mean, std)
    return z * s + m
