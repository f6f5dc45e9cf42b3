"""Start to ready of `h3serve serve` from weight files on disk: a cold kernel cache (an empty `H3_CACHE_DIR`) against
a warm one (the cold start's), per profile.

The released checkpoint does not fit the GPU machine's disk (DiT 60 GB, text encoder 48 GB), so the script first
writes a folder that `serve --model` takes as a release: a DiT at the released width (hidden 5376, 56 x 128 heads,
FFN 14336, the released time embedder) with `--blocks` blocks, random bf16 weights with the float32 islands, in
diffusers shards; everything else is the tiny checkpoint of bench/lib/tiny_folder.py (text encoder, VAEs, tokenizer,
processor, schedulers), with the DiT's text_dim and latent widths set to its. Regional compile compiles one block
and repeats it, so the compiled graph is the released one at the production warmup shape (768x448, 56 frames). What
a real start adds does not depend on the kernel cache: reading 46 more blocks and the 48 GB text encoder, and in the
warmup those blocks' AdaLN tables and forward (both in each start's warmup_stages_s and adaln_tables_s, to scale by
50 / blocks), and the text encoder's eager forward at its real size.

Per profile (`cutlass`: the CUDA default, cuDNN attention, regional compile, CUTLASS FP8 block linears; `bf16`: the
same with BF16 linears; `default`: the device's defaults, eager BF16 on the CPU), two `serve` processes in turn,
each on a free port with an output folder of its own:

    cold  H3_CACHE_DIR an empty folder of the profile's own
    warm  the same folder, as the cold start left it

Each is timed from its launch to the first 200 from /ready (the startup warmup passed). /health gives the warmup's
seconds and result, the server's log the model load ("model ... loaded in X s") and any GB/s lines. The server is
stopped with SIGINT (SIGKILL after a grace) before the next starts. Servers run with -v, so a failure logs its
traceback. The JSON is rewritten after every start, so a
run cut short keeps what it measured; starts that would pass `--budget` are skipped and say so.

    PYTHONPATH=src python bench/start.py --out bench/results/start.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from lib.export import export_state_dict
from lib.host import evict
from lib.models import fill_random
from lib.timing import run_header
from lib.tiny_folder import write_tiny_checkpoint
from safetensors.torch import save_file

from h3serve.accel.caches import CACHES
from h3serve.checkpoint.folder import resolve_model_folder
from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT, is_fp32_name

# The profiles' settings, spelled out (the CUDA defaults today) so that the record says what ran whatever the defaults
# become; `default` sets none of them.
_COMPILED = {"H3_DIFFUSION_ATTENTION_BACKEND": "CUDNN_ATTN", "H3_EXECUTION_MODE": "compile"}
PROFILES: dict[str, dict[str, str]] = {
    "cutlass": {**_COMPILED, "H3_LINEAR_BACKEND": "CUTLASS"},
    "bf16": {**_COMPILED, "H3_LINEAR_BACKEND": "BF16"},
    "default": {},
}
TARGET_WARM_WARMUP_S = 10.0  # the goal this measures against: a warm-cache warmup at the reference shape
SHARD_BYTES = 2 * 2**30  # several shards, so the start reads an index as it reads the release's 14
POLL_S = 0.1  # how often /ready is asked: the resolution of start_to_ready_s
STOP_GRACE_S = 30.0  # serve's own graceful shutdown limit (uvicorn's timeout_graceful_shutdown)
STOP_RESERVE_S = STOP_GRACE_S + 15.0  # kept back from the budget for stopping a start that never got ready
MIN_START_S = 20.0  # a start given less than this would only show that it had no time
LOG_KEPT = ("GB/s", " loaded", "warmup", "AdaLN tables", "kernel caches", "rror", "Traceback", "refused")
LOG_LINE_CHARS = 400
ACCESS_LOG = re.compile(r'"(GET|HEAD) /(ready|health)')
LOADED = re.compile(r"model .+ loaded(?: on \d+ GPUs)? in ([0-9.]+) s")
WARMUP_PASSED = re.compile(r"warmup passed in ([0-9.]+) s")
TABLES = re.compile(r"AdaLN tables made in ([0-9.]+) s")
STAGES = re.compile(r"warmup render stages \(s\): (.+)$")


# ---- the model folder -------------------------------------------------------------------------------------------


def dit_config(tiny: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The DiT's diffusers `config.json`: the tiny checkpoint's keys, the released widths (or the flags'), and the
    tiny components' text_dim and latent channels, so the condition and patch projections fit them."""
    released = DiTConfig()
    hidden = args.hidden or released.hidden_size
    widths = {
        "hidden_size": hidden,
        "num_attention_heads": args.heads or released.num_attention_heads,
        "attention_head_dim": args.head_dim or released.attention_head_dim,
        "ffn_dim": args.ffn or released.ffn_hidden_size,
        "num_layers": args.blocks,
        "num_refiner_layers": args.refiner_blocks,
        "freq_dim": released.timestep_input_dim,
        # Released: the time embedder is hidden wide and its output half that (5376 -> 2688), kept with --hidden.
        "time_embed_hidden_dim": hidden,
        "time_embed_dim": hidden // 2,
        "rope_freq_dim": released.rope_inv_freq_len,
    }
    unknown = set(widths) - set(tiny)
    if unknown:
        raise ValueError(f"the tiny checkpoint's transformer config lacks {sorted(unknown)}; its keys: {sorted(tiny)}")
    config = {**tiny, **widths}
    DiTConfig.from_dict(config)  # refuses a combination that is no H3 DiT (odd widths, rotary dims past a head)
    return config


