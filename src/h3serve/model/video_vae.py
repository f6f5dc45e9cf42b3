"""MiniMax-H3 video VAE ("H3-VisualVAE", f16t4c24): causal 3D CNN encoder and ViT3D decoder.

Parameter names follow the original checkpoint (`FL2VA/video_vae/source/model.safetensors`), so that layout loads
without renaming; the diffusers layout (`vae/`) is converted once, at load, in `checkpoint/vae.py`.

Temporal geometry (released config: clip 17 frames, token_drop 3, temporal ratio 4): frames are encoded in
17-frame clips of 5 latents each and the last 3 latents of the whole video are dropped, so 17n+5 frames map to
5n+2 latents. Decoding re-chunks the latents into windows of 5+2 and cross-fades the 5 frames where neighbouring
windows overlap (`VideoVAEConfig.decode_plan` counts them; `pipeline.video_decode` runs them). Spatially, both
directions run on 256 px tiles with >= 64 px overlap, blended linearly, exactly as the released recipe does; the
blended-tile frames are what the model was released with. This file decodes one batch of a window's tiles
(`VideoVAE.decode_tiles`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.config import from_diffusers_keys
from h3serve.model.latents import HasLatentStats
from h3serve.model.ops import AttentionKernel, apply_rotary, attention, rotary_table, sdpa

_PAD_MODES = ("reflect", "replicate", "constant", "circular")


@dataclass(frozen=True, kw_only=True)
class VideoVAEConfig(HasLatentStats):
    """Architecture and recipe of the video VAE.

    Field names are the keys of the diffusers `vae/config.json`: it is the one released config that names every
    knob in a single flat file. The original layout splits the same facts over `video_vae/config.json` (clip
    geometry, tiling, latent statistics) and `video_vae/source/config.json` (architecture) and hard-codes a few
    (register tokens, group count, epsilons); `checkpoint.vae.original_video_vae_config` maps it. `tile_size`,
    `tile_overlap_min` and the two tiling switches come from the original wrapper config (`vae_tile_size`, ...);
    diffusers hard-codes 256/64/on.
    """

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 24
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    layers_per_block: int = 2
    spatial_downsample_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    temporal_downsample_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    spatial_padding_mode: str = "reflect"
    decoder_num_layers: int = 36
    decoder_num_attention_heads: int = 32
    decoder_attention_head_dim: int = 64
    decoder_num_register_tokens: int = 4
    decoder_ffn_mult: int = 4
    decoder_rope_theta: float = 100.0
    decoder_rope_dim_ratio: float = 0.75
    decoder_norm_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    tile_size: int = 256
    tile_overlap_min: int = 64
    encoder_tiling: bool = True
    decoder_tiling: bool = True

    def __post_init__(self) -> None:
        # JSON gives lists; the config is hashable and immutable, so store tuples.
        for name in ("block_out_channels", "spatial_downsample_factors", "temporal_downsample_factors"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        positive = (
            "in_channels",
            "out_channels",
            "latent_channels",
            "layers_per_block",
            "norm_num_groups",
            "decoder_num_layers",
            "decoder_num_attention_heads",
            "decoder_attention_head_dim",
            "decoder_ffn_mult",
            "clip_length",
            "tile_size",
            "tile_overlap_min",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"VideoVAEConfig.{name} must be a positive int, got {value!r}")
        levels = len(self.block_out_channels)
        if levels == 0 or any(c <= 0 for c in self.block_out_channels):
            raise ValueError(f"block_out_channels must be non-empty and positive, got {self.block_out_channels}")
        for name in ("spatial_downsample_factors", "temporal_downsample_factors"):
            factors = getattr(self, name)
            if len(factors) != levels:
                raise ValueError(f"{name} has {len(factors)} entries, block_out_channels has {levels}")
            if any(f not in (1, 2) for f in factors):
                raise ValueError(f"{name} entries must be 1 or 2, got {factors}")
        for s, t in zip(self.spatial_downsample_factors, self.temporal_downsample_factors, strict=True):
            # The reference's downsample conv has no spatial padding of its own; only the stride-2 path pads, so a
            # temporal-only downsample would silently shrink the frame by 2 px. No released config does that.
            if t == 2 and s != 2:
                raise ValueError("a temporal downsample level must also downsample spatially (reference quirk)")
        for c in (*self.block_out_channels,):
            if c % self.norm_num_groups:
                raise ValueError(f"channel count {c} is not divisible by norm_num_groups {self.norm_num_groups}")
        if self.spatial_padding_mode not in _PAD_MODES:
            raise ValueError(f"spatial_padding_mode must be one of {_PAD_MODES}, got {self.spatial_padding_mode!r}")
        if self.decoder_num_register_tokens < 0:
            raise ValueError("decoder_num_register_tokens must be >= 0")
        for name in ("norm_eps", "decoder_norm_eps", "decoder_rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"VideoVAEConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.decoder_rope_dim_ratio <= 1:
            raise ValueError(f"decoder_rope_dim_ratio must be in (0, 1], got {self.decoder_rope_dim_ratio}")
        if self.rope_dim % 6:
            # Three axes, each rotating pairs of channels: the rotated width must split into 3 x 2 x n.
            raise ValueError(f"rotary width {self.rope_dim} (head_dim x rope_dim_ratio) must be a multiple of 6")
        if not 0 <= self.token_drop < self.tokens_chunk_size:
            raise ValueError(f"token_drop must be in [0, {self.tokens_chunk_size}), got {self.token_drop}")
        self._check_latent_stats()
        r = self.spatial_ratio
        if self.tile_size % r or self.tile_overlap_min % r:
            raise ValueError(f"tile_size and tile_overlap_min must be multiples of the spatial ratio {r}")
        if self.tile_overlap_min >= self.tile_size:
            raise ValueError("tile_overlap_min must be smaller than tile_size")

    # Derived geometry ------------------------------------------------------------------------------------------
    @property
    def spatial_ratio(self) -> int:
        return math.prod(self.spatial_downsample_factors)

    @property
    def temporal_ratio(self) -> int:
        return math.prod(self.temporal_downsample_factors)

    @property
    def decoder_dim(self) -> int:
        return self.decoder_num_attention_heads * self.decoder_attention_head_dim

    @property
    def rope_dim(self) -> int:
        return int(self.decoder_attention_head_dim * self.decoder_rope_dim_ratio)

    @property
    def tokens_chunk_size(self) -> int:
        """Latents per encoded clip (5 for 17 frames at ratio 4)."""
        return math.ceil(self.clip_length / self.temporal_ratio)

    @property
    def frame_pre_padding(self) -> int:
        """Pixel frames the decoder emits ahead of a clip's first real frame (3: 17 is 4*5 - 3)."""
        return (-self.clip_length) % self.temporal_ratio

    @property
    def token_overlap(self) -> int:
        """Extra latents each decode window reads past its chunk (2)."""
        return (-self.token_drop) % self.tokens_chunk_size

    @property
    def frame_overlap(self) -> int:
        """Pixel frames cross-faded between neighbouring decode windows (5)."""
        return max(self.token_overlap * self.temporal_ratio - self.frame_pre_padding, 0)

    def decode_plan(self, num_latents: int) -> tuple[int, int, int]:
        """(pad_latents, num_windows, num_frames) of decoding `num_latents` latents.

        Encoding dropped `token_drop` latents from the end, so decoding pretends they are there, pads with the
        last latent up to whole chunks, and cuts the extra frames off again.
        """
        cfg = self
        chunk, ratio = cfg.tokens_chunk_size, cfg.temporal_ratio
        tokens = num_latents + cfg.token_drop
        pad = (-tokens) % chunk
        windows = (tokens + pad) // chunk - int(cfg.token_drop > 0)
        if windows < 1:
            raise ValueError(f"{num_latents} latent frames are too few to decode (the reference cannot either)")
        padded = num_latents + pad
        frames, tail = 0, 0
        for i in range(windows):
            clip_frames = max(0, min(padded, i * chunk + chunk + cfg.token_overlap) - i * chunk) * ratio
            for j in range(int(cfg.token_drop > 0) + 1):
                part = max(0, min(chunk * ratio, clip_frames - j * chunk * ratio) - cfg.frame_pre_padding)
                if j == 0:
                    frames += part
                else:
                    tail = part
        frames += tail
        # A chunk's last latent covers only clip_length % ratio frames (1), the others `ratio` frames.
        intra = cfg.clip_length % ratio
        cut = sum(intra if intra and (num_latents + k) % chunk == 0 else ratio for k in range(pad))
        return pad, windows, frames - cut

    # Reader --------------------------------------------------------------------------------------------------
    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> VideoVAEConfig:
        """Build from a diffusers `vae/config.json` dict; unknown keys are an error, not ignored."""
        recipe = frozenset({"tile_size", "tile_overlap_min", "encoder_tiling", "decoder_tiling"})
        return from_diffusers_keys(cls, dict(config), "video VAE", exclude=recipe)


