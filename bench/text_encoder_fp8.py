"""The text encoder's FP8 option at full size (random weights): what it does to the text states and to memory, and
a whole render with both FP8 options (DiT block linears and text encoder; AdaLN tables, the weights off the GPU)
for the resident peak, and the engine's memory budget.

    PYTHONPATH=src python bench/text_encoder_fp8.py --out bench/results/text_encoder_fp8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from lib.models import build, t2va_prompt
from lib.timing import run_header

from h3serve.accel.linear import quantize_text_encoder
from h3serve.accel.profile import Profile
from h3serve.pipeline.conditioning import encode_text
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", type=int, help="DiT main blocks (default: the released 50); fewer for a smoke run")
    parser.add_argument("--steps", type=int, default=20, help="grid points of the render")
    args = parser.parse_args()
    components = build(torch.device("cuda"), args.blocks)
    gib = lambda: round(torch.cuda.memory_allocated() / 2**30, 2)  # noqa: E731
    record: dict = {
        **run_header(),
        "all_bf16_gib": gib(),
    }
    prompt = t2va_prompt()
    with torch.no_grad():
        bf16 = encode_text(components.text_encoder, prompt).states.float()
        before = gib()
        record["quantized_linears"] = quantize_text_encoder(components.text_encoder)
        torch.cuda.empty_cache()
        record["text_encoder_saved_gib"] = round(before - gib(), 2)
        fp8 = encode_text(components.text_encoder, prompt).states.float()
    record["text_rows"] = int(bf16.shape[0])
    record["text_states_rel_err"] = ((fp8 - bf16).norm() / bf16.norm()).item()
    record["text_states_max_row_rel_err"] = ((fp8 - bf16).norm(dim=1) / bf16.norm(dim=1)).max().item()
    # The whole model with both FP8 options (the engine quantizes the DiT's block linears one at a time).
    profile = Profile(device="cuda", dtype="bfloat16", vae_autocast="float16", attention="CUDNN_ATTN",
                      execution="compile", linear="CUTLASS", text_linear="BF16")  # fmt: skip
    engine = Engine(components, profile)  # text_linear BF16 here: it is quantized already, above
    torch.cuda.empty_cache()
    record["resident_both_fp8_gib"] = gib()
    record["memory_budget_gib"] = dataclasses.asdict(engine.memory_budget())  # a Budget: a dataclass of GiB
    request = engine.validate(RequestFields(prompt, width=768, height=448, num_frames=56, steps=args.steps, seed=42))
    start = time.perf_counter()
    engine.render(request)
    record["first_render_s"] = round(time.perf_counter() - start, 2)
    torch.cuda.reset_peak_memory_stats()
    result = engine.render(request)
    record["render_timings_s"] = {k: round(v, 3) for k, v in result.timings.items()}
    record["render_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
