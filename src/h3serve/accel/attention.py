"""Attention backends by the seed's names, each a kernel over (B, H, S, D) set once into `h3serve.model.ops`.

TORCH_SDPA  torch's scaled_dot_product_attention with its own backend choice (flash on Hopper): the reference
CUDNN_ATTN  the same call held to cuDNN's fused attention (613 TFLOP/s at the reference shape on an H200 against
            flash's 330, and bitwise repeatable there: PERFORMANCE.md)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from h3serve.model import ops


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


KERNELS: dict[str, ops.AttentionKernel] = {"TORCH_SDPA": ops.sdpa, "CUDNN_ATTN": cudnn_sdpa}


def check(name: str, device: torch.device) -> None:
    """Refuse a backend this device cannot run (ValueError naming what is allowed)."""
    if name not in KERNELS:
        raise ValueError(f"attention must be one of {', '.join(KERNELS)}, got {name!r}")
    if name == "CUDNN_ATTN":
        if device.type != "cuda":
            raise ValueError(f"attention CUDNN_ATTN needs a CUDA device (allowed on {device.type}: TORCH_SDPA)")
        if not torch.backends.cudnn.is_available():
            raise ValueError("attention CUDNN_ATTN: cuDNN is not available in this torch build (allowed: TORCH_SDPA)")


def use(name: str) -> None:
    """Make every `ops.attention` call run this backend from now on."""
    ops.use_attention_kernel(KERNELS[name])
