"""FA4 (FlashAttention-4's forward, `accel.fa4`) alone on one GPU, beside cuDNN's attention, in one process:

1. the start's choice: `accel.attention.resolve` of the CUDA default profile (`auto`, compile) and of an explicit FA4,
   with the self-test's line and time (the first FA4 call in the process: its JIT compile, or its persistent cache);
2. the DiT's attention (56 heads x 128, bfloat16, Q, K and V as views of one fused projection) at the reference
   (6,435 rows) and default (38,247) shapes: ms and TFLOP/s of cuDNN and FA4 (CUDA events, median), FA4 against
   cuDNN (relative Frobenius error), a rerun compared bit for bit, and the first FA4 call at a row count not seen
   before (whether a new length compiles again);
3. the split's property: the 56 heads computed in groups of 2, 4, 7 and 8 heads (Q, K and V laid out as a rank
   receives them, `parallel.ranks._ulysses`) give the all-heads call's bits;
4. the video decoder's attention (32 heads x 64, float16 under its autocast) at its tile shapes (a tile of 256 px and
   one temporal chunk: 5 x 16 x 16 latent tokens + 4 registers + 1 = 1,285 rows; batches of 1 and 4; and twice the
   rows): cuDNN against FA4, to decide whether FA4 should run there.

    PYTHONPATH=src python bench/fa4_check.py --out bench/results/fa4_check.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lib.timing import run_header, time_ms

from h3serve.accel import fa4
from h3serve.accel.attention import cudnn_sdpa, resolve
from h3serve.accel.profile import Profile

DIT_HEADS, DIT_DIM = 56, 128
DIT_ROWS = {"reference": 6435, "default": 38247}
DECODER_HEADS, DECODER_DIM = 32, 64
DECODER_SHAPES = ((1, 1285), (4, 1285), (1, 2565))  # (batch, rows)
GROUPS = (2, 4, 7, 8)


def fused_views(rows: int, heads: int, dim: int, dtype: torch.dtype, batch: int = 1, seed: int = 0):
    """q, k, v (B, H, S, D) as views of one (B, S, 3, H, D) projection output, keys with a shared per-head offset."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, rows, 3, heads, dim, device="cuda", generator=gen, dtype=torch.float32)
    qkv[:, :, 1] += torch.randn(1, 1, heads, dim, device="cuda", generator=gen)  # keys share an offset per head
    qkv = qkv.to(dtype)
    return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tflops(batch: int, heads: int, rows: int, dim: int, ms: float) -> float:
    return 4 * batch * heads * rows * rows * dim / (ms * 1e-3) / 1e12


def pair(q, k, v, iters: int) -> dict:
    """cuDNN and FA4 on the same operands: median ms, TFLOP/s, FA4 against cuDNN, a rerun bitwise."""
    b, h, s, d = q.shape
    out: dict = {}
    for name, kernel in (("cudnn", cudnn_sdpa), ("fa4", fa4.fa4_sdpa)):
        ms = statistics.median(time_ms(lambda kernel=kernel: kernel(q, k, v, False), warmup=2, iters=iters))
        out[name] = {"ms": round(ms, 3), "tflops": round(tflops(b, h, s, d, ms), 1)}
    ref, got = cudnn_sdpa(q, k, v, False), fa4.fa4_sdpa(q, k, v, False)
    out["fa4_vs_cudnn_rel"] = float(f"{rel(got, ref):.2e}")
    out["fa4_rerun_bitwise"] = torch.equal(fa4.fa4_sdpa(q, k, v, False), got)
    out["speedup"] = round(out["cudnn"]["ms"] / out["fa4"]["ms"], 3)
    out["output_layout_as_cudnn"] = got.stride() == ref.stride()
    return out


def split_heads(rows: int) -> dict:
    """Each group count: whether every group of heads alone (as a rank's all-to-all hands them) gives the bits of
    the all-heads call."""
    q, k, v = fused_views(rows, DIT_HEADS, DIT_DIM, torch.bfloat16, seed=1)
    whole = fa4.fa4_sdpa(q, k, v, False)
    result = {}
    for n in GROUPS:
        hn = DIT_HEADS // n
        same = True
        for j in range(n):
            heads = slice(j * hn, (j + 1) * hn)
            # A rank's layout: (S, 3, hn, D) rows of every rank, Q, K and V strided views of it (`_ulysses`).
            recv = torch.stack([t[0, heads].transpose(0, 1) for t in (q, k, v)], dim=1).contiguous()
            qkv = recv.permute(1, 2, 0, 3)  # (3, hn, S, D)
            part = fa4.fa4_sdpa(qkv[0:1], qkv[1:2], qkv[2:3], False)
            same = same and torch.equal(part, whole[:, heads])
        result[str(n)] = same
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    record: dict = {**run_header("cuda"), "fa4_version": fa4.version(),
                    "capability": list(torch.cuda.get_device_capability())}  # fmt: skip

    def save(key: str, value) -> None:
        record[key] = value
        print(key, json.dumps(value), flush=True)
        if args.out:
            args.out.write_text(json.dumps(record, indent=2) + "\n")

    why = fa4.missing()
    if why is not None:
        save("missing", why)
        return
    start = time.perf_counter()
    chosen, line = resolve(Profile.for_device("cuda"), DIT_DIM)
    save("resolve_auto", {"attention": str(chosen.attention), "line": line, "s": round(time.perf_counter() - start, 2)})
    start = time.perf_counter()
    _, line = resolve(Profile.for_device("cuda", attention="FA4"), DIT_DIM)
    save("resolve_fa4", {"line": line, "s": round(time.perf_counter() - start, 2)})
    with torch.inference_mode():
        for name, rows in DIT_ROWS.items():
            q, k, v = fused_views(rows, DIT_HEADS, DIT_DIM, torch.bfloat16)
            torch.cuda.synchronize()
            start = time.perf_counter()
            fa4.fa4_sdpa(q, k, v, False)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            save(f"dit_{name}", {"rows": rows, "first_fa4_call_s": round(first, 3), **pair(q, k, v, args.iters)})
            del q, k, v
        save("split_heads_bitwise", split_heads(DIT_ROWS["reference"]))
        for batch, rows in DECODER_SHAPES:
            q, k, v = fused_views(rows, DECODER_HEADS, DECODER_DIM, torch.float16, batch=batch)
            fa4.fa4_sdpa(q, k, v, False)  # the float16, 64-wide kernel's compile
            save(f"decoder_b{batch}_s{rows}", {"batch": batch, "rows": rows, **pair(q, k, v, args.iters)})
            # The decoder's own call: torch's SDPA over the same views (what TORCH_SDPA would pick), for scale.
            ms = statistics.median(time_ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v), 2, 10))
            record[f"decoder_b{batch}_s{rows}"]["torch_sdpa_ms"] = round(ms, 3)
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
