"""Each fused block pass (`h3serve.accel.fused`) at the released block's widths, against Inductor's code for the same
reference ops (and the reference ops run eagerly), and each pass's launch choices (`triton_block.LAUNCH`: chunk
width, warps), on one GPU.

Per pass: the median time of one launch replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`, so the
host's launch cost is not in it), the bytes it must move (each input read
once, each output written once) and the rate that makes; Inductor's compiled reference in the same run; the pass's
largest difference from the eager reference. The rows are the reference shape's 6435 (or `--rows`).

    PYTHONPATH=src:bench python bench/fused_passes.py --out bench/results/fused_passes.json
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from lib.timing import run_header

from h3serve.accel import fused
from h3serve.config import DiTConfig
from h3serve.model.dit import TABLE_ROWS

RELEASED = DiTConfig()
HIDDEN, FFN, INNER = RELEASED.hidden_size, RELEASED.ffn_hidden_size, RELEASED.inner_dim  # the block's widths
CHUNKS = (1024, 2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)


def cases(s: int) -> dict:
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).cuda()

    x, y = rand(s, HIDDEN, scale=2), rand(s, HIDDEN)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16).cuda()
    table = rand(TABLE_ROWS, 6 * HIDDEN, scale=0.3)
    idx = torch.randint(0, 6, (s,), generator=g).cuda()
    f, out = rand(s, 2 * FFN, scale=2), rand(s, INNER, scale=3)
    row = s * HIDDEN * 2  # one (S, hidden) bf16 tensor, bytes
    return {
        # name: (pass, args, bytes moved: inputs once + outputs once)
        "norm_modulate": ("norm_modulate", (x, None, w, table, idx, 1e-6, 0, 0, 1, False), 2 * row),
        "norm_modulate+residual": ("norm_modulate", (x, y, w, table, idx, 1e-6, 2, 3, 4, False), 4 * row),
        "norm_modulate+fp8": ("norm_modulate", (x, None, w, table, idx, 1e-6, 0, 0, 1, True), 1.5 * row),
        "norm_modulate+residual+fp8": ("norm_modulate", (x, y, w, table, idx, 1e-6, 2, 3, 4, True), 3.5 * row),
        "swiglu": ("swiglu", (f, False), s * FFN * (4 + 2)),
        "swiglu+fp8": ("swiglu", (f, True), s * FFN * (4 + 1)),
        "quantize_rows": ("quantize_rows", (out,), s * INNER * 3),
        # the eager profile's exact passes around torch's own rms_norm (x stands for its normalised output)
        "modulate": ("modulate", (x, table, idx, 0, 1, False), 2 * row),
        "modulate+fp8": ("modulate", (x, table, idx, 3, 4, True), 1.5 * row),
        "gated_residual": ("gated_residual", (x, y, table, idx, 2), 3 * row),
    }


def max_diff(got, want) -> float:
    """Largest difference of the pass's main output from the reference's (dequantized for e4m3)."""
    if torch.is_tensor(got):
        return (got.float() - want.float()).abs().max().item()
    a, b = (got[1], got[2]) if len(got) == 3 else (got[0], got[1])
    c, d = (want[1], want[2]) if len(want) == 3 else (want[0], want[1])
    if a.dtype == torch.float8_e4m3fn:
        a, c = a.float() * b, c.float() * d
    return (a.float() - c.float()).abs().max().item()


def gpu_ms(fn) -> float:
    """One call's GPU time: median of replays of a CUDA graph of it."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=50, return_mode="median")


def reference_times(reference, call: tuple) -> dict:
    """The reference ops' time, compiled by Inductor (each case its own compile: the cases share one wrapper's code,
    which would hit the recompile limit) and run eagerly (what eager ran before the passes)."""
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(reference, *call), fullgraph=True)
    compiled()
    return {
        "inductor_ms": round(gpu_ms(compiled), 4),
        "eager_reference_ms": round(gpu_ms(functools.partial(reference, *call)), 4),
    }


