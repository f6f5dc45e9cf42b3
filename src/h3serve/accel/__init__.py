"""Acceleration applied from outside the model files: attention kernels, compilation, linear layers. Each is chosen
once at start from a registry that refuses what it cannot run (the engine's `Profile` validates the names)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from h3serve.accel import attention, fused, humming, linear
from h3serve.accel.adaln import AdalnHostHook
from h3serve.accel.compile import GraphCounter, compile_repeated_blocks
from h3serve.accel.linear import Fp8LoadHook, TextFp8LoadHook
from h3serve.accel.vae import decoder_weights_to
from h3serve.model.loading import chain

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from h3serve.model.folder import Components
    from h3serve.model.loading import LoadHook
    from h3serve.pipeline.engine import Profile


def load_hooks(profile: Profile) -> dict[str, LoadHook | None]:
    """The transforms a checkpoint load applies for `profile` (`load_components`' `dit_hook` and `text_hook`), so
    that no component is ever whole on the device in a form the profile drops: FP8 block linears (CUTLASS; HUMMING
    starts from the same e4m3 weights) and the FP8 text encoder are quantized as their weights are read, and the
    AdaLN weights go to host memory as they are read unless kept resident."""
    quantize = Fp8LoadHook() if profile.linear in ("CUTLASS", "HUMMING") else None
    offload = AdalnHostHook() if profile.torch_device.type == "cuda" and not profile.adaln_resident else None
    return {
        "dit_hook": chain(quantize, offload),
        "text_hook": TextFp8LoadHook() if profile.text_linear == "CUTLASS" else None,
    }


def apply_profile(components: Components, profile: Profile) -> GraphCounter | None:
    """Set the attention kernel; store the video decoder's weights in its autocast dtype (bitwise the same decode);
    for CUTLASS, quantize the DiT's block linears unless the loader already did (`Fp8LoadHook`), for HUMMING turn
    them into Humming's layout; for `compile`,
    compile the repeated blocks with the fused passes on CUDA (`compile_blocks`; returns their graph counter); eager
    on CUDA runs the exact passes (`fused.use_eager_passes`: bit for bit the reference ops)."""
    attention.use(profile.attention)
    fused.use(False)  # the reference qk-norm + rotary until a choice below
    if profile.vae_autocast_dtype is not None:
        decoder_weights_to(components.video_vae, profile.vae_autocast_dtype)
    dits = list(components.dits.values())  # the FL2VA DiT, the Ref2VA DiT, or both: the same profile for each
    for dit in dits:
        if profile.linear == "CUTLASS" and not linear.is_quantized(dit):
            linear.quantize_blocks(dit)
        if profile.linear == "HUMMING" and not humming.is_humming(dit):
            humming.quantize_blocks(dit)  # from the BF16 linears, or the loader's e4m3 ones
    if profile.text_linear == "CUTLASS" and not linear.is_text_quantized(components.text_encoder):
        linear.quantize_text_encoder(components.text_encoder)
    if profile.execution == "compile":
        # One compile for both DiTs: their blocks share the compiled code and one graph counter.
        return compile_blocks(nn.ModuleList(dits), profile.linear, profile.torch_device)
    if profile.torch_device.type == "cuda":
        if fused.available():  # the exact passes: the reference ops' numbers, bit for bit, in fewer passes
            fused.use_eager_passes(nn.ModuleList(dits))
        else:
            log.warning("Triton is not importable: eager runs the reference ops unfused (the same numbers, slower)")
    return None


FUSIONS = ("blocks", "qk", "none")


def compile_blocks(
    model: nn.Module, linear: str, device: torch.device, fuse: str = "blocks", inductor_config: dict | None = None
) -> GraphCounter:
    """The engine's compile of the repeated blocks for a linear backend: on CUDA with Triton, the fused passes
    (`accel.fused`; `fuse`: "blocks", the block passes and the qk-norm + rotary pass, what the engine runs; "qk", that
    pass alone; "none", neither: the benchmark's comparisons), Inductor for the rest. BF16 keeps eager's roundings
    (`eager_precision`, and the passes' `eager_rounding`); the FP8 backends, whose rounding dominates, do not.
    `inductor_config`: a benchmark's further Inductor options (the engine passes none)."""
    if fuse not in FUSIONS:
        raise ValueError(f"fuse {fuse!r}: allowed {', '.join(FUSIONS)}")
    exact = linear == "BF16"
    on = device.type == "cuda" and fused.available() and fuse != "none"
    fused.use(on)
    forwards = fused.block_forwards(eager_rounding=exact) if on and fuse == "blocks" else None
    return compile_repeated_blocks(model, eager_precision=exact, forwards=forwards, inductor_config=inductor_config)
