"""One DiT forward at the reference (or released default) shape, every profile of ours and the peer, on one GPU.

The full-size DiT from the released config with random weights (fixed seed, never zeros), the reference packed
shape of docs/model.md §6 (T2VA 768x448, 56 frames: 537 text + 186 audio + 5712 video rows = 6435), or with
`--shape default` the released default request (T2VA 1344x768, 124 frames: 537 text + 414 audio + 37296 video rows =
38247, where attention dominates; `--warmup 1 --iters 3` unless given), then:

1. ours, for each profile (attention TORCH_SDPA | CUDNN_ATTN | FA4 | CUDNN_FP8 | CUDNN_FP8_NAIVE) x (linear BF16 |
   CUTLASS) x (execution eager | compile), HUMMING eager, and with cuDNN attention the compile variants
   `lib.variants.EXECUTIONS` lists (the fused passes in
   part or not at all, a CUDA-graph replay, static shapes): median of `--iters` forwards after warm-up (CUDA
   events), the first compiled call's time, peak memory, two further forwards compared bit for bit, and for
   compile the graphs compiled and recompiles after a second input of another length (300 text rows);
2. our weights exported in diffusers' layout (by diffusers' own converter) into diffusers' MiniMaxH3Transformer3DModel
   (the peer; ours is freed first: the peer alone peaks at 134 GB), eager and with `compile_repeated_blocks`;
3. each profile's output against the peer's eager output (relative error, video and audio rows).

With an FP8 attention profile in the run, `attention_op` times one attention call at the run's row count alone
(cuDNN bfloat16, the FP8 backend with its quantization, naive, and cuDNN's FP8 kernel alone); with an FA4 profile,
FA4 alone beside cuDNN bfloat16 on Q, K and V as strided views of one fused projection, as the DiT gives them
(`attention_op["fa4"]`: ms, TFLOP/s, reruns bitwise, FA4's output against cuDNN's and both against float32
attention). With `--block-errors`, every profile's hidden state after each block is compared with the exact
profile's (CUDNN_ATTN+eager+BF16, which must be in the run) on `--block-rows` rows: where a lossy profile's error
grows.

Ours runs as the engine does, with the blocks' AdaLN tables made once before the forwards (bitwise the same
modulation); the peer computes its AdaLN projection inside every forward, as it always does.

With `--kernels`, every compiled profile (ours and the peer's) gets a per-op breakdown of one forward
(torch.profiler): the top kernels by time (`kernels`), and `kernel_breakdown`: kernel time per category (GEMM,
attention, element-wise and reductions, other) in ms per forward and share of the kernels' total, and every Triton
kernel with the ops Inductor fused into it.

Results go to `--out` as JSON after every step, so a run cut short keeps what it measured.

    PYTHONPATH=src python bench/dit_step.py --out bench/results/dit_step.json
    PYTHONPATH=src python bench/dit_step.py --kernels --only CUDNN_ATTN+compile+BF16,CUDNN_ATTN+compile+CUTLASS,\
        diffusers+compile --out bench/results/dit_step_kernels.json    # add --shape default for 1344x768x124

`--only` picks our profiles by name; the peer runs eager and compiled unless `--only` names a `diffusers+` profile,
then only those named (the errors against the peer need `diffusers+eager`, or `diffusers+offload`). Where the peer
does not fit the card resident (all 50 blocks with ours freed still take more than 80 GB at the default shape),
`diffusers+offload` runs by itself: diffusers' group offloading, a block at a time with CUDA streams, what a diffusers
user on that card has; name it to run it anyway. A CPU dry run of the plumbing:
`--tiny` (`--shape default` then takes a tiny canvas 4x the tiny reference's rows; CPU ops instead of kernels).

FA4 (FlashAttention-4's forward kernel, `accel.fa4`) runs only on a CUDA GPU of sm90 or newer with the `fa4` extra
installed. Where it cannot (the `--tiny` dry run, or `accel.fa4.missing()` says why), a run without `--only` leaves its
profiles out and records why under `skipped_attentions`; `--only` naming one stops before anything is built, with the
reason. FA4 against cuDNN attention, compiled, with BF16 and CUTLASS linears; the whole forward's errors against the
peer's eager output and the exact profile's (the two are the same bits at the reference shape); the peer compiled:

    PYTHONPATH=src python bench/dit_step.py --only CUDNN_ATTN+eager+BF16,CUDNN_ATTN+compile+BF16,FA4+compile+BF16,\
        CUDNN_ATTN+compile+CUTLASS,FA4+compile+CUTLASS,diffusers+eager,diffusers+compile \
        --out bench/results/dit_step_fa4.json
    # the same with --shape default (1344x768x124) --out bench/results/dit_step_fa4_default.json

The linear `CUTLASS_EPILOGUE` (profiles named in `--only` only, never in a run without it): CUTLASS's e4m3 weights
with the EPILOGUE scaling (`accel.linear.Fp8Scaling`: a per-tensor GEMM to float32, then the row and column scales
and the cast), the fallback for GPUs whose rowwise-scaled GEMM fails (`accel.fp8_check`); the same weights as CUTLASS,
so that one run times both and records each one's whole-forward error against the exact profile:

    PYTHONPATH=src python bench/dit_step.py --only CUDNN_ATTN+eager+BF16,CUDNN_ATTN+compile+CUTLASS,\
        CUDNN_ATTN+compile+CUTLASS_EPILOGUE,diffusers+eager --out bench/results/dit_step_epilogue.json
    # the same with --shape default (1344x768x124) --out bench/results/dit_step_epilogue_default.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lib import models, peer
from lib.profiler import kernel_table
from lib.shapes import SHAPES, TIMING, forward, inputs, rel, text_states
from lib.split import Job, environment, run_group, scaling
from lib.timing import allocated, peak, reset_peak, run_header, sync, time_ms
from lib.variants import (
    ATTENTIONS,
    EXACT,
    EXECUTIONS,
    FP8_ATTENTIONS,
    LINEARS,
    NAMED_ONLY,
    GraphReplay,
    configure,
    missing,
    naive_sdpa,
    profile_linear,
    restore,
    swap_linears,
    uncompile,
    wanted,
)

from h3serve.accel import attention
from h3serve.accel.adaln import AdalnTables


class Record:
    def __init__(self, path: Path):
        self.path = path
        self.data: dict = {
            **run_header(),
            "profiles": {},
        }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def kernel_tabled(name: str) -> bool:
    """Which profiles `--kernels` breaks down: every compiled one, ours (BF16 and CUTLASS) and the peer's."""
    return "+eager" not in name


