"""Step caching at the reference shape with full-size random weights: a 20-grid-point render (19 DiT forwards) with
full compute (quality=lossless), the seed's balanced DBCache profile (the server's, below) and the conservative
`quality=high` profile, in one process on one engine (default CUDA profile: cuDNN attention, regional compile,
CUTLASS FP8). One warm-up render first (compile). Reports the denoise time, the forwards each cached and the speedup.

Random weights say nothing about visual quality: these numbers are speed only. The cache is lossy.

    PYTHONPATH=src:bench python bench/stepcache.py --out bench/results/stepcache.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from lib.models import build, t2va_prompt
from lib.timing import run_header

from h3serve.accel.profile import Profile
from h3serve.accel.stepcache import HIGH_QUALITY, parse_cache_config
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

# The seed's one-Spark "balanced" profile: its users measured about 1.38x at an SSIM of 0.81-0.88 on real weights
# (public joeynyc/MiniMax-H3-DGX-Spark, docs/RESULTS.md; docs/operators.md).
BALANCED = (
    '{"Fn_compute_blocks":1,"Bn_compute_blocks":0,"max_warmup_steps":4,"max_cached_steps":-1,'
    '"residual_diff_threshold":0.10,"max_continuous_cached_steps":1,"enable_taylorseer":false}'
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a dry run of the script's plumbing on the CPU")
    parser.add_argument("--blocks", type=int, help="DiT main blocks (default: the released 50); fewer for a smoke run")
    args = parser.parse_args()
    if args.blocks is not None and args.blocks < 2:
        parser.error("--blocks: at least 2 (the balanced cache computes the first block and caches the rest)")
    balanced = parse_cache_config(BALANCED)
    if args.tiny:
        engine = Engine.load(None, Profile.for_device("cpu"), step_cache=balanced)
        shape = {}
    else:
        engine = Engine(build(torch.device("cuda"), args.blocks), Profile.for_device("cuda"), step_cache=balanced)
        shape = dict(width=768, height=448, num_frames=56)
    record: dict = {
        **run_header(),
        "request": f"t2va {shape or 'tiny default'}, {args.steps} grid points, seed 42, the guide's T2VA prompt",
        "profile": engine.profile.__dict__,
        "balanced": json.loads(BALANCED),
        "conservative (quality=high)": HIGH_QUALITY.__dict__,
        "runs": {},
    }

    def render(quality):
        request = engine.validate(RequestFields(t2va_prompt(), steps=args.steps, seed=42, quality=quality, **shape))
        return engine.render(request)

    render("lossless")  # compiles
    results = {}
    for name, quality in (("full compute", "lossless"), ("balanced", None), ("conservative", "high")):
        result = render(quality)
        results[name] = result
        report = result.step_cache
        record["runs"][name] = {
            "quality": quality,
            "denoise_s": round(result.timings["denoise"], 3),
            "total_s": round(result.timings["total"], 3),
            "forwards": report.forwards,
            "cached_forwards": list(report.cached),
            "num_cached": report.num_cached,
            "residual_diffs": {k: round(v, 4) for k, v in report.residual_diffs.items()},
        }
        print(name, record["runs"][name], flush=True)
    full = record["runs"]["full compute"]["denoise_s"]
    for name in ("balanced", "conservative"):
        record["runs"][name]["denoise_speedup"] = round(full / record["runs"][name]["denoise_s"], 3)
        frames = results[name].frames.astype(np.float32)
        ref = results["full compute"].frames.astype(np.float32)
        record["runs"][name]["frames_mean_abs_diff_vs_full"] = round(float(np.abs(frames - ref).mean()), 3)
    if engine.compiled is not None:
        record["graphs"], record["recompiles"] = engine.compiled.graphs, engine.compiled.recompiles
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
