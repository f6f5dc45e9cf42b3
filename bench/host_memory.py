"""The host memory a render's frames take on the largest request (1344x768, 362 frames: 107 latents, 22 decode windows
of 28 tiles), held whole and then encoded (the engine before issue 41) against streamed into the encoder window by
window (`RenderContext.frames_to`, `media.mp4.Mp4Writer`: what `h3serve render` does now).

    PYTHONPATH=src python bench/host_memory.py --out bench/results/host_memory.json

Each way runs in a fresh process on the CPU, through the tiny model's video decoder (its frames are noise but of the
real size; the decoder's own memory is a few MB) and the real encoder; the record is the process's peak resident
memory above what it held before the decode. On a GPU the decode's float32 pixels live on the device, and the host
holds what this measures: the uint8 frames (whole: one (362, 768, 1344, 3) array, 1.12 GB; streamed: the windows
the encoder has not read yet, two at most) and the encoder's buffers. So the whole way copies each window's frames
into one preallocated array, as the engine's single copy to the host did, and the float32 pixels are never whole in
either way.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LATENTS, HEIGHT, WIDTH = 107, 768, 1344


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def one(mode: str, latents: int = LATENTS) -> dict:
    import numpy as np
    import torch

    from h3serve.media.mp4 import FPS, SAMPLE_RATE, Mp4Writer, write_mp4
    from h3serve.model.tiny import TINY_SEED, TINY_VIDEO_VAE, randomize
    from h3serve.model.video_vae import VideoVAE
    from h3serve.pipeline.video_decode import decode

    torch.set_num_threads(2)
    vae = randomize(VideoVAE(TINY_VIDEO_VAE), TINY_SEED + 1).eval()
    cfg = vae.cfg
    z = torch.randn(
        1, cfg.latent_channels, latents, HEIGHT // 16, WIDTH // 16, generator=torch.Generator().manual_seed(0)
    )
    frames_total = cfg.decode_plan(latents)[2]
    audio = np.zeros((2, round(frames_total / FPS * SAMPLE_RATE)), np.float32)
    rgb = lambda pixels: VideoVAE.output_to_rgb(pixels)[0].numpy()  # noqa: E731 (what pipeline.decode hands on)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.mp4"
        base = rss_mb()
        start = time.perf_counter()
        if mode == "whole":
            frames = np.empty((frames_total, HEIGHT, WIDTH, 3), np.uint8)
            pos = 0

            def keep(pixels: torch.Tensor) -> None:
                nonlocal pos
                part = rgb(pixels)
                frames[pos : pos + len(part)] = part
                pos += len(part)

            decode(vae, z, on_frames=keep)
            write_mp4(path, frames, audio)
        else:
            writer = Mp4Writer(path)
            writer.begin(audio, SAMPLE_RATE, FPS, WIDTH, HEIGHT)
            decode(vae, z, on_frames=lambda pixels: writer.put(rgb(pixels)))
            writer.finish()
        seconds = time.perf_counter() - start
        size = path.stat().st_size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    return {"frames": frames_total, "before_decode_mb": round(base, 1), "peak_mb": round(peak, 1),
            "above_before_mb": round(peak - base, 1), "seconds": round(seconds, 1), "mp4_bytes": size}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["whole", "streamed"], help=argparse.SUPPRESS)  # one way, in this process
    parser.add_argument(
        "--latents",
        type=int,
        default=LATENTS,
        help=f"latent frames decoded (default {LATENTS}: the largest request; fewer for a smoke run)",
    )
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(one(args.mode, args.latents)))
        return
    from lib.timing import run_header

    record: dict = {**run_header(None), "request": f"{WIDTH}x{HEIGHT}, {args.latents} latents", "ways": {}}
    for mode in ("whole", "streamed"):
        run = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--mode", mode, "--latents",
                              str(args.latents)], capture_output=True, text=True, check=True)  # fmt: skip
        record["ways"][mode] = json.loads(run.stdout.strip().splitlines()[-1])
        print(mode, record["ways"][mode], flush=True)
    ways = record["ways"]
    record["saved_mb"] = round(ways["whole"]["above_before_mb"] - ways["streamed"]["above_before_mb"], 1)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
