"""One box (issue 27): the integrated-GPU memory path forced on a discrete GPU, measured against the plan.

Full-size random weights (`full_size_smoke.build`); the DiT blocks' AdaLN weights are written to safetensors files on
local disk and the DiT's AdaLN parameters replaced by views of those files' mappings, as a load with
`H3_ADALN_WEIGHTS=mapped` leaves them (`assign_from_checkpoint(mapped=...)`). Per profile (BF16 and
CUTLASS compiled, CUTLASS with the FP8 text encoder), with one schedule's tables kept (the integrated default):
the default schedule's tables made (the warmup's first step; timed: the mapped weights stream in), a warm-up render
and a timed render at the reference request (T2VA 768x448, 56 frames, `--steps` grid points) and one render at the
default request (1344x768, 124 frames, `--default-steps` grid points, compiling its shape; the activations do not
depend on the step count).
Measured: the GPU's peak allocation per render, and the process's non-evictable host memory (RssAnon and RssShmem
sampled every 20 ms, and torch's pinned-memory allocator), both against the plan's rows for the same profile on one
pool (`pipeline.budget.plan_budget(..., shared=True)`).

    PYTHONPATH=/tmp/site:src python3 bench/one_box.py --out $OUT/one_box.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
from lib.host import StatusPeaks, proc_status
from lib.models import build, t2va_prompt
from lib.timing import run_header
from safetensors import safe_open
from safetensors.torch import save_file

from h3serve.accel.compile import uncompile_repeated_blocks
from h3serve.accel.profile import Profile
from h3serve.checkpoint.adapters.read import is_block_adaln
from h3serve.pipeline.budget import GIB, PROCESS_HOST_GIB, plan_budget
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import RELEASED_RULES


def gib(status: dict[str, int]) -> dict[str, float]:
    """`lib.host.proc_status`-style bytes as GiB, rounded."""
    return {k: round(v / GIB, 3) for k, v in status.items()}


def pinned_gib() -> float:
    """What torch's page-locked host allocator holds now (GiB); 0 when the stats are not there."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", 0)) / GIB


def map_adaln(dit, folder: Path) -> float:
    """Write each block's AdaLN weights to `folder/block_NN.safetensors` and replace the DiT's parameters by views of
    the files' mappings (what a mapped load leaves). Returns the GiB written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for i, block in enumerate(dit.blocks):
        tensors = {f"blocks.{i}.adaln_proj.{n}": p.detach().cpu() for n, p in block.adaln_proj.named_parameters()}
        assert all(is_block_adaln(name) for name in tensors)
        file = folder / f"block_{i:02d}.safetensors"
        save_file(tensors, str(file))
        written += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        for n, p in block.adaln_proj.named_parameters():
            p.data = safe_open(str(file), framework="pt", device="cpu").get_tensor(f"blocks.{i}.adaln_proj.{n}")
    torch.cuda.empty_cache()
    return written / GIB


def plan_rows(profile: Profile) -> dict:
    from lib.models import released_configs  # the released configurations, as the plan reads them

    budget = plan_budget(released_configs(), profile, RELEASED_RULES, shared=True)
    return {
        "device_weights": budget.device_weights,
        "host": budget.host,
        "mapped": budget.mapped,
        "process_host": PROCESS_HOST_GIB,
        "pool_need_default": budget.pool_need(budget.activations_default),
        "pool_need_largest": budget.pool_need(),
        "budget": dataclasses.asdict(budget),
    }


def measured_render(engine: Engine, request) -> dict:
    torch.cuda.reset_peak_memory_stats()
    with StatusPeaks(0.02) as host:
        start = time.perf_counter()
        result = engine.render(request)
        seconds = time.perf_counter() - start
    entry = {
        "seconds": round(seconds, 2),
        "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
        "gpu_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
        "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
        "host_peak_gib": gib(host.peak),
        "pinned_gib": round(pinned_gib(), 3),
    }
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/h3-one-box"), help="where the AdaLN files go")
    parser.add_argument("--steps", type=int, default=20, help="grid points of the reference render")
    parser.add_argument("--default-steps", type=int, default=3, help="grid points of the default-request render")
    parser.add_argument("--profiles", default="BF16,CUTLASS,CUTLASS+text", help="comma-separated")
    parser.add_argument("--blocks", type=int, help="DiT main blocks (default: the released 50); fewer for a smoke run")
    args = parser.parse_args()
    record: dict = {**run_header(), "runs": {}}
    record["host_before_build_gib"] = gib(proc_status())
    start = time.perf_counter()
    components = build(torch.device("cuda"), args.blocks)
    record["build_s"] = round(time.perf_counter() - start, 1)
    start = time.perf_counter()
    record["adaln_written_gib"] = round(map_adaln(components.dit, args.dir), 2)
    components.adaln_mapped = True  # what a mapped load records
    record["adaln_write_s"] = round(time.perf_counter() - start, 1)
    record["host_after_map_gib"] = gib(proc_status())
    record["pinned_after_map_gib"] = pinned_gib()
    wanted = args.profiles.split(",")
    base = dict(device="cuda", dtype="bfloat16", vae_autocast="float16", attention="CUDNN_ATTN", execution="compile")
    for name, linear, text_linear in (
        ("BF16", "BF16", "BF16"),
        ("CUTLASS", "CUTLASS", "BF16"),
        ("CUTLASS+text", "CUTLASS", "CUTLASS"),
    ):
        if name not in wanted:
            continue
        uncompile_repeated_blocks(components.dit)
        torch._dynamo.reset()
        profile = Profile(**base, linear=linear, text_linear=text_linear, adaln_weights="mapped", adaln_tables_kept=1)
        entry: dict = {"plan": plan_rows(profile)}
        try:
            engine = Engine(components, profile)
            torch.cuda.empty_cache()
            entry["resident_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
            with StatusPeaks(0.02) as host:
                entry["default_tables_s"] = round(engine.prepare_tables(), 2)  # streamed from the mapped files
            entry["host_after_tables_gib"] = gib(host.peak)
            entry["pinned_after_tables_gib"] = round(pinned_gib(), 3)
            reference = engine.validate(
                RequestFields(t2va_prompt(), width=768, height=448, num_frames=56, steps=args.steps, seed=42)
            )
            engine.render(reference)  # warm-up: the compile
            entry["reference"] = measured_render(engine, reference)
            # 1344x768, 124 frames
            default = engine.validate(RequestFields(t2va_prompt(), steps=args.default_steps, seed=42))
            entry["default"] = measured_render(engine, default)  # its own tables, and the compile's second shape
            entry["tables_after_gib_pinned"] = round(pinned_gib(), 3)
            del engine
        except Exception as err:  # recorded, so that the other profiles still run
            entry["error"] = f"{type(err).__name__}: {err}"[:2000]
        record["runs"][name] = entry
        args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(name, json.dumps({k: v for k, v in entry.items() if k != "plan"}, default=str)[:1500], flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