@torch.no_grad()
def write_dit(folder: Path, config: dict[str, Any], device: torch.device) -> int:
    """A DiT of `config` with random weights (drawn on `device`), written to `folder` as the diffusers release
    stores it: bf16 with the float32 islands, shards and an index, diffusers key names. Returns the bytes written."""
    cfg = DiTConfig.from_dict(config)
    with torch.device("meta"):
        dit = H3DiT(cfg)
    for name, t in dit.state_dict(keep_vars=True).items():  # dtypes set on meta: no float32 copy of the whole DiT
        t.data = t.data.to(torch.float32 if is_fp32_name(name) else torch.bfloat16)
    dit = dit.to_empty(device=device)
    fill_random(dit, skip=("rope.inv_freq",))  # the buffer is not stored in the diffusers layout
    state = export_state_dict(dit, "diffusers")  # on the CPU, converted by diffusers' own converter
    del dit
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        nbytes = state[key].numel() * state[key].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = state.pop(key)
        size += nbytes
    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        total += sum(t.numel() * t.element_size() for t in shard.values())
        shard.clear()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return total


def write_folder(root: Path, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The tiny checkpoint with its transformer/ replaced by the wide DiT; checked as `serve` will check it."""
    start = time.perf_counter()
    write_tiny_checkpoint(root)
    transformer = root / "transformer"
    config = dit_config(json.loads((transformer / "config.json").read_text()), args)
    shutil.rmtree(transformer)
    dit_bytes = write_dit(transformer, config, device)
    folder = resolve_model_folder(root)  # every config and header, as `serve --model` reads them
    return {
        "build_s": round(time.perf_counter() - start, 2),
        "build_device": str(device),
        "dit_config": folder.dit.to_dict(),
        "dit_bytes": dit_bytes,
    }


def tree_bytes(root: Path) -> tuple[int, int]:
    """(bytes, files) under `root`."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def evict_page_cache(root: Path) -> None:
    """Drop the folder's files from the page cache, so a start reads them from the disk."""
    evict(p for p in root.rglob("*") if p.is_file())


# ---- one start ----------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def server_env(device: str, cache: Path, profile: dict[str, str]) -> dict[str, str]:
    """This process's environment without H3_ variables (serve refuses any it does not know) and without the kernel
    caches' own variables (H3_CACHE_DIR sets them, as an operator's start does), plus the start's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_") and k not in CACHES}
    paths = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(paths if src in paths else [src, *paths])
    env["PYTHONUNBUFFERED"] = "1"  # the log is read after the stop, a kill included
    settings = {"H3_DEVICE": device, "H3_CACHE_DIR": str(cache), "H3_STARTUP_WARMUP": "true", **profile}
    return env | settings


def wait_ready(proc: subprocess.Popen, url: str, launch: float, timeout_s: float) -> dict[str, Any]:
    """Poll /ready until 200, the warmup's failure, the process's exit or the timeout; /health once at the end."""
    out: dict[str, Any] = {"ready": False}
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while True:
            if proc.poll() is not None:
                out["error"] = f"serve exited with status {proc.returncode} before it was ready (see log_tail)"
                return out
            if time.perf_counter() - launch > timeout_s:
                out["error"] = f"not ready {timeout_s:.0f} s after launch"
                break
            try:
                answer = client.get("/ready")
            except httpx.HTTPError:
                time.sleep(POLL_S)
                continue
            now = time.perf_counter() - launch
            out.setdefault("start_to_port_s", round(now, 2))
            if answer.status_code == 200:
                out["ready"], out["start_to_ready_s"] = True, round(now, 2)
                break
            with contextlib.suppress(ValueError):
                if answer.json().get("readiness") == "failed":
                    out["error"] = "the startup warmup failed (see warmup.error)"
                    break
            time.sleep(POLL_S)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            health = client.get("/health").json()
            out["warmup"] = health.get("warmup")
            out["warmup_s"] = (health.get("warmup") or {}).get("seconds")
            out["profile"] = health.get("profile")
            out["readiness"] = health.get("readiness")
    return out


def stop(proc: subprocess.Popen) -> dict[str, Any]:
    """SIGINT (serve's Ctrl-C: uvicorn's graceful shutdown), SIGKILL after the grace; then anything left of the
    session the server leads (its compile workers), which this script started."""
    start = time.perf_counter()
    killed = False
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            killed = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return {"returncode": proc.returncode, "stop_s": round(time.perf_counter() - start, 2), "killed": killed}


def read_log(text: str) -> dict[str, Any]:
    """The load's and the warmup's seconds from serve's log, the lines that say how the start went, and its tail."""
    lines = text.splitlines()
    out: dict[str, Any] = {}
    for key, pattern in (("load_s", LOADED), ("warmup_log_s", WARMUP_PASSED), ("adaln_tables_s", TABLES)):
        found = [float(m.group(1)) for line in lines if (m := pattern.search(line))]
        out[key] = found[-1] if found else None
    stages = [m.group(1) for line in lines if (m := STAGES.search(line))]
    if stages:  # "text 0.06, keyframes 0.00, ..., total 2.72"
        pairs = (item.rsplit(" ", 1) for item in stages[-1].split(", "))
        out["warmup_stages_s"] = {name: float(value) for name, value in pairs}
    kept = [line[:LOG_LINE_CHARS] for line in lines if any(k in line for k in LOG_KEPT) and "settings: " not in line]
    out["gbps_lines"] = [line[:LOG_LINE_CHARS] for line in lines if "GB/s" in line]
    out["log_lines"] = kept[:40]
    out["log_tail"] = [line[:LOG_LINE_CHARS] for line in lines if not ACCESS_LOG.search(line)][-15:]
    return out


def start_once(folder: Path, cache: Path, work: Path, device: str, profile: dict[str, str], timeout_s: float) -> dict:
    """One `serve` start: launched, polled to ready, stopped; its numbers and log lines."""
    port = free_port()
    out_dir = work / "output"
    cmd = [sys.executable, "-m", "h3serve.cli", "-v", "serve", "--model", str(folder), "--output-dir", str(out_dir),
           "--api-port", str(port)]  # fmt: skip
    env = server_env(device, cache, profile)
    entry: dict[str, Any] = {
        "command": cmd,
        "settings": {k: v for k, v in env.items() if k.startswith("H3_") or k in CACHES},
        "cache_bytes_before": tree_bytes(cache)[0],
    }
    log_path = work / "serve.log"
    with log_path.open("wb") as log:
        launch = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            entry |= wait_ready(proc, f"http://127.0.0.1:{port}", launch, timeout_s)
        finally:
            entry |= stop(proc)
    entry["cache_bytes_after"], entry["cache_files_after"] = tree_bytes(cache)
    entry["log"] = str(log_path)
    return entry | read_log(log_path.read_text(errors="replace"))


# ---- the run ------------------------------------------------------------------------------------------------------


def summarise(runs: dict[str, dict]) -> dict[str, Any]:
    cold, warm = runs.get("cold", {}), runs.get("warm", {})
    out: dict[str, Any] = {}
    if cold.get("ready") and warm.get("ready"):
        out["warm_saves_s"] = round(cold["start_to_ready_s"] - warm["start_to_ready_s"], 2)
    if warm.get("ready") and warm.get("warmup_s") is not None:
        out["warm_warmup_within_target"] = warm["warmup_s"] <= TARGET_WARM_WARMUP_S
    return out


def table(profiles: dict[str, dict]) -> str:
    head = (
        f"{'profile':<9} {'cache':<5} {'ready':>5} {'start->ready s':>14} {'port s':>7} {'load s':>7} "
        f"{'warmup s':>9} {'cache MB':>9}"
    )
    rows = [head, "-" * len(head)]

    def cell(value: object, width: int) -> str:
        return f"{value:>{width}.2f}" if isinstance(value, float | int) else f"{'-':>{width}}"

    for name, runs in profiles.items():
        for phase in ("cold", "warm"):
            r = runs.get(phase, {})
            ready = "yes" if r.get("ready") else ("skip" if "skipped" in r else "NO")
            rows.append(
                f"{name:<9} {phase:<5} {ready:>5} {cell(r.get('start_to_ready_s'), 14)} "
                f"{cell(r.get('start_to_port_s'), 7)} {cell(r.get('load_s'), 7)} "
                f"{cell(r.get('warmup_s'), 9)} {cell(r.get('cache_bytes_after', 0) / 1e6, 9)}"
            )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the JSON record (rewritten after every start)")
    allowed = ", ".join(PROFILES)
    parser.add_argument("--profiles", help=f"comma-separated, of {allowed} (cuda: cutlass,bf16; cpu: default)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="H3_DEVICE of the servers (cuda when available)")
    parser.add_argument("--blocks", type=int, default=4, help="DiT blocks (4; the release has 50)")
    parser.add_argument("--refiner-blocks", type=int, default=2, help="token refiner blocks (2, as released)")
    parser.add_argument("--hidden", type=int, help="DiT hidden size (the released 5376; smaller for a CPU run)")
    parser.add_argument("--heads", type=int, help="attention heads (56)")
    parser.add_argument("--head-dim", type=int, help="attention head width (128; >= 96, the rotary dims)")
    parser.add_argument("--ffn", type=int, help="FFN width (14336)")
    parser.add_argument("--model-dir", type=Path, help="serve this folder instead of writing one")
    parser.add_argument(
        "--work",
        type=Path,
        help="folder for the model, caches and logs (default: a temporary one, removed at the end unless --keep)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--logs", type=Path, help="copy each server's whole log here, as PROFILE-PHASE.log")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds from launch to ready per start (240)")
    parser.add_argument(
        "--budget",
        type=float,
        default=500.0,
        help="seconds for the run after its imports; a start that would pass it is skipped (500)",
    )
    parser.add_argument(
        "--evict-page-cache",
        action="store_true",
        help="before each start, drop the folder's files from the page cache, so the load reads the "
        "disk (default: they stay cached from the write, the best case of a restart)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    begin = time.perf_counter()
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = (args.profiles or ("cutlass,bf16" if device == "cuda" else "default")).split(",")
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        raise SystemExit(f"--profiles: unknown {unknown}; allowed: {', '.join(PROFILES)}")
    deadline = begin + args.budget
    temporary = args.work is None
    work = Path(tempfile.mkdtemp(prefix="h3-start-")) if temporary else args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        **run_header(device),
        "executable": sys.executable,
        "pythonpath": os.environ.get("PYTHONPATH"),
        "device": device,
        "target_warm_warmup_s": TARGET_WARM_WARMUP_S,
        "page_cache": "evicted before each start" if args.evict_page_cache else "kept (warm from the write)",
        "profiles": {},
    }

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")

    try:
        if args.model_dir is not None:
            folder = args.model_dir.resolve()
            record["dit_config"] = resolve_model_folder(folder).dit.to_dict()
            record["dit_bytes"], _ = tree_bytes(folder / "transformer")
        else:
            folder = work / "model"
            if folder.exists():
                shutil.rmtree(folder)
            build = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            record |= write_folder(folder, args, build)
        record["folder"] = str(folder)
        record["blocks"] = record["dit_config"]["num_layers"]
        record["folder_bytes"], _ = tree_bytes(folder)
        print(f"model folder {folder}: {record['folder_bytes'] / 1e9:.2f} GB", flush=True)
        save()
        for name in names:
            cache = work / f"cache-{name}"
            if cache.exists():
                shutil.rmtree(cache)
            cache.mkdir()
            runs: dict[str, Any] = {"settings": PROFILES[name]}
            record["profiles"][name] = runs
            for phase in ("cold", "warm"):
                left = deadline - time.perf_counter() - STOP_RESERVE_S
                if left < MIN_START_S:
                    runs[phase] = {"skipped": f"{left + STOP_RESERVE_S:.0f} s of the --budget left"}
                    continue
                if args.evict_page_cache:
                    evict_page_cache(folder)
                run_dir = work / f"{name}-{phase}"
                run_dir.mkdir(exist_ok=True)
                try:
                    entry = start_once(folder, cache, run_dir, device, PROFILES[name], min(args.timeout, left))
                except Exception as err:  # recorded, so that the other starts still run (the server is stopped)
                    entry = {"ready": False, "error": f"{type(err).__name__}: {err}"[:2000]}
                if args.logs is not None and "log" in entry:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    entry["log"] = str(shutil.copy(entry["log"], args.logs / f"{name}-{phase}.log"))
                elif temporary and not args.keep:
                    entry.pop("log", None)  # removed with the work folder at the end; its lines are in the entry
                runs[phase] = entry
                shown = {k: entry.get(k) for k in ("ready", "start_to_ready_s", "load_s", "warmup_s", "error")}
                print(f"{name} {phase}: {shown}", flush=True)
                save()
            runs |= summarise(runs)
            save()
        record["total_s"] = round(time.perf_counter() - begin, 1)
        save()
    except Exception as err:  # the folder could not be written or read: said in the record too
        record["error"] = f"{type(err).__name__}: {err}"[:2000]
        save()
        raise
    finally:
        if temporary and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(record["profiles"]))
    starts = [r for p in record["profiles"].values() for ph, r in p.items() if ph in ("cold", "warm")]
    return 0 if starts and all(r.get("ready") for r in starts) else 1


if __name__ == "__main__":
    sys.exit(main())
