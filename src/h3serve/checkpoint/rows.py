"""The row orders the published layouts store fused tensors in, and the one place each reorder is written.

Ours (the parameter names' order; `model/`): the DiT's fused QKV stacked `[q_all; k_all; v_all]` and its fc1
`[gate; value]`; the video VAE decoder's fused QKV interleaved per head `[h0: q k v, h1: q k v, ...]` and its SwiGLU
`w1` `[gate; up]`. The released files differ from ours in three ways: per-head interleaved QKV (the original DiT
shards, DiffSynth and FlashGen adapters), q, k and v apart (diffusers; `torch.cat` stacks them), and the two halves of
a gated projection swapped (diffusers' `[value; gate]` fc1, `[up; gate]` w1). Every function moves rows only, so a
reordered tensor is bitwise the stored one; each works on a weight, a bias, a LoRA B factor or a full delta alike.
"""

from __future__ import annotations

import torch


def deinterleave_qkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows `[h0: q k v, h1: q k v, ...]` -> `[q_all; k_all; v_all]`: (H * 3 * D, ...) -> (3 * H * D, ...)."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def interleave_qkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows `[q_all; k_all; v_all]` -> `[h0: q k v, h1: q k v, ...]` (the inverse of `deinterleave_qkv`)."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """The two row halves of a gated projection swapped: diffusers' `[value; gate]` -> our `[gate; value]` (its own
    inverse)."""
    first, second = t.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)
