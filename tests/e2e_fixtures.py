"""The complete tiny H3 checkpoint in the diffusers layout (bench/lib/tiny_folder.py, which bench/start.py writes its
folders with too), for the end-to-end tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from lib.export import is_diffusers_fp32 as is_ref_fp32
from lib.tiny_folder import (
    RELEASED_INDEX,
    SEED,
    TINY_AUDIO_VAE_DIFFUSERS,
    TINY_DIT_DIFFUSERS,
    TINY_VAE_DIFFUSERS,
    write_tiny_checkpoint,
)

__all__ = ["RELEASED_INDEX", "SEED", "TINY_AUDIO_VAE_DIFFUSERS", "TINY_DIT_DIFFUSERS", "TINY_VAE_DIFFUSERS",
           "is_ref_fp32", "write_tiny_checkpoint"]  # fmt: skip
