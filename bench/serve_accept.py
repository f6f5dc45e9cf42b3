"""The service at full size on one GPU: every component at the released configuration with random weights (the
real ones cannot reach the GPU machine), served over loopback with a key, then checked the way an operator would.

1. Time from app start to ready: the startup warmup at the production shape (768x448, 56 frames, one forward),
   encoded and verified.
2. `h3serve accept`'s procedure: health, model identity, the seed's fixed request (seed 42, 768x448, duration 2.0,
   20 steps) twice through /v1/videos/sync; decoded frames byte for byte, audio PSNR.
3. The same request as an async job: its decoded frames against the sync renders' (one engine, one answer).
4. A running 50-step async job cancelled by DELETE: time until it stopped, and GPU memory back to the idle level.

Random weights say nothing about picture quality; this measures the service path and its timings, not the model.
With `--num-gpus N` (N > 1, or `--split` on one GPU) the served engine is a `ParallelEngine` of N workers, each
drawing the same weights (`lib.models.seeded_rank_engine`), and memory is each GPU's as nvidia-smi reports it.

    PYTHONPATH=src python bench/serve_accept.py --out bench/results/serve_accept.json [--num-gpus N]
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import uvicorn
from lib.host import gpu_used_mib
from lib.models import build, released_dit_config, seeded_rank_engine
from lib.timing import run_header

from h3serve.accel.profile import Profile
from h3serve.accept import AcceptPlan, run_accept
from h3serve.media.mp4 import decode_frames
from h3serve.parallel.workers import ParallelEngine, WorkerSpec
from h3serve.pipeline.engine import Engine
from h3serve.service.app import create_app
from h3serve.settings import Settings

MODEL_ID = "/models/MiniMax-H3/FL2VA"
KEY = "bench-" + "0123456789abcdef" * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a dry run of the script with the tiny model on the CPU")
    parser.add_argument("--num-gpus", type=int, default=1, help="serve a render split over this many GPUs")
    parser.add_argument("--split", action="store_true", help="the split path (workers) even for one GPU")
    parser.add_argument(
        "--blocks",
        type=int,
        help="DiT main blocks of the one-GPU run (default: the released 50); fewer for a smoke run",
    )
    args = parser.parse_args()
    work = args.out.parent / "serve_accept"
    device = torch.device("cpu" if args.tiny else "cuda")
    split = args.num_gpus > 1 or args.split
    if args.blocks is not None and (split or args.tiny):
        parser.error("--blocks: the one-GPU full-size run only")
    t0 = time.perf_counter()
    if split:
        profile = Profile.for_device(device.type)
        full = {} if args.tiny else {"engine_factory": seeded_rank_engine, "dit_config": released_dit_config()}
        engine = ParallelEngine(WorkerSpec(None, profile, args.num_gpus, cpu_threads=1), **full)
    else:
        full = None if args.tiny else build(device, args.blocks)
        engine = Engine.load(None, Profile()) if full is None else Engine(full, Profile.for_device("cuda"))
    shape = dict(width=224, height=128, duration=0.9, steps=3) if args.tiny else {}
    build_s = time.perf_counter() - t0
    idle_mib = _allocated_mib(device)  # this process's (a split engine's memory is in its workers: nvidia-smi below)
    settings = Settings(served_model_name=MODEL_ID, api_key=KEY, output_dir=work / "output")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = create_app(settings, engine)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    start = time.perf_counter()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    result: dict = {
        **run_header(device),
        "profile": engine.profile.__dict__,
        "num_gpus": args.num_gpus,
        "split": split,
        "build_random_weights_s": round(build_s, 2),
    }
    if not split:
        result["idle_allocated_gib"] = round(idle_mib / 1024, 2)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        while True:
            try:
                health = c.get("/health").json()
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if health["readiness"] != "warming":
                break
            time.sleep(0.05)
        result["ready_after_s"] = round(time.perf_counter() - start, 2)
        result["warmup"] = health["warmup"]
        result["anonymous_models_status"] = httpx.get(f"{url}/v1/models").status_code

        plan = AcceptPlan(url=url, out_dir=work / "accept", key=KEY, expect_model=MODEL_ID, **shape)
        passed, report = run_accept(plan)
        result["accept"] = {"passed": passed, **report}

        plan = AcceptPlan(url=url, out_dir=work, **shape)
        parts = plan.parts()
        answer = c.post("/v1/videos", files=parts)
        if answer.status_code != 200:
            raise SystemExit(f"the async job was refused: {answer.status_code} {answer.text[:500]}")
        job = answer.json()
        while (record := c.get(f"/v1/videos/{job['id']}").json())["status"] in ("queued", "in_progress"):
            time.sleep(0.2)
        async_mp4 = work / "async.mp4"
        async_mp4.write_bytes(c.get(f"/v1/videos/{job['id']}/content").content)
        same = passed and np.array_equal(decode_frames(async_mp4), decode_frames(work / "accept" / "accept-1.mp4"))
        result["async_job"] = {"record": record, "frames_equal_to_sync": bool(same)}

        idle_per_gpu = gpu_used_mib() if split and not args.tiny else []  # between renders, after the warmup
        long = c.post("/v1/videos", files={**parts, "num_inference_steps": (None, "50")}).json()
        deadline = time.monotonic() + 600
        while (state := c.get(f"/v1/videos/{long['id']}").json())["progress"] < 10:
            if state["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
                raise RuntimeError(f"the 50-step job did not reach 10% progress: {state}")
            time.sleep(0.05)
        t = time.perf_counter()
        cancelled = c.delete(f"/v1/videos/{long['id']}").json()
        stop_s = time.perf_counter() - t
        result["cancel"] = {
            "status": cancelled["status"],
            "delete_returned_after_s": round(stop_s, 3),
        }
        if not split:
            result["cancel"] |= {"allocated_after_gib": round(_allocated_mib(device) / 1024, 2),
                                 "idle_allocated_gib": round(idle_mib / 1024, 2)}  # fmt: skip
        if idle_per_gpu:  # a split engine's memory is in its workers: each GPU's use, idle and after the cancel
            time.sleep(1.0)  # the workers' caches are emptied as the cancel ends; nvidia-smi samples
            result["cancel"] |= {"used_mib_per_gpu_idle": idle_per_gpu, "used_mib_per_gpu_after": gpu_used_mib()}
        result["metrics_tail"] = [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("h3serve_")][-12:]
    server.should_exit = True
    thread.join(60)
    if split:
        engine.close()
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("ready_after_s", "warmup", "cancel")}, indent=2, default=str))
    print("accept passed:", passed, "| async frames equal to sync:", same)


def _allocated_mib(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) / 2**20


if __name__ == "__main__":
    main()
