"""Probe for issue 41: does decoding several tiles of a window in one batch (and replaying the decoder as a CUDA
graph) keep every tile's bits, and what does it buy? One process, the released decoder (random weights, float16
weights and autocast, cuDNN attention, every Triton pass: the engine's CUDA decode), one window of the default request
(7 latents, 28 tiles of 16x16 latents: 1797 tokens each).

    PYTHONPATH=src python bench/decode_batch.py --out bench/results/decode-batch.json

1. Row invariance of each kernel on its own: each projection of a block (and the embedding and the head) on a batch
   of B tiles' rows against the same rows alone, cuDNN attention on B sequences against one; bitwise or not.
2. The window's 28 tiles decoded B at a time (B = 1, 2, 4, 7, 14), each batch's tiles against the one-at-a-time
   tiles bit for bit; time (CUDA events) and peak memory; then the same batches replayed from a CUDA graph.
3. The launch choices of the exact norm passes (`triton_decoder.LAUNCH`), each timed alone on 4 tiles' rows and
   compared bit for bit with the default choice (stops adding choices after --sweep-s seconds: compiles are slow).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from decode import build, profile
from lib.timing import run_header, time_ms

from h3serve.accel import triton_decoder
from h3serve.accel.vae import decoder_passes, set_decoder_passes
from h3serve.model.ops import attention
from h3serve.model.video_vae import TileGrid

AUTOCAST = torch.float16


def invariance(vae, device: torch.device, tokens: int, batches: tuple[int, ...]) -> dict:
    """Each linear of the decoder's first block (and the embedding and head) and its attention: B sequences' rows
    in one call against one sequence's rows alone."""
    dec = vae.decoder
    block = dec.transformer_blocks[0]
    g = torch.Generator(device).manual_seed(3)
    layers = {
        "x_embedder": dec.x_embedder, "to_qkv": block.attn.to_qkv, "to_out": block.attn.to_out,
        "w1": block.ff.w1, "w2": block.ff.w2, "proj_out": dec.proj_out,
    }  # fmt: skip
    out: dict = {}
    for name, layer in layers.items():
        x = torch.randn(max(batches), tokens, layer.in_features, device=device, generator=g, dtype=AUTOCAST)
        one = F.linear(x[:1], layer.weight, layer.bias)
        out[name] = {b: bool(torch.equal(F.linear(x[:b], layer.weight, layer.bias)[:1], one)) for b in batches}
        # Row-chunked (the FFN in pieces): the first half of one sequence's rows alone.
        half = tokens // 2
        out[name]["rows_half"] = bool(torch.equal(F.linear(x[0, :half], layer.weight, layer.bias), one[0, :half]))
    heads, hd = vae.cfg.decoder_num_attention_heads, vae.cfg.decoder_attention_head_dim
    q, k, v = (torch.randn(max(batches), tokens, heads, hd, device=device, generator=g, dtype=AUTOCAST)
               for _ in range(3))  # fmt: skip
    kernel = block.attn.kernel
    one = attention(q[:1], k[:1], v[:1], kernel=kernel)
    out["attention"] = {b: bool(torch.equal(attention(q[:b], k[:b], v[:b], kernel=kernel)[:1], one)) for b in batches}
    return out


def tiles_of(vae, z: torch.Tensor) -> list[torch.Tensor]:
    """The window's tiles' latents after post_quant_conv (each alone, as `VideoVAE.decode_tiles` runs it)."""
    grid = TileGrid.of(vae.cfg, z.shape[-2], z.shape[-1], True)
    with torch.autocast("cuda", dtype=AUTOCAST):
        return [vae.post_quant_conv(grid.latents(z, k)) for k in range(grid.count)]


def run_batched(vae, tiles: list[torch.Tensor], b: int) -> list[torch.Tensor]:
    outs = []
    with torch.autocast("cuda", dtype=AUTOCAST):
        for s in range(0, len(tiles), b):
            outs.extend(vae.decoder(torch.cat(tiles[s : s + b])).float().unbind(0))
    return outs


