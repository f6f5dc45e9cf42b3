"""The small ops every model file shares: attention over (S, H, D) rows, rotate-half rotary embedding, AdaLN
modulation and the gated residual.

The DiT and both VAEs call these instead of `scaled_dot_product_attention` and their own RoPE, so an outside
layer has one place to act on: the attention kernel is set once at start (`use_attention_kernel`, from the
registry in `h3serve.accel.attention`); the rest are the plain references that fused kernels are checked against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The reference kernel: torch's scaled_dot_product_attention with its own backend choice. (B, H, S, D)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


_kernel: AttentionKernel = sdpa


def use_attention_kernel(kernel: AttentionKernel) -> None:
    """Set the kernel every `attention` call runs (chosen once at start, by `h3serve.accel.attention`)."""
    global _kernel
    _kernel = kernel


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False) -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(D), no mask (or a causal one).

    q, k, v: (S, H, D) for one sequence or (B, S, H, D) for a batch; returns the same layout. The kernel sees
    (B, H, S, D): a 4-D call picks the same kernels as the reference's batched calls (on the CPU the 3-D and 4-D
    bfloat16 paths round differently).

    Float32 attention always runs the reference `sdpa`: the chosen kernel is for the half-precision attention of
    the DiT and the video decoder (cuDNN's fused attention has no float32 kernel), and the only float32 attention
    in the pipeline is the audio VAE's encoder (Ref2VA's reference audio), a few hundred rows.
    """
    single = q.ndim == 3
    if single:
        q, k, v = q[None], k[None], v[None]
    kernel = sdpa if q.dtype == torch.float32 else _kernel
    out = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal)
    out = out.transpose(1, 2)  # (B, S, H, D)
    return out[0] if single else out


def rotary_table(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, R/2) angles -> cos, sin (S, R) for rotate-half: each angle covers channel i and channel i + R/2."""
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading R channels of each head; the remaining D - R pass through.

    x: (..., S, H, D); cos, sin: (S, R) with R <= D. The table is cast to x's dtype first, as the references do.
    """
    r = cos.shape[-1]
    cos = cos.to(x.dtype)[:, None, :]  # (S, 1, R): one row per position, shared by the heads
    sin = sin.to(x.dtype)[:, None, :]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rot, rest), dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """AdaLN modulation of a normalised activation: x * (1 + scale) + shift, per row."""
    return x * (1.0 + scale) + shift


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gated residual add of an AdaLN block: x + gate * y."""
    return x + gate * y
