"""What the AdaLN tables cost at full size: making a schedule's tables with the AdaLN weights in host memory (the
CUDA default), finding them cached, and copying one step's tables in, on the full-size DiT with random weights.

    PYTHONPATH=src python bench/adaln_tables.py --out bench/results/adaln_tables.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from lib.models import build_dit
from lib.timing import run_header

from h3serve.accel.adaln import AdalnTables
from h3serve.config import AUDIO_SHIFT, DEFAULT_STEPS, VIDEO_SHIFT
from h3serve.pipeline.layout import MediaGeometry, build_layout
from h3serve.pipeline.sampling import step_timesteps
from h3serve.pipeline.schedule import DualSchedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", type=int, help="DiT main blocks (default: the released 50); fewer for a smoke run")
    parser.add_argument(
        "--steps",
        type=lambda v: [int(s) for s in v.split(",")],
        default=[20, DEFAULT_STEPS],
        help="comma-separated grid point counts of the schedules (default 20 and the default's)",
    )
    args = parser.parse_args()
    record: dict = {
        **run_header(),
        "schedules": {},
    }
    dit = build_dit(torch.device("cuda"), args.blocks)
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    tables = AdalnTables(dit, weights="pinned")
    record["offload_s"] = round(time.perf_counter() - start, 2)
    record["gpu_freed_gib"] = round((before - torch.cuda.memory_allocated()) / 2**30, 2)
    geometry = MediaGeometry.from_pixels(448, 768, 56)
    with torch.no_grad():
        for steps in args.steps:
            schedule = DualSchedule.build(steps, VIDEO_SHIFT, AUDIO_SHIFT)
            for task, anchors in (("t2va", ()), ("fl2va", ("first", "last"))):
                layout = build_layout([1] * 537, geometry, anchors)
                plan = step_timesteps(layout, schedule)
                torch.cuda.synchronize()
                start = time.perf_counter()
                made = tables.for_steps(plan)
                torch.cuda.synchronize()
                make_s = time.perf_counter() - start
                start = time.perf_counter()
                again = tables.for_steps(plan)
                cached_s = time.perf_counter() - start
                copies = []
                for step in range(len(made)):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    per_block = made[step]
                    b.record()
                    torch.cuda.synchronize()
                    copies.append(a.elapsed_time(b))
                host_bytes = sum(t.numel() * t.element_size() for step in made.tables for t in step)
                record["schedules"][f"{task} {steps} grid points"] = {
                    "forwards": len(made),
                    "make_s": round(make_s, 3),
                    "cached_lookup_ms": round(cached_s * 1e3, 3),
                    "same_object_when_cached": again is made,
                    "host_gib": round(host_bytes / 2**30, 3),
                    "step_copy_ms_median": round(statistics.median(copies), 3),
                    "blocks_per_step": len(per_block),
                }
                print(task, steps, record["schedules"][f"{task} {steps} grid points"], flush=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
