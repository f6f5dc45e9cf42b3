"""RGB -> YUV 4:2:0 (I420, BT.709, limited range) for the H.264 encoder, on whatever device the frames are on.

The conversion is integer arithmetic (16-bit fixed-point coefficients, int32 sums), so it gives the same bytes on a
GPU and on a CPU: a render that converts its frames on the GPU and one whose frames are converted in the writer make
byte-identical MP4s. It follows what FFmpeg's swscale does for rgb24 -> yuv420p at the same size (the converter
`media.mp4` used before, with BT.709 tables and limited range), and stays within one code value of it on every
plane, noise included (tests/test_yuv.py):
- luma per pixel;
- chroma from each pair of horizontally adjacent pixels averaged, then down the rows with the taps 1, 3, 3, 1 (a
  2:1 bilinear filter whose centre lies between two luma rows, the MPEG-2 chroma siting), the edge rows repeated.

`rgb_to_i420` returns each frame's three planes packed in one row of bytes, laid out as FFmpeg's yuv420p (Y, then
U, then V), shaped (n, H * 3 // 2, W) as `av.VideoFrame.from_ndarray(..., format="yuv420p")` takes it.
"""

from __future__ import annotations

import torch

# BT.709 luma weights.
_KR, _KB = 0.2126, 0.0722
_KG = 1.0 - _KR - _KB
_SHIFT = 16  # fixed-point fraction bits of the coefficients
# Limited range: luma 16..235 (219 steps), chroma 16..240 around 128 (224 steps).
_Y_SCALE = 219 / 255
_C_SCALE = 224 / 255
# Chroma taps: 2 across x 1, 3, 3, 1 down: 16 in all, 4 more fraction bits.
_TAP_BITS = 4
# Frames converted at once: bounds the int32 temporaries (about 24 bytes a pixel) on a GPU that is decoding.
_CHUNK = 8


def _fixed(weights: tuple[float, float, float], total: float) -> tuple[int, int, int]:
    """Coefficients in fixed point whose sum is exactly `total` in fixed point (grey stays grey: white is 235, a
    grey's chroma 128), the rounding error put on green, the largest."""
    r, b = (round(w * (1 << _SHIFT)) for w in (weights[0], weights[2]))
    return r, round(total * (1 << _SHIFT)) - r - b, b


_Y = _fixed((_KR * _Y_SCALE, _KG * _Y_SCALE, _KB * _Y_SCALE), _Y_SCALE)
_U = _fixed((-_KR * _C_SCALE / (2 * (1 - _KB)), -_KG * _C_SCALE / (2 * (1 - _KB)), _C_SCALE / 2), 0.0)
_V = _fixed((_C_SCALE / 2, -_KG * _C_SCALE / (2 * (1 - _KR)), -_KB * _C_SCALE / (2 * (1 - _KR))), 0.0)


def i420_rows(height: int) -> int:
    """Rows of one packed frame (`rgb_to_i420`'s second dimension) for frames `height` pixels high."""
    return height * 3 // 2


def rgb_to_i420(rgb: torch.Tensor) -> torch.Tensor:
    """(n, H, W, 3) uint8 RGB on any device -> (n, H * 3 // 2, W) uint8 packed yuv420p on the same device."""
    if rgb.dtype != torch.uint8 or rgb.ndim != 4 or rgb.shape[3] != 3:
        raise ValueError(f"frames to convert must be uint8 (n, H, W, 3) RGB, got {rgb.dtype} {tuple(rgb.shape)}")
    n, h, w, _ = rgb.shape
    if h < 2 or w < 2 or h % 2 or w % 2:
        raise ValueError(f"frames height and width must be even and >= 2 for yuv420p, got H={h} W={w}")
    out = torch.empty((n, h * w * 3 // 2), dtype=torch.uint8, device=rgb.device)
    for start in range(0, n, _CHUNK):
        part = rgb[start : start + _CHUNK]
        y, u, v = _planes(part)
        k = len(part)
        out[start : start + k, : h * w] = y.reshape(k, -1)
        out[start : start + k, h * w : h * w * 5 // 4] = u.reshape(k, -1)
        out[start : start + k, h * w * 5 // 4 :] = v.reshape(k, -1)
    return out.view(n, h * 3 // 2, w)


def _planes(rgb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = rgb.permute(0, 3, 1, 2).contiguous().to(torch.int32)  # (n, 3, H, W): each channel one contiguous plane
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    y = r * _Y[0]
    y.add_(g, alpha=_Y[1]).add_(b, alpha=_Y[2]).add_((16 << _SHIFT) + (1 << (_SHIFT - 1)))
    return y.bitwise_right_shift_(_SHIFT).to(torch.uint8), _chroma(r, g, b, _U), _chroma(r, g, b, _V)


def _chroma(r: torch.Tensor, g: torch.Tensor, b: torch.Tensor, k: tuple[int, int, int]) -> torch.Tensor:
    """One chroma plane (n, H/2, W/2): the pixel pairs summed across, then taps 1, 3, 3, 1 down (edges repeated)."""
    c = r * k[0]
    c.add_(g, alpha=k[1]).add_(b, alpha=k[2])  # (n, H, W), |c| < 2^23
    pairs = c[..., 0::2] + c[..., 1::2]  # (n, H, W/2)
    h = pairs.shape[1]
    padded = torch.cat([pairs[:, :1], pairs, pairs[:, -1:]], dim=1)  # row k is row k-1, clamped
    taps = padded[:, 0:h:2] + padded[:, 3 : h + 2 : 2]
    taps.add_(padded[:, 1 : h + 1 : 2] + padded[:, 2 : h + 2 : 2], alpha=3)  # |taps| < 2^27
    bits = _SHIFT + _TAP_BITS
    taps.add_((128 << bits) + (1 << (bits - 1))).bitwise_right_shift_(bits)
    return taps.clamp_(0, 255).to(torch.uint8)