class Graphed:
    """The decoder over a static batch of b tiles, captured once and replayed."""

    def __init__(self, vae, like: torch.Tensor, b: int):
        self.static = like.new_zeros((b, *like.shape[1:]))
        self.vae = vae
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.autocast("cuda", dtype=AUTOCAST):
            for _ in range(2):
                vae.decoder(self.static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.autocast("cuda", dtype=AUTOCAST):
            self.out = vae.decoder(self.static)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        self.static.copy_(batch)
        self.graph.replay()
        return self.out.clone()  # the next replay writes over the static output


def run_graphed(graphs: dict, tiles: list[torch.Tensor], b: int) -> list[torch.Tensor]:
    outs = []
    for s in range(0, len(tiles), b):
        outs.extend(graphs[b](torch.cat(tiles[s : s + b])).unbind(0))
    return outs


def peak_of(fn) -> float:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


def launch_sweep(device: torch.device, rows: int, budget_s: float) -> dict:
    """Each launch choice of the norm and qk passes timed alone, its output compared with the default's."""
    g = torch.Generator(device).manual_seed(5)
    n, heads, hd = 2048, 32, 64
    x = torch.randn(rows, n, device=device, generator=g)
    y = torch.randn(rows, n, device=device, generator=g, dtype=AUTOCAST)
    scale = torch.randn(n, device=device, generator=g) * 0.1
    w = torch.randn(n, device=device, generator=g)
    qkv = torch.randn(1, rows, heads, 3 * hd, device=device, generator=g, dtype=AUTOCAST)
    q, k, _ = qkv.chunk(3, dim=-1)
    cos, sin = torch.randn(rows, 48, device=device, generator=g), torch.randn(rows, 48, device=device, generator=g)
    choices = {
        "norm": [(4, 4), (1, 4), (2, 4), (8, 4), (4, 8), (8, 8), (16, 8)],
        "qk": [(32, 4), (16, 4), (64, 4), (64, 8), (128, 8), (32, 2), (128, 4)],
    }
    default = dict(triton_decoder.LAUNCH)
    ops = {
        "norm": lambda: triton_decoder.residual_norm(x, y, scale, w, 1e-5),
        "qk": lambda: triton_decoder.qk(q, k, 1e-5, cos, sin),
    }
    result: dict = {"rows": rows}
    start = time.monotonic()
    with torch.autocast("cuda", dtype=AUTOCAST):
        for name, fn in ops.items():
            triton_decoder.LAUNCH.update(default)
            reference = fn()
            result[name] = {}
            for choice in choices[name]:
                if time.monotonic() - start > budget_s:
                    result[name][str(choice)] = "not run (time)"
                    continue
                triton_decoder.LAUNCH[name] = choice
                got = fn()
                same = all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
                us = min(time_ms(fn, 3, 20)) * 1e3
                result[name][str(choice)] = {"us": round(us, 1), "bitwise": same}
                print("launch", name, choice, result[name][str(choice)], flush=True)
    triton_decoder.LAUNCH.update(default)
    return result


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,2,4,7,14")
    parser.add_argument("--graph-batches", default="1,4,7")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--sweep-s", type=float, default=120.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    vae = build(device)
    set_decoder_passes(vae, decoder_passes())
    batches = tuple(int(b) for b in args.batches.split(","))
    result: dict = {**run_header(device), "autocast": str(AUTOCAST)}

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=1))

    result["invariance"] = invariance(vae, device, 1797, batches)
    print("invariance", json.dumps(result["invariance"]), flush=True)
    save()

    z = torch.randn(1, 24, 7, 48, 84, device=device, generator=torch.Generator(device).manual_seed(42))
    tiles = tiles_of(vae, z)
    reference = run_batched(vae, tiles, 1)
    result["batched"] = {}
    for b in batches:
        outs = run_batched(vae, tiles, b)
        same = sum(torch.equal(o, r) for o, r in zip(outs, reference, strict=True))
        diff = max((o - r).abs().max().item() for o, r in zip(outs, reference, strict=True))
        del outs
        ms = time_ms(lambda b=b: run_batched(vae, tiles, b), 1, args.iters)
        peak = peak_of(lambda b=b: run_batched(vae, tiles, b))
        result["batched"][b] = {"ms": [round(t, 1) for t in ms], "best_ms": round(min(ms), 1), "peak_gib": peak,
                                "tiles_bitwise": f"{same}/{len(tiles)}", "max_abs_diff": diff}  # fmt: skip
        print("batched", b, result["batched"][b], flush=True)
        save()

    result["graphed"] = {}
    for b in (int(b) for b in args.graph_batches.split(",")):
        graphs: dict = {}
        try:
            graphs[b] = Graphed(vae, tiles[0], b)
            outs = run_graphed(graphs, tiles, b)
            same = sum(torch.equal(o, r) for o, r in zip(outs, reference, strict=True))
            del outs
            ms = time_ms(lambda b=b, graphs=graphs: run_graphed(graphs, tiles, b), 1, args.iters)
            result["graphed"][b] = {"ms": [round(t, 1) for t in ms], "best_ms": round(min(ms), 1),
                                    "tiles_bitwise": f"{same}/{len(tiles)}"}  # fmt: skip
        except Exception as err:  # a probe: record why a capture failed and go on
            result["graphed"][b] = {"error": repr(err)[:500]}
        print("graphed", b, result["graphed"][b], flush=True)
        del graphs
        gc.collect()
        torch.cuda.empty_cache()
        save()

    best = min(result["batched"], key=lambda b: result["batched"][b]["best_ms"])
    result["profile"] = {"batch": best, **profile(lambda: run_batched(vae, tiles, best))}
    print("profile", best, json.dumps(result["profile"]["categories_ms"]), flush=True)
    save()

    result["launch"] = launch_sweep(device, 4 * 1797, args.sweep_s)
    save()


if __name__ == "__main__":
    main()
