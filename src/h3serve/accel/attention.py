"""Attention backends by the seed's names (`accel.profile.Attention`), each a kernel over (B, H, S, D) that a model's
attention modules hold (`kernel`), set per model by `set_kernel`.

TORCH_SDPA  torch's scaled_dot_product_attention with its own backend choice (flash on Hopper): the reference
CUDNN_ATTN  the same call held to cuDNN's fused attention (faster than flash on Hopper at H3's shapes, and bitwise
            repeatable: bench/results/README.md)
FA4         the DiT's attention through FlashAttention-4's forward kernel (`accel.fa4`; exact, faster than cuDNN on
            Hopper). The DiT's alone: under it the decoders' attention runs CUDNN_ATTN (`DIT_ONLY`).
CUDNN_FP8   the DiT's attention in FP8 through cuDNN's FP8 SDPA (`accel.fp8_attention`; opt-in, lossy). The DiT's
            alone: under it the decoders' attention runs CUDNN_ATTN (`DIT_ONLY`).
`auto` is no kernel: it is chosen where no hardware decides (`accel.profile.resolve_attention`), else at start on the
device (`resolve`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3serve.accel import fa4, fp8_attention
from h3serve.accel.profile import Attention, Profile, ProfileError
from h3serve.model import audio_vae, dit, ops, video_vae


def cudnn_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    # cuDNN's fused attention has no float32 kernel. The backend is for the half-precision attention of the DiT and
    # the video decoder; the only float32 attention in the pipeline is the audio VAE's encoder (Ref2VA's reference
    # audio, a few hundred rows), which runs torch's own choice. A float32 DiT with CUDNN_ATTN is refused up front
    # (`Profile`), so this is never where the DiT's attention lands.
    if q.dtype == torch.float32:
        return ops.sdpa(q, k, v, causal)
    # Held to cuDNN only: if cuDNN cannot run a call, it fails rather than falling back to another kernel.
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


KERNELS: dict[Attention, ops.AttentionKernel] = {
    Attention.TORCH_SDPA: ops.sdpa,
    Attention.CUDNN_ATTN: cudnn_sdpa,
    Attention.CUDNN_FP8: fp8_attention.fp8_sdpa,
    Attention.FA4: fa4.fa4_sdpa,
}
# A backend name without a kernel fails at import, not at a request (`auto` is no kernel: it is resolved first).
if set(KERNELS) != set(Attention) - {Attention.AUTO}:
    raise ImportError(f"attention backends without a kernel: {set(Attention) - set(KERNELS) - {Attention.AUTO}}")
# The modules that hold an attention kernel: the DiT's, the video decoder's, the audio encoder's.
MODULES = (dit.Attention, video_vae.Attention, audio_vae.CausalAttention)
# Backends for the DiT's attention alone, and what the other modules run under them.
DIT_ONLY = {Attention.CUDNN_FP8: Attention.CUDNN_ATTN, Attention.FA4: Attention.CUDNN_ATTN}


def set_kernel(model: nn.Module, name: Attention) -> int:
    """Every attention module of `model` runs backend `name` from now on; returns how many there are."""
    name = Attention(name)
    if name == Attention.AUTO:
        raise ValueError("attention auto is chosen at start (`resolve`), not run: resolve the profile first")
    modules = [m for m in model.modules() if isinstance(m, MODULES)]
    for module in modules:
        module.kernel = KERNELS[name if isinstance(module, dit.Attention) else DIT_ONLY.get(name, name)]
    return len(modules)


def resolve(profile: Profile, head_dim: int) -> tuple[Profile, str | None]:
    """The profile with its attention chosen on its device, and the line that says so (None when there was nothing to
    choose or test: not CUDA, or neither FA4 nor auto). An explicit FA4 is self-tested (`fa4.self_test`) and refused
    if it fails: it never falls back. `auto` becomes FA4 where `fa4.auto_refusal` has nothing against it and the
    self-test passes, else CUDNN_ATTN, and the line says why. `head_dim`: the DiT's, which the self-test compiles
    for."""
    if not profile.cuda or profile.attention not in (Attention.AUTO, Attention.FA4):
        return profile, None
    device = profile.torch_device
    if profile.attention == Attention.FA4:
        result = fa4.self_test(device, head_dim, profile.torch_dtype)
        if not result.ok:
            raise ProfileError(
                "attention",
                f"attention FA4 does not compute correctly on {profile.device} ({result.describe()}): use CUDNN_ATTN",
            )
        return profile, f"attention FA4: {result.describe()}"
    why = fa4.auto_refusal(device)
    if why is None:
        result = fa4.self_test(device, head_dim, profile.torch_dtype)
        if result.ok:
            return dataclasses.replace(profile, attention=Attention.FA4), f"attention auto: FA4 ({result.describe()})"
        why = result.describe()
    return dataclasses.replace(profile, attention=Attention.CUDNN_ATTN), f"attention auto: CUDNN_ATTN ({why})"
