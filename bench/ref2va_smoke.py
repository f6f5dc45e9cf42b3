"""Full-size Ref2VA smoke run on one GPU: the Ref2VA DiT at the released configuration (random weights), a realistic
reference set (3 images, 1 video with sound), through `Engine` with the default CUDA profile (cuDNN attention,
regional compile, CUTLASS FP8 block linears). Stage times, the packed sequence's size and peak memory; the render
runs twice (the first compiles) and the second must equal the first. Not a benchmark: no peer runs here.

    PYTHONPATH=src:bench python bench/ref2va_smoke.py --out bench/results/ref2va_smoke.json
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import av
import numpy as np
import torch
from lib.models import build, t2va_prompt
from lib.timing import run_header
from PIL import Image

from h3serve.accel.profile import Profile
from h3serve.model.components import Components
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.layout import MediaGeometry, build_ref2va_layout
from h3serve.pipeline.references import reference_descriptors
from h3serve.pipeline.request import RequestFields


def image_file(seed: int, width: int, height: int) -> bytes:
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    pixels = np.clip(ramp + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def video_file(seconds: float = 3.0, fps: int = 30, size: tuple[int, int] = (640, 480), rate: int = 44100) -> bytes:
    """An H.264 + AAC stereo MP4: moving gradients and a two-tone sound."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = size[0], size[1], "yuv420p"
        audio = container.add_stream("aac", rate=rate, layout="stereo")
        x = np.linspace(0, 1, size[0], dtype=np.float32)[None, :]
        y = np.linspace(0, 1, size[1], dtype=np.float32)[:, None]
        for i in range(int(seconds * fps)):
            t = i / fps
            rgb = np.stack([x + 0 * y + t, y + 0 * x, (x + y) / 2 + t / 2], -1) % 1.0
            frame = av.VideoFrame.from_ndarray((rgb * 255).astype(np.uint8), format="rgb24")
            container.mux(video.encode(frame))
        n = int(seconds * rate)
        t = np.arange(n, dtype=np.float32) / rate
        wave = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
        for start in range(0, n, 1024):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start : start + 1024]), format="fltp",
                                               layout="stereo")  # fmt: skip
            chunk.sample_rate = rate
            container.mux(audio.encode(chunk))
        container.mux(video.encode())
        container.mux(audio.encode())
    return buffer.getvalue()


def describe(ref) -> dict:
    shape = {name: None if v is None else list(v.shape) for name, v in (("pixels", ref.pixels), ("audio", ref.audio))}
    return {"kind": ref.kind, **shape}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--blocks", type=int, help="DiT main blocks (default: the released 50); fewer for a smoke run")
    args = parser.parse_args()
    device = torch.device("cuda")
    start = time.perf_counter()
    full = build(device, args.blocks)
    # The same architecture as the FL2VA DiT, loaded as the Ref2VA one (random weights either way).
    components = Components(
        dit=None, ref_dit=full.dit, text_encoder=full.text_encoder, video_vae=full.video_vae,
        audio_vae=full.audio_vae, name="full-size random (Ref2VA)",
    )  # fmt: skip
    del full
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    engine = Engine(components, Profile.for_device("cuda"))
    references = [
        ("square.jpg", image_file(1, 1024, 1024)),
        ("landscape.jpg", image_file(2, 1600, 900)),
        ("portrait.jpg", image_file(3, 900, 1200)),
        ("clip.mp4", video_file()),
    ]
    request = engine.validate(
        RequestFields(t2va_prompt(), task="ref2va", width=768, height=448, num_frames=56, steps=args.steps, seed=42,
        references=references),
    )  # fmt: skip
    blocks = reference_descriptors(request.references)
    layout = build_ref2va_layout([1], blocks, MediaGeometry.from_pixels(448, 768, 56))
    record: dict = {
        **run_header(),
        "request": "ref2va 768x448, 56 frames, seed 42, the guide's T2VA prompt; references: 1024x1024, 1600x900 and "
        "900x1200 JPEGs, a 3 s 640x480 30 fps H.264 clip with 44.1 kHz stereo AAC",
        "profile": Profile.for_device("cuda").__dict__,
        "steps_grid_points": args.steps,
        "build_s": round(build_s, 1),
        "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
        "references": [describe(r) for r in request.references],
        "rows": {
            "reference_video": layout.num_reference_video_rows,
            "reference_audio": layout.num_reference_audio_rows,
            "target_video": layout.num_video_rows,
            "target_audio": layout.num_audio_rows,
            "without_text": int(layout.token_tags.numel()) - 1,
        },
        "runs": {},
    }
    outputs = []
    for name in ("first (compiles)", "second"):
        torch.cuda.reset_peak_memory_stats()
        result = engine.render(request)
        outputs.append(result)
        record["runs"][name] = {
            "frames": list(result.frames.shape),
            "audio": list(result.audio.shape),
            "frames_varied": bool(result.frames.std() > 0),
            "audio_finite": bool(np.isfinite(result.audio).all()),
            "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(name, record["runs"][name], flush=True)
    a, b = outputs
    record["second_identical_to_first"] = bool(np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio))
    record["graphs"], record["recompiles"] = engine.compiled.graphs, engine.compiled.recompiles
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
