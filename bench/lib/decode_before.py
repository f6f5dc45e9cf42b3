"""The video decode as it was before issue 41 (main at 8d6725d, 2026-12-03): the reference the new decode is held to,
bit for bit, under the same autocast (bench/decode.py on the GPU, tests/test_decode_exact.py on the CPU).

It differs from today's decode (`pipeline.video_decode.decode`) in how it moves data, not in what it computes: the
blocks' plain ops one at a time (whatever `ViTDecoder3d.passes` holds), the patch layout reshaped in the compute dtype
and then copied to float32, tiles and windows cross-faded by concatenation (a new tensor per blend) and copied again
into the canvas and the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from h3serve.model.ops import attention
from h3serve.model.video_vae import TransformerBlock, VideoVAE, _autocast, qk_reference, split_tiles, swiglu_reference


def _blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    extent = min(a.shape[dim], b.shape[dim], extent)
    shape = [1] * b.ndim
    shape[dim] = extent
    pos = torch.arange(extent, device=b.device, dtype=b.dtype)
    wa, wb = (1 - pos / extent).view(shape), (pos / extent).view(shape)
    blended = a.narrow(dim, a.shape[dim] - extent, extent) * wa + b.narrow(dim, 0, extent) * wb
    return torch.cat([blended, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)


def _stitch(run_tile, starts_y, overlaps_y, starts_x, overlaps_x, out_h, out_w) -> torch.Tensor:
    canvas = None
    upper: list[torch.Tensor] = []
    for i, y0 in enumerate(starts_y):
        lower: list[torch.Tensor] = []
        left = None
        for j, x0 in enumerate(starts_x):
            raw = run_tile(i, j).float()
            if canvas is None:
                canvas = raw.new_empty(*raw.shape[:-2], out_h, out_w)
            tile = raw
            if i > 0:
                tile = _blend(upper[j], tile, overlaps_y[i - 1], dim=-2)
            if j > 0:
                tile = _blend(left, tile, overlaps_x[j - 1], dim=-1)
            if i < len(starts_y) - 1:
                lower.append(raw[..., -overlaps_y[i] :, :].clone())
                tile = tile[..., : -overlaps_y[i], :]
            if j < len(starts_x) - 1:
                left = raw[..., :, -overlaps_x[j] :].clone()
                tile = tile[..., :, : -overlaps_x[j]]
            canvas[..., y0 : y0 + tile.shape[-2], x0 : x0 + tile.shape[-1]] = tile
            del raw, tile
        upper = lower
    assert canvas is not None
    return canvas


def _block(block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A decoder block as it ran: the plain ops, one at a time."""
    attn, eps = block.attn, block.eps
    h = F.rms_norm(x.float(), (x.shape[-1],), block.norm1.weight, eps)
    b, s, _ = h.shape
    q, k, v = attn.to_qkv(h).view(b, s, attn.heads, 3 * attn.head_dim).chunk(3, dim=-1)
    q, k = qk_reference(q, k, attn.eps, cos, sin)
    x = x + attn.to_out(attention(q, k, v, kernel=attn.kernel).reshape(b, s, -1)) * block.scale1
    h = F.rms_norm(x.float(), (x.shape[-1],), block.norm2.weight, eps)
    return x + block.ff.w2(swiglu_reference(block.ff.w1(h))) * block.scale2


def _decoder(vae: VideoVAE, z: torch.Tensor) -> torch.Tensor:
    dec = vae.decoder
    b, c, t, h, w = z.shape
    x = dec.x_embedder(z.permute(0, 2, 3, 4, 1).reshape(b, t * h * w, c))
    regs = dec.register_tokens.expand(b, -1, -1).to(x.dtype)
    x = torch.cat([x, regs, torch.zeros_like(x[:, :1])], dim=1)
    cos, sin = dec._rotary(t, h, w, z.device)
    for block in dec.transformer_blocks:
        x = _block(block, x, cos, sin)
    x = dec.proj_out(dec.norm_out(x)[:, : t * h * w])
    pt, p, co = dec.cfg.temporal_ratio, dec.cfg.spatial_ratio, dec.cfg.out_channels
    x = x.view(b, t, h, w, co, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, co, t * pt, h * p, w * p)


def decode_window_before(vae: VideoVAE, z: torch.Tensor, autocast_dtype: torch.dtype | None, tiled: bool | None = None):
    """One window of latents (no padding, no cross-fade), as `VideoVAE._decode_clip` decoded it then."""
    cfg, r = vae.cfg, vae.cfg.spatial_ratio
    tiled = cfg.decoder_tiling if tiled is None else tiled

    def run_untiled(zt: torch.Tensor) -> torch.Tensor:
        with _autocast(zt.device, autocast_dtype):
            return _decoder(vae, vae.post_quant_conv(zt))

    z = z.float()
    if not tiled:
        return run_untiled(z).float()
    h, w = z.shape[-2] * r, z.shape[-1] * r
    ys, oys = split_tiles(h, cfg.tile_size, cfg.tile_overlap_min, r)
    xs, oxs = split_tiles(w, cfg.tile_size, cfg.tile_overlap_min, r)
    th, tw = min(cfg.tile_size, h) // r, min(cfg.tile_size, w) // r

    def run(i: int, j: int) -> torch.Tensor:
        return run_untiled(z[..., ys[i] // r : ys[i] // r + th, xs[j] // r : xs[j] // r + tw])

    return _stitch(run, ys, oys, xs, oxs, h, w)


@torch.no_grad()
def decode_before(
    vae: VideoVAE, z: torch.Tensor, autocast_dtype: torch.dtype | None, tiled: bool | None = None
) -> torch.Tensor:
    """The decode as it was (`VideoVAE.decode` then): latents (B, C, T, h, w) de-normalised -> pixels (B, 3, F, 16h,
    16w) float32."""
    cfg = vae.cfg
    z = z.float()
    pad, windows, num_frames = cfg.decode_plan(z.shape[2])
    if pad:
        z = torch.cat([z, z[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
    chunk, ratio = cfg.tokens_chunk_size, cfg.temporal_ratio
    span = chunk * ratio
    r = cfg.spatial_ratio
    out = z.new_empty(z.shape[0], cfg.out_channels, num_frames, z.shape[3] * r, z.shape[4] * r)
    pos = 0

    def emit(part: torch.Tensor) -> None:
        nonlocal pos
        n = min(part.shape[2], num_frames - pos)
        out[:, :, pos : pos + n] = part[:, :, :n]
        pos += n

    carry = None
    for i in range(windows):
        part = decode_window_before(
            vae, z[:, :, i * chunk : i * chunk + chunk + cfg.token_overlap], autocast_dtype, tiled
        )
        head = part[:, :, :span][:, :, cfg.frame_pre_padding :]
        if carry is not None:
            head = _blend(carry, head, cfg.frame_overlap, dim=2)
        emit(head)
        if cfg.token_drop > 0:
            carry = part[:, :, span : 2 * span][:, :, cfg.frame_pre_padding :].clone()
        del part, head
    if carry is not None:
        emit(carry)
    assert pos == num_frames, (pos, num_frames)
    return out
