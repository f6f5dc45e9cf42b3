"""Checkpoint load speed and memory: the reader (`h3serve.checkpoint.reader`, `load_dit`'s one read path) against
safetensors' own mmap (`mmap_load` below, the path production had before the reader), BF16 to the GPU and FP8 at load
(`Fp8LoadHook`), each as a first read (the files evicted from the page cache) and cached, on a DiT written in the
released layout (original key names, QKV interleaved per head, sharded under `model.safetensors.index.json`) at full
width with `--blocks` of its 50 blocks, random weights.

    PYTHONPATH=/tmp/site:src:tests python3 bench/load.py --blocks 16 --out bench/results/DATE-h200-load.json
    PYTHONPATH=src:tests python bench/load.py --device cpu --blocks 1 --hidden 256 --out /tmp/load.json  # smoke

GB/s is checkpoint bytes / wall seconds of `load_dit` or `mmap_load` (GB = 1e9 bytes; the device synchronized).
Memory: the host's extra RSS during each load (RssAnon and RssFile sampled from /proc/self/status, their sum's peak
from VmHWM) over the load's start, and the GPU's peak allocation over the model it leaves resident. Targets: >= 2 GB/s
BF16, >= 1.5 GB/s FP8, first read from local NVMe or the page cache; the host's extra bounded by about two of the
largest tensor (the reader's window and the tensor in hand), whatever the checkpoint's size.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from lib.host import StatusPeaks, evict, proc_status
from lib.timing import run_header
from safetensors import safe_open
from safetensors.torch import save_file

from h3serve.accel.linear import Fp8LoadHook
from h3serve.checkpoint.dit import dit_plan, load_dit, resolve_dit_layout
from h3serve.checkpoint.reader import DEFAULT_THREADS, MIN_WINDOW
from h3serve.checkpoint.safetensors import LoadHook, LoadStats, open_checkpoint
from h3serve.config import NUM_BLOCK_MODULATIONS, NUM_MODALITIES, DiTConfig
from h3serve.model.dit import H3DiT, inv_freq, is_fp32_name

# The release's names (tests/data/reference/FL2VA/transformer/model.safetensors.index.json): 13 shards of ~5 GB.
INDEX = "model.safetensors.index.json"
SHARD = "model-{:05d}-of-{:05d}.safetensors"
RELEASED_FP8_GIB = 89  # the FP8 model's set of files, for the projection line
TARGET_GB_S = {"bf16": 2.0, "fp8": 1.5}
GB = 1e9


def bench_config(hidden: int, blocks: int) -> DiTConfig:
    """The released DiT with `blocks` blocks; another `hidden` scales every width with it (the CPU smoke)."""
    if hidden == DiTConfig.hidden_size:
        return DiTConfig(num_layers=blocks)
    return DiTConfig(
        hidden_size=hidden,
        num_layers=blocks,
        num_attention_heads=max(1, hidden // 128),
        attention_head_dim=128,
        ffn_hidden_size=max(64, round(hidden * 8 / 3 / 64) * 64),
        time_embed_hidden_size=hidden,
        time_embed_dim=max(2, hidden // 2),
        adaln_out_features=NUM_BLOCK_MODULATIONS * NUM_MODALITIES * hidden,
        final_adaln_out_features=2 * hidden,
    )


def stored_shapes(config: DiTConfig) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Key -> (shape, stored dtype) in module order, as the original shards store them."""
    with torch.device("meta"):
        model = H3DiT(config)
    return {k: (v.shape, torch.float32 if is_fp32_name(k) else torch.bfloat16) for k, v in model.state_dict().items()}


def nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


