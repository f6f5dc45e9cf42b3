"""Per-channel latent statistics, one type for both VAEs and the keyframe path: z_norm = (z - mean) / std.

The DiT works on normalised latents; each VAE config carries the statistics of its latent space (24 values for
video, 32 for audio, as `latents_mean` / `latents_std` in its config.json; `HasLatentStats` wires them). Channels are
at dim 1 of a latent of any rank ((B, C, N) audio, (B, C, T, H, W) video) and the arithmetic runs in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LatentStats:
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))
        if len(self.mean) != len(self.std):
            raise ValueError(f"latents_mean has {len(self.mean)} values but latents_std has {len(self.std)}")
        if not all(math.isfinite(m) for m in self.mean):
            raise ValueError("latents_mean must be finite")
        if not all(math.isfinite(s) and s > 0 for s in self.std):
            raise ValueError("latents_std must be finite and strictly positive")

    @classmethod
    def for_channels(cls, mean: Sequence[float], std: Sequence[float], channels: int) -> LatentStats:
        """The statistics of a `channels`-channel latent space; a count that does not match is an error."""
        stats = cls(tuple(mean), tuple(std))
        if len(stats.mean) != channels:
            raise ValueError(f"latents_mean / latents_std have {len(stats.mean)} values, expected {channels}")
        return stats

    def _view(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1) + (1,) * (z.ndim - 2)
        m = torch.tensor(self.mean, dtype=torch.float32, device=z.device).view(shape)
        s = torch.tensor(self.std, dtype=torch.float32, device=z.device).view(shape)
        return m, s

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """VAE latent -> the space the transformer works in."""
        m, s = self._view(z)
        return (z - m) / s

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """The transformer's latent -> what the VAE decoder takes."""
        m, s = self._view(z)
        return z * s + m


class HasLatentStats:
    """What both VAE configs share: `latents_mean` / `latents_std` fields (their config.json keys) holding the
    statistics of a `latent_channels`-channel latent space, read as one `LatentStats`."""

    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    latent_channels: int

    def _check_latent_stats(self) -> None:
        """Called from the config's `__post_init__`: a wrong count, a non-finite mean or a non-positive std is a
        ValueError, and JSON lists become the float tuples a frozen, hashable config stores."""
        stats = LatentStats.for_channels(self.latents_mean, self.latents_std, self.latent_channels)
        object.__setattr__(self, "latents_mean", stats.mean)
        object.__setattr__(self, "latents_std", stats.std)

    @property
    def latent_stats(self) -> LatentStats:
        return LatentStats(self.latents_mean, self.latents_std)
