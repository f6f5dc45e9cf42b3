"""Acceleration applied from outside the model files: attention kernels, compilation, linear layers. Each is chosen
once at start from a registry that refuses what it cannot run (the engine's `Profile` validates the names)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from h3serve.accel import attention, humming, linear
from h3serve.accel.compile import GraphCounter, compile_repeated_blocks
from h3serve.accel.vae import decoder_weights_to

if TYPE_CHECKING:
    from h3serve.model.folder import Components
    from h3serve.pipeline.engine import Profile


def apply_profile(components: Components, profile: Profile) -> GraphCounter | None:
    """Set the attention kernel; store the video decoder's weights in its autocast dtype (bitwise the same decode);
    for CUTLASS, quantize the DiT's block linears unless the loader already did (`Fp8LoadHook`), for HUMMING turn
    them into Humming's layout; for `compile`,
    compile the repeated blocks (returns their graph counter)."""
    attention.use(profile.attention)
    if profile.vae_autocast_dtype is not None:
        decoder_weights_to(components.video_vae, profile.vae_autocast_dtype)
    if profile.linear == "CUTLASS" and not linear.is_quantized(components.dit):
        linear.quantize_blocks(components.dit)
    if profile.linear == "HUMMING" and not humming.is_humming(components.dit):
        humming.quantize_blocks(components.dit)  # from the BF16 linears, or the loader's e4m3 ones
    if profile.text_linear == "CUTLASS":
        linear.quantize_text_encoder(components.text_encoder)
    if profile.execution == "compile":
        return compile_repeated_blocks(components.dit, eager_precision=profile.linear == "BF16")
    return None