def auto_blocks(root: Path, hidden: int, cap: int = 24, reserve: int = 8 << 30) -> int:
    """As many blocks as the disk under `root` holds, keeping `reserve` bytes free; at most `cap`."""
    one = stored_shapes(bench_config(hidden, 1))
    per_block = sum(nbytes(*v) for k, v in one.items() if k.startswith("blocks."))
    rest = sum(nbytes(*v) for v in one.values()) - per_block
    free = shutil.disk_usage(root).free
    return max(1, min(cap, (free - reserve - rest) // per_block))


def write_checkpoint(folder: Path, config: DiTConfig, device: torch.device, shard_bytes: int) -> list[Path]:
    """Random weights (N(0, 0.02), drawn on `device`) in the released layout; every file fsynced. The QKV rows of
    random weights need no interleaving to be laid out as the release's: the loader de-interleaves them all the same.
    """
    shapes = stored_shapes(config)
    shards: list[list[str]] = [[]]
    size = 0
    for key, spec in shapes.items():
        if shards[-1] and size + nbytes(*spec) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes(*spec)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    files, weight_map = [], {}
    for i, keys in enumerate(shards):
        part = {}
        for key in keys:
            shape, dtype = shapes[key]
            if key == "rope.inv_freq":
                part[key] = inv_freq(config.rope_inv_freq_len, config.rope_theta).to(dtype)
            else:
                t = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(0.02)
                part[key] = t.to(dtype).cpu()
                del t
        name = SHARD.format(i + 1, len(shards))
        save_file(part, folder / name, metadata={"format": "pt"})
        del part
        files.append(folder / name)
        weight_map.update(dict.fromkeys(keys, name))
        fsync(folder / name)
    total = sum(nbytes(*spec) for spec in shapes.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps({"_class_name": "MiniMaxH3DiTModel", **config.to_dict()}))
    fsync(folder)
    return files


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resident_fraction(files: list[Path]) -> float:
    """The share of the files' pages in the page cache (mincore over a mapping made and unmade here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for file in files:
        size = file.stat().st_size
        fd = os.open(file, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {file} failed")
            pages = (size + page - 1) // page
            vec = np.zeros(pages, dtype=np.uint8)
            try:
                if libc.mincore(addr, size, vec.ctypes.data) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {file} failed")
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += int((vec & 1).sum())
        total += pages
    return resident / max(total, 1)


def reset_peak_rss() -> bool:
    """VmHWM back to the current RSS (Linux clear_refs 5), so that it reads this load's peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mmap_load(
    path: Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    hook: LoadHook | None = None,
    config: DiTConfig | None = None,
    qkv_layout: str | None = None,
) -> H3DiT:
    """The comparison path: the DiT read through safetensors' own mmap, as production read it before the reader.

    Each key is a zero-copy view into a fresh mapping of its file (`safe_open(...).get_tensor`), paged in by the one
    thread that copies it; the tensors are built by the loader's own plan (`dit_plan`: the same keys and row reorders),
    on the CPU, then copied once into an allocation of their own at the target dtype and device, and `hook` transforms
    each one in turn, as `load_dit` does. Built here from public pieces, so that production keeps one read path; the
    checks (key set, dtypes) are `load_dit`'s job, not this measurement's. `config`: else the folder's config.json.
    """
    path = Path(path)
    device = torch.empty(0, device=device).device
    ckpt = open_checkpoint(path)
    layout = resolve_dit_layout(ckpt, qkv_layout)
    if config is None:
        config = DiTConfig.from_json((path if path.is_dir() else path.parent) / "config.json")
    with torch.device("meta"):
        model = H3DiT(config)
    state: dict[str, torch.Tensor] = {}
    for name, src in dit_plan(model, layout, ckpt.keys()).items():
        views = [safe_open(str(ckpt.file_of(k)), framework="pt", device="cpu").get_tensor(k) for k in src.keys]
        built = src.build(views)
        tensor = torch.empty(built.shape, dtype=torch.float32 if is_fp32_name(name) else dtype, device=device)
        tensor.copy_(built)  # converts and transfers in the one copy
        del views, built
        state.update(hook.transform(name, tensor) if hook is not None else {name: tensor})
        del tensor
    if hook is not None:
        hook.prepare(model)
    model.load_state_dict(state, strict=True, assign=True)
    sync(device)
    return model.eval().requires_grad_(False)


def resident_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in model.state_dict().values())


