"""torch.profiler tables of one call: the top kernels by time, the kernel time per category (GEMM, attention,
element-wise and reductions, other) with every Triton kernel and the ops Inductor fused into it, and for a split
forward the time in each kind of collective and the GPU's idle time. On a CPU dry run: CPU ops instead of kernels."""

from __future__ import annotations

import re

import torch

from lib.timing import sync

# Collective kinds by the marks in a kernel's name (NCCL's: ncclDevKernel_SendRecv is all_to_all_single's) or a CPU
# op's (gloo's). On CUDA only kernels named nccl* count: CUTLASS's rowwise FP8 GEMM has "RowBroadcast" in its name.
COLLECTIVES = (("all_to_all", ("SendRecv", "AllToAll", "alltoall")), ("all_gather", ("AllGather", "allgather")),
               ("all_reduce", ("AllReduce", "allreduce")), ("broadcast", ("Broadcast", "broadcast")))  # fmt: skip


def kernel_table(fn, top: int = 30) -> tuple[list[dict], dict]:
    """The GPU kernels of one call by total time (torch.profiler), to see where two variants differ: the `top` kernels,
    and the per-op breakdown (`breakdown`). On a CPU dry run: the CPU ops by self time instead of kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    events = [
        (e.key, e.count, (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3) for e in prof.key_averages()
    ]
    events = [e for e in events if e[2] > 0]
    return top_kernels(events, top), breakdown(events, "CUDA kernels" if cuda else "CPU ops, self time (dry run)")


def top_kernels(events: list[tuple[str, int, float]], top: int) -> list[dict]:
    """The `top` (name, calls, ms) entries by time, as rows."""
    ranked = sorted(events, key=lambda e: -e[2])[:top]
    return [{"name": name[:160], "calls": calls, "ms": round(ms, 3)} for name, calls, ms in ranked]


# Kernel categories, tried in this order (Triton first: Inductor names a kernel after the ops it fused, which can
# include an attention op whose input it lays out; a Triton template doing a matmul counts as GEMM).
CATEGORIES = (
    ("gemm", re.compile(r"^triton_tem_.*mm")),
    ("elementwise", re.compile(r"^triton_|cpp_fused|^_\w+_kernel$")),  # Inductor's, then ours (`accel.fused`)
    ("attention", re.compile(r"sdpa|flash|fmha|attention", re.I)),
    ("gemm", re.compile(r"nvjet|cutlass|xmma|gemm|gemv|scaled_mm|f8f8bf16|cublas|^aten::(mm|addmm|bmm)$", re.I)),
    ("elementwise", re.compile(r"at::native|elementwise|reduce|^aten::", re.I)),
)
CATEGORY_NAMES = {
    "gemm": "GEMM (nvjet, CUTLASS, xmma/cuBLAS, _scaled_mm)",
    "attention": "attention (cuDNN SDPA, flash, fmha)",
    "elementwise": "element-wise and reductions (Triton, at::native)",
    "other": "other (memset, memcpy, the rest)",
}
TRITON = re.compile(r"^triton_(?P<kind>[a-z]+)_(?:fused_)?(?P<ops>.*?)(?:_\d+)?$|^_(?P<hand>\w+)_kernel$")


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def breakdown(events: list[tuple[str, int, float]], source: str) -> dict:
    """Kernel time of one forward per category (ms and share of the kernels' total), and every Triton kernel with
    the ops Inductor fused into it (the name after `triton_<kind>_fused_`)."""
    total = sum(ms for _, _, ms in events)
    cats = {
        cat: {"what": what, "ms": 0.0, "share": 0.0, "calls": 0, "kernels": 0} for cat, what in CATEGORY_NAMES.items()
    }
    triton = []
    for name, calls, ms in events:
        c = cats[category(name)]
        c["ms"] += ms
        c["calls"] += calls
        c["kernels"] += 1
        if m := TRITON.match(name):
            triton.append({
                "name": name, "kind": m["kind"] or "ours", "ops": m["ops"] or m["hand"], "calls": calls,
                "ms": round(ms, 3), "share": round(ms / total, 4) if total else 0.0,
            })  # fmt: skip
    for c in cats.values():
        c["share"] = round(c["ms"] / total, 4) if total else 0.0
        c["ms"] = round(c["ms"], 3)
    return {"source": source, "forwards": 1, "total_ms": round(total, 3), "categories": cats, "triton": triton}


TOP_KERNELS = 25  # kept per profiled forward, by time


def comm_profile(forward, device: torch.device, stand_in=None) -> dict:
    """One `forward()` under torch.profiler: its span, the kernel time per collective kind (ms), every kernel's busy
    time (the union of their intervals), the idle time in the span, and the other kernels' time per category
    (`breakdown`: GEMM, attention, element-wise, other); on a CPU the collectives' op time alone and the
    top-level ops by category. With a `stand_in` (a simulated split), the time its copies took in the forward."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    if stand_in is not None:
        stand_in.time_copies()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        forward()
        sync(device)
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and e.time_range.end > e.time_range.start
              and not e.is_user_annotation]  # fmt: skip
    per_kind = {k: 0.0 for k, _ in COLLECTIVES} | {"other_nccl": 0.0}
    for e in events:
        k = collective(e.name, cuda)
        if k is not None and not any(collective(p.name, cuda) for p in _ancestors(e)):  # CPU ops nest: the outer
            per_kind[k] += (e.time_range.end - e.time_range.start) / 1e3
    if not cuda:
        events = [e for e in events if e.cpu_parent is None]  # top-level ops for the busy time
    entry = {"collectives_ms": {k: round(v, 3) for k, v in per_kind.items()}}
    if stand_in is not None:
        entry["stand_in_ms"] = round(stand_in.take_ms(), 3)
    if events:
        span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3
        busy = _union_ms([(e.time_range.start, e.time_range.end) for e in events])
        entry |= {"span_ms": round(span, 3), "busy_ms": round(busy, 3), "idle_ms": round(span - busy, 3)}
    kernels: dict[str, list] = {}
    for e in events:
        if collective(e.name, cuda) is None:
            calls_ms = kernels.setdefault(e.name, [0, 0.0])
            calls_ms[0] += 1
            calls_ms[1] += (e.time_range.end - e.time_range.start) / 1e3
    rows = [(k, c, ms) for k, (c, ms) in kernels.items()]
    table = breakdown(rows, "kernels other than collectives" if cuda
                               else "top-level CPU ops other than collectives (dry run)")  # fmt: skip
    entry["kernels"] = {cat: v["ms"] for cat, v in table["categories"].items()} | {"total": table["total_ms"]}
    entry["top_kernels"] = top_kernels(rows, TOP_KERNELS)
    return entry


def collective(name: str, cuda: bool) -> str | None:
    """Which collective a kernel (`cuda`) or CPU op of this name is part of, or None."""
    if cuda and not name.startswith("nccl"):
        return None
    kind = next((k for k, marks in COLLECTIVES if any(m in name for m in marks)), None)
    return kind or ("other_nccl" if cuda else None)


def _ancestors(event):
    while (event := event.cpu_parent) is not None:
        yield event


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3