# ----------------------------------------------------------------------------------------------------------------
# Encoder: causal 3D CNN
# ----------------------------------------------------------------------------------------------------------------
class CausalConv3d(nn.Conv3d):
    """Conv3d with symmetric spatial padding (reflect in the release) and causal temporal padding: k_t - 1 zero
    frames in front, none behind, so latent t only sees frames <= its own."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: tuple[int, int, int] = (1, 1, 1), *, pad_mode: str):
        super().__init__(cin, cout, kernel, stride=stride, padding=0)
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor, spatial_pad: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        k = self.kernel_size[0]
        if spatial_pad is None:
            spatial_pad = (k // 2,) * 4
        if any(spatial_pad):
            x = F.pad(x, (*spatial_pad, 0, 0), mode=self.pad_mode)
        if k > 1:
            x = F.pad(x, (0, 0, 0, 0, k - 1, 0))
        return F.conv3d(x, self.weight, self.bias, self.stride)


def _frame_group_norm(norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    # Statistics per frame ("t-isolated"): fold time into batch so a frame never sees its neighbours, which is what
    # lets a single image encode the same way as the first frame of a clip.
    b, c, t, h, w = x.shape
    y = F.group_norm(x.transpose(1, 2).reshape(b * t, c, h, w), norm.num_groups, norm.weight, norm.bias, norm.eps)
    return y.reshape(b, t, c, h, w).transpose(1, 2)


class ResnetBlock3d(nn.Module):
    def __init__(self, cin: int, cout: int, cfg: VideoVAEConfig):
        super().__init__()
        g, eps, mode = cfg.norm_num_groups, cfg.norm_eps, cfg.spatial_padding_mode
        self.norm1 = nn.GroupNorm(g, cin, eps=eps)
        self.conv1 = CausalConv3d(cin, cout, 3, pad_mode=mode)
        self.norm2 = nn.GroupNorm(g, cout, eps=eps)
        self.conv2 = CausalConv3d(cout, cout, 3, pad_mode=mode)
        self.nin_shortcut = CausalConv3d(cin, cout, 1, pad_mode=mode) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(_frame_group_norm(self.norm1, x)))
        h = self.conv2(F.silu(_frame_group_norm(self.norm2, h)))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class Downsample3d(nn.Module):
    def __init__(self, channels: int, stride_t: int, cfg: VideoVAEConfig):
        super().__init__()
        self.conv = CausalConv3d(channels, channels, 3, (stride_t, 2, 2), pad_mode=cfg.spatial_padding_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pad one pixel bottom/right only, so an even size halves exactly and tiles stay latent-aligned.
        return self.conv(x, spatial_pad=(0, 1, 0, 1))


class DownLevel(nn.Module):
    def __init__(self, cin: int, cout: int, level: int, cfg: VideoVAEConfig):
        super().__init__()
        self.block = nn.ModuleList(
            [ResnetBlock3d(cin if j == 0 else cout, cout, cfg) for j in range(cfg.layers_per_block)]
        )
        s, t = cfg.spatial_downsample_factors[level], cfg.temporal_downsample_factors[level]
        self.downsample = Downsample3d(cout, t, cfg) if s * t > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        return x if self.downsample is None else self.downsample(x)


class Encoder3d(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        chans = cfg.block_out_channels
        mode = cfg.spatial_padding_mode
        self.conv_in = CausalConv3d(cfg.in_channels, chans[0], 3, pad_mode=mode)
        ins = (chans[0], *chans[:-1])
        self.down = nn.ModuleList([DownLevel(ins[i], chans[i], i, cfg) for i in range(len(chans))])
        self.norm_out = nn.GroupNorm(cfg.norm_num_groups, chans[-1], eps=cfg.norm_eps)
        self.conv_out = CausalConv3d(chans[-1], 2 * cfg.latent_channels, 3, pad_mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, 3, T, H, W) -> (B, 2C, ceil(T/4), H/16, W/16)
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        return self.conv_out(F.silu(_frame_group_norm(self.norm_out, x)))


# ----------------------------------------------------------------------------------------------------------------
# Decoder: ViT over latent voxels
# ----------------------------------------------------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def qk_reference(
    q: torch.Tensor, k: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's qk-norm, per head, no affine, in fp32 whatever the compute dtype and back to it (as the
    reference does), then the rotary: q, k (B, S, nh, hd) views of the fused projection."""
    q = _rms_norm(q.float(), None, eps).to(q.dtype)
    k = _rms_norm(k.float(), None, eps).to(k.dtype)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def residual_reference(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The block's residual add: x + y * scale (fp32 x and scale: the stream stays fp32)."""
    return x + y * scale


def swiglu_reference(f: torch.Tensor) -> torch.Tensor:
    """up * silu(gate) of the feed-forward's first projection, its rows `[gate | up]`."""
    gate, up = f.chunk(2, dim=-1)
    return up * F.silu(gate)


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A block's input norm: rms_norm of the stream in fp32 with its fp32 weight (under autocast the projection that
    reads it casts it to the compute dtype)."""
    return _rms_norm(x.float(), weight, eps)


def residual_norm_reference(
    x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm of its result that feeds the next projection: (x + y * scale, its norm)."""
    x = residual_reference(x, y, scale)
    return x, norm_reference(x, weight, eps)


