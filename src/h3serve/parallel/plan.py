"""What a split over N GPUs needs of the model and the profile, checked from configs alone (no torch): `h3serve
check` runs it without touching the hardware; the visible device count is `workers.check_visible`'s."""

from __future__ import annotations

from h3serve.accel.profile import Linear, Profile
from h3serve.config import DiTConfig

SETTING = "H3_NUM_GPUS (--num-gpus)"


def check_split(config: DiTConfig, profile: Profile, num_gpus: int) -> None:
    """ValueError naming H3_NUM_GPUS and what is allowed: heads that do not divide, HUMMING, one named GPU."""
    check_heads(config, num_gpus)
    if num_gpus > 1 and profile.linear == Linear.HUMMING:
        raise ValueError(
            f"{SETTING} {num_gpus}: linear HUMMING runs on one GPU only (its kernels are not shown to give a row "
            "block's bits alone); use BF16 or CUTLASS, or one GPU"
        )
    if num_gpus > 1 and profile.cuda and profile.device != "cuda":
        raise ValueError(f"{SETTING} {num_gpus}: device {profile.device} names one GPU; set device cuda (rank r "
                         "runs on cuda:r)")  # fmt: skip


def check_heads(config: DiTConfig, num_gpus: int) -> None:
    """The DiT's attention heads divide by `num_gpus` (each rank attends over its own heads)."""
    if num_gpus < 1:
        raise ValueError(f"{SETTING} must be at least 1, got {num_gpus}")
    heads = config.num_attention_heads
    if heads % num_gpus:
        allowed = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        raise ValueError(
            f"{SETTING} {num_gpus}: the DiT's {heads} attention heads do not divide by it (allowed: {allowed})"
        )
