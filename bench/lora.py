"""Few-step adapter on the full-size DiT (random weights): the merge's time, then few-forward renders per profile.

A synthetic adapter of LightX2V's published shape (diffusers names, rank 128 on every block and refiner linear,
metadata alpha 128: the 4-step 768p variant, whose trained sampler is 5 points at shifts 6/3) is written to disk,
read and checked (`read_adapter`), and merged into the BF16 DiT on the GPU (`merge_into`); then each profile runs
(eager BF16, compiled BF16, compiled CUTLASS, which quantizes the merged weights to FP8). Renders: the reference
request (T2VA 768x448, 56 frames) and the default request (1344x768, 124 frames), each with 9 points (8 forwards)
and 5 points (4 forwards, the adapter's default); `--profiles` and `--runs` pick some.
Each render runs twice: the first warms up (compiles), the second is timed; the two must be
byte-identical, and the graph counter must show 0 recompiles.

    PYTHONPATH=src python bench/lora.py --out bench/results/lora.json [--profiles "eager BF16"] [--runs NAME]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from lib.models import build, t2va_prompt
from lib.timing import run_header, timed_render
from safetensors.torch import save_file

from h3serve.accel.compile import uncompile_repeated_blocks
from h3serve.accel.profile import Profile
from h3serve.checkpoint.adapters import merge_into, read_adapter
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

RUNS = (
    ("reference 768x448x56, 9 points", 768, 448, 56, 9),
    ("reference 768x448x56, adapter default (5 points)", 768, 448, 56, None),
    ("default 1344x768x124, 9 points", 1344, 768, 124, 9),
    ("default 1344x768x124, adapter default (5 points)", 1344, 768, 124, None),
)
# In this order: the BF16 profiles first, then CUTLASS, which quantizes the merged BF16 block weights in place.
PROFILES = (
    ("eager BF16", "eager", "BF16"),
    ("compile BF16", "compile", "BF16"),
    ("compile CUTLASS", "compile", "CUTLASS"),
)


def write_lightx2v(path: Path, cfg, rank: int, seed: int = 0) -> None:
    """A synthetic adapter as LightX2V publishes theirs: diffusers module names (q, k, v apart) with the `.default.`
    infix, rank `rank` on every block and refiner linear, bf16 factors whose product has a weight's scale, metadata
    key_format and alpha = rank."""
    h, inner, ffn = cfg.hidden_size, cfg.inner_dim, cfg.ffn_hidden_size
    widths = {"attn.to_q": (h, inner), "attn.to_k": (h, inner), "attn.to_v": (h, inner), "attn.to_out.0": (inner, h),
              "ff.net.0.proj": (h, 2 * ffn), "ff.net.2": (ffn, h)}  # fmt: skip
    blocks = [f"transformer_blocks.{i}" for i in range(cfg.num_layers)]
    blocks += [f"token_refiner.refiner_blocks.{i}" for i in range(cfg.token_refiner_num_layers)]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for block in blocks:
        for module, (fan_in, fan_out) in widths.items():
            down = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            up = torch.randn(fan_out, rank, generator=g) * 0.5 / rank**0.5
            tensors[f"{block}.{module}.lora_A.default.weight"] = down.to(torch.bfloat16)
            tensors[f"{block}.{module}.lora_B.default.weight"] = up.to(torch.bfloat16)
    save_file(tensors, path, metadata={"key_format": "minimax-h3-diffusers", "alpha": str(rank)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--profiles", nargs="*", help="profile labels to run (default: all of PROFILES)")
    parser.add_argument("--runs", nargs="*", help="run names to run (default: all of RUNS)")
    parser.add_argument("--blocks", type=int, help="DiT main blocks (default: the released 50); fewer for a smoke run")
    args = parser.parse_args()
    components = build(torch.device("cuda"), args.blocks)
    config = components.dit_config
    record: dict = {**run_header(), "rank": args.rank, "runs": {}}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "minimax_h3_fl2v_turbo_4step_v1.0_768p.safetensors"
        start = time.perf_counter()
        write_lightx2v(path, config, args.rank)
        record["write_s"] = round(time.perf_counter() - start, 2)
        record["file_gib"] = round(path.stat().st_size / 2**30, 3)
        start = time.perf_counter()
        adapter = read_adapter(path, config=config)
        record["read_s"] = round(time.perf_counter() - start, 2)
    record["adapter"] = adapter.describe()
    record["targets"] = adapter.targets
    torch.cuda.synchronize()
    start = time.perf_counter()
    merge_into(components.dit, [adapter])
    torch.cuda.synchronize()
    record["merge_s"] = round(time.perf_counter() - start, 2)
    print("merge", {k: record[k] for k in ("write_s", "file_gib", "read_s", "merge_s", "targets")}, flush=True)

    base = dict(device="cuda", dtype="bfloat16", vae_autocast="float16", attention="CUDNN_ATTN")
    for label, execution, linear in PROFILES:
        if args.profiles and label not in args.profiles:
            continue
        uncompile_repeated_blocks(components.dit)
        torch._dynamo.reset()
        engine = Engine(components, Profile(**base | {"execution": execution, "linear": linear}), adapters=[adapter])
        torch.cuda.empty_cache()
        record["sampler"] = engine.admission.sampler.describe()
        for name, width, height, frames, steps in RUNS:
            if args.runs and name not in args.runs:
                continue
            shape = RequestFields(t2va_prompt(), width=width, height=height, num_frames=frames, steps=steps, seed=42)
            request = engine.validate(shape)
            entry = {"shifts": [request.video_shift, request.audio_shift]} | timed_render(engine, request)
            record["runs"][f"{label}: {name}"] = entry
            args.out.write_text(json.dumps(record, indent=2) + "\n")
            print(label, name, entry, flush=True)


if __name__ == "__main__":
    main()
