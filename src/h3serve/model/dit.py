"""The MiniMax-H3 DiT: one stack of single-stream blocks over one packed sequence of text, audio and video rows.

Architecture only. Parameter names follow the original checkpoint (`FL2VA/transformer`), with one internal layout
choice: `qkv_proj` rows are contiguous `[q_all; k_all; v_all]` (the original interleaves them per head; the loader
reorders once). Kernels, compilation and attention backends are applied from outside (see `REPEATED_BLOCKS` and
`FP32_MODULES`): each `Attention` holds the kernels it calls (`kernel`, `qk_kernel`: the references of
`h3serve.model.ops` until `h3serve.accel.apply` sets others), and how the repeated blocks run is declared in one
place outside the model (`h3serve.accel.blocks`).

Shapes are unbatched: one request is one packed sequence of S rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.config import MAX_TIMESTEPS, NUM_BLOCK_MODULATIONS, NUM_MODALITIES, DiTConfig
from h3serve.model.ops import (
    AttentionKernel,
    QkNormRopeKernel,
    attention,
    gated_residual,
    modulate,
    qk_norm_rope_reference,
    rotary_table,
    sdpa,
)

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin (S, rotary_dim), float32


def timestep_sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """(M,) timesteps in [0, 1], used unscaled -> (M, dim) `[cos | sin]` features in float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class RotaryEmbedding(nn.Module):
    """3-axis RoPE: one `inv_freq` shared by t, h and w; angles `[t | h | w]` duplicated for rotate-half."""

    def __init__(self, num_freqs: int, theta: float):
        super().__init__()
        # Persistent because the original checkpoint ships it (`rope.inv_freq`, float32); the loader computes it
        # with `inv_freq()` for layouts that drop it.
        self.register_buffer("inv_freq", inv_freq(num_freqs, theta))

    def forward(self, position_ids: torch.Tensor) -> Rope:
        # position_ids (S, 3) -> cos, sin (S, 6 * num_freqs), float32
        angles = position_ids.float()[:, :, None] * self.inv_freq.float()[None, None, :]  # (S, 3, F)
        return rotary_table(angles.flatten(1))  # angles (S, 3F) as [t | h | w]


def inv_freq(num_freqs: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, 2 * num_freqs, 2, dtype=torch.float32) / (2 * num_freqs)))


class TimestepEmbedder(nn.Module):
    """Sinusoid(t) -> proj_in -> SiLU -> proj_out; an fp32 island in the released checkpoint."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.dim = cfg.timestep_input_dim
        self.proj_in = nn.Linear(cfg.timestep_input_dim, cfg.time_embed_hidden_size)
        self.proj_out = nn.Linear(cfg.time_embed_hidden_size, cfg.time_embed_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # t (M,) -> temb (M, time_embed_dim)
        emb = timestep_sinusoid(t, self.dim).to(self.proj_in.weight.dtype)
        return self.proj_out(F.silu(self.proj_in(emb)))


class Attention(nn.Module):
    """Full bidirectional self-attention with fused QKV and per-head qk-RMSNorm; no biases, no mask."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.inner_dim, bias=False)
        self.q_norm = nn.RMSNorm(cfg.attention_head_dim, eps=cfg.qk_norm_eps)
        self.k_norm = nn.RMSNorm(cfg.attention_head_dim, eps=cfg.qk_norm_eps)
        self.out_proj = nn.Linear(cfg.inner_dim, cfg.hidden_size, bias=False)
        # The kernels this module runs: the references unless an outside layer sets others (plain attributes, so
        # torch.compile guards on them and two models never share a choice).
        self.kernel: AttentionKernel = sdpa
        self.qk_kernel: QkNormRopeKernel = qk_norm_rope_reference

    def forward(self, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        # x (S, hidden) -> q, k, v (S, H, D)
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in self.qkv_proj(x).chunk(3, dim=-1))
        if rope is None:
            q, k = self.q_norm(q), self.k_norm(k)
        else:  # one call, so that a fused kernel can do both in one pass (`ops.qk_norm_rope_reference`)
            q, k = self.qk_kernel(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, *rope)
        out = attention(q, k, v, kernel=self.kernel)  # (S, H, D): one document, no mask
        return self.out_proj(out.flatten(1).to(x.dtype))  # (S, hidden)