def summarized(name: str, entry: dict, chosen: tuple[int, int]) -> dict:
    """The entry with the chosen launch and the fastest timed one; printed without its variants."""
    entry["chosen"] = "{}x{}".format(*chosen)
    timed = {key: v["ms"] for key, v in entry["variants"].items() if "ms" in v}
    entry["best"] = min(timed, key=timed.get)
    entry["best_ms"] = timed[entry["best"]]
    print(name, {key: v for key, v in entry.items() if key != "variants"}, flush=True)
    return entry


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6435)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="", help="comma-separated pass names (qk_norm_rope, qk_rope included)")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    kernels = fused.triton_kernels()
    from h3serve.accel import triton_block

    record = {**run_header(), "rows": args.rows, "passes": {}}
    chosen = dict(triton_block.LAUNCH)
    for name, (op, call, nbytes) in cases(args.rows).items():
        if only and name not in only:
            continue
        eager_rounding = call[-1] is not True  # the FP8 passes run as the CUTLASS profile does
        reference = getattr(fused.REFERENCES, op)  # called as the op is, by position (the same parameters)
        kernel = kernels[op]
        kargs = (*call, eager_rounding) if op in ("norm_modulate", "swiglu") else call
        want = reference(*call)
        entry: dict = {"bytes": nbytes, "variants": {}, **reference_times(reference, call)}
        entry["inductor_tb_s"] = round(nbytes / entry["inductor_ms"] / 1e9, 2)
        for chunk in CHUNKS:
            for warps in WARPS:
                if chunk // (32 * warps) < 1 or chunk // (32 * warps) > 64:
                    continue
                triton_block.LAUNCH[name] = (chunk, warps)
                try:
                    got = kernel(*kargs)
                    ms = gpu_ms(functools.partial(kernel, *kargs))
                    entry["variants"][f"{chunk}x{warps}"] = {
                        "ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 2), "max_diff": max_diff(got, want)
                    }  # fmt: skip
                except Exception as err:  # a launch that does not fit (registers): recorded, not fatal
                    entry["variants"][f"{chunk}x{warps}"] = {"error": f"{type(err).__name__}: {err}"[:300]}
        triton_block.LAUNCH[name] = chosen[name]
        record["passes"][name] = summarized(name, entry, chosen[name])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    qk_passes(args.rows, record, only)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


def qk_passes(s: int, record: dict, only: set[str]) -> None:
    """The qk-norm + rotary pass (the compiled block's) and the rotary alone (the eager passes', after torch's
    rms_norm), over (BLOCK_M, warps) choices (`triton_qk_norm_rope.LAUNCH`), against the reference ops (Inductor's
    and eager) at the released head layout: q and k views of one fused QKV projection."""
    from h3serve.accel import triton_qk_norm_rope as qk
    from h3serve.model import ops

    g = torch.Generator().manual_seed(1)
    heads, d = RELEASED.num_attention_heads, RELEASED.attention_head_dim
    qkv = (torch.randn(s, 3 * INNER, generator=g) * 3).to(torch.bfloat16).cuda()
    q, k, _ = (t.unflatten(-1, (heads, d)) for t in qkv.chunk(3, dim=-1))
    qw, kw = ((1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).cuda() for _ in range(2))
    cos, sin = (t.cuda() for t in ops.rotary_table(torch.rand(s, RELEASED.rotary_dim // 2, generator=g) * 40))
    call = (q, k, qw, kw, 1e-6, cos, sin)
    nbytes = 4 * s * INNER * 2  # q and k read, q and k written
    kernels = fused.triton_kernels()
    cases = {"qk_norm_rope": (fused.qk_kernel(kernels, exact=False), ops.qk_norm_rope_reference),
             "qk_rope": (fused.qk_kernel(kernels, exact=True), ops.qk_norm_rope_reference)}  # fmt: skip
    chosen = dict(qk.LAUNCH)
    for name, (kernel, reference) in cases.items():
        if only and name not in only:
            continue
        want = reference(*call)
        entry: dict = {"bytes": nbytes, "variants": {}, **reference_times(reference, call)}
        for block_m in (2, 4, 8, 16, 32):
            for warps in (1, 2, 4, 8):
                qk.LAUNCH[name] = (block_m, warps)
                got = kernel(*call)
                ms = gpu_ms(functools.partial(kernel, *call))
                differ = sum((a != b).sum().item() for a, b in zip(got, want, strict=True)) / (2 * q.numel())
                entry["variants"][f"{block_m}x{warps}"] = {"ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 2),
                                                           "differ": differ}  # fmt: skip
        qk.LAUNCH[name] = chosen[name]
        record["passes"][name] = summarized(name, entry, chosen[name])


if __name__ == "__main__":
    main()
