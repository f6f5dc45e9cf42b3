"""Full-size smoke run on one GPU: every component at the released configuration, random weights, through `Engine`.

No released weights exist on the GPU machine, so this checks what can be checked without them: that the released
shapes run end to end through our own code (tokenizer and 50-layer Qwen3-VL text encoder with its vision tower,
layout, 33 B-parameter DiT, tiled video VAE decode, BigVGAN audio decode), that everything fits in the GPU's memory
at once, and how long each stage takes with plain eager PyTorch. Not a benchmark: no peer runs here.

    PYTHONPATH=src python bench/full_size_smoke.py --out bench/results/full_size_smoke.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from lib.models import build, t2va_prompt
from lib.timing import run_header
from PIL import Image

from h3serve.accel.profile import Profile
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--blocks", type=int, help="DiT main blocks (default: the released 50); fewer for a smoke run")
    args = parser.parse_args()
    device = torch.device("cuda")
    start = time.perf_counter()
    components = build(device, args.blocks)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    weights_gib = torch.cuda.memory_allocated() / 2**30
    engine = Engine(components, Profile.for_device("cuda"))
    rng = np.random.default_rng(0)
    keyframe = Image.fromarray(rng.integers(0, 255, (448, 768, 3), dtype=np.uint8))
    runs = {}
    for task, keyframes in (("t2va", []), ("t2va", []), ("i2va", [keyframe])):
        request = engine.validate(
            RequestFields(
                t2va_prompt(),
                task=task,
                width=768,
                height=448,
                num_frames=56,
                steps=args.steps,
                seed=42,
                keyframes=keyframes,
            ),
        )
        torch.cuda.reset_peak_memory_stats()
        result = engine.render(request)
        key = task if task not in runs else f"{task}_again"
        runs[key] = {
            "frames": list(result.frames.shape),
            "audio": list(result.audio.shape),
            "frames_finite_and_varied": bool(result.frames.std() > 0),
            "audio_finite": bool(np.isfinite(result.audio).all()),
            "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "_frames": result.frames,
            "_audio": result.audio,
        }
    runs["t2va_again"]["identical_to_first"] = bool(
        np.array_equal(runs["t2va"]["_frames"], runs["t2va_again"]["_frames"])
        and np.array_equal(runs["t2va"]["_audio"], runs["t2va_again"]["_audio"])
    )
    for run in runs.values():
        run.pop("_frames"), run.pop("_audio")
    record = {
        **run_header(),
        "request": "768x448, 56 frames, seed 42, the guide's T2VA case prompt; i2va adds one 768x448 keyframe",
        "steps_grid_points": args.steps,
        "build_s": round(build_s, 1),
        "weights_gib": round(weights_gib, 2),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
