"""The small ops every model file shares: attention over (S, H, D) rows, rotate-half rotary embedding, the DiT's
qk-RMSNorm + rotary, AdaLN modulation and the gated residual.

The DiT and both VAEs call these instead of `scaled_dot_product_attention` and their own RoPE. Each attention
module holds the kernels it runs as attributes (`kernel`, and the DiT's `qk_kernel`), the references here by
default; `h3serve.accel.apply` sets them per model, so two models in one process never share a choice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The reference kernel: torch's scaled_dot_product_attention with its own backend choice. (B, H, S, D)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, kernel: AttentionKernel = sdpa
) -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(D), no mask (or a causal one), computed by `kernel` (the caller's choice).

    q, k, v: (S, H, D) for one sequence or (B, S, H, D) for a batch; returns the same layout. The kernel sees
    (B, H, S, D): a 4-D call picks the same kernels as the reference's batched calls (on the CPU the 3-D and 4-D
    bfloat16 paths round differently).
    """
    single = q.ndim == 3
    if single:
        q, k, v = q[None], k[None], v[None]
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


QkNormRopeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiT attention's qk-RMSNorm over each head's D channels (own weight for q and k), then rotate-half RoPE on
    the leading R, in one call so that one fused pass can replace both (a `QkNormRopeKernel`).

    q, k: (S, H, D), any strides (views of the fused QKV projection); weights (D,); cos, sin: (S, R) float32, R <= D
    and even, each half equal (`rotary_table`). Returns the normalised, rotated q and k, (S, H, D) at q's dtype.
    """
    q, k = qk_norm(q, k, q_weight, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def qk_norm(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's RMSNorm of q and k over each head's D channels, each with its own weight (torch's rms_norm;
    the exact fused qk pass runs this same call before its rotary)."""
    d = q.shape[-1]
    return F.rms_norm(q, (d,), q_weight, eps), F.rms_norm(k, (d,), k_weight, eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """AdaLN modulation of a normalised activation: x * (1 + scale) + shift, per row."""
    return x * (1.0 + scale) + shift


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gated residual add of an AdaLN block: x + gate * y."""
    return x + gate * y
