"""Adapters at run time against merged (issue 57), one DiT forward at a time on one GPU, in one process.

The full-width DiT (random weights, `--blocks` of the released 50 main blocks: the per-forward ratio is per block)
and three synthetic adapters of LightX2V's published shape (`lora.write_lightx2v`: rank `--rank` on every block and
refiner linear), declared as the engine declares them (`AdapterLibrary`, page-locked, a host cache that holds all
three; a second library that holds two of them times the third's first use, a read from disk). For `--linear`
(CUTLASS, or BF16), compiled:

1. merged: adapter `a` merged into the BF16 weights (float32, rounded once) before the profile's linears are made;
   forwards at the reference shape (768x448x56) and the default request's (1344x768x124); the exact reference is
   the same merged weights in BF16, eager (what diffusers + peft fused computes);
2. plain: the same weights without the adapter, compiled: the forwards, and its outputs;
3. run time: the plain weights wrapped (`accel.lora.RuntimeAdapters`): with no adapter applied, bit for bit the
   plain outputs; with `a` applied, the forwards and their error against the exact reference beside the merged
   profile's, for each variant (the width one adapter needs or the buffers' full; over FP8 bases the delta in the
   base's own GEMM, or an addmm beside it with the down projection in FP8 or on dequantized rows), the engine's own
   last; then every switch between the adapters (host
   cache, and the first use from disk) and the graphs compiled and recompiled over 10 requests alternating a, b, c
   and none.

`--tiny` runs the plumbing on the CPU (the tiny DiT, eager, BF16): a dry run, not a benchmark.

    PYTHONPATH=src python bench/lora_runtime.py --blocks 20 --out bench/results/lora_runtime.json
    # --max-active 2 (the server's default): buffers at two adapters' rank, one applied; --linear BF16
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lib import models
from lib.shapes import SHAPES, forward, inputs, rel
from lib.timing import run_header, time_ms
from lib.variants import configure, restore, swap_linears, uncompile
from lora import write_lightx2v

from h3serve.accel.adaln import AdalnTables
from h3serve.accel.lora import RuntimeAdapters
from h3serve.checkpoint.adapters import merge_into, read_adapter
from h3serve.checkpoint.adapters.library import AdapterLibrary

ATTENTION = "CUDNN_ATTN"  # TORCH_SDPA on a CPU dry run
SWITCHES = (["a"], ["b"], ["a", "b"], [], ["c"], ["a"])  # two at once only where --max-active allows
ALTERNATING = (["a"], ["b"], ["c"], [], ["a"], ["b"], ["c"], [], ["a"], [])


class Record:
    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def targeted(dit) -> dict[str, torch.Tensor]:
    """Every block and refiner linear's weight, by name (what the adapters change)."""
    return {n: p for n, p in dit.named_parameters() if ("blocks." in n and ".adaln_proj." not in n and
                                                        n.endswith(".weight") and p.ndim == 2)}  # fmt: skip


def timed_shapes(dit, xs: dict, warmup: int, iters: int) -> dict:
    """Per shape: the median forward (ms) and the output of one more."""
    out = {}
    for name, x in xs.items():
        ms = time_ms(lambda x=x: forward(dit, x), warmup, iters)
        out[name] = {"ms": round(statistics.median(ms), 2), "spread": [round(min(ms), 2), round(max(ms), 2)]}
    return out


def outputs(dit, xs: dict) -> dict:
    return {name: forward(dit, x) for name, x in xs.items()}


