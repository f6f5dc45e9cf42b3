"""A whole render through the engine at the reference shape with full-size random weights, per profile: T2VA
768x448, 56 frames, 20 grid points (19 forwards), seed 42, the prompt guide's T2VA case prompt. For each profile one
render to warm up (compile happens there), then one timed: per-stage times, total, resident peak.

    PYTHONPATH=src python bench/render.py --out bench/results/render.json

Profiles in order: eager BF16, compile BF16 (cuDNN attention both), then compile with CUTLASS FP8 block linears
(the BF16 block weights are dropped as they are quantized, so it runs after the BF16 ones), then the same with the
text encoder's decoder layers in FP8 too (quantized in place, so last).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import run_header, timed_render
from full_size_smoke import build, t2va_prompt

from h3serve.accel.compile import uncompile_repeated_blocks
from h3serve.accel.profile import Profile
from h3serve.pipeline.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    components = build(torch.device("cuda"))
    record: dict = {
        **run_header(),
        "weights_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
        "runs": {},
    }
    base = dict(device="cuda", dtype="bfloat16", vae_autocast="float16", attention="CUDNN_ATTN")
    for name, execution, linear, text_linear in (
        ("eager", "eager", "BF16", "BF16"),
        ("compile", "compile", "BF16", "BF16"),
        ("compile+CUTLASS", "compile", "CUTLASS", "BF16"),
        ("compile+CUTLASS+text CUTLASS", "compile", "CUTLASS", "CUTLASS"),
    ):
        uncompile_repeated_blocks(components.dit)
        torch._dynamo.reset()
        # CUTLASS: the engine quantizes the loaded block linears one by one, dropping each BF16 weight (a checkpoint
        # load quantizes them as they are read instead); FP8 is what stays resident.
        profile = Profile(**base | {"execution": execution, "linear": linear, "text_linear": text_linear})
        engine = Engine(components, profile)
        torch.cuda.empty_cache()
        request = engine.validate(t2va_prompt(), width=768, height=448, num_frames=56, steps=args.steps, seed=42)
        entry: dict = {"resident_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}
        entry["budget_gib"] = engine.memory_budget()
        entry |= timed_render(engine, request)
        record["runs"][name] = entry
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(name, entry, flush=True)


if __name__ == "__main__":
    main()
