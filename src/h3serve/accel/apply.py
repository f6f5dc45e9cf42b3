"""Where a profile becomes transforms: the load hooks a checkpoint load applies, and `apply`, which gives each loaded
model its own kernels, linears and block stack. Nothing is chosen through process state, so two engines with
different profiles in one process each keep their own numbers."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from h3serve.accel import attention, fused, humming, linear
from h3serve.accel.adaln import AdalnHostHook
from h3serve.accel.blocks import BlockStack
from h3serve.accel.compile import Compiler, GraphCounter
from h3serve.accel.linear import Fp8LoadHook, TextFp8LoadHook
from h3serve.accel.profile import AdalnWeights, Execution, Fp8Scaling, Linear, Profile, TextLinear
from h3serve.accel.vae import (
    CUDA_TILE_BATCH,
    decoder_cast_names,
    decoder_passes,
    decoder_weights_to,
    set_decoder_passes,
    set_tile_batch,
)
from h3serve.checkpoint.adapters.read import is_block_adaln
from h3serve.checkpoint.safetensors import chain
from h3serve.model import ops
from h3serve.model.dit import Attention, Block
from h3serve.model.video_vae import VideoVAE

if TYPE_CHECKING:
    from h3serve.checkpoint.folder import ModelFolder
    from h3serve.checkpoint.safetensors import LoadHook
    from h3serve.model.components import Components
    from h3serve.model.ops import QkNormRopeKernel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadPlan:
    """What a checkpoint load does for a profile, as hooks (`load_components`' `dit_hook` and `text_hook`): FP8
    block linears (CUTLASS; HUMMING starts from the same e4m3 weights) and the FP8 text encoder are quantized as
    their weights are read, and the AdaLN weights go to pinned host memory as they are read (`AdalnWeights.PINNED`)
    or are not read at all (`MAPPED`: `dit_mapped`), so no component is ever whole on the device in a form the
    profile drops. The memory plan (`pipeline.budget`) runs the same hooks' `prepare` on meta-device models, so the
    plan and the load count one layout."""

    dit_hook: LoadHook | None
    text_hook: LoadHook | None
    adaln: AdalnWeights  # where the DiT blocks' AdaLN weights live after the load
    off_device: bool  # whether that is off the compute device
    decoder_dtype: torch.dtype | None = None  # the video decoder's linears and convolutions, as read (autocast's)

    def hooks(self, folder: ModelFolder | None = None) -> dict[str, object]:
        """`load_components`' keyword arguments (with `folder`, the video decoder's dtypes as read)."""
        mapped = is_block_adaln if self.adaln == AdalnWeights.MAPPED else None
        out = {"dit_hook": self.dit_hook, "text_hook": self.text_hook, "dit_mapped": mapped}
        if folder is not None and self.decoder_dtype is not None:
            with torch.device("meta"):
                names = decoder_cast_names(VideoVAE(folder.video_vae_config))
            dtype = self.decoder_dtype
            out["video_dtype_of"] = lambda name: dtype if name in names else torch.float32
        return out

    def where(self, name: str) -> str:
        """Where the DiT tensor `name` is after a load under this plan: "device", "host" (page-locked host memory)
        or "mapped" (the checkpoint's file mapping: page cache)."""
        if not is_block_adaln(name):
            return "device"
        if self.adaln == AdalnWeights.MAPPED:
            return "mapped"
        return "host" if self.off_device else "device"


def load_plan(profile: Profile) -> LoadPlan:
    quantize = Fp8LoadHook() if profile.quantized_linears else None
    pinned = profile.adaln_off_device and profile.adaln_weights == AdalnWeights.PINNED
    text = TextFp8LoadHook() if profile.text_linear == TextLinear.CUTLASS else None
    return LoadPlan(
        dit_hook=chain(quantize, AdalnHostHook() if pinned else None),
        text_hook=text,
        adaln=profile.adaln_weights,
        off_device=profile.adaln_off_device,
        decoder_dtype=profile.vae_autocast_dtype,
    )


class Passes(enum.StrEnum):
    """Which of the Triton passes (`accel.fused`) the DiT blocks run on CUDA: ALL (the engine's), QK (the fused
    qk-norm + rotary alone) or NONE (the reference ops). Only a benchmark asks for less than ALL, to measure what the
    passes save (bench/lib/variants.py)."""

    ALL = "all"
    QK = "qk"
    NONE = "none"


def profile_compiler(profile: Profile, **options) -> Compiler:
    """The compiler of a compile profile: BF16 keeps eager's roundings (the profile's point is fidelity); with FP8
    linears their rounding dominates. `options`: the rest of `Compiler`'s (a benchmark's static shapes or Inductor
    options); the engine passes none."""
    return Compiler(eager_precision=profile.linear == Linear.BF16, **options)


def apply(
    components: Components, profile: Profile, compiler: Compiler | None = None, passes: Passes = Passes.ALL
) -> GraphCounter | None:
    """Give every loaded model the profile's choices, on the model itself:
    - each attention module its kernel (DiT, video decoder, audio encoder);
    - the video decoder its weights in the autocast dtype (bitwise the same decode), on CUDA its tiles decoded
      `CUDA_TILE_BATCH` at a time and, with Triton, its blocks' fused passes (the same numbers);
    - the DiTs' block linears: FP8 (CUTLASS) unless the loader already quantized them, or Humming's layout;
      the text encoder's FP8 linears when asked; the FP8 GEMM's scaling, once the self-test chose it;
    - each DiT's block stack: on CUDA with Triton, eager runs the exact passes (bit for bit the reference ops) and
      compile traces the fused passes; compile shares one compiler (code and graph counter) between the DiTs.
    `compiler` (`profile_compiler` with a benchmark's options) and `passes`: a benchmark's variants; the engine passes
    neither. Returns the compile's graph counter (None when eager)."""
    dits = list(components.dits.values())  # the FL2VA DiT, the Ref2VA DiT, or both: the same profile for each
    for model in (*dits, components.video_vae, components.audio_vae):
        attention.set_kernel(model, profile.attention)
    if profile.vae_autocast_dtype is not None:
        decoder_weights_to(components.video_vae, profile.vae_autocast_dtype)
    set_tile_batch(components.video_vae, CUDA_TILE_BATCH if profile.cuda else 1)
    for dit in dits:
        if profile.linear == Linear.CUTLASS and not linear.is_quantized(dit):
            linear.quantize_blocks(dit)
        if profile.linear == Linear.HUMMING and not humming.is_humming(dit):
            humming.quantize_blocks(dit)  # from the BF16 linears, or the loader's e4m3 ones
    if profile.text_linear == TextLinear.CUTLASS and not linear.is_text_quantized(components.text_encoder):
        linear.quantize_text_encoder(components.text_encoder)
    if profile.fp8_scaling != Fp8Scaling.AUTO:  # the self-test's choice (`accel.fp8_check.resolve`)
        for model in (*dits, components.text_encoder):
            linear.set_scaling(model, profile.fp8_scaling.value)

    triton = profile.cuda and fused.available()
    if profile.cuda and not triton:
        log.warning("Triton is not importable: the DiT runs the reference ops unfused (the same numbers, slower)")
    if triton and Passes(passes) != Passes.NONE:
        set_decoder_passes(components.video_vae, decoder_passes())
    if compiler is None and profile.execution == Execution.COMPILE:
        compiler = profile_compiler(profile)
    qk, body = block_passes(profile, triton and Passes(passes) != Passes.NONE)
    if Passes(passes) == Passes.QK:
        body = None  # the blocks' own forward around the fused qk-norm + rotary
    for dit in dits:
        set_block_passes(dit, qk, body)
        stack = BlockStack.of(dit).set_compiler(compiler if profile.execution == Execution.COMPILE else None)
        log.info("DiT blocks run: %s", stack.install(dit).describe())
    return compiler.counter if compiler is not None else None


def block_passes(profile: Profile, enabled: bool) -> tuple[QkNormRopeKernel, Callable | None]:
    """The qk-norm + rotary kernel and the blocks' body for the profile: the Triton passes when `enabled` (exact for
    eager, the compiled passes for compile, rounding as eager does for BF16), else the references (None: the
    block's own forward). Made once per `apply`, so that DiTs sharing a compiler share its code."""
    if not enabled:
        return ops.qk_norm_rope_reference, None
    kernels = fused.triton_kernels()
    passes = fused.BlockPasses.from_kernels(kernels)
    if profile.execution == Execution.EAGER:
        return fused.qk_kernel(kernels, exact=True), fused.block_body(fused.exact_passes(passes), eager_rounding=True)
    body = fused.block_body(fused.compile_passes(passes), eager_rounding=profile.linear == Linear.BF16)
    return fused.qk_kernel(kernels, exact=False), body


def set_block_passes(dit: nn.Module, qk: QkNormRopeKernel, body: Callable | None) -> None:
    """`dit`'s attention modules run `qk`; its blocks run `body` (None: their own forward)."""
    for module in dit.modules():
        if isinstance(module, Attention):
            module.qk_kernel = qk
    BlockStack.of(dit).set_body(Block, body)
