"""Cold against warm start with `H3_CACHE_DIR`: the time from launching a process to its first compiled DiT forward.

Two fresh processes, one after the other, each building the full-size DiT (random weights), compiling its repeated
blocks (compile, CUTLASS FP8 block linears, the attention `--attention` names: CUDNN_ATTN unless given) and running
one forward at the reference shape. The first starts with an empty cache folder (cold); the second finds the first
one's kernels (warm). With `--attention auto` or `FA4` the attention is chosen as a start chooses it
(`accel.attention.resolve`, FA4's self-test: its JIT compile when cold, its persistent cache when warm), timed apart
(`resolve_s`), and the files FA4 left in the cache are counted.

    PYTHONPATH=src python bench/warm_restart.py --out bench/results/warm_restart.json
    PYTHONPATH=src python bench/warm_restart.py --attention auto --out bench/results/warm_restart_fa4.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(cache: Path, attention: str, blocks: int | None) -> None:
    marks = {"interpreter_up": time.time()}  # wall clock, comparable with the parent's launch time
    from h3serve.accel.caches import use_cache_dir

    use_cache_dir(cache)
    import torch

    marks["torch_imported"] = time.time()
    torch.ones(1, device="cuda")
    marks["cuda_ready"] = time.time()

    from lib.models import build_dit
    from lib.shapes import SHAPE, forward, inputs
    from lib.variants import alone, profile

    from h3serve.accel.apply import apply
    from h3serve.accel.attention import resolve

    t0 = time.perf_counter()
    prof = profile(attention, "compile", "CUTLASS")  # the engine's compiled FP8 profile
    prof, line = resolve(prof, 128)  # as the start resolves it: FA4's self-test compiles (or loads) its kernel
    resolved = time.perf_counter() - t0
    marks["resolved"] = time.time()
    dit = build_dit(torch.device("cuda"), blocks)
    counter = apply(alone(dit), prof)
    x = inputs(dit, SHAPE["text"], SHAPE, "cuda")
    built = time.perf_counter() - t0
    marks["built"] = time.time()
    with torch.no_grad():
        forward(dit, x)
    torch.cuda.synchronize()
    marks["first_forward_done"] = time.time()
    launch = float(os.environ["BENCH_LAUNCH_TIME"])
    fa4_files = [p for p in (cache / "fa4").rglob("*") if p.is_file()] if (cache / "fa4").is_dir() else []
    print(json.dumps({"attention": str(prof.attention), "resolve_line": line, "resolve_s": round(resolved, 2),
                      "fa4_cache_files": len(fa4_files),
                      "build_s": round(built - resolved, 2),
                      "first_forward_s": round(time.perf_counter() - t0 - built, 2),
                      "graphs": counter.graphs,
                      "since_launch_s": {k: round(v - launch, 2) for k, v in marks.items()}}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--attention", default="CUDNN_ATTN", help="the DiT's attention: CUDNN_ATTN, FA4 or auto")
    parser.add_argument("--blocks", type=int, help="DiT main blocks (default: the released 50); fewer for a smoke run")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.attention, args.blocks)
        return
    record: dict = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
                    "command": " ".join(sys.argv), "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:
        from h3serve.accel.caches import CACHES, SWITCHES

        env = {k: v for k, v in os.environ.items() if k not in CACHES and k not in SWITCHES}
        for name in ("cold", "warm"):
            start = time.perf_counter()
            env["BENCH_LAUNCH_TIME"] = repr(time.time())
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    cache,
                    "--attention",
                    args.attention,
                    *(["--blocks", str(args.blocks)] if args.blocks else []),
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - start
            if done.returncode:
                record["runs"][name] = {"error": done.stderr[-3000:]}
                break
            record["runs"][name] = {
                "launch_to_first_forward_s": round(wall, 2),
                **json.loads(done.stdout.splitlines()[-1]),
            }
            print(name, record["runs"][name], flush=True)
    runs = record["runs"]
    if "warm" in runs and "error" not in runs["warm"]:
        record["warm_speedup_launch_to_first_forward"] = round(
            runs["cold"]["launch_to_first_forward_s"] / runs["warm"]["launch_to_first_forward_s"], 2
        )
        record["warm_speedup_first_forward"] = round(
            runs["cold"]["first_forward_s"] / runs["warm"]["first_forward_s"], 2
        )
    import torch

    record["gpu"], record["torch"] = torch.cuda.get_device_name(), torch.__version__
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
