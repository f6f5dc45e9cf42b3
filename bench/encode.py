"""The MP4 encode of the default request's video (1344x768, 124 frames, 5.17 s of stereo), today's writer beside the
new one's settings, on natural-looking content and on noise: seconds, bytes, PSNR and SSIM against the frames, and
whether two encodes of a setting are the same bytes. Then the colour conversion (on the GPU against swscale on one
host thread), and the tail a render waits for: frames arriving in decode windows at the decode's pace, the seconds
from the last window to the complete file.

    PYTHONPATH=src:bench python bench/encode.py --out bench/results/encode.json
    PYTHONPATH=src:bench python bench/encode.py --frames 22 --width 192 --height 128 --presets veryfast \
        --out /tmp/encode.json   # a smoke run (CPU too)

The encodes are the host's work (x264 on its cores): their seconds are wall time. "before" is the writer of
53e8fc5 (`lib.mp4_before`: swscale on the encoder's thread, x264 medium, 4 threads, one stream); every other row
is `media.mp4.encode_mp4` with an `Encoding`, fed packed yuv420p as a render hands it on. Natural-looking content: a
pan across a field with a natural image's spectrum (power ~ 1/f^2), a soft object crossing it, and a little grain.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from lib.mp4_before import write_mp4_before
from lib.timing import run_header

from h3serve.media.encoding import Encoding
from h3serve.media.mp4 import FrameStream, Mp4Writer, decode_frames, encode_mp4
from h3serve.media.yuv import rgb_to_i420
from h3serve.pipeline.decode import to_host

PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium")
# (name, segment frames, x264 threads per encoder); "one" takes every core of the host in one encoder.
LAYOUTS = (
    ("one", 0, 0),
    ("seg16x1", 16, 1),
    ("seg16x2", 16, 2),
    ("seg24x2", 24, 2),
    ("seg32x2", 32, 2),
    ("seg32x4", 32, 4),
    ("seg62x8", 62, 8),
)


def natural(frames: int, height: int, width: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """(F, H, W, 3) uint8: a pan (2.1 px a frame across, 0.6 down) over a 1/f field, a soft disc crossing, grain."""
    g = torch.Generator(device).manual_seed(seed)
    ch, cw = height + int(0.6 * frames) + 8, width + int(2.1 * frames) + 8
    fy = torch.fft.fftfreq(ch, device=device)[:, None]
    fx = torch.fft.rfftfreq(cw, device=device)[None, :]
    falloff = 1.0 / torch.sqrt(fx**2 + fy**2).clamp_min(1.0 / max(ch, cw))  # amplitude ~ 1/f: power ~ 1/f^2
    fields = []
    for _ in range(3):
        spectrum = torch.randn((ch, cw // 2 + 1), generator=g, device=device, dtype=torch.complex64) * falloff
        field = torch.fft.irfft2(spectrum, s=(ch, cw))
        fields.append((field - field.mean()) / field.std())
    lum, c1, c2 = fields
    canvas = torch.stack([lum + 0.35 * c1, lum - 0.2 * c1 + 0.2 * c2, lum - 0.35 * c2], -1) * 45 + 118
    yy = torch.arange(height, device=device, dtype=torch.float32)[:, None]
    xx = torch.arange(width, device=device, dtype=torch.float32)[None, :]
    out = torch.empty((frames, height, width, 3), dtype=torch.uint8, device=device)
    for t in range(frames):
        y0, x0 = int(0.6 * t), int(2.1 * t)
        frame = canvas[y0 : y0 + height, x0 : x0 + width].clone()
        cy, cx = height * (0.3 + 0.4 * t / frames), width * (0.8 - 0.6 * t / frames)
        disc = torch.sigmoid((min(height, width) * 0.12 - torch.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)) / 4)[..., None]
        frame = frame * (1 - disc) + disc * torch.tensor([200.0, 90.0, 60.0], device=device)
        frame += torch.randn(frame.shape, generator=g, device=device) * 1.5
        out[t] = frame.round().clamp(0, 255).to(torch.uint8)
    return out


def noise(frames: int, height: int, width: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(seed)
    return torch.randint(0, 256, (frames, height, width, 3), generator=g, device=device, dtype=torch.uint8)


def tone(seconds: float, sample_rate: int = 32000) -> np.ndarray:
    s = np.arange(round(seconds * sample_rate)) / sample_rate
    return np.stack([0.4 * np.sin(2 * np.pi * 440 * s), 0.3 * np.sin(2 * np.pi * 660 * s)]).astype(np.float32)


def quality(data: bytes, rgb: torch.Tensor, i420: np.ndarray) -> dict:
    """Against the frames: PSNR of the encoder's own planes (the file's yuv420p against what it was given: what the
    encode lost), PSNR in RGB (the file decoded as a player shows it: 4:2:0 loses much of noise's colour on top), and
    SSIM (luma, 11x11 Gaussian windows)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        planes = np.stack([f.to_ndarray() for f in container.decode(video=0)])  # (F, H * 3 // 2, W)
    decoded = torch.from_numpy(decode_frames(io.BytesIO(data))).to(rgb.device)
    a, b = decoded.float(), rgb.float()
    luma = torch.tensor([0.2126, 0.7152, 0.0722], device=rgb.device)
    return {"psnr_yuv_db": psnr(planes, i420), "psnr_rgb_db": psnr(decoded.cpu().numpy(), rgb.cpu().numpy()),
            "ssim_y": round(ssim(a @ luma, b @ luma), 5)}  # fmt: skip


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return round(10 * float(np.log10(255**2 / mse)), 3) if mse else float("inf")


def ssim(x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean SSIM of (F, H, W) luma in 0..255, Gaussian windows (11, sigma 1.5), the usual constants."""
    k = torch.exp(-((torch.arange(11, device=x.device) - 5.0) ** 2) / (2 * 1.5**2))
    k = (k / k.sum())[None, None]
    blur = lambda z: F.conv2d(F.conv2d(z[:, None], k[..., None]), k[:, :, None])[:, 0]  # noqa: E731
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    total = 0.0
    for i in range(0, x.shape[0], 16):
        a, b = x[i : i + 16], y[i : i + 16]
        ma, mb = blur(a), blur(b)
        va, vb, cov = blur(a * a) - ma**2, blur(b * b) - mb**2, blur(a * b) - ma * mb
        s = ((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2))
        total += s.sum().item() / s[0].numel()
    return total / x.shape[0]


def encode_new(i420: np.ndarray, width: int, height: int, audio: np.ndarray, encoding: Encoding) -> tuple[float, bytes]:
    stream = FrameStream(width, height, depth=0)
    for start in range(0, len(i420), 31):  # decode-window-sized chunks, as a render hands them on
        stream.put(i420[start : start + 31])
    stream.close()
    buffer = io.BytesIO()
    start = time.perf_counter()
    encode_mp4(buffer, stream, audio, encoding=encoding)
    return time.perf_counter() - start, buffer.getvalue()


def encode_before(rgb: np.ndarray, audio: np.ndarray) -> tuple[float, bytes]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "before.mp4"
        start = time.perf_counter()
        write_mp4_before(path, [rgb], audio, rgb.shape[2], rgb.shape[1])
        return time.perf_counter() - start, path.read_bytes()


def tail(frames: np.ndarray, width: int, height: int, audio: np.ndarray, pace_s: float, encoding: Encoding | None,
         rgb: np.ndarray) -> dict:  # fmt: skip
    """Frames put in 4 windows `pace_s` apart (the decode's pace) into a writer on its own thread, as a render's
    `Mp4Writer`; the seconds from the last window to the complete file. encoding None: today's writer, whose frames
    were RGB and whose encode began with the first window as this one's does."""
    windows = np.array_split(np.arange(len(frames)), 4)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "out.mp4"
        if encoding is None:  # today's writer fed as it was: a stream of RGB chunks into its one encoder
            stream = FrameStream(width, height, depth=0)
            thread = threading.Thread(target=write_mp4_before, args=(path, stream, audio, width, height))
            thread.start()
            put, source = stream.put, rgb

            def finish() -> None:
                stream.close()
                thread.join()

        else:
            writer = Mp4Writer(path, encoding=encoding)
            writer.begin(audio, 32000, 24, width, height)
            put, source, finish = writer.put, frames, writer.finish
        started = time.perf_counter()
        for rows in windows:
            time.sleep(pace_s)
            put(source[rows])
        last = time.perf_counter()
        finish()
        end = time.perf_counter()
    return {"decode_s": round(last - started, 3), "tail_s": round(end - last, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frames", type=int, default=124)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--presets", type=lambda v: v.split(","), default=list(PRESETS))
    parser.add_argument("--contents", type=lambda v: v.split(","), default=["natural", "noise"])
    parser.add_argument("--repeats", type=int, default=2, help="encodes of each setting (the bytes compared)")
    parser.add_argument("--pace", type=float, default=0.97, help="seconds between decode windows in the tail run")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cores = os.cpu_count() or 1
    record: dict = {**run_header(device), "cores": cores, "shape": [args.frames, args.height, args.width],
                    "contents": {}, "conversion": {}}  # fmt: skip
    audio = tone(args.frames / 24)
    for content, make in ((c, {"natural": natural, "noise": noise}[c]) for c in args.contents):
        rgb_dev = make(args.frames, args.height, args.width, device)
        rgb = rgb_dev.cpu().numpy()
        i420 = to_host(rgb_to_i420(rgb_dev))
        rows: dict = {}
        seconds, data = encode_before(rgb, audio)
        rows["before"] = {"s": round(seconds, 3), "bytes": len(data), **quality(data, rgb_dev, swscale(rgb))}
        print(content, "before", rows["before"], flush=True)
        for preset in args.presets:
            for name, segment, threads in LAYOUTS:
                encoding = Encoding(preset=preset, segment=segment, threads=threads or min(cores, 64))
                runs = [encode_new(i420, args.width, args.height, audio, encoding) for _ in range(args.repeats)]
                data = runs[0][1]
                row = {"s": round(min(s for s, _ in runs), 3), "bytes": len(data),
                       "same_bytes": all(d == data for _, d in runs), "threads": encoding.threads,
                       "workers": encoding.concurrency, **quality(data, rgb_dev, i420)}  # fmt: skip
                row["speedup"] = round(rows["before"]["s"] / row["s"], 2)
                rows[f"{preset}/{name}"] = row
                print(content, preset, name, row, flush=True)
                args.out.write_text(json.dumps(record | {"contents": record["contents"] | {content: rows}}, indent=1))
        # The bytes do not follow the workers: the default setting with 1 worker and with every core.
        default = Encoding()
        one_worker = encode_new(i420, args.width, args.height, audio, Encoding(workers=1))
        rows["default_workers_1"] = {"s": round(one_worker[0], 3),
                                     "same_bytes_as_default": one_worker[1] == encode_new(
                                         i420, args.width, args.height, audio, default)[1]}  # fmt: skip
        rows["tail"] = {
            "before": tail(i420, args.width, args.height, audio, args.pace, None, rgb),
            "default": tail(i420, args.width, args.height, audio, args.pace, default, rgb),
        }
        print(content, "tail", rows["tail"], flush=True)
        record["contents"][content] = rows
        if content == args.contents[0]:
            record["conversion"] = conversion(rgb_dev, rgb)
            print("conversion", record["conversion"], flush=True)
        args.out.write_text(json.dumps(record, indent=1))


def swscale(rgb: np.ndarray) -> np.ndarray:
    """FFmpeg's conversion, one frame at a time on this thread (what the writer of 53e8fc5 did): packed yuv420p."""
    import av

    return np.stack([
        av.VideoFrame.from_ndarray(frame, format="rgb24").reformat(
            format="yuv420p", src_colorspace="ITU709", dst_colorspace="ITU709", dst_color_range="MPEG"
        ).to_ndarray()
        for frame in rgb
    ])  # fmt: skip


def conversion(rgb_dev: torch.Tensor, rgb: np.ndarray) -> dict:
    """The frames to yuv420p: on the device (CUDA events) and through page-locked memory to the host, against swscale
    one frame at a time on one host thread (what the writer did); the device's bytes against the host's."""
    out: dict = {}
    if rgb_dev.is_cuda:
        rgb_to_i420(rgb_dev[:2])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        converted = rgb_to_i420(rgb_dev)
        end.record()
        torch.cuda.synchronize()
        out["device_ms"] = round(start.elapsed_time(end), 2)
        begin = time.perf_counter()
        host = to_host(converted)
        out["to_host_ms"] = round((time.perf_counter() - begin) * 1e3, 2)
        cpu = rgb_to_i420(torch.from_numpy(rgb)).numpy()
        out["device_equals_host_conversion"] = bool(np.array_equal(host, cpu))
    begin = time.perf_counter()
    swscale(rgb)
    out["swscale_one_thread_ms"] = round((time.perf_counter() - begin) * 1e3, 2)
    return out


if __name__ == "__main__":
    main()