class SwiGLU(nn.Module):
    """`fc1` rows are `[gate; value]` as in the original checkpoint (diffusers stores `[value; gate]`)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, bias=False)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(value * F.silu(gate))


class AdaLNProjection(nn.Module):
    """temb (M, time_embed_dim) -> a modulation table of (M * rows_per_t, chunks * hidden) rows.

    Blocks use rows_per_t = 3 (one row per modality, addressed by `t_index * 3 + tag`) and 6 chunks; the final layer
    uses one row per timestep and 2 chunks (shift, scale).
    """

    def __init__(self, cfg: DiTConfig, chunks: int, rows_per_t: int):
        super().__init__()
        self.hidden = cfg.hidden_size
        self.chunks = chunks
        self.linear = nn.Linear(cfg.time_embed_dim, chunks * rows_per_t * cfg.hidden_size)

    def forward(self, temb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # SiLU runs at temb's precision (fp32) and only its result is cast to the compute dtype: a rounding before
        # the activation would shift every block's modulation the same way at every step and accumulate.
        return self.linear(F.silu(temb).to(dtype)).view(-1, self.chunks * self.hidden)


class RefinerBlock(nn.Module):
    """Plain pre-norm block for the text rows: no AdaLN, no RoPE."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), None)
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.token_refiner_num_layers))
        self.final_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)


TABLE_ROWS = MAX_TIMESTEPS * NUM_MODALITIES  # a block's modulation table, padded to a shape fixed for every forward
# The six (hidden,) chunks of a block's modulation row, in the checkpoint's order.
MODULATIONS = ("shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp")
assert len(MODULATIONS) == NUM_BLOCK_MODULATIONS


def pad_table(table: torch.Tensor) -> torch.Tensor:
    """(M * 3, 6 * hidden) -> (TABLE_ROWS, 6 * hidden), the extra rows zero."""
    return F.pad(table, (0, 0, 0, TABLE_ROWS - table.shape[0]))


