"""GPU check: correctness and determinism on CUDA, and an eager DiT timing against the peer in the same process.

Run on a CUDA machine from the repository root (diffusers 0.42.1 installed, as for the tests):

    PYTHONPATH=src python bench/gpu_check.py --out bench/results/gpu_check.json

1. The tiny model renders on CUDA (bf16 DiT and text encoder, fp16-autocast video decode): two renders of one seed
   must give identical frames and samples.
2. Full-width DiT (the released widths: hidden 5376, 56 x 128 heads, ffn 14336; `--layers` blocks instead of 50)
   with the same random bf16 weights in ours and in diffusers' MiniMaxH3Transformer3DModel (the peer: our weights
   exported by diffusers' own converter, `lib.peer`), at the
   reference packed shape (537 text + 186 audio + 5712 video rows = 6435): relative error of ours against the peer,
   run-to-run bit equality, and eager milliseconds per forward for both (CUDA events, median after warm-up).
   Eager against eager: this measures parity of the plain model, not any acceleration.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from lib.models import build_dit
from lib.peer import call_peer, peer, peer_weights
from lib.timing import run_header, time_ms

from h3serve.pipeline.request import RequestFields


def tiny_render_check() -> dict:
    from h3serve.accel.profile import Profile
    from h3serve.pipeline.engine import Engine

    engine = Engine.load(None, Profile.for_device("cuda"))
    request = engine.validate(RequestFields("a red fox runs through fresh snow", num_frames=39, steps=10, seed=42))
    one, two = engine.render(request), engine.render(request)
    return {
        "profile": vars(engine.profile) if hasattr(engine.profile, "__dict__") else str(engine.profile),
        "frames_shape": list(one.frames.shape),
        "audio_shape": list(one.audio.shape),
        "frames_identical": bool(np.array_equal(one.frames, two.frames)),
        "audio_identical": bool(np.array_equal(one.audio, two.audio)),
        "timings_s": {k: round(v, 4) for k, v in two.timings.items()},
    }


def packed_reference_shape(n_text: int, n_audio: int, n_video: int, cfg: dict, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    s = n_text + n_audio + n_video
    tags = torch.tensor([1] * n_text + [2] * n_audio + [0] * n_video)
    t_idx = torch.tensor([1] * n_text + [0] * n_audio + [1] * n_video)  # audio at t=0.3, text/video at t=0.6
    pos = torch.stack([torch.arange(s) * 1.0, torch.rand(s, generator=g) * 16, torch.rand(s, generator=g) * 16], -1)
    return {
        "video": torch.randn(n_video, cfg["in_channels"] * 4, generator=g).to(device),
        "audio": torch.randn(n_audio, cfg["audio_in_channels"], generator=g).to(device),
        "text_states": torch.randn(n_text, cfg["text_dim"], generator=g).to(device, torch.bfloat16),
        "timesteps": torch.tensor([0.3, 0.6], device=device),
        "timestep_indices": t_idx.to(device),
        "token_tags": tags.to(device),
        "position_ids": pos.to(device),
        "video_indices": torch.arange(n_text + n_audio, s, device=device),
        "audio_indices": torch.arange(n_text, n_text + n_audio, device=device),
        "text_indices": torch.arange(n_text, device=device),
    }


def dit_check(layers: int, warmup: int, iters: int) -> dict:
    torch.manual_seed(0)
    ours = build_dit(torch.device("cuda"), blocks=layers)  # random, non-zero, norms near 1
    weights = peer_weights(ours)  # the same weights in diffusers' layout, by diffusers' own converter
    cfg = dict(weights["config"])
    ref = peer(weights, "cuda")
    x = packed_reference_shape(537, 186, 5712, cfg, "cuda")

    def run_ref():
        return call_peer(ref, x)

    def run_ours():
        text = ours.refine_text(x["text_states"])
        rope = ours.rope(x["position_ids"])
        return ours(
            x["video"],
            x["audio"],
            text,
            x["timesteps"],
            x["timestep_indices"],
            x["token_tags"],
            rope,
            x["video_indices"],
            x["audio_indices"],
            x["text_indices"],
        )

    with torch.no_grad():
        rv, ra = run_ref()
        v1, a1 = run_ours()
        v2, a2 = run_ours()
        rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
        result = {
            "layers": layers,
            "sequence_length": int(x["token_tags"].shape[0]),
            "rel_err_video": rel(v1, rv[0]),
            "rel_err_audio": rel(a1, ra[0]),
            "bitwise_equal_to_peer": bool(torch.equal(v1, rv[0]) and torch.equal(a1, ra[0])),
            "rerun_bitwise_identical": bool(torch.equal(v1, v2) and torch.equal(a1, a2)),
        }
        ours_ms = time_ms(run_ours, warmup, iters)
        ref_ms = time_ms(run_ref, warmup, iters)
    result["ours_ms_median"] = statistics.median(ours_ms)
    result["peer_ms_median"] = statistics.median(ref_ms)
    result["ours_ms_spread"] = [min(ours_ms), max(ours_ms)]
    result["peer_ms_spread"] = [min(ref_ms), max(ref_ms)]
    result["speedup_vs_peer"] = result["peer_ms_median"] / result["ours_ms_median"]
    result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    record = {
        **run_header(),
        "tiny_render": tiny_render_check(),
        "dit": dit_check(args.layers, args.warmup, args.iters),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
