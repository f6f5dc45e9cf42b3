"""Streamed weights against resident ones, one device memory cap per process, at one profile and request shape.

Streaming as `pipeline.placement` places it and `accel.offload` runs it; full-size random weights (seed 0 in every
process, so every process holds the same numbers), the T2VA case prompt of the prompt guide, seed 42.

For each cap a child process (a fresh CUDA context) plans the placement from the released configurations alone
(`pipeline.budget.plan_budget`, then `placement.place(budget, cap)`; the cap `resident` keeps everything on the device),
builds the components on the GPU, makes the engine with that placement (quantizing, then sending what streams to
page-locked host memory), and only then caps the PyTorch allocator at `cap` GiB
(`torch.cuda.set_per_process_memory_fraction`): the full BF16 model is built on the device before anything is moved
off it, so the cap holds from the end of the load, not through it (`cap_applied_after_load` in the JSON; what the
load left allocated is checked against the cap first). The cap is the caching allocator's: the CUDA context and
memory outside PyTorch's allocator are on top of it (`non_allocator_gib` records them). Then the default schedule's
AdaLN tables (`prepare_tables`, as a start makes them), one warmup render of `--warmup-steps` points at the same shape
(compile happens there) and one timed render of `--steps` points. Per cap: the placement and its planned peak, the
timed render's stage times, the DiT's time per forward (denoise seconds / forwards, and each forward between CUDA
events recorded around the DiT's forward), the text stage, the peak the allocator measured during the timed render,
the pinned host bytes of the streamed parts, the process's host RSS, the host->device bandwidth of a 1 GiB page-locked
buffer (5 copies, CUDA events), the bytes streamed per forward and the transfer-to-compute ratio (those bytes at that
bandwidth against the time per forward), and SHA-256 of the frames' and the audio's bytes. The parent adds, per cap,
whether the render is bitwise the `resident` one's and its time per forward against the resident one's. A child that
fails (out of memory, killed) leaves its error and the tail of its output; the other caps still run. The JSON is
written after every cap.

Compiled CUTLASS with FP8 text-encoder layers at the released default request (1344x768, 124 frames), resident and
within 24 GiB; BF16 resident and within 48 GiB; the reference shape (768x448, 56 frames) at five caps, in two runs
into one file (`--resume` runs only the caps the file lacks, or whose run failed):

    PYTHONPATH=src python bench/offload.py --profile "compile+CUTLASS+text CUTLASS" --shape default \
        --caps resident,24 --out bench/results/offload-cutlass-text-default.json
    PYTHONPATH=src python bench/offload.py --profile compile --shape default --caps resident,48 \
        --out bench/results/offload-bf16-default.json
    PYTHONPATH=src python bench/offload.py --profile "compile+CUTLASS+text CUTLASS" --shape reference \
        --caps resident,24,32 --out bench/results/offload-cutlass-text-reference.json
    PYTHONPATH=src python bench/offload.py --profile "compile+CUTLASS+text CUTLASS" --shape reference \
        --caps resident,24,32,48,80 --resume --out bench/results/offload-cutlass-text-reference.json

Per-forward time against the cap for result files (matplotlib where it is installed, else Pillow):

    python bench/offload.py --plot bench/results/offload.png bench/results/offload-*.json

Profiles as bench/render.py names them (`PROFILES`); each is the CUDA defaults of `Profile.for_device` (AdaLN weights
in page-locked host memory, as a start on a discrete GPU keeps them and as the placement plans) with that execution
and those linears. `--attention auto` (the default) is resolved in each child as a start resolves it
(`accel.attention.resolve`); every child records what it chose. Each child takes minutes (the build, the engine's
packing into page-locked memory, the compile), so choose `--caps` to fit the time at hand.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import hashlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
from lib.models import build, released_configs, released_dit_config, t2va_prompt
from lib.timing import run_header

from h3serve.accel.profile import Attention
from h3serve.pipeline.request import RequestFields

# (execution, linear, text_linear), as bench/render.py names them.
PROFILES = {
    "eager": ("eager", "BF16", "BF16"),
    "compile": ("compile", "BF16", "BF16"),
    "compile+CUTLASS": ("compile", "CUTLASS", "BF16"),
    "compile+CUTLASS+text CUTLASS": ("compile", "CUTLASS", "CUTLASS"),
}
SHAPES = {"reference": dict(width=768, height=448, num_frames=56), "default": {}}  # as bench/render.py's
RESIDENT_CAP = "resident"
GIB = 2**30
BANDWIDTH_BYTES = GIB  # the host->device copy timed once per child
BANDWIDTH_COPIES = 5
TAIL_LINES = 60  # a failed child's last lines of output kept in the JSON


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_caps(text: str) -> list[str]:
    """`resident` and caps in GiB (positive numbers), comma-separated, each once, in the order given."""
    caps: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part != RESIDENT_CAP:
            try:
                value = float(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r}: a cap is {RESIDENT_CAP} or GiB (24, 47.5)") from None
            if not value > 0:
                raise argparse.ArgumentTypeError(f"{part!r}: a cap in GiB must be positive")
            part = f"{value:g}"
        if part not in caps:
            caps.append(part)
    if not caps:
        raise argparse.ArgumentTypeError("no cap given")
    return caps


# ---- the child: one cap, one process ------------------------------------------------------------------------------


class ForwardEvents:
    """CUDA events around every DiT forward (hooks on the DiT module: the streamed blocks' waits are inside)."""

    def __init__(self, dit: torch.nn.Module):
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.handles = [dit.register_forward_pre_hook(self._start), dit.register_forward_hook(self._end)]

    def _start(self, module, args) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.pairs.append((start, torch.cuda.Event(enable_timing=True)))

    def _end(self, module, args, output) -> None:
        self.pairs[-1][1].record()

    def ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [round(start.elapsed_time(end), 2) for start, end in self.pairs]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def h2d_bandwidth() -> dict:
    """Host->device copies of a 1 GiB buffer page-locked as the streamed weights are (`offload.HostBuffer`: a mapping
    of its own, registered with CUDA), each between CUDA events on the current stream."""
    from h3serve.accel.offload import HostBuffer

    host = HostBuffer(BANDWIDTH_BYTES, pin=True)
    device = torch.empty(BANDWIDTH_BYTES, dtype=torch.uint8, device="cuda")
    device.copy_(host.tensor, non_blocking=True)  # the first copy apart
    torch.cuda.synchronize()
    ms = []
    for _ in range(BANDWIDTH_COPIES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host.tensor, non_blocking=True)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    del device, host
    gc.collect()
    median = statistics.median(ms)
    return {"ms": [round(m, 2) for m in ms], "gib_per_s": round(BANDWIDTH_BYTES / GIB / (median / 1e3), 2),
            "bytes_per_s": BANDWIDTH_BYTES / (median / 1e3)}  # fmt: skip


def host_memory() -> dict:
    """This process's resident set now and at its peak, and the host's available memory (GiB; /proc)."""
    out: dict = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss_gib" if key == "VmRSS" else "rss_peak_gib"] = round(int(value.split()[0]) * 1024 / GIB, 2)
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                out["available_gib"] = round(int(line.split()[1]) * 1024 / GIB, 2)
    return out


def sha256(array) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def streamer_copies(engine) -> dict:
    """Module copies each streamer has issued so far, and the video VAE's visits."""
    offloaded = engine.offloaded
    return {
        "dit": sum(s.copies for s in offloaded.dits.values()),
        "text": offloaded.text.copies if offloaded.text is not None else 0,
        "video_visits": offloaded.video.visits if offloaded.video is not None else 0,
    }


def streaming(engine, before: dict, after: dict, forwards: int, per_forward_s: float, text_s: float, bw: dict) -> dict:
    """What the timed render streamed, and how long it takes at the measured bandwidth against its compute."""
    offloaded = engine.offloaded
    dit_module = max((s.bytes_per_module for s in offloaded.dits.values()), default=0)
    text_module = offloaded.text.bytes_per_module if offloaded.text is not None else 0
    dit_bytes = (after["dit"] - before["dit"]) * dit_module
    text_bytes = (after["text"] - before["text"]) * text_module
    per_forward = dit_bytes / forwards if forwards else 0.0
    rate = bw["bytes_per_s"]
    out = {
        "dit_module_copies": after["dit"] - before["dit"],
        "dit_bytes_per_forward": round(per_forward),
        "dit_gib_per_forward": round(per_forward / GIB, 3),
        "dit_transfer_s_per_forward": round(per_forward / rate, 4),
        "transfer_to_compute": round(per_forward / rate / per_forward_s, 3) if per_forward_s else None,
        "dit_block_copy_ms": round(dit_module / rate * 1e3, 2),
        "text_layer_copies": after["text"] - before["text"],
        "text_gib": round(text_bytes / GIB, 3),
        "text_transfer_s": round(text_bytes / rate, 4),
        "text_transfer_to_stage": round(text_bytes / rate / text_s, 3) if text_s else None,
        "video_vae_visits": after["video_visits"] - before["video_visits"],
        "video_vae_gib_per_visit": round(offloaded.video.bytes / GIB, 3) if offloaded.video is not None else 0.0,
    }
    if dit_module and per_forward_s:
        out["dit_block_compute_ms"] = round(per_forward_s / released_dit_config().num_layers * 1e3, 2)  # a mean
    return out


def child(args: argparse.Namespace) -> None:
    """One cap in this process; the entry goes to `args.child_out` after every phase (a kill keeps what was done)."""
    from h3serve.accel import attention
    from h3serve.accel.profile import Profile, check
    from h3serve.pipeline.budget import plan_budget
    from h3serve.pipeline.engine import Engine
    from h3serve.pipeline.placement import RESIDENT, place
    from h3serve.pipeline.rules import RELEASED_RULES

    cap = args.child
    label = f"cap {cap}"
    entry: dict = {"cap": cap}
    out = Path(args.child_out)
    phases: dict[str, float] = {}
    entry["phases_s"] = phases

    def save() -> None:
        out.write_text(json.dumps(entry, indent=2, default=str) + "\n")

    def phase(name: str, start: float) -> None:
        phases[name] = round(time.perf_counter() - start, 2)
        log(f"{label}: {name} {phases[name]} s")
        save()

    try:
        entry["header"] = run_header()
        total = torch.cuda.get_device_properties(0).total_memory
        entry["device_total_gib"] = round(total / GIB, 2)
        entry["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        cap_bytes = None if cap == RESIDENT_CAP else float(cap) * GIB
        if cap_bytes is not None:
            entry["cap_gib"] = float(cap)
            if cap_bytes > total:
                raise ValueError(f"cap {cap} GiB is more than this GPU's {total / GIB:.1f} GiB")

        execution, linear, text_linear = PROFILES[args.profile]
        profile = Profile.for_device("cuda", attention=args.attention, execution=execution, linear=linear,
                                     text_linear=text_linear)  # fmt: skip
        check(profile)
        start = time.perf_counter()
        profile, line = attention.resolve(profile, released_dit_config().attention_head_dim)
        entry["attention"] = str(profile.attention)
        entry["attention_choice"] = line
        entry["profile"] = profile.as_dict()
        phase("attention", start)

        # The plan from the configurations alone: no resident engine (that would need the whole model on the device).
        budget = plan_budget(released_configs(), profile, RELEASED_RULES)
        placement = RESIDENT if cap_bytes is None else place(budget, float(cap), args.offload, slots=args.slots)
        entry["placement"] = placement.as_dict()
        entry["placement_described"] = placement.describe()
        entry["dit_streamed"] = list(placement.dit_streamed)
        entry["planned"] = {
            "device_weights_resident_gib": round(budget.device_weights, 2),
            "activations_largest_gib": round(budget.activations_largest, 2),
            "activations_default_gib": round(budget.activations_default, 2),
            "peak_gib": round(placement.device_gib if placement.budget_gib is not None else budget.device_need, 2),
            "peak_is_for": "the largest request the rules allow" if placement.max_rows is None
            else f"{placement.max_rows:,} packed rows (max_rows)",
            "pinned_streamed_gib": round(placement.pinned_gib, 2),
            "host_need_gib": round(budget.host_need + placement.pinned_gib, 2),
        }  # fmt: skip
        log(f"{label}: {placement.describe()}")
        available = host_memory().get("available_gib")
        if available is not None and entry["planned"]["host_need_gib"] > available:
            entry["warning"] = (f"the plan pins {entry['planned']['host_need_gib']} GiB of host memory, "
                                f"{available} GiB available: the load may fail or be killed")  # fmt: skip
            log(f"{label}: {entry['warning']}")
        save()

        start = time.perf_counter()
        bandwidth = h2d_bandwidth()
        entry["h2d"] = {k: v for k, v in bandwidth.items() if k != "bytes_per_s"}
        phase("bandwidth", start)

        start = time.perf_counter()
        torch.manual_seed(0)  # every child the same weights: their renders are compared bit for bit
        components = build(torch.device("cuda"))
        torch.cuda.synchronize()
        entry["weights_built_gib"] = round(torch.cuda.memory_allocated() / GIB, 2)
        phase("build", start)

        start = time.perf_counter()
        engine = Engine(components, profile, placement=placement)  # quantizes, then sends what streams to the host
        del components
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        entry["allocated_after_load_gib"] = round(torch.cuda.memory_allocated() / GIB, 2)
        entry["reserved_after_load_gib"] = round(torch.cuda.memory_reserved() / GIB, 2)
        entry["pinned_host_gib"] = round(engine.offloaded.host_bytes / GIB, 2)
        with contextlib.suppress(Exception):  # a report only
            entry["host_budget_gib"] = {k: round(v, 2) for k, v in engine.memory_budget().host.items()}
        entry["host_after_load"] = host_memory()
        phase("engine", start)

        if cap_bytes is not None:
            if torch.cuda.memory_allocated() > cap_bytes:
                raise RuntimeError(f"the load left {torch.cuda.memory_allocated() / GIB:.2f} GiB allocated on the "
                                   f"device, above the cap of {cap} GiB: nothing measured under it")  # fmt: skip
            torch.cuda.set_per_process_memory_fraction(cap_bytes / total)
            entry["cap_fraction"] = round(cap_bytes / total, 5)
            entry["cap_applied_after_load"] = True
            log(f"{label}: allocator capped at {cap} GiB ({entry['cap_fraction']} of {total / GIB:.1f} GiB)")

        shape = SHAPES[args.shape]
        request = engine.validate(RequestFields(t2va_prompt(), **shape, steps=args.steps, seed=42))
        warm = engine.validate(RequestFields(t2va_prompt(), **shape, steps=args.warmup_steps, seed=42))
        entry |= {"width": request.width, "height": request.height, "num_frames": request.num_frames,
                  "steps": request.steps, "forwards": request.forwards, "warmup_steps": warm.steps}  # fmt: skip

        start = time.perf_counter()
        entry["default_tables_s"] = round(engine.prepare_tables(), 2)
        phase("prepare_tables", start)

        start = time.perf_counter()
        engine.render(warm)
        phase("warmup_render", start)

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = streamer_copies(engine)
        events = ForwardEvents(engine.components.dit)
        start = time.perf_counter()
        try:
            result = engine.render(request)
        finally:
            events.remove()
        entry["end_to_end_s"] = round(time.perf_counter() - start, 3)
        phase("timed_render", start)
        after = streamer_copies(engine)

        timings = result.timings
        entry["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
        per_forward = timings["denoise"] / request.forwards
        entry["per_forward_s"] = round(per_forward, 4)
        forward_ms = events.ms()
        entry["forward_ms"] = forward_ms
        if forward_ms:
            entry["per_forward_events_s"] = round(statistics.median(forward_ms) / 1e3, 4)
        entry["text_s"] = round(timings["text"], 3)
        entry["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        entry["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
        free, _ = torch.cuda.mem_get_info()
        entry["device_used_gib"] = round((total - free) / GIB, 2)  # every process's, the CUDA context included
        entry["non_allocator_gib"] = round((total - free - torch.cuda.memory_reserved()) / GIB, 2)
        entry["frames_sha256"] = sha256(result.frames)
        entry["audio_sha256"] = sha256(result.audio)
        entry["frames_shape"] = list(result.frames.shape)
        entry["audio_shape"] = list(result.audio.shape)
        entry["host"] = host_memory()
        entry["streaming"] = streaming(engine, before, after, request.forwards,
                                       entry.get("per_forward_events_s", per_forward), timings["text"],
                                       bandwidth)  # fmt: skip
        if engine.compiled is not None:
            entry["graphs"], entry["recompiles"] = engine.compiled.graphs, engine.compiled.recompiles
    except Exception as err:  # recorded: the parent runs the other caps
        entry["error"] = f"{type(err).__name__}: {err}"[:4000]
        entry["out_of_memory"] = isinstance(err, torch.OutOfMemoryError)
        entry["traceback"] = traceback.format_exc()[-4000:]
        log(f"{label}: {entry['error']}")
    save()
    if "error" in entry:
        sys.exit(1)


# ---- the parent: one child per cap, then the comparisons -----------------------------------------------------------


def run_child(args: argparse.Namespace, cap: str) -> dict:
    """Run one cap in a child process (its output echoed as it comes, prefixed with the cap); its entry, with the
    tail of its output where it failed."""
    with tempfile.TemporaryDirectory(prefix="offload-") as tmp:
        result = Path(tmp) / "entry.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", cap, "--child-out", str(result),
                   "--profile", args.profile, "--shape", args.shape, "--steps", str(args.steps),
                   "--warmup-steps", str(args.warmup_steps), "--attention", args.attention, "--offload", args.offload,
                   "--slots", str(args.slots)]  # fmt: skip
        start = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, env=env)  # fmt: skip
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip("\n")[:1000])
                print(f"[{cap}] {line}", end="", file=sys.stderr, flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            returncode = proc.wait(timeout=args.child_timeout or None)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()  # its compile workers exit with it
            returncode = proc.wait()
        finally:  # interrupted or terminated (SIGTERM: `parent`), the child goes too: it holds the GPU
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
        entry: dict = {}
        if result.is_file():
            with contextlib.suppress(ValueError):
                entry = json.loads(result.read_text())
    entry.setdefault("cap", cap)
    entry["returncode"] = returncode
    entry["child_wall_s"] = round(time.perf_counter() - start, 1)
    if timed_out:
        entry.setdefault("error", f"timed out after {args.child_timeout} s (killed)")
    elif returncode != 0 and "error" not in entry:
        entry["error"] = f"the child exited with {returncode} (killed, or out of host memory?)"
    if "error" in entry:
        entry["output_tail"] = list(tail)
    return entry


def compare(caps: dict[str, dict]) -> None:
    """Per cap: bitwise equal to the resident render, and its time per forward against the resident one's."""
    resident = caps.get(RESIDENT_CAP, {})
    for entry in caps.values():
        for key in ("bitwise_equal_to_resident", "per_forward_vs_resident", "per_forward_events_vs_resident"):
            entry.pop(key, None)
        if "frames_sha256" not in entry or "frames_sha256" not in resident:
            continue
        entry["bitwise_equal_to_resident"] = (entry["frames_sha256"], entry["audio_sha256"]) == (
            resident["frames_sha256"],
            resident["audio_sha256"],
        )
        if entry.get("attention") != resident.get("attention"):
            entry["bitwise_note"] = f"attention {entry.get('attention')} here, {resident.get('attention')} resident"
        entry["per_forward_vs_resident"] = round(entry["per_forward_s"] / resident["per_forward_s"], 3)
        if "per_forward_events_s" in entry and "per_forward_events_s" in resident:
            entry["per_forward_events_vs_resident"] = round(
                entry["per_forward_events_s"] / resident["per_forward_events_s"], 3
            )


def summary(caps: dict[str, dict]) -> list[str]:
    rows = []
    for cap, e in caps.items():
        if "error" in e:
            rows.append(f"{cap:>9}: {e['error'][:200]}")
            continue
        rows.append(
            f"{cap:>9}: {e.get('per_forward_s')} s/forward (x{e.get('per_forward_vs_resident', '?')}), text "
            f"{e.get('text_s')} s, peak {e.get('peak_allocated_gib')} GiB, pinned {e.get('pinned_host_gib')} GiB, "
            f"transfer/compute {e.get('streaming', {}).get('transfer_to_compute')}, bitwise "
            f"{e.get('bitwise_equal_to_resident', '?')}; {e.get('placement_described', '')}"
        )
    return rows


def parent(args: argparse.Namespace) -> None:
    run = {"profile": args.profile, "shape": args.shape, "steps": args.steps, "warmup_steps": args.warmup_steps,
           "attention_asked": args.attention, "offload": args.offload, "slots": args.slots}  # fmt: skip
    caps: dict[str, dict] = {}
    if args.resume and args.out.is_file():
        earlier = json.loads(args.out.read_text())
        if any(earlier.get(k) != v for k, v in run.items()):
            theirs = ", ".join(f"{k}={earlier.get(k)!r}" for k in run)
            raise SystemExit(f"--resume: {args.out} is another run's ({theirs})")
        caps = {cap: e for cap, e in earlier.get("caps", {}).items() if "error" not in e}
        log(f"--resume: keeping {', '.join(caps) or 'nothing'} from {args.out}")
    # No CUDA in this process (the children's device stays free of a context): the GPU's name comes from a child.
    record: dict = {**run_header("cpu"), "gpu": "unknown (no child reported it)", **run, "caps_asked": args.caps,
                    "caps": caps}  # fmt: skip
    record["command"] = shlex.join(sys.argv)  # quoted: a profile name has a space
    args.out.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # `run_child` stops its child
    for cap in args.caps:
        if cap in caps:
            continue
        log(f"== cap {cap}: {args.profile}, {args.shape} shape, {args.steps} points (warmup {args.warmup_steps})")
        caps[cap] = run_child(args, cap)
        gpus = [e["header"]["gpu"] for e in caps.values() if "header" in e]
        if gpus:
            record["gpu"] = gpus[0]
        compare(caps)
        args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    order = [c for c in args.caps if c in caps] + [c for c in caps if c not in args.caps]
    record["caps"] = {c: caps[c] for c in order}
    compare(record["caps"])
    record["summary"] = summary(record["caps"])
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    for row in record["summary"]:
        print(row, flush=True)
    print(f"wrote {args.out}", flush=True)


# ---- the plot ------------------------------------------------------------------------------------------------------


def series(data: dict) -> tuple[str, list[tuple[float, float, str]]]:
    """One result file's points: (cap GiB, per-forward s, label); the resident run at the GPU's memory."""
    points = []
    for cap, e in data.get("caps", {}).items():
        y = e.get("per_forward_events_s", e.get("per_forward_s"))
        if y is None:
            continue
        x = e.get("device_total_gib", 141.0) if cap == RESIDENT_CAP else float(cap)
        ratio = e.get("per_forward_events_vs_resident" if "per_forward_events_s" in e else "per_forward_vs_resident")
        note = "resident" if cap == RESIDENT_CAP else f"x{ratio if ratio is not None else '?'}"
        if e.get("bitwise_equal_to_resident") is False:
            note += " NOT bitwise"
        points.append((x, y, note))
    return f"{data.get('profile')}, {data.get('shape')} shape, {data.get('attention_asked')}", sorted(points)


def plot(paths: list[Path], png: Path) -> None:
    """Per-forward time against the device memory cap, one line per result file."""
    lines = [series(json.loads(p.read_text())) for p in paths]
    lines = [(name, pts) for name, pts in lines if pts]
    if not lines:
        raise SystemExit("nothing to plot: no cap with a per-forward time in the files given")
    png.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: drawn with Pillow")
        _plot_pillow(lines, png)
    else:
        fig, ax = plt.subplots(figsize=(10, 6))
        for name, pts in lines:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            for x, y, note in pts:
                ax.annotate(note, (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
        ax.set_xlabel("device memory cap, GiB (resident: the GPU's memory)")
        ax.set_ylabel("DiT time per forward, s")
        ax.set_title("Streamed weights: per-forward time against the device memory cap")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
    print(f"wrote {png}", flush=True)


def _plot_pillow(lines: list[tuple[str, list[tuple[float, float, str]]]], png: Path) -> None:
    from PIL import Image, ImageDraw, ImageFont

    colours = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (140, 86, 75))
    img = Image.new("RGB", (1000, 600), "white")
    draw, font = ImageDraw.Draw(img), ImageFont.load_default()
    x0, y0, x1, y1 = 80, 50, 960, 460
    xs = [p[0] for _, pts in lines for p in pts]
    ys = [p[1] for _, pts in lines for p in pts]
    xmax, ymax = max(xs) * 1.05, max(ys) * 1.15

    def at(x: float, y: float) -> tuple[float, float]:
        return x0 + x / xmax * (x1 - x0), y1 - y / ymax * (y1 - y0)

    draw.text((x0, 15), "Streamed weights: DiT time per forward (s) against the device memory cap (GiB)", fill="black",
              font=font)  # fmt: skip
    draw.rectangle((x0, y0, x1, y1), outline="black")
    for i in range(6):
        xv, yv = xmax * i / 5, ymax * i / 5
        draw.text((at(xv, 0)[0] - 8, y1 + 6), f"{xv:.0f}", fill="black", font=font)
        draw.text((x0 - 45, at(0, yv)[1] - 6), f"{yv:.2f}", fill="black", font=font)
    for i, (name, pts) in enumerate(lines):
        colour = colours[i % len(colours)]
        xy = [at(x, y) for x, y, _ in pts]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=3)
        for (x, y), (_, _, note) in zip(xy, pts, strict=True):
            draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)
            draw.text((x + 6, y - 16 + 12 * i), note, fill=colour, font=font)
        draw.rectangle((x0, 490 + 16 * i, x0 + 12, 500 + 16 * i), fill=colour)
        draw.text((x0 + 20, 488 + 16 * i), name, fill="black", font=font)
    img.save(png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the result JSON (required unless --plot)")
    parser.add_argument("--profile", choices=PROFILES, default="compile+CUTLASS+text CUTLASS")
    parser.add_argument("--shape", choices=SHAPES, default="default",
                        help="default: the released default request (1344x768, 124 frames); reference: 768x448, "
                        "56 frames")  # fmt: skip
    parser.add_argument("--caps", type=parse_caps, default=parse_caps("resident,24,48"),
                        help="comma-separated: resident and device memory caps in GiB, each in its own process "
                        "(default resident,24,48)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="grid points of the timed render (forwards: one fewer)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="grid points of the warmup render")
    parser.add_argument("--attention", choices=[str(a) for a in Attention], default=str(Attention.AUTO),
                        help="auto: chosen in each child as a start chooses it")  # fmt: skip
    parser.add_argument("--offload", choices=("auto", "all"), default="auto",
                        help="auto: stream only what the cap cannot hold; all: stream every streamable "
                        "part")  # fmt: skip
    parser.add_argument("--slots", type=int, default=2, help="device slots per streamed stack")
    parser.add_argument("--resume", action="store_true",
                        help="keep the caps --out already holds without an error (the same run's), run the "
                        "rest")  # fmt: skip
    parser.add_argument("--child-timeout", type=float, default=0, help="seconds before a child is killed (0: none)")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="draw per-forward time against cap for RESULTS")
    parser.add_argument("results", type=Path, nargs="*", help="with --plot: result files of this script")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plot is not None:
        if not args.results:
            parser.error("--plot needs result files")
        plot(args.results, args.plot)
        return
    if args.results:
        parser.error(f"unexpected arguments {[str(r) for r in args.results]} (result files go with --plot)")
    if args.steps < 2 or args.warmup_steps < 2:
        parser.error("--steps and --warmup-steps are grid points: at least 2 (one forward)")
    if args.child is not None:
        child(args)
        return
    if args.out is None:
        parser.error("--out is required")
    parent(args)


if __name__ == "__main__":
    main()