QkPass = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ResidualNormPass = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


@dataclass(frozen=True)
class DecoderPasses:
    """The decoder blocks' passes around their projections and attention: the plain ops (`REFERENCE_PASSES`), or
    kernels computing the same numbers set from outside (`h3serve.accel.vae`). A norm's output may come in the
    dtype its projection computes in (what autocast would cast it to) instead of fp32: the same numbers."""

    qk: QkPass  # (q, k, eps, cos, sin) -> q, k normed and rotated
    residual: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # the last block's second add
    swiglu: Callable[[torch.Tensor], torch.Tensor]
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # the first block's first norm
    residual_norm: ResidualNormPass  # every other add and the norm that follows it


REFERENCE_PASSES = DecoderPasses(
    qk=qk_reference,
    residual=residual_reference,
    swiglu=swiglu_reference,
    norm=norm_reference,
    residual_norm=residual_norm_reference,
)


class Attention(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        dim = cfg.decoder_dim
        self.heads = cfg.decoder_num_attention_heads
        self.head_dim = cfg.decoder_attention_head_dim
        self.eps = cfg.decoder_norm_eps
        # Rows are per-head interleaved, [h0: q k v, h1: q k v, ...], as the original checkpoint stores them.
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)
        self.kernel: AttentionKernel = sdpa  # set from outside (`h3serve.accel.apply`)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, passes: DecoderPasses = REFERENCE_PASSES
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, s, self.heads, 3 * self.head_dim).chunk(3, dim=-1)  # (B, S, nh, hd)
        q, k = passes.qk(q, k, self.eps, cos, sin)
        return self.to_out(attention(q, k, v, kernel=self.kernel).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        dim, hidden = cfg.decoder_dim, cfg.decoder_dim * cfg.decoder_ffn_mult
        self.w1 = nn.Linear(dim, 2 * hidden)  # rows [gate; up]
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, passes: DecoderPasses = REFERENCE_PASSES) -> torch.Tensor:
        return self.w2(passes.swiglu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        dim = cfg.decoder_dim
        self.eps = cfg.decoder_norm_eps
        self.norm1 = nn.RMSNorm(dim, eps=self.eps)
        self.attn = Attention(cfg)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = nn.RMSNorm(dim, eps=self.eps)
        self.ff = FeedForward(cfg)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        passes: DecoderPasses = REFERENCE_PASSES,
        next_norm: nn.RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the residual stream, h: `norm1(x)` (made by the add before it). Returns the stream and, when a next
        block's `next_norm` is given, its norm of it; the add and the norm after it are one pass
        (`passes.residual_norm`). The stream stays fp32 (scale1/2 are fp32) and norms run in fp32; under autocast
        only the projections and attention drop to fp16."""
        x, h = passes.residual_norm(x, self.attn(h, cos, sin, passes), self.scale1, self.norm2.weight, self.eps)
        f = self.ff(h, passes)
        if next_norm is None:
            return passes.residual(x, f, self.scale2), None
        return passes.residual_norm(x, f, self.scale2, next_norm.weight, self.eps)


class ViTDecoder3d(nn.Module):
    """One token per latent voxel plus registers and a zero token, full self-attention, then each token expands
    to a (t4, h16, w16) pixel patch."""

    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        dim = cfg.decoder_dim
        self.cfg = cfg
        self.x_embedder = nn.Linear(cfg.latent_channels, dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.decoder_num_register_tokens, dim))
        # Masked-autoencoding training leftover: never read, but the original checkpoint stores it.
        self.register_buffer("mask_token", torch.zeros(1, 1, dim))
        self.transformer_blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.decoder_num_layers)])
        self.norm_out = nn.LayerNorm(dim, eps=cfg.decoder_norm_eps)
        patch = cfg.out_channels * cfg.temporal_ratio * cfg.spatial_ratio**2
        self.proj_out = nn.Linear(dim, patch)
        self.passes = REFERENCE_PASSES  # set from outside (`h3serve.accel.vae`)

    def _rotary(self, t: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Voxel centres normalised to (-1, 1) per axis; registers and the zero token sit at the origin.
        grids = [2.0 * (torch.arange(0.5, n, dtype=torch.float32, device=device) / n) - 1.0 for n in (t, h, w)]
        pos = torch.stack(torch.meshgrid(*grids, indexing="ij"), dim=-1).flatten(0, 2)  # (T*H*W, 3)
        pos = torch.cat([pos, pos.new_zeros(self.cfg.decoder_num_register_tokens + 1, 3)])  # (S, 3)
        inv_freq = 1.0 / self.cfg.decoder_rope_theta ** torch.arange(
            0, 1, 6 / self.cfg.rope_dim, dtype=torch.float32, device=device
        )
        return rotary_table((2.0 * math.pi * pos[:, :, None] * inv_freq).flatten(1))  # (S, rope_dim) each

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = z.shape  # (B, C, T, h, w) latents
        x = self.x_embedder(z.permute(0, 2, 3, 4, 1).reshape(b, t * h * w, c))  # (B, N, dim)
        regs = self.register_tokens.expand(b, -1, -1).to(x.dtype)
        x = torch.cat([x, regs, torch.zeros_like(x[:, :1])], dim=1)  # (B, N + R + 1, dim)
        cos, sin = self._rotary(t, h, w, z.device)
        blocks, passes = self.transformer_blocks, self.passes
        normed = passes.norm(x, blocks[0].norm1.weight, self.cfg.decoder_norm_eps)
        for i, block in enumerate(blocks):
            x, normed = block(x, normed, cos, sin, passes, blocks[i + 1].norm1 if i + 1 < len(blocks) else None)
        x = self.proj_out(self.norm_out(x)[:, : t * h * w])  # (B, N, 3*pt*p*p)
        pt, p, co = self.cfg.temporal_ratio, self.cfg.spatial_ratio, self.cfg.out_channels
        # Each token's patch to its place, in float32, in one copy (the cast is exact).
        out = x.new_empty((b, co, t * pt, h * p, w * p), dtype=torch.float32)  # (B, 3, 4T, 16h, 16w)
        out.view(b, co, t, pt, h, p, w, p).copy_(x.view(b, t, h, w, co, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7))
        return out


# ----------------------------------------------------------------------------------------------------------------
# Tiling: the spatial tiles both directions run on, and the linear blends that join tiles (and decode windows)
# ----------------------------------------------------------------------------------------------------------------
def split_tiles(length: int, tile: int, min_overlap: int, ratio: int) -> tuple[list[int], list[int]]:
    """Tile starts and the overlaps between consecutive tiles, in pixels.

    The fewest tiles that cover `length` with every overlap >= `min_overlap`; the slack is handed out round-robin
    in whole latents (`ratio` px), so every boundary stays latent-aligned. One tile when it already fits.
    """
    if tile >= length:
        return [0], []
    n = math.ceil(length / tile)
    while tile * n - min_overlap * (n - 1) < length:
        n += 1
    overlaps = [min_overlap] * (n - 1)
    for i in range((tile * n - sum(overlaps) - length) // ratio):
        overlaps[i % (n - 1)] += ratio
    starts = [0]
    for ov in overlaps:
        starts.append(starts[-1] + tile - ov)
    return starts, overlaps


def blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> None:
    """Linear cross-fade of the last `extent` entries of `a` into the first of `b` along `dim`, written over those of
    `b` (in place: no copy of the rest of `b`). The ramp starts at weight 1 for `a` (not 1 - 1/extent), as the
    reference's does."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    shape = [1] * b.ndim
    shape[dim] = extent
    pos = torch.arange(extent, device=b.device, dtype=b.dtype)
    wa, wb = (1 - pos / extent).view(shape), (pos / extent).view(shape)
    head = b.narrow(dim, 0, extent)
    head.copy_(a.narrow(dim, a.shape[dim] - extent, extent) * wa + head * wb)


def stitch_tiles(
    run_tile: Callable[[int, int], torch.Tensor],
    starts_y: list[int],
    overlaps_y: list[int],
    starts_x: list[int],
    overlaps_x: list[int],
    out_h: int,
    out_w: int,
) -> torch.Tensor:
    """Run tiles row by row and blend them into one canvas, holding only the overlap strips of neighbours.

    Same arithmetic as the reference, which keeps every raw tile and blends each tile with its *raw* upper and
    left neighbours (the left one not yet blended with its own upper neighbour). Keeping only those raw strips
    gives identical values while memory stays at one tile plus one row of strips, independent of the frame size.
    The blends are written over the tile's own edges, so a tile is copied once, into the canvas.
    """
    canvas: torch.Tensor | None = None
    upper: list[torch.Tensor] = []  # raw bottom strips of the previous tile row
    for i, y0 in enumerate(starts_y):
        lower: list[torch.Tensor] = []
        left: torch.Tensor | None = None  # raw right strip of the previous tile in this row
        for j, x0 in enumerate(starts_x):
            tile = run_tile(i, j).float()  # (..., th, tw), blended in place below
            if canvas is None:
                canvas = tile.new_empty(*tile.shape[:-2], out_h, out_w)
            # The raw strips the next row and the next tile blend with, taken before this tile's own blends.
            right = tile[..., :, -overlaps_x[j] :].clone() if j < len(starts_x) - 1 else None
            if i < len(starts_y) - 1:
                lower.append(tile[..., -overlaps_y[i] :, :].clone())
            if i > 0:
                blend(upper[j], tile, overlaps_y[i - 1], dim=-2)
            if j > 0:
                blend(left, tile, overlaps_x[j - 1], dim=-1)
            if i < len(starts_y) - 1:
                tile = tile[..., : -overlaps_y[i], :]
            if j < len(starts_x) - 1:
                tile = tile[..., :, : -overlaps_x[j]]
            canvas[..., y0 : y0 + tile.shape[-2], x0 : x0 + tile.shape[-1]] = tile
            left = right
            del tile
        upper = lower
    assert canvas is not None
    return canvas


@dataclass(frozen=True)
class TileGrid:
    """A window's spatial tiles: starts and overlaps in pixels (`split_tiles`), the tile's size in latents, and the
    canvas; one tile covering it all when untiled."""

    ratio: int
    starts_y: list[int]
    overlaps_y: list[int]
    starts_x: list[int]
    overlaps_x: list[int]
    tile_h: int  # latents
    tile_w: int
    height: int  # pixels
    width: int

    @classmethod
    def of(cls, cfg: VideoVAEConfig, h: int, w: int, tiled: bool) -> TileGrid:
        r = cfg.spatial_ratio
        if not tiled:
            return cls(r, [0], [], [0], [], h, w, h * r, w * r)
        # Tiles are laid out in pixels and mapped back onto the latent grid.
        ys, oys = split_tiles(h * r, cfg.tile_size, cfg.tile_overlap_min, r)
        xs, oxs = split_tiles(w * r, cfg.tile_size, cfg.tile_overlap_min, r)
        return cls(r, ys, oys, xs, oxs, min(cfg.tile_size, h * r) // r, min(cfg.tile_size, w * r) // r, h * r, w * r)

    @property
    def count(self) -> int:
        return len(self.starts_y) * len(self.starts_x)

    def latents(self, z: torch.Tensor, k: int) -> torch.Tensor:
        """Tile k's latents (row-major)."""
        i, j = divmod(k, len(self.starts_x))
        y, x = self.starts_y[i] // self.ratio, self.starts_x[j] // self.ratio
        return z[..., y : y + self.tile_h, x : x + self.tile_w]

    def stitch(self, tiles: Iterator[torch.Tensor]) -> torch.Tensor:
        """The next `count` tiles of `tiles` (row-major, float32) blended into one canvas (`stitch_tiles`)."""
        if self.count == 1:
            return next(tiles)
        return stitch_tiles(lambda _i, _j: next(tiles), self.starts_y, self.overlaps_y, self.starts_x,
                            self.overlaps_x, self.height, self.width)  # fmt: skip


PIXEL_MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics over [0, 1]
PIXEL_STD = (0.229, 0.224, 0.225)


def _pixel_stats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(PIXEL_MEAN, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=device).view(1, -1, 1, 1, 1)
    return mean, std


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class VideoVAE(nn.Module):
    """Encoder for keyframes and reference videos, decoder for the generated latents."""

    def __init__(self, cfg: VideoVAEConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.latent_channels
        self.encoder = Encoder3d(cfg)
        self.quant_conv = nn.Conv3d(2 * c, 2 * c, 1)
        self.post_quant_conv = nn.Conv3d(c, c, 1)
        self.decoder = ViTDecoder3d(cfg)
        # How many of a window's tiles the decoder runs as one batch (set from outside, `h3serve.accel.apply`): each
        # tile is still attended alone; whether a batch gives each tile's bits is the kernels' property (on CUDA
        # cuBLAS's and cuDNN's are row and batch invariant at the decoder's shapes: tests/test_gpu_decode.py).
        # `pipeline.video_decode` runs whole batches only: the tiles left over (fewer than tile_batch in a window, or
        # of a rank's share) go one at a time, so a decode runs batches of exactly these two sizes.
        self.tile_batch = 1

    # Pixel convention ---------------------------------------------------------------------------------------------
    # The encoder takes, and the decoder returns, ImageNet-normalised RGB (`pixel_norm_type: imagenet` in the
    # original config); these two convert from and to uint8 frames.
    @staticmethod
    def rgb_to_input(rgb: torch.Tensor) -> torch.Tensor:
        """uint8 RGB frames (B, F, H, W, 3) -> encoder input (B, 3, F, H, W), float32, ImageNet-normalised."""
        x = rgb.permute(0, 4, 1, 2, 3).float().div(255.0)
        mean, std = _pixel_stats(x.device)
        return (x - mean) / std

    @staticmethod
    def output_to_rgb(pixels: torch.Tensor) -> torch.Tensor:
        """Decoder output (B, 3, F, H, W), ImageNet-normalised -> uint8 RGB frames (B, F, H, W, 3), rounded.

        Works in place on a float32 `pixels`: at 1344x768x362 each full-size float32 copy would be ~4.5 GB.
        """
        mean, std = _pixel_stats(pixels.device)
        pixels = pixels.float().mul_(std).add_(mean).clamp_(0, 1).mul_(255).round_()
        return pixels.permute(0, 2, 3, 4, 1).to(torch.uint8)

    # Encode ---------------------------------------------------------------------------------------------------
    def _encode_clip(self, x: torch.Tensor, tiled: bool) -> torch.Tensor:
        if not tiled:
            return self.quant_conv(self.encoder(x))
        cfg, r = self.cfg, self.cfg.spatial_ratio
        h, w = x.shape[-2:]
        ys, oys = split_tiles(h, cfg.tile_size, cfg.tile_overlap_min, r)
        xs, oxs = split_tiles(w, cfg.tile_size, cfg.tile_overlap_min, r)
        th, tw = min(cfg.tile_size, h), min(cfg.tile_size, w)

        def run(i: int, j: int) -> torch.Tensor:
            tile = x[..., ys[i] : ys[i] + th, xs[j] : xs[j] + tw]
            return self.quant_conv(self.encoder(tile))

        return stitch_tiles(
            run,
            [y // r for y in ys],
            [o // r for o in oys],
            [s // r for s in xs],
            [o // r for o in oxs],
            h // r,
            w // r,
        )

    @torch.no_grad()
    def encode(self, x: torch.Tensor, *, tiled: bool | None = None) -> torch.Tensor:
        """Pixels (B, 3, F, H, W), ImageNet-normalised, fp32 -> posterior moments (B, 2C, T, H/16, W/16).

        F = 1 (an image) encodes alone to one latent: padding it to a clip would give 2 latents of 17 copies, not
        the conditioning H3 was trained with. Otherwise the frames are padded with the last frame to whole clips,
        each clip encodes to 5 latents, and the final `token_drop` latents are dropped.
        """
        cfg = self.cfg
        if x.ndim != 5 or x.shape[1] != cfg.in_channels:
            raise ValueError(f"expected pixels (B, {cfg.in_channels}, F, H, W), got {tuple(x.shape)}")
        r = cfg.spatial_ratio
        if x.shape[-2] % r or x.shape[-1] % r:
            raise ValueError(f"frame size {tuple(x.shape[-2:])} is not a multiple of the spatial ratio {r}")
        tiled = cfg.encoder_tiling if tiled is None else tiled
        x = x.float()
        n = x.shape[2]
        if n == 1:
            return self._encode_clip(x, tiled)
        if n % cfg.clip_length:
            x = torch.cat([x, x[:, :, -1:].expand(-1, -1, (-n) % cfg.clip_length, -1, -1)], dim=2)
        clips = [
            self._encode_clip(x[:, :, s : s + cfg.clip_length], tiled) for s in range(0, x.shape[2], cfg.clip_length)
        ]
        moments = torch.cat(clips, dim=2)
        return moments[:, :, : moments.shape[2] - cfg.token_drop]

    # Decode ---------------------------------------------------------------------------------------------------
    def check_decode(self, z: torch.Tensor, autocast_dtype: torch.dtype | None) -> None:
        """ValueError unless `z` are latents this decoder takes, under an autocast its weights' dtype allows."""
        cfg = self.cfg
        if z.ndim != 5 or z.shape[1] != cfg.latent_channels:
            raise ValueError(f"expected latents (B, {cfg.latent_channels}, T, h, w), got {tuple(z.shape)}")
        weights = self.decoder.proj_out.weight.dtype
        if weights != torch.float32 and autocast_dtype != weights:
            raise ValueError(f"the decoder's weights are {weights}: decode under autocast_dtype={weights}")

    @torch.no_grad()  # the tiles of a batch are views of one output, blended in place
    def decode_tiles(
        self, z: torch.Tensor, grid: TileGrid, ks: Iterable[int], autocast_dtype: torch.dtype | None
    ) -> list[torch.Tensor]:
        """Tiles `ks` (row-major) of one window's latents `z` (B, C, T, h, w), float32, decoded in one batch: float32
        pixels (B, 3, 4T, th, tw) each. Each tile's latents go through `post_quant_conv` alone (a 1x1x1 convolution:
        no batch to gain), then the decoder over them all, every tile its own sequence. Which tiles, of which
        window, in what batches: `pipeline.video_decode`."""
        with _autocast(z.device, autocast_dtype):
            latents = [self.post_quant_conv(grid.latents(z, k)) for k in ks]
            pixels = self.decoder(latents[0] if len(latents) == 1 else torch.cat(latents)).float()
        return list(pixels.split(z.shape[0]))


def check_tile_batch(batch: object) -> int:
    """`batch` as `VideoVAE.tile_batch` takes it (a positive int); ValueError otherwise."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"tile_batch must be a positive int, got {batch!r}")
    return batch


def posterior_sample(
    mean: torch.Tensor, logvar: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """mean + std * eps with eps drawn from `generator` (H3 uses a CPU generator seeded 42 for keyframes).

    The noise is drawn on the generator's device, so a CPU generator gives the same noise whatever device encodes.
    """
    std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
    noise_device = generator.device if generator is not None else mean.device
    eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=noise_device).to(mean.device)
    return mean + std * eps
