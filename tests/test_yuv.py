"""RGB -> yuv420p for the encoder (`media.yuv`): within one code value of FFmpeg's swscale (the converter the writer
used before) on every plane, smooth content and noise alike, exact on the values the standard fixes, and the same
bytes on any device (integer arithmetic; the CUDA case is in the GPU tier, tests/test_gpu_yuv.py)."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from h3serve.media.yuv import i420_rows, rgb_to_i420


def swscale(rgb: np.ndarray) -> np.ndarray:
    """FFmpeg's conversion of one (H, W, 3) frame, BT.709 limited range, packed as `rgb_to_i420` packs it."""
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    return frame.reformat(
        format="yuv420p", src_colorspace="ITU709", dst_colorspace="ITU709", dst_color_range="MPEG"
    ).to_ndarray()


def planes(packed: np.ndarray, h: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    flat = packed.reshape(-1).astype(np.int64)
    y, u, v = np.split(flat, [h * w, h * w * 5 // 4])
    return y.reshape(h, w), u.reshape(h // 2, w // 2), v.reshape(h // 2, w // 2)


def smooth(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([128 + 100 * np.sin(x / 17), 128 + 100 * np.cos(y / 11), (x + y) * 255 / (h + w)], -1)
    return rgb.round().astype(np.uint8)


@pytest.mark.parametrize(("h", "w"), [(8, 10), (10, 16), (64, 96), (96, 160), (62, 62), (192, 336)])
@pytest.mark.parametrize("content", ["noise", "smooth", "extremes"])
def test_within_one_code_value_of_swscale(h: int, w: int, content: str) -> None:
    rng = np.random.default_rng(h * w)
    if content == "noise":
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    elif content == "extremes":  # saturated colours at the corners of the cube: the largest chroma
        rgb = rng.choice(np.array([0, 255], np.uint8), (h, w, 3))
    else:
        rgb = smooth(h, w)
    ours = rgb_to_i420(torch.from_numpy(rgb[None])).numpy()[0]
    assert ours.shape == (i420_rows(h), w) == swscale(rgb).shape
    for name, a, b in zip("YUV", planes(ours, h, w), planes(swscale(rgb), h, w), strict=True):
        assert np.abs(a - b).max() <= 1, f"{name} differs from swscale by {np.abs(a - b).max()} at {h}x{w} {content}"


def test_the_values_the_standard_fixes_are_exact() -> None:
    """Black 16, white 235, a grey's chroma 128, and the primaries' BT.709 limited-range codes."""
    colours = np.array([[0, 0, 0], [255, 255, 255], [128, 128, 128], [255, 0, 0], [0, 255, 0], [0, 0, 255]], np.uint8)
    rgb = np.repeat(np.repeat(colours[:, None, None], 4, 1), 4, 2)  # (6, 4, 4, 3): each frame one colour
    out = rgb_to_i420(torch.from_numpy(rgb)).numpy()
    yuv = [tuple(int(p.reshape(-1)[0]) for p in planes(frame, 4, 4)) for frame in out]
    # BT.709: Y = 16 + 219 (.2126 R + .7152 G + .0722 B); Cb, Cr = 128 + 224 (B - Y') / 1.8556, (R - Y') / 1.5748.
    assert yuv == [(16, 128, 128), (235, 128, 128), (126, 128, 128), (63, 102, 240), (173, 42, 26), (32, 240, 118)]


def test_a_chunk_is_its_frames_converted_one_by_one_and_bad_input_is_refused() -> None:
    rgb = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (19, 16, 24, 3), dtype=np.uint8))
    whole = rgb_to_i420(rgb)  # more frames than one pass converts
    assert torch.equal(whole, torch.cat([rgb_to_i420(rgb[i : i + 1]) for i in range(19)]))
    with pytest.raises(ValueError, match=r"must be uint8 \(n, H, W, 3\) RGB, got torch.float32"):
        rgb_to_i420(rgb.float())
    with pytest.raises(ValueError, match="even and >= 2 for yuv420p, got H=15 W=24"):
        rgb_to_i420(rgb[:, :15])
