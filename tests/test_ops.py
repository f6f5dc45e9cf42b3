"""The shared ops (attention over (S, H, D), rotate-half RoPE) and the latent statistics, against hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from h3serve.model.latents import LatentStats
from h3serve.model.ops import apply_rotary, attention, rotary_table


def naive_attention(q, k, v, causal=False):
    # q, k, v (S, H, D): softmax(q k^T / sqrt(D)) v per head, in float64.
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # (H, S, D)
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # (S, H, D)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_the_formula_for_one_sequence_and_a_batch(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 8, generator=g) for _ in range(3))  # (B, S, H, D), distinct S, H and D
    batched = attention(q, k, v, causal=causal)
    assert batched.shape == (2, 7, 3, 8)
    for b in range(2):
        single = attention(q[b], k[b], v[b], causal=causal)
        assert single.shape == (7, 3, 8)
        torch.testing.assert_close(single.double(), naive_attention(q[b], k[b], v[b], causal), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(batched[b], single)


def test_causal_attention_ignores_later_rows():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 2, 4, generator=g) for _ in range(3))
    out = attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[3:], v2[3:] = 100.0, -100.0
    torch.testing.assert_close(attention(q, k2, v2, causal=True)[:3], out[:3])
    assert not torch.allclose(attention(q, k2, v2)[:3], attention(q, k, v)[:3])


def test_partial_rotary_by_hand():
    # One head of 6 dims, 4 rotate: pairs (0, 2) and (1, 3) turn by the angle; dims 4, 5 pass through.
    x = torch.arange(1.0, 7.0).view(1, 1, 6)
    cos, sin = rotary_table(torch.tensor([[0.3, 0.7]]))
    out = apply_rotary(x, cos, sin)
    c, s = math.cos(0.3), math.sin(0.3)
    c2, s2 = math.cos(0.7), math.sin(0.7)
    expected = torch.tensor([1 * c - 3 * s, 2 * c2 - 4 * s2, 3 * c + 1 * s, 4 * c2 + 2 * s2, 5, 6])
    torch.testing.assert_close(out.view(-1), expected)


def test_rotary_broadcasts_over_batch_and_heads_and_keeps_the_dtype():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 3, 8, generator=g).to(torch.bfloat16)  # (B, S, H, D)
    cos, sin = rotary_table(torch.randn(5, 3, generator=g))  # R = 6 of 8
    out = apply_rotary(x, cos, sin)
    assert out.dtype == torch.bfloat16
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(out[b, :, h], apply_rotary(x[b, :, h : h + 1], cos, sin)[:, 0])
    torch.testing.assert_close(out[..., 6:], x[..., 6:])


def test_latent_stats_round_trip_any_rank():
    stats = LatentStats((0.5, -1.0, 2.0), (2.0, 0.5, 4.0))
    for shape in [(2, 3, 5), (1, 3, 2, 2, 2)]:
        z = torch.randn(shape)
        n = stats.normalize(z)
        torch.testing.assert_close(n[:, 1], (z[:, 1] + 1.0) / 0.5)
        torch.testing.assert_close(stats.denormalize(n), z)


@pytest.mark.parametrize(
    ("mean", "std", "message"),
    [
        ((0.0, 0.0), (1.0,), "latents_mean has 2 values but latents_std has 1"),
        ((0.0,), (0.0,), "strictly positive"),
        ((0.0,), (-1.0,), "strictly positive"),
        ((float("nan"),), (1.0,), "finite"),
    ],
)
def test_latent_stats_refuse_bad_values(mean, std, message):
    with pytest.raises(ValueError, match=message):
        LatentStats(mean, std)


def test_latent_stats_for_channels_checks_the_count():
    assert LatentStats.for_channels([0, 1], [1, 2], 2).mean == (0.0, 1.0)
    with pytest.raises(ValueError, match="have 2 values, expected 3"):
        LatentStats.for_channels([0, 1], [1, 2], 3)
