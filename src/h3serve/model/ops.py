"""The small ops every model file shares: attention over (S, H, D) rows and rotate-half rotary embedding.

The DiT and both VAEs call these instead of `scaled_dot_product_attention` and their own RoPE, so an outside
layer (an attention backend, a fused kernel) has one place to act on. Plain PyTorch here: which SDPA kernel runs is
steered from outside (an `sdpa_kernel` context).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False) -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(D), no mask (or a causal one).

    q, k, v: (S, H, D) for one sequence or (B, S, H, D) for a batch; returns the same layout. The kernel sees
    (B, H, S, D): a 4-D call picks the same kernels as the reference's batched calls (on the CPU the 3-D and 4-D
    bfloat16 paths round differently).
    """
    single = q.ndim == 3
    if single:
        q, k, v = q[None], k[None], v[None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
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