class Block(RefinerBlock):
    """Single-stream block: the refiner block's layers plus AdaLN, whose parameters are picked per row from the
    (timestep, modality) table, and RoPE.

    The table is an input: `modulation(temb)` makes it (it depends on the timesteps only, so it can be made ahead of
    time for a whole schedule), padded to `TABLE_ROWS` rows so that `forward` sees the same shapes at every step.
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__(cfg)
        self.adaln_proj = AdaLNProjection(cfg, NUM_BLOCK_MODULATIONS, NUM_MODALITIES)

    def modulation(self, temb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # temb (M, time_embed_dim) -> (TABLE_ROWS, 6 * hidden); rows past M * 3 are zero and never indexed
        return pad_table(self.adaln_proj(temb, dtype))

    def forward(self, x: torch.Tensor, table: torch.Tensor, adaln_indices: torch.Tensor, rope: Rope) -> torch.Tensor:
        # x (S, hidden); table (TABLE_ROWS, 6 * hidden); adaln_indices (S,) = t_index * 3 + tag
        # One gather per modulation vector, each next to its use: a compiler fuses each into its consumer instead of
        # writing all six (S, hidden) gathers out first.
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            m.index_select(0, adaln_indices) for m in table.chunk(NUM_BLOCK_MODULATIONS, dim=-1)
        )
        x = gated_residual(x, gate_msa, self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope))
        return gated_residual(x, gate_mlp, self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp)))


class FinalLayer(nn.Module):
    """Shift/scale-modulated norm (one table row per timestep), then the two fp32 heads on their own rows only."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.final_norm_eps)
        self.adaln_proj = AdaLNProjection(cfg, 2, 1)
        self.video_out = nn.Linear(cfg.hidden_size, cfg.video_patch_dim)
        self.audio_out = nn.Linear(cfg.hidden_size, cfg.audio_latents_dim)

    def forward(
        self,
        x: torch.Tensor,
        temb: torch.Tensor,
        timestep_indices: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.hidden(x, temb, timestep_indices)
        return self.video_out(h.index_select(0, video_indices)), self.audio_out(h.index_select(0, audio_indices))

    def hidden(self, x: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        """Every row's modulated norm, at the heads' precision: what the two heads read."""
        shift, scale = self.adaln_proj(temb, x.dtype).index_select(0, timestep_indices).chunk(2, dim=-1)
        # Modulate at the block stack's precision, then cast to the heads' (fp32) precision.
        return modulate(self.norm(x), shift, scale).to(self.video_out.weight.dtype)


class H3DiT(nn.Module):
    """embed -> scatter into one packed sequence -> blocks -> final layer -> per-modality heads.

    Output is a data-ward velocity (x0_hat = x_t + (1 - t) v, t = 1 clean) for the rows named by `video_indices` and
    `audio_indices`, in their order, conditioning rows included.
    """

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.config = cfg
        self.video_patch_proj = nn.Linear(cfg.video_patch_dim, cfg.hidden_size)
        self.audio_patch_proj = nn.Linear(cfg.audio_latents_dim, cfg.hidden_size)
        self.condition_proj = nn.Linear(cfg.text_dim, cfg.hidden_size)
        self.time_embedder = TimestepEmbedder(cfg)
        self.rope = RotaryEmbedding(cfg.rope_inv_freq_len, cfg.rope_theta)
        self.token_refiner = TokenRefiner(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layer = FinalLayer(cfg)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype outside the fp32 islands: the block stack's norm weights', which no weight
        transform (quantization) touches, so an FP8 linear never turns activations into FP8."""
        return self.token_refiner.final_norm.weight.dtype

    def refine_text(self, text_states: torch.Tensor) -> torch.Tensor:
        """(L, text_dim) text-encoder states -> (L, hidden) text rows. Independent of t: run once per request."""
        return self.token_refiner(self.condition_proj(text_states.to(self.compute_dtype)))

    def forward(
        self,
        video: torch.Tensor,
        audio: torch.Tensor,
        text: torch.Tensor,
        timesteps: torch.Tensor,
        timestep_indices: torch.Tensor,
        token_tags: torch.Tensor,
        rope: Rope,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        tables: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """video (Nv, C*pt*ph*pw), audio (Na, C_a), text (L, hidden) from `refine_text`, timesteps (M,) distinct,
        timestep_indices / token_tags (S,), rope from `self.rope(position_ids)`, index tensors into the S rows.
        `tables`: each block's modulation table for these timesteps, made ahead of time (else each block makes
        its own from `timesteps`). Returns velocities (Nv, C*pt*ph*pw) and (Na, C_a) at the heads' dtype."""
        v, a = self.embed(video, audio)
        x = self.pack(timestep_indices.shape[0], v, a, text, video_indices, audio_indices, text_indices)
        temb = self.time_embedder(timesteps)  # (M, time_embed_dim), fp32
        x = self.run_blocks(x, temb, timestep_indices * NUM_MODALITIES + token_tags, rope, tables)
        return self.final_layer(x, temb, timestep_indices, video_indices, audio_indices)

    def embed(self, video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The video and audio rows' fp32 input projections."""
        v = self.video_patch_proj(video.to(self.video_patch_proj.weight.dtype))
        return v, self.audio_patch_proj(audio.to(self.audio_patch_proj.weight.dtype))

    def pack(self, num_rows: int, v, a, text, video_indices, audio_indices, text_indices) -> torch.Tensor:
        """The packed sequence (num_rows, hidden) at the stack's dtype: each kind's rows scattered to its indices."""
        x = text.new_zeros(num_rows, text.shape[-1])
        x = x.index_copy(0, text_indices, text)
        x = x.index_copy(0, video_indices, v.to(x.dtype))
        return x.index_copy(0, audio_indices, a.to(x.dtype))

    def run_blocks(self, x, temb, adaln_indices, rope: Rope, tables: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """The main blocks over the packed rows; adaln_indices (S,) = t_index * 3 + tag."""
        for i, block in enumerate(self.blocks):
            table = block.modulation(temb, x.dtype) if tables is None else tables[i]
            x = block(x, table, adaln_indices, rope)
        return x


# What outside layers may act on. Regional compile and block caches wrap these classes; the listed submodules
# (and the `rope.inv_freq` buffer) stay float32 whatever dtype the rest of the model runs in.
REPEATED_BLOCKS = (Block, RefinerBlock)
FP32_MODULES = (
    "video_patch_proj",
    "audio_patch_proj",
    "time_embedder",
    "rope",
    "final_layer.video_out",
    "final_layer.audio_out",
)


def is_fp32_name(name: str) -> bool:
    """Whether a parameter/buffer name of H3DiT belongs to an fp32 island."""
    return any(name == m or name.startswith(m + ".") for m in FP32_MODULES)
