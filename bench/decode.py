"""The video decode before and after issue 41, in one process on the same weights: the released decoder (random weights,
the engine's placement: float16 weights for float16 autocast, cuDNN attention), the released default request's latents
(1344x768, 124 frames: 37 latents, 7 windows) and the reference request's (768x448, 56 frames: 17 latents, 3 windows).

    PYTHONPATH=src python bench/decode.py --out bench/results/decode.json

Variants, each timed with CUDA events (warm-up, then `--iters`), its peak memory, and its frames compared with
`before`'s bit for bit (`bitwise`, and the largest difference):
  before     the decode at main 8d6725d (`lib/decode_before.py`): the plain ops, blends by concatenation
  plain      today's decode with the plain passes: blends written in place, the patch layout copied to float32 once
  +qk        plain, with the qk-norm and rotary in one Triton pass (`accel.vae.decoder_passes`)
  +norms     plain, with the residual adds and the norms after them in one Triton pass each
  all        every Triton pass: the two above and the SwiGLU gate
  batched    all, a window's tiles decoded `CUDA_TILE_BATCH` at a time (what the engine runs on CUDA)
  fp8        (only when named) all, with the decoder blocks' linears in FP8 (`quantize_decoder`, lossy: a second
             decoder of the same weights); its frames' distance from `before`'s as uint8 frames (steps, PSNR)
Then a kernel profile (torch.profiler) of `before` and `batched` over one decode window of the default request (its 28
tiles: a whole decode under the profiler ran out of GPU memory on 2026-12-03), by category (GEMM, attention, copies
(casts, concatenations, layout), other element-wise, other); and the time of one preview-sized window
(`decode_window` of 1..7 latents at the default size, what `pipeline.preview` decodes). `streamed_batched`: the
engine's decode, each window's frames handed on as they are final (`on_frames`), its time and peak memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import re
from pathlib import Path

import torch
from lib.decode_before import decode_before, decode_window_before
from lib.models import fill_random, released_configs
from lib.timing import run_header

from h3serve.accel import attention
from h3serve.accel.linear import Fp8Linear
from h3serve.accel.profile import Attention
from h3serve.accel.vae import CUDA_TILE_BATCH, decoder_passes, decoder_weights_to, set_decoder_passes, set_tile_batch
from h3serve.model.video_vae import REFERENCE_PASSES, VideoVAE
from h3serve.pipeline.video_decode import decode, decode_window

SHAPES = {"default": (37, 48, 84), "reference": (17, 28, 48)}  # latents (T, h, w)
AUTOCAST = torch.float16
COPIES = re.compile(r"copy|CatArray|cat_|transpose|permute", re.I)


def build(device: torch.device) -> VideoVAE:
    vae = VideoVAE(released_configs().video_vae_config).to(device).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        fill_random(vae)
        for block in vae.decoder.transformer_blocks:  # the residual scales as a trained model's: small, not ~1
            block.scale1.normal_(0.0, 0.1)
            block.scale2.normal_(0.0, 0.1)
    decoder_weights_to(vae, AUTOCAST)
    attention.set_kernel(vae, Attention.CUDNN_ATTN)
    return vae


def quantize_decoder(vae: VideoVAE) -> int:
    """The decoder blocks' four linears (fused QKV, attention out, the feed-forward's two: 99.8% of its GEMM work) as
    `Fp8Linear` (e4m3 weights with per-channel scales, activations quantized per row at each call, CUTLASS's rowwise
    GEMM), in place; the embedding and the patch head stay float16. A lossy experiment, not an engine choice."""
    count = 0
    for block in vae.decoder.transformer_blocks:
        for parent, leaf in ((block.attn, "to_qkv"), (block.attn, "to_out"), (block.ff, "w1"), (block.ff, "w2")):
            setattr(parent, leaf, Fp8Linear.from_linear(getattr(parent, leaf)))
            count += 1
    return count


def variants(vae: VideoVAE, fp8: VideoVAE | None = None) -> dict:
    fast = decoder_passes()
    plain = REFERENCE_PASSES

    def with_passes(passes, batch: int = 1):
        def run(z):
            set_decoder_passes(vae, passes)
            set_tile_batch(vae, batch)
            return decode(vae, z, autocast_dtype=AUTOCAST)

        return run

    def before(z):
        set_decoder_passes(vae, plain)
        set_tile_batch(vae, 1)
        return decode_before(vae, z, AUTOCAST)

    def quantized(z):
        set_decoder_passes(fp8, fast)
        return decode(fp8, z, autocast_dtype=AUTOCAST)

    norms = dataclasses.replace(plain, norm=fast.norm, residual_norm=fast.residual_norm, residual=fast.residual)
    runs = {
        "before": before,
        "plain": with_passes(plain),
        "+qk": with_passes(dataclasses.replace(plain, qk=fast.qk)),
        "+norms": with_passes(norms),
        "all": with_passes(fast),
        "batched": with_passes(fast, CUDA_TILE_BATCH),
    }
    if fp8 is not None:
        runs["fp8"] = quantized
    return runs


def frames_distance(out: torch.Tensor, reference: torch.Tensor) -> dict:
    """How far `out`'s uint8 frames are from `reference`'s: the largest step, the mean step, the share of values that
    differ, and the PSNR (dB) over every frame."""
    a, b = VideoVAE.output_to_rgb(out.clone()).float(), VideoVAE.output_to_rgb(reference.clone()).float()
    d = (a - b).abs()
    mse = d.square().mean().item()
    psnr = float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)
    return {"max_step": int(d.max().item()), "mean_step": round(d.mean().item(), 4),
            "differ": round((d > 0).float().mean().item(), 4), "psnr_db": round(psnr, 2)}  # fmt: skip


def timed(fn, iters: int) -> tuple[list[float], float, torch.Tensor]:
    """Milliseconds per call (CUDA events) after one warm-up, the peak memory of the calls above what was allocated
    before them (GiB), and the last call's output."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times, out = [], None
    for _ in range(iters):
        del out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, (torch.cuda.max_memory_allocated() - base) / 2**30, out