class BlockStates:
    """The hidden state after every main block of one forward, on a fixed subset of its rows (float32, on the
    device): where a lossy profile's error against the exact one grows (`--block-errors`)."""

    def __init__(self, states: list[torch.Tensor]):
        self.states = states

    @classmethod
    def capture(cls, dit, run: Callable[[], object], rows: int) -> BlockStates:
        states: list[torch.Tensor] = []

        def keep(module, args, output):
            step = max(1, output.shape[0] // rows)
            states.append(output[::step][:rows].float().clone())

        hooks = [block.register_forward_hook(keep) for block in dit.blocks]
        try:
            run()
        finally:
            for hook in hooks:
                hook.remove()
        return cls(states)

    def rel_errors(self, exact: BlockStates) -> list[float]:
        return [round(rel(a, b), 5) for a, b in zip(self.states, exact.states, strict=True)]


def attention_op(rows: int, cfg, iters: int = 10, fp8: bool = True, fa4: bool = False) -> dict:
    """One attention call at this row count and the DiT's heads, alone (ms, CUDA events). With `fp8`: cuDNN bfloat16,
    the FP8 backend whole (its scales and quantization included) and naive, and cuDNN's FP8 SDPA alone on quantized
    inputs; each FP8 output's relative error against bfloat16's. With `fa4`: FA4 beside cuDNN bfloat16 (`fa4_op`)."""
    out: dict = {"rows": rows, "heads": cfg.num_attention_heads, "head_dim": cfg.attention_head_dim}
    if fp8:
        out |= fp8_op(rows, cfg, iters)
    if fa4:
        out["fa4"] = fa4_op(rows, cfg, iters)
    return out


def fp8_op(rows: int, cfg, iters: int) -> dict:
    """`attention_op`'s FP8 part: cuDNN bfloat16 and the FP8 kernels on separate random q, k, v."""
    from h3serve.accel.attention import cudnn_sdpa
    from h3serve.accel.fp8_attention import fp8_sdpa, quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, d = cfg.num_attention_heads, cfg.attention_head_dim
    q, k, v = (torch.randn(1, rows, h, d, generator=gen, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))  # fmt: skip
    k = k + 2.0 * torch.randn(1, h, 1, d, generator=gen, device="cuda", dtype=torch.bfloat16)  # a shared key offset
    q8, k8, v8, scales = quantize(q, k, v)
    kernels = {
        "cudnn_bf16": lambda: cudnn_sdpa(q, k, v, False),
        "cudnn_fp8": lambda: fp8_sdpa(q, k, v, False),
        "cudnn_fp8_naive": lambda: naive_sdpa(q, k, v, False),
        "cudnn_fp8_op_alone": lambda: torch.ops.h3serve.cudnn_fp8_sdpa(q8, k8, v8, scales.descale),
    }
    out: dict = {"inputs": "randn, keys with a shared per-head offset of 2"}
    exact = kernels["cudnn_bf16"]()
    for name, fn in kernels.items():
        try:
            ms = time_ms(fn, 3, iters)
            out[name] = {"ms_median": round(statistics.median(ms), 3)}
            if name in ("cudnn_fp8", "cudnn_fp8_naive"):
                out[name]["rel_err_vs_bf16"] = round(rel(fn(), exact), 5)
        except Exception as err:
            out[name] = {"error": f"{type(err).__name__}: {err}"[:1000]}
    return out


def fa4_op(rows: int, cfg, iters: int) -> dict:
    """FA4 (`accel.fa4.fa4_sdpa`) and cuDNN bfloat16 on the same operands: Q, K and V strided views of one fused
    projection's output, as the DiT hands them over (row stride 3 x heads x head_dim; no copy). Each: ms, TFLOP/s
    (4 S^2 H D per call), a rerun compared bit for bit, and the relative error against float32 attention of the same
    bfloat16 operands (torch's memory-efficient kernel); FA4's output against cuDNN's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from h3serve.accel import fa4
    from h3serve.accel.attention import cudnn_sdpa

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, d = cfg.num_attention_heads, cfg.attention_head_dim
    qkv = torch.randn(1, rows, 3 * h * d, generator=gen, device="cuda", dtype=torch.bfloat16)  # (1, S, 3 H D)
    qkv[..., h * d : 2 * h * d] += 2.0 * torch.randn(h * d, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (1, H, S, D) views
    kernels = {"cudnn_bf16": lambda: cudnn_sdpa(q, k, v, False), "fa4": lambda: fa4.fa4_sdpa(q, k, v, False)}
    flops = 4 * h * rows**2 * d
    out: dict = {"version": fa4.version(), "inputs": "randn as one fused q|k|v projection (strided views), keys "
                 "with a shared per-head offset of 2"}  # fmt: skip
    results = {}
    for name, fn in kernels.items():
        try:
            first, again = fn(), fn()  # the first call compiles FA4's kernel (or loads it from its cache)
            ms = statistics.median(time_ms(fn, 3, iters))
            out[name] = {"ms_median": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
                         "rerun_bitwise_identical": bool(torch.equal(first, again))}  # fmt: skip
            results[name] = first
        except Exception as err:
            out[name] = {"error": f"{type(err).__name__}: {err}"[:1000]}
    if len(results) == 2:
        out["fa4"]["rel_diff_vs_cudnn_bf16"] = round(rel(results["fa4"], results["cudnn_bf16"]), 6)
        out["fa4"]["speedup_vs_cudnn_bf16"] = round(out["cudnn_bf16"]["ms_median"] / out["fa4"]["ms_median"], 3)
    try:  # held to the memory-efficient kernel: the math one would hold S^2 H float32 scores
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        for name, got in results.items():
            out[name]["rel_err_vs_float32"] = round(rel(got, want), 6)
    except Exception as err:
        out["float32_reference_error"] = f"{type(err).__name__}: {err}"[:1000]
    return out


def skipped_attentions(measured: set[str], dev: str) -> dict[str, str]:
    """The attention backends among `measured` that a run on `dev` leaves out, each with why (`variants.missing`)."""
    return {attn: why for attn in sorted(measured) if (why := missing(attn, dev)) is not None}


def only_refusal(only: list[str] | None, tiny: bool) -> str | None:
    """Why `--only` names a profile this run cannot measure (its attention backend cannot run here: `missing`), or
    None. Asked before anything is built, so a GPU run that would measure nothing of what it was asked for stops at
    once, with the reason."""
    for name in only or ():
        attn = name.split("+")[0]
        if attn in ATTENTIONS and (why := missing(attn, "cpu" if tiny else "cuda")) is not None:
            return f"--only {name}: {why}"
    return None


@torch.no_grad()
def run_ours(rec: Record, args) -> tuple[dict, dict]:
    torch.manual_seed(0)
    dev = "cpu" if args.tiny else "cuda"
    shape = SHAPES[args.shape][1 if args.tiny else 0]
    dit = models.tiny_dit() if args.tiny else models.build_dit(torch.device("cuda"), args.blocks)
    rec.data["weights_gib"] = round(allocated() / 2**30, 2)
    x = inputs(dit, shape["text"], shape, dev)
    other = inputs(dit, shape["other_text"], shape, dev, seed=1)
    layout = x["layout"]
    rec.data["shape"] = {
        "name": args.shape + (" (tiny)" if args.tiny else ""),
        **shape,
        "rows": {"text": shape["text"], "audio": layout.num_audio_rows, "video": layout.num_video_rows},
    }
    rec.data["warmup"], rec.data["iters"], rec.data["blocks"] = args.warmup, args.iters, len(dit.blocks)
    # The engine makes every block's modulation table before the denoise loop (h3serve.accel.adaln); so does this
    # benchmark, once: the 26 GB AdaLN projection is not part of a forward any more (the peer's forward includes it).
    x["tables"] = other["tables"] = AdalnTables(dit, weights="device").for_steps([x["timesteps"]])[0]
    rec.data["sequence_length"] = int(x["token_tags"].shape[0])
    outputs = {}
    block_states: dict[str, BlockStates] = {}
    measured = {name.split("+")[0] for name in args.only} if args.only else set(ATTENTIONS)
    # A backend this machine cannot run (FA4 on the CPU, or without its GPU or package) is left out of a run without
    # --only, and the JSON says why (`--only` naming it stopped before anything was built: `only_refusal`).
    skipped = skipped_attentions(measured, dev)
    if skipped:
        rec.data["skipped_attentions"] = skipped
        measured -= set(skipped)
        print("skipped", skipped, flush=True)
    fp8, fa4 = bool(measured & set(FP8_ATTENTIONS)), "FA4" in measured
    if (fp8 or fa4) and not args.tiny:
        rec.data["attention_op"] = attention_op(x["token_tags"].shape[0], dit.config, fp8=fp8, fa4=fa4)
        rec.save()
        print("attention_op", rec.data["attention_op"], flush=True)
    for linear in LINEARS:
        if linear == "HUMMING" and args.tiny:
            continue  # a CUDA-only kernel library
        if args.only and not any(n.endswith(f"+{linear}") for n in args.only):
            continue  # none of this linear's profiles asked for: no swap (HUMMING's needs its package)
        if linear in NAMED_ONLY and not args.only:
            continue  # a variant runs only where named
        replaced = swap_linears(dit, linear)
        for attn in (a for a in ATTENTIONS if a not in skipped):
            for execution in EXECUTIONS:
                name = f"{attn}+{execution}+{linear}"
                named = bool(args.only) and name in args.only
                if (args.only and not named) or not (wanted(linear, attn, execution) or
                                                     (named and execution == "compile-autotune")):  # fmt: skip
                    continue
                entry: dict = {}
                try:
                    uncompile(dit, x, other)
                    torch._dynamo.reset()
                    counter = configure(dit, attn, execution, linear, dev)
                    run = functools.partial(forward, dit, x)
                    if EXECUTIONS[execution].graph:
                        run = GraphReplay(run)  # called directly, then captured, then replayed
                    reset_peak()
                    start = time.perf_counter()
                    run()
                    sync()
                    entry["first_call_s"] = round(time.perf_counter() - start, 2)
                    ms = time_ms(run, args.warmup, args.iters)
                    entry["ms_median"] = round(statistics.median(ms), 2)
                    entry["ms_spread"] = [round(min(ms), 2), round(max(ms), 2)]
                    a, b = run(), run()
                    entry["rerun_bitwise_identical"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
                    entry["peak_gib"] = round(peak() / 2**30, 2)
                    outputs[name] = (a[0].float().cpu(), a[1].float().cpu())
                    passes = outputs.get(f"{attn}+eager+{linear}")
                    if execution == "eager-unfused" and passes is not None:  # the exact passes' claim, measured
                        entry["bitwise_equal_to_eager_passes"] = all(
                            torch.equal(p, o) for p, o in zip(passes, outputs[name], strict=True)
                        )
                    if args.kernels and kernel_tabled(name):
                        entry["kernels"], entry["kernel_breakdown"] = kernel_table(run)
                    if args.block_errors:
                        states = BlockStates.capture(dit, run, rows=args.block_rows)
                        if name == EXACT:
                            block_states[name] = states  # only the exact profile's are kept
                        elif EXACT in block_states:
                            entry["block_rel_err_vs_exact"] = states.rel_errors(block_states[EXACT])
                        del states
                    if counter is not None:
                        forward(dit, other)  # another sequence length: must not recompile
                        entry["graphs"] = counter.graphs
                        entry["recompiles"] = counter.recompiles
                except Exception as err:  # record and go on: one failing profile must not lose the others
                    entry["error"] = f"{type(err).__name__}: {err}"[:2000]
                rec.data["profiles"][name] = entry
                rec.save()
                print(name, {k: v for k, v in entry.items() if k not in ("kernels", "kernel_breakdown")}, flush=True)
        uncompile(dit, x, other)
        if replaced is not None:
            restore(dit, replaced)
    block_states.clear()
    attention.set_kernel(dit, "TORCH_SDPA")
    # Keep the weights for the peer on the host, in diffusers' layout, and free the GPU.
    start = time.perf_counter()
    weights = peer.peer_weights(dit)
    rec.data["export_s"] = round(time.perf_counter() - start, 1)
    host_inputs = {
        k: (v.cpu() if torch.is_tensor(v) else v) for k, v in x.items() if k not in ("rope", "text", "tables")
    }
    host_inputs["position_ids"] = x["layout"].rope_positions()
    host_inputs["text_states"] = text_states(shape["text"], dit.config.text_dim, 0)  # what ours refined
    del dit, x, other
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outputs, {"weights": weights, "inputs": host_inputs, "dev": dev}


PEER_EXECUTIONS = ("eager", "compile", "offload")


@torch.no_grad()
def run_peer(rec: Record, args, handoff: dict, outputs: dict) -> None:
    """The peer's rows: eager and compiled with every weight on the device, and `diffusers+offload` (diffusers' own
    group offloading, a block at a time, with CUDA streams: the path a diffusers user has where the model does not
    fit the card) when named, or by itself when the resident peer ran out of memory."""
    dev = handoff["dev"]
    weights = handoff.pop("weights")
    spec = {k: weights[k] for k in ("config", "inv_freq")}
    model = peer.peer(weights, "cpu")  # placed per row: resident, or offloaded by diffusers' hooks
    h = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in handoff["inputs"].items()}
    # The peer refines the text itself: the same states that went into ours' refine_text.

    def run():
        return peer.call_peer(model, h)

    named = [n for n in args.only or () if n.startswith("diffusers+")]
    for execution in PEER_EXECUTIONS:
        name = f"diffusers+{execution}"
        out_of_memory = "OutOfMemoryError" in rec.data["profiles"].get("diffusers+eager", {}).get("error", "")
        if (named and name not in named) or (not named and execution == "offload" and not out_of_memory):
            continue
        entry: dict = {}
        try:
            if execution == "offload":  # a fresh, uncompiled model over the same host tensors
                model = peer.peer({**spec, "state": model.to("cpu").state_dict()}, "cpu")
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                stream = torch.device(dev).type == "cuda"
                model.enable_group_offload(torch.device(dev), torch.device("cpu"), offload_type="block_level",
                                           num_blocks_per_group=1, non_blocking=stream, use_stream=stream,
                                           record_stream=stream)  # fmt: skip
                entry["offload"] = f"block_level, 1 block a group, streams {stream}"
            else:
                model.to(dev)
            if execution == "compile":
                model.compile_repeated_blocks(fullgraph=True)
            reset_peak()
            start = time.perf_counter()
            run()
            sync()
            entry["first_call_s"] = round(time.perf_counter() - start, 2)
            ms = time_ms(run, args.warmup, args.iters)
            entry["ms_median"] = round(statistics.median(ms), 2)
            entry["ms_spread"] = [round(min(ms), 2), round(max(ms), 2)]
            a, b = run(), run()
            entry["rerun_bitwise_identical"] = bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
            entry["peak_gib"] = round(peak() / 2**30, 2)
            outputs[name] = (a[0][0].float().cpu(), a[1][0].float().cpu())
            if args.kernels and kernel_tabled(name):
                entry["kernels"], entry["kernel_breakdown"] = kernel_table(run)
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {err}"[:2000]
            model.to("cpu")  # what did not fit goes back to the host for the next row
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rec.data["profiles"][name] = entry
        rec.save()
        print(name, {k: v for k, v in entry.items() if k not in ("kernels", "kernel_breakdown")}, flush=True)


# --num-gpus: the profiles a split serves (HUMMING and FP8 attention run on one GPU only) and their order.
SPLIT_PROFILES = ("CUDNN_ATTN+eager+BF16", "CUDNN_ATTN+compile+BF16", "CUDNN_ATTN+eager+CUTLASS",
                  "CUDNN_ATTN+compile+CUTLASS")  # fmt: skip


def run_split(args) -> None:
    """`--num-gpus`: for each count, the forward split over that many ranks (`lib.split`), then the scaling table
    against one GPU (measured first in the same run when 1 is among the counts)."""
    from h3serve.model.tiny import TINY_DIT
    from h3serve.parallel.plan import check_heads, split_refusals

    profiles = tuple(args.only) if args.only else SPLIT_PROFILES
    if args.tiny and not args.only:  # the CPU has no cuDNN
        profiles = tuple(p.replace("CUDNN_ATTN", "TORCH_SDPA") for p in profiles)
    for n in args.num_gpus:  # what a split refuses, before any rank builds the model
        check_heads(TINY_DIT if args.tiny else models.released_dit_config(), n)
        for name in profiles:
            attn, _, linear = name.split("+")
            if refused := split_refusals(profile_linear(linear), None, n, attn):
                raise SystemExit(f"--num-gpus {n}, {name}: {refused[0]}")
    shape = SHAPES[args.shape][1 if args.tiny else 0]
    job = Job("tiny" if args.tiny else "full", shape, profiles, blocks=args.blocks, warmup=args.warmup,
              iters=args.iters, cuda=not args.tiny, simulate=args.simulate)  # fmt: skip
    rec = Record(args.out)
    rec.data |= {"shape": {"name": args.shape + (" (tiny)" if args.tiny else ""), **shape}, "blocks": args.blocks,
                 "warmup": args.warmup, "iters": args.iters, "environment": environment(), "groups": {},
                 "simulated": args.simulate}  # fmt: skip
    groups = {}
    for n in sorted(set(args.num_gpus)):
        start = time.perf_counter()
        try:
            groups[n] = run_group(n, dataclasses.replace(job, split=n > 1))
        except Exception as err:  # recorded: the other counts still run
            rec.data["groups"][str(n)] = {"error": f"{type(err).__name__}: {err}"[-4000:]}
            rec.save()
            continue
        first = groups[n][0]
        rec.data["sequence_length"] = first["rows"]
        rec.data["groups"][str(n)] = {
            "wall_s": round(time.perf_counter() - start, 1),
            "per_rank": [{k: r[k] for k in ("rank", "weights_gib", "profiles")} for r in groups[n]],
        }
        rec.data["scaling"] = scaling(groups, compare=not args.simulate)
        rec.save()
        print(n, "GPU(s):", json.dumps({k: {c: {f: v[f] for f in ("ms_median", "speedup_vs_1") if f in v}
                                            for c, v in row.items()} for k, row in rec.data["scaling"].items()}),
              flush=True)  # fmt: skip
    print(json.dumps(rec.data.get("scaling"), indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="reference",
        help="reference: 768x448, 56 frames (S = 6435); default: the released default 1344x768, 124 frames (S = 38247)",
    )
    parser.add_argument("--warmup", type=int, help="forwards before timing (default 2; 1 at --shape default)")
    parser.add_argument("--iters", type=int, help="timed forwards (default 5; 3 at --shape default)")
    parser.add_argument("--tiny", action="store_true", help="a dry run of the script's plumbing on the CPU")
    parser.add_argument(
        "--kernels", action="store_true", help="a per-kernel and per-op breakdown of every compiled profile's forward"
    )
    parser.add_argument(
        "--only",
        type=lambda v: v.split(","),
        help="comma-separated profile names (the peer: both unless a diffusers+ profile is named); the linear "
        "CUTLASS_EPILOGUE (CUTLASS with the EPILOGUE FP8 scaling) only runs where named here",
    )
    parser.add_argument(
        "--block-errors",
        action="store_true",
        help=f"every profile's hidden state after each block against {EXACT}'s (run it first), on a row subset",
    )
    parser.add_argument("--block-rows", type=int, default=2048, help="rows kept per block for --block-errors")
    parser.add_argument(
        "--num-gpus",
        type=lambda v: [int(n) for n in v.split(",")],
        help="comma-separated GPU counts, e.g. 1,2,4,8: the forward split over each (1: the plain one-GPU forward), "
        f"in spawned processes; `--only` picks the profiles (default {','.join(SPLIT_PROFILES)}); no peer",
    )
    parser.add_argument(
        "--blocks",
        type=int,
        help="the first BLOCKS main blocks only (not with --tiny; a smoke run's setting, or a split's)",
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="with --num-gpus: rank 0's part of each split alone on one GPU, its peers' messages copies of its own (a "
        "projection of a rank's compute at each count, no interconnect)",
    )
    args = parser.parse_args()
    warmup, iters = TIMING[args.shape]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.iters = iters if args.iters is None else args.iters
    if (refused := only_refusal(args.only, args.tiny)) is not None:
        raise SystemExit(refused)
    if args.num_gpus:
        return run_split(args)
    rec = Record(args.out)
    outputs, handoff = run_ours(rec, args)
    run_peer(rec, args, handoff, outputs)
    # The peer's eager output is the reference; offloaded, it is the same computation (where eager did not fit).
    reference = outputs.get("diffusers+eager", outputs.get("diffusers+offload"))
    peers = [f"diffusers+{e}" for e in PEER_EXECUTIONS]
    peer_ms = {k: rec.data["profiles"].get(k, {}).get("ms_median") for k in peers}
    for name, (video, audio) in outputs.items():
        entry = rec.data["profiles"][name]
        if reference is not None:
            entry["rel_err_video_vs_peer_eager"] = rel(video, reference[0])
            entry["rel_err_audio_vs_peer_eager"] = rel(audio, reference[1])
        if EXACT in outputs and name != EXACT:  # the whole forward against the exact profile (lossy profiles' error)
            entry["rel_err_video_vs_exact"] = rel(video, outputs[EXACT][0])
            entry["rel_err_audio_vs_exact"] = rel(audio, outputs[EXACT][1])
        for name_of_peer, ms in peer_ms.items():
            if ms and entry.get("ms_median"):
                entry[f"speedup_vs_{name_of_peer}"] = round(ms / entry["ms_median"], 3)
    rec.save()
    print(json.dumps(rec.data, indent=2, default=str))


if __name__ == "__main__":
    main()