def errors(got: dict, want: dict) -> dict:
    return {name: [round(rel(g, w), 6) for g, w in zip(got[name], want[name], strict=True)] for name in got}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--blocks", type=int, default=20, help="DiT main blocks (of the released 50)")
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--linear", default="CUTLASS", choices=("CUTLASS", "BF16"))
    parser.add_argument(
        "--max-active", type=int, default=2, help="adapters at once the buffers hold (the server's default: 2)"
    )
    parser.add_argument("--quick", action="store_true", help="the engine's way and the second-GEMM way only, width one")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a CPU dry run of the plumbing (tiny DiT, eager BF16)")
    args = parser.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    execution = "eager" if args.tiny else "compile"
    linear = "BF16" if args.tiny else args.linear
    attention = "TORCH_SDPA" if args.tiny else ATTENTION
    rec = Record(args.out, {**run_header(dev), "blocks": args.blocks, "rank": args.rank, "linear": linear,
                            "max_active": args.max_active,
                            "execution": execution, "attention": attention})  # fmt: skip
    torch.manual_seed(0)
    dit = models.tiny_dit() if args.tiny else models.build_dit(torch.device("cuda"), args.blocks)
    cfg = dit.config
    xs = {}
    for shape_name in ("reference", "default"):
        shape = SHAPES[shape_name][1 if args.tiny else 0]
        xs[shape_name] = inputs(dit, shape["text"], shape, dev)
        xs[shape_name]["tables"] = AdalnTables(dit, weights="device").for_steps([xs[shape_name]["timesteps"]])[0]
    rec.data["rows"] = {name: int(x["token_tags"].shape[0]) for name, x in xs.items()}

    folder = Path(tempfile.mkdtemp(prefix="lora_runtime_"))
    paths = {}
    for seed, name in enumerate("abc"):
        paths[name] = folder / f"{name}.safetensors"
        write_lightx2v(paths[name], cfg, args.rank, seed=seed)
    one = paths["a"].stat().st_size
    start = time.perf_counter()
    declared = [(n, p, 1.0) for n, p in paths.items()]
    library = AdapterLibrary(
        declared, cfg, 4 * one, args.max_active, pin=dev == "cuda"
    )  # a file is no smaller than its factors
    rec.data["declare_s"] = round(time.perf_counter() - start, 2)
    rec.data["adapter_gib"] = round(library.catalog.entries["a"].nbytes / 2**30, 3)
    rec.data["held_at_start"] = list(library.held)

    # 1. merged, and the exact reference (the merged BF16 weights, eager)
    plain_weights = {n: p.detach().to("cpu", copy=True) for n, p in targeted(dit).items()}
    merge_into(dit, [read_adapter(paths["a"], config=cfg)])
    configure(dit, attention, "eager", "BF16", dev)
    exact = {name: tuple(t.float().cpu() for t in out) for name, out in outputs(dit, xs).items()}
    kept = swap_linears(dit, linear)
    counter = configure(dit, attention, execution, linear, dev)
    merged_out = outputs(dit, xs)
    rec.data["merged"] = timed_shapes(dit, xs, args.warmup, args.iters)
    rec.data["merged_error_vs_exact"] = errors({k: tuple(t.float().cpu() for t in v) for k, v in merged_out.items()},
                                               exact)  # fmt: skip
    del merged_out
    rec.save()
    print("merged", rec.data["merged"], rec.data["merged_error_vs_exact"], flush=True)

    # 2. plain: the weights as they were
    uncompile(dit, *xs.values())
    torch._dynamo.reset()
    if kept is not None:
        restore(dit, kept)
    with torch.no_grad():
        for name, p in targeted(dit).items():
            p.copy_(plain_weights[name])
    del plain_weights
    swap_linears(dit, linear)
    counter = configure(dit, attention, execution, linear, dev)
    plain_out = outputs(dit, xs)
    rec.data["plain"] = timed_shapes(dit, xs, args.warmup, args.iters)
    rec.save()
    print("plain", rec.data["plain"], flush=True)

    # 3. run time: wrapped once, then applied
    runtime = RuntimeAdapters(dit, library, "fl2va", torch.bfloat16, torch.device(dev), keep_factors=True)
    rec.data["buffer_gib"] = round(runtime.buffer_bytes / 2**30, 3)
    none_out = outputs(dit, xs)
    rec.data["none_bitwise_plain"] = {
        name: all(torch.equal(g, w) for g, w in zip(none_out[name], plain_out[name], strict=True)) for name in xs
    }
    rec.data["runtime_none"] = timed_shapes(dit, xs, args.warmup, args.iters)
    del none_out, plain_out
    runtime.activate([("a", 1.0)])
    # The variants, each compiled in turn, the engine's own (first) last so the rest runs it: `width` one adapter's
    # rank or the buffers' full (two adapters' at --max-active 2); over FP8 bases the delta in the base's own GEMM
    # (wide: resident blocks), or the up projection accumulating into the base's output with the down projection in
    # FP8 on the fused rows (streamed blocks) or on the rows dequantized.
    fp8_bases = any(hasattr(m, "lora_down_q") for m in runtime.linears.values())
    ways = ("wide", "addmm, down fp8", "addmm, down dequantized") if fp8_bases else ("addmm",)
    ways = ways[:2] if args.quick else ways
    variants = [(way, "one") for way in ways] + ([(ways[0], "full")] if args.max_active > 1 and not args.quick else [])
    variants.append(variants[0])
    applied = {target: m.width for target, m in runtime.linears.items()}
    rec.data["runtime_variants"] = {}
    for n, (way, width) in enumerate(variants):
        for target, m in runtime.linears.items():
            m.width = applied[target] if width == "one" else m.lora_down.shape[0]
            m.use_wide = way == "wide" and hasattr(m, "wide")
            m.down_fp8 = way == "addmm, down fp8" and hasattr(m, "lora_down_q")
        name = "engine" if n == len(variants) - 1 else f"{way}, width {width}"
        got = outputs(dit, xs)
        mine = {k: tuple(t.float().cpu() for t in v) for k, v in got.items()}
        row = {"forward": timed_shapes(dit, xs, args.warmup, args.iters), "error_vs_exact": errors(mine, exact)}
        row["over_merged"] = {k: round(row["forward"][k]["ms"] / rec.data["merged"][k]["ms"], 4) for k in xs}
        rec.data["runtime_variants"][name] = row
        rec.save()
        print("runtime", name, row, flush=True)
    del got
    engine = rec.data["runtime_variants"]["engine"]
    rec.data["runtime_a"], rec.data["runtime_error_vs_exact"] = engine["forward"], engine["error_vs_exact"]
    rec.data["runtime_over_merged"] = engine["over_merged"]
    rec.save()

    switches = []
    for names in SWITCHES:
        if len(names) > args.max_active:
            continue
        done = runtime.activate([(n, 1.0) for n in names])
        switches.append({"to": names, "s": round(done.seconds, 4), "from_disk_s": round(done.read_seconds, 4)})
    rec.data["switches"] = switches
    factors = library.catalog.entries["a"].nbytes
    small = AdapterLibrary(declared, cfg, int(2.5 * factors), 1, pin=dev == "cuda")  # holds b and c
    _, seconds = small.get("a")
    rec.data["first_use_from_disk_s"] = round(seconds, 6)
    del small
    graphs = counter.graphs if counter is not None else None
    recompiles = counter.recompiles if counter is not None else None
    first = None
    for i, names in enumerate(ALTERNATING):
        runtime.activate([(n, 1.0) for n in names])
        out = forward(dit, xs["reference"])
        if i == 0:
            first = copy.copy(out)
        if i == 4:  # a again: the same bits as the first time
            rec.data["a_again_bitwise"] = all(torch.equal(g, w) for g, w in zip(out, first, strict=True))
    if counter is not None:
        rec.data["alternating"] = {"requests": len(ALTERNATING), "graphs_before": graphs,
                                   "graphs_after": counter.graphs, "recompiles_before": recompiles,
                                   "recompiles_after": counter.recompiles}  # fmt: skip
    rec.data["library"] = {"reads": library.reads, "evictions": library.evictions, "held": list(library.held)}
    rec.save()
    print("switches", switches, rec.data.get("alternating"), rec.data["library"], flush=True)


if __name__ == "__main__":
    main()