def profile(fn) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cats = {k: 0.0 for k in ("gemm", "attention", "copies", "elementwise", "other")}
    kernels = []
    for e in prof.key_averages():
        ms = e.device_time_total / 1e3
        if ms <= 0:
            continue
        name = e.key
        if re.search(r"fmha|flash|sdpa|attention|cudnn", name, re.I) and not re.search(r"gemm|nvjet", name, re.I):
            cat = "attention"
        elif re.search(r"nvjet|cutlass|xmma|gemm|gemv|cublas|sm90_", name, re.I):
            cat = "gemm"
        elif COPIES.search(name):
            cat = "copies"
        elif re.search(r"elementwise|reduce|norm|_kernel|triton|at::native", name, re.I):
            cat = "elementwise"
        else:
            cat = "other"
        cats[cat] += ms
        kernels.append({"name": name[:140], "calls": e.count, "ms": round(ms, 2), "category": cat})
    kernels.sort(key=lambda k: -k["ms"])
    total = sum(cats.values())
    return {"total_ms": round(total, 1), "categories_ms": {k: round(v, 1) for k, v in cats.items()},
            "top_kernels": kernels[:30]}  # fmt: skip


@torch.no_grad()  # the windows and the preview windows are timed outside `decode`'s own no_grad
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--shapes", default="default,reference")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--variants", help="comma-separated variants to time (default: every one; `before` always)")
    args = parser.parse_args()
    device = torch.device("cuda")
    vae = build(device)
    result = {**run_header(device), "autocast": str(AUTOCAST), "shapes": {}}
    wanted = args.variants.split(",") if args.variants else None
    fp8 = None
    if wanted is not None and "fp8" in wanted:
        fp8 = build(device)
        result["fp8_layers"] = quantize_decoder(fp8)
    runs = variants(vae, fp8)
    if args.variants:
        runs = {k: v for k, v in runs.items() if k == "before" or k in wanted}
    for shape in args.shapes.split(","):
        t, h, w = SHAPES[shape]
        z = torch.randn(1, 24, t, h, w, device=device, generator=torch.Generator(device).manual_seed(42))
        entry: dict = {"latents": [t, h, w], "variants": {}}
        reference = None
        for name, fn in runs.items():
            times, peak, out = timed(lambda fn=fn, z=z: fn(z), args.iters)
            if reference is None:
                reference = out
            diff = (out - reference).abs().max().item()
            entry["variants"][name] = {
                "ms": [round(x, 1) for x in times], "best_ms": round(min(times), 1), "peak_gib": round(peak, 2),
                "bitwise": bool(torch.equal(out, reference)), "max_abs_diff": diff,
            }  # fmt: skip
            if not entry["variants"][name]["bitwise"]:
                entry["variants"][name]["frames"] = frames_distance(out, reference)
            print(shape, name, entry["variants"][name], flush=True)
            del out
        before = entry["variants"]["before"]["best_ms"]
        for v in entry["variants"].values():
            v["speedup"] = round(before / v["best_ms"], 3)
        # As the engine decodes: each window's final frames handed on (`on_frames`) instead of one whole output.
        set_decoder_passes(vae, decoder_passes())
        set_tile_batch(vae, CUDA_TILE_BATCH)
        times, peak, _ = timed(lambda z=z: decode(vae, z, autocast_dtype=AUTOCAST, on_frames=lambda _p: None), 1)
        entry["streamed_batched"] = {"ms": round(times[0], 1), "peak_gib": round(peak, 2)}
        print(shape, "streamed batched", entry["streamed_batched"], flush=True)
        result["shapes"][shape] = entry
        del reference
        args.out.write_text(json.dumps(result, indent=1))
    if not args.no_profile:
        _, h, w = SHAPES["default"]
        z = torch.randn(1, 24, 7, h, w, device=device, generator=torch.Generator(device).manual_seed(42))

        def window(passes, before: bool):
            set_decoder_passes(vae, passes)
            set_tile_batch(vae, 1 if before else CUDA_TILE_BATCH)
            if before:
                return decode_window_before(vae, z, AUTOCAST)
            return decode_window(vae, z, autocast_dtype=AUTOCAST)

        gc.collect()
        torch.cuda.empty_cache()
        result["profile"] = {
            "before": profile(lambda: window(REFERENCE_PASSES, True)),
            "batched": profile(lambda: window(decoder_passes(), False)),
            "what": "one decode window (7 latents, 28 tiles) of the default request",
        }
        print(json.dumps({k: result["profile"][k]["categories_ms"] for k in ("before", "batched")}), flush=True)
    # Preview-sized windows: the first n latents decoded as one window (`pipeline.preview` decodes 3).
    t, h, w = SHAPES["default"]
    z = torch.randn(1, 24, 7, h, w, device=device, generator=torch.Generator(device).manual_seed(7))
    result["preview_windows_ms"] = {}
    for passes_name, passes, batch in (("before", REFERENCE_PASSES, 1), ("batched", decoder_passes(), CUDA_TILE_BATCH)):
        set_decoder_passes(vae, passes)
        set_tile_batch(vae, batch)
        result["preview_windows_ms"][passes_name] = {
            n: round(min(timed(lambda n=n: decode_window(vae, z[:, :, :n], autocast_dtype=AUTOCAST), 3)[0]), 1)
            for n in (1, 2, 3, 5, 7)
        }
    print(json.dumps(result["preview_windows_ms"]), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