def measure(
    folder: Path,
    files: list[Path],
    ckpt_bytes: int,
    device: torch.device,
    mode: str,
    path: str,
    cache: str,
    threads: int,
) -> tuple[dict, torch.nn.Module]:
    """One timed load (`load_dit` for the reader, `mmap_load` for mmap); its record and the model."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    gpu_base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if cache == "first_read":
        evict(files)
    cached_before = resident_fraction(files)
    if cache == "first_read" and cached_before > 0.05:
        print(
            f"warning: {cached_before:.0%} of the checkpoint is still in the page cache after the eviction (a tmpfs "
            f"--dir?); this 'first read' is not one",
            flush=True,
        )
    exact_peak = reset_peak_rss()
    base = proc_status()
    stats: list[LoadStats] = []
    hook = Fp8LoadHook() if mode == "fp8" else None
    with StatusPeaks() as sampler:
        sync(device)
        start = time.perf_counter()
        if path == "reader":
            model = load_dit(
                folder, device=device, dtype=torch.bfloat16, hook=hook, threads=threads, on_stats=stats.append
            )
        else:
            model = mmap_load(folder, device=device, dtype=torch.bfloat16, hook=hook)
        sync(device)
        seconds = time.perf_counter() - start
    after = proc_status()
    on_device = resident_bytes(model)
    record = {
        "mode": mode,
        "path": path,
        "cache": cache,
        "threads": threads,
        "page_cache_resident_before": round(cached_before, 4),
        "seconds": round(seconds, 3),
        "gb_per_s": round(ckpt_bytes / GB / seconds, 3),
        "loader_stats": None  # the reader's own account (the mmap path keeps none)
        if not stats
        else {
            "bytes_read": stats[0].bytes_read,
            "seconds": round(stats[0].seconds, 3),
            "gb_per_s": round(stats[0].gb_per_s, 3),
            "peak_ahead_bytes": stats[0].peak_ahead,
        },
        "model_bytes": on_device,
        "host_extra_peak_bytes": {
            "rss": (after["VmHWM"] if exact_peak else max(after["VmRSS"], sampler.peak.get("VmRSS", 0)))
            - base["VmRSS"],
            "rss_exact": exact_peak,
            "anon_sampled": sampler.peak.get("RssAnon", base["RssAnon"]) - base["RssAnon"],
            "file_sampled": sampler.peak.get("RssFile", base["RssFile"]) - base["RssFile"],
        },
    }
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - gpu_base
        record["gpu"] = {"peak_allocated_bytes": peak, "over_model_bytes": peak - on_device}
    if device.type == "cpu":
        # On the CPU the model is the host's: what the load held beside it.
        record["host_extra_peak_bytes"]["rss_over_model"] = record["host_extra_peak_bytes"]["rss"] - on_device
    return record, model


def warm_up(folder: Path, device: torch.device, threads: int) -> None:
    """Both paths once over a tiny checkpoint, unrecorded: the process's first load pays for lazy initialisation
    (CUDA context, kernels, allocator pools) that the measured loads should not."""
    files = write_checkpoint(folder, bench_config(256, 1), torch.device("cpu"), int(GB))
    try:
        for hook in (None, Fp8LoadHook()):
            load_dit(folder, device=device, dtype=torch.bfloat16, hook=hook, threads=threads)
            mmap_load(folder, device=device, dtype=torch.bfloat16, hook=hook)
        sync(device)
    finally:
        for f in [*files, folder / INDEX, folder / "config.json"]:
            f.unlink(missing_ok=True)
        folder.rmdir()


def bitwise_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        x, y = sa[k], sb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def line(r: dict) -> str:
    host = r["host_extra_peak_bytes"]
    text = (
        f"{r['mode']:4} {r['path']:6} {r['cache']:10} {r['gb_per_s']:7.2f} GB/s ({r['seconds']:.1f} s, page cache "
        f"{r['page_cache_resident_before']:.0%} before), host extra {host['rss'] / GB:.2f} GB "
        f"(anon {host['anon_sampled'] / GB:.2f}, file {host['file_sampled'] / GB:.2f})"
    )
    if "gpu" in r:
        text += f", GPU peak over model {r['gpu']['over_model_bytes'] / GB:.2f} GB"
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run, not a benchmark)")
    parser.add_argument(
        "--blocks", type=int, default=0, help="DiT blocks to write (0: as many as the disk holds, <= 24)"
    )
    parser.add_argument("--hidden", type=int, default=DiTConfig.hidden_size, help="width (default: the released)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (else removed after)")
    parser.add_argument("--reuse", action="store_true", help="--dir already holds the checkpoint: do not write it")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (the release's: ~5)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="the reader's threads")
    parser.add_argument("--modes", default="bf16,fp8", help="comma list of bf16, fp8")
    parser.add_argument("--paths", default="reader,mmap", help="comma list of reader, mmap (safetensors' own)")
    parser.add_argument("--caches", default="first_read,cached", help="comma list of first_read, cached")
    parser.add_argument("--out", type=Path, default=None, help="the result JSON (written after every measurement)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available (use --device cpu for a smoke run)")
    modes, paths, caches = (s.split(",") for s in (args.modes, args.paths, args.caches))
    for name, values, allowed in [
        ("--modes", modes, ("bf16", "fp8")),
        ("--paths", paths, ("reader", "mmap")),
        ("--caches", caches, ("first_read", "cached")),
    ]:
        if not set(values) <= set(allowed):
            parser.error(f"{name} must be a comma list of {', '.join(allowed)}, got {','.join(values)}")

    made_dir = args.dir is None
    folder = Path(tempfile.mkdtemp(prefix="h3-load-")) if made_dir else args.dir
    record: dict = {**run_header(device), "device": str(device), "argv": sys.argv}

    def write() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=2) + "\n")

    try:
        if args.reuse:
            config = DiTConfig.from_json(folder / "config.json")
            files = sorted(folder.glob("*.safetensors"))
        else:
            blocks = args.blocks or auto_blocks(folder, args.hidden)
            config = bench_config(args.hidden, blocks)
            start = time.perf_counter()
            gen = device if device.type == "cuda" else torch.device("cpu")
            files = write_checkpoint(folder, config, gen, int(args.shard_gb * GB))
            record["write_seconds"] = round(time.perf_counter() - start, 1)
        shapes = stored_shapes(config)
        ckpt_bytes = sum(nbytes(*spec) for spec in shapes.values())
        largest = max(nbytes(*spec) for spec in shapes.values())
        record["checkpoint"] = {
            "dir": str(folder),
            "blocks": config.num_layers,
            "hidden": config.hidden_size,
            "bytes": ckpt_bytes,
            "file_bytes": sum(f.stat().st_size for f in files),
            "files": [f.name for f in files],
            "tensors": len(shapes),
            "largest_tensor_bytes": largest,
            "reader_window_bytes": max(MIN_WINDOW, largest),
        }
        print(
            f"checkpoint: {config.num_layers} blocks at hidden {config.hidden_size}, {ckpt_bytes / GB:.2f} GB in "
            f"{len(files)} shards at {folder} (largest tensor {largest / GB:.3f} GB)",
            flush=True,
        )
        record["runs"], record["bitwise_equal_reader_vs_mmap"] = [], {}
        write()
        warm_up(folder / "warm-up", device, args.threads)
        for mode in modes:
            last: dict[str, torch.nn.Module] = {}
            for path in paths:
                for cache in caches:
                    threads = args.threads if path == "reader" else 0
                    last.pop(path, None)  # this path's previous model goes first: at most two models at once
                    run, model = measure(folder, files, ckpt_bytes, device, mode, path, cache, threads)
                    record["runs"].append(run)
                    print(line(run), flush=True)
                    write()
                    last[path] = model  # kept for the bitwise comparison of the two paths
                    del model
            if len(last) == 2:
                record["bitwise_equal_reader_vs_mmap"][mode] = bitwise_equal(last["reader"], last["mmap"])
                print(f"{mode}: reader and mmap loads bitwise equal: {record['bitwise_equal_reader_vs_mmap'][mode]}")
            del last
            write()
        record["summary"] = summarize(record["runs"])
        for text in record["summary"]["lines"]:
            print(text)
        write()
    finally:
        if made_dir and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        elif not args.keep and not args.reuse:
            for f in [*folder.glob("*.safetensors"), folder / INDEX, folder / "config.json"]:
                f.unlink(missing_ok=True)


def summarize(runs: list[dict]) -> dict:
    """Per mode: the reader's first-read and cached GB/s, its speed-up over mmap, the targets, the 89 GiB line."""
    by = {(r["mode"], r["path"], r["cache"]): r for r in runs}
    out: dict = {"lines": []}
    for mode in ("bf16", "fp8"):
        for path in ("reader", "mmap"):
            first = by.get((mode, path, "first_read"))
            if first is None:
                continue
            seconds = RELEASED_FP8_GIB * 2**30 / (first["gb_per_s"] * GB)
            out[f"{mode}_{path}_projected_89gib_s"] = round(seconds, 1)
            out["lines"].append(
                f"{mode} {path}: the {RELEASED_FP8_GIB} GiB FP8 set at {first['gb_per_s']:.2f} GB/s (first read): "
                f"{seconds:.0f} s"
            )
        reader = by.get((mode, "reader", "first_read"))
        if reader is not None:
            target = TARGET_GB_S[mode]
            out[f"{mode}_meets_target"] = reader["gb_per_s"] >= target
            out["lines"].append(f"{mode}: reader first read {reader['gb_per_s']:.2f} GB/s, target >= {target} GB/s")
        for cache in ("first_read", "cached"):
            new, old = by.get((mode, "reader", cache)), by.get((mode, "mmap", cache))
            if new is not None and old is not None:
                out[f"{mode}_{cache}_speedup"] = round(new["gb_per_s"] / old["gb_per_s"], 2)
                out["lines"].append(f"{mode} {cache}: reader / mmap = {out[f'{mode}_{cache}_speedup']:.2f}x")
    return out


if __name__ == "__main__":
    main()
