"""The engine's default CUDA profile on the tiny model: cuDNN attention everywhere (DiT, video decoder, audio VAE) and
regional compile, two renders of each of three different requests: identical twice, and no recompile after the first.

    PYTHONPATH=src python bench/cuda_profile_check.py --out bench/results/cuda_profile_check.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from lib.timing import run_header
from PIL import Image

from h3serve.accel.profile import Profile
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    profile = Profile.for_device("cuda")
    engine = Engine.load(None, profile)
    key = Image.new("RGB", (64, 48), (200, 40, 10))
    requests = [
        engine.validate(RequestFields("a fox", steps=6, seed=1)),
        engine.validate(
            RequestFields(
                "a longer prompt about a fox in the snow at night",
                task="i2va",
                keyframes=[key],
                width=256,
                height=128,
                num_frames=39,
                steps=6,
                seed=2,
            ),
        ),
        engine.validate(
            RequestFields("first and last", task="fl2va", keyframes=[key, key], width=160, height=96, steps=6, seed=3)
        ),
    ]
    runs = []
    for r in requests:
        start = time.perf_counter()
        one = engine.render(r)
        first_s = time.perf_counter() - start
        two = engine.render(r)
        runs.append({
            "task": r.task, "size": f"{r.width}x{r.height}", "frames": r.num_frames, "first_s": round(first_s, 2),
            "second_s": round(two.timings["total"], 3),
            "identical": bool(np.array_equal(one.frames, two.frames) and np.array_equal(one.audio, two.audio)),
        })  # fmt: skip
    record = {
        **run_header(),
        "profile": profile.__dict__,
        "runs": runs,
        "graphs": engine.compiled.graphs if engine.compiled else None,
        "recompiles": engine.compiled.recompiles if engine.compiled else None,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
