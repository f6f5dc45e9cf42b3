"""A render split over GPUs (Ulysses sequence parallelism, `h3serve.parallel`) against the same render on one GPU,
in one run, with full-size random weights: bit-for-bit equality and the per-forward scaling.

    PYTHONPATH=src python bench/split.py --out bench/results/split.json [--num-gpus N] [--steps 6] [--shape default]

First the kernel-level facts the split rests on, at the default shape (S = 38,247 rows, 56 heads): attention on a
contiguous group of heads alone against the same heads inside the whole call (cuDNN and flash), for 2, 4, 7 and 8
groups; the video head's fp32 GEMM on a rank's contiguous rows against the one-GPU call on the video rows. Then, per
profile (eager BF16, compile + CUTLASS), the reference request (T2VA 768x448, 56 frames; `--shape default`: the
released default request, 1344x768, 124 frames) rendered by
`ParallelEngine` over --num-gpus workers (default: every visible GPU; 1 runs the split path on a group of one:
every all-to-all, gather and agreement, on one GPU) and by one in-process `Engine`, one after the other (a
full-size model each): a warmup render, then a timed one; frames and audio compared byte for byte. The weights are
drawn from one seed on each GPU, so every worker and the one-GPU engine hold the same numbers.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from lib.models import released_dit_config, seeded_engine, seeded_rank_engine, t2va_prompt
from lib.timing import run_header

from h3serve.accel.attention import cudnn_sdpa
from h3serve.accel.profile import Profile
from h3serve.model import ops
from h3serve.parallel.group import row_ranges
from h3serve.parallel.workers import ParallelEngine, WorkerSpec, load_rank_engine
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

DEFAULT_ROWS = 38_247  # the released default request's packed rows (1344x768, 124 frames)
VIDEO_ROWS = 37_152  # its video rows, the last of the packed sequence


def tiny_engine(profile: Profile) -> Engine:
    """--tiny: the built-in tiny model (a CPU dry run of the script's plumbing)."""
    return Engine.load(None, profile)


def head_groups_check() -> dict:
    """Attention over a contiguous group of heads alone == those heads inside the whole call, bit for bit?"""
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = [torch.randn(DEFAULT_ROWS, 3 * 56 * 128, device="cuda", dtype=torch.bfloat16, generator=g)]
    q, k, v = (t.unflatten(-1, (56, 128))[None].transpose(1, 2) for t in rows[0].chunk(3, dim=-1))  # as the DiT
    out = {}
    for name, kernel in (("cudnn", cudnn_sdpa), ("torch_sdpa", ops.sdpa)):
        whole = kernel(q, k, v, False)
        for n in (2, 4, 7, 8):
            hn = 56 // n
            worst = 0.0
            for j in range(n):
                part = slice(j * hn, (j + 1) * hn)
                alone = kernel(q[:, part].contiguous(), k[:, part].contiguous(), v[:, part].contiguous(), False)
                worst = max(worst, (alone.float() - whole[:, part].float()).abs().max().item())
            out[f"{name}_{n}_groups_max_abs_diff"] = worst
        del whole
    return out


def video_head_check() -> dict:
    """The video head (fp32, 5376 -> 128) as a rank computes it (an input shaped as every video row, the rank's rows in
    place, the rest zero) == the one-GPU call on the video rows? And on the rank's rows alone (not used: a GEMM's
    kernel follows its shape)?"""
    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(DEFAULT_ROWS, 5376, device="cuda", generator=g)
    w = torch.randn(128, 5376, device="cuda", generator=g) * 5376**-0.5
    b = torch.randn(128, device="cuda", generator=g)
    first = DEFAULT_ROWS - VIDEO_ROWS
    whole = F.linear(h[first:], w, b)  # the one-GPU call: every video row
    out = {}
    for n in (2, 4, 7, 8):
        placed = alone = 0.0
        for start, end in row_ranges(DEFAULT_ROWS, n):
            lo, hi = max(start, first) - first, end - first  # this rank's video rows, among the video rows
            if hi <= lo:
                continue
            rows = torch.zeros_like(h[first:])
            rows[lo:hi] = h[first + lo : first + hi]
            placed = max(placed, (F.linear(rows, w, b)[lo:hi] - whole[lo:hi]).abs().max().item())
            local = F.linear(h[start:end], w, b)[first + lo - start :]
            alone = max(alone, (local - whole[lo:hi]).abs().max().item())
        out[f"{n}_ranks_as_computed_max_abs_diff"] = placed
        out[f"{n}_ranks_rows_alone_max_abs_diff"] = alone
    return out


SHAPES = {"reference": {"width": 768, "height": 448, "num_frames": 56}, "default": {}}  # default: the released one


def timed(engine, steps: int, tiny: bool, shape_name: str = "reference") -> tuple[dict, object]:
    shape = {} if tiny else SHAPES[shape_name]
    request = engine.validate(RequestFields(t2va_prompt(), **shape, steps=steps, seed=42))
    engine.render(request)  # warmup: compile, tables, the decoder's first call
    result = engine.render(request)
    denoise = result.timings["denoise"]
    entry = {
        "forwards": request.forwards,
        "denoise_s": round(denoise, 3),
        "per_forward_s": round(denoise / request.forwards, 4),
        "total_s": round(result.timings["total"], 3),
        "timings_s": {k: round(v, 3) for k, v in result.timings.items()},
        "frames_sha256": hashlib.sha256(result.frames.tobytes()).hexdigest(),
        "audio_sha256": hashlib.sha256(result.audio.tobytes()).hexdigest(),
        "split": list(result.split),
    }
    return entry, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument(
        "--shape", choices=SHAPES, default="reference", help="reference (768x448x56) or default (1344x768x124)"
    )
    parser.add_argument("--tiny", action="store_true", help="a dry run of the plumbing on the CPU (tiny model)")
    args = parser.parse_args()
    record: dict = {**run_header(None if not args.tiny else "cpu"), "num_gpus": args.num_gpus, "steps": args.steps,
                    "shape": args.shape, "renders": {}}  # fmt: skip
    if not (args.skip_checks or args.tiny):
        record["head_groups"] = head_groups_check()
        record["video_head"] = video_head_check()
        print(json.dumps({k: record[k] for k in ("head_groups", "video_head")}, indent=1), flush=True)
        torch.cuda.empty_cache()
    base = dict(device="cuda", dtype="bfloat16", vae_autocast="float16", attention="CUDNN_ATTN")
    profiles = [("eager BF16", Profile(**base | {"execution": "eager", "linear": "BF16"})),
                ("compile CUTLASS", Profile(**base | {"execution": "compile", "linear": "CUTLASS"}))]  # fmt: skip
    make, make_rank = seeded_engine, seeded_rank_engine
    if args.tiny:
        profiles, make, make_rank = [("tiny cpu", Profile.for_device("cpu"))], tiny_engine, load_rank_engine
    for name, profile in profiles:
        config = None if args.tiny else released_dit_config()
        spec = WorkerSpec(None, profile, args.num_gpus, cpu_threads=1)
        split = ParallelEngine(spec, engine_factory=make_rank, dit_config=config)
        try:
            split_entry, split_result = timed(split, args.steps, args.tiny, args.shape)
        finally:
            split.close()
        torch._dynamo.reset()
        if args.tiny:
            torch.set_num_threads(1)
        one = make(profile)
        one_entry, one_result = timed(one, args.steps, args.tiny, args.shape)
        del one
        gc.collect()
        torch.cuda.empty_cache()
        entry = {
            "split": split_entry,
            "one_gpu": one_entry,
            "frames_equal": bool((split_result.frames == one_result.frames).all()),
            "audio_equal": bool((split_result.audio == one_result.audio).all()),
            "per_forward_speedup": round(one_entry["per_forward_s"] / split_entry["per_forward_s"], 3),
        }
        record["renders"][name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k not in ("split", "one_gpu")}), flush=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
