"""The checkpoint reader (`checkpoint.reader`): its bytes are safetensors' bytes for every dtype and shape however it
chunks them, a short or corrupt file stops it naming the file and key, its read-ahead and files are bounded, and a
DiT loaded through it is bitwise safetensors' own mmap load (bench/load.py's comparison), owned, in bounded memory."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from folder_fixtures import write_sharded
from h3serve.checkpoint.dit import load_dit
from h3serve.checkpoint.reader import MIN_WINDOW, CheckpointError, TensorReader, read_header
from h3serve.checkpoint.safetensors import LoadStats
from h3serve.config import NUM_BLOCK_MODULATIONS, NUM_MODALITIES, DiTConfig
from h3serve.model.dit import H3DiT, is_fp32_name
from h3serve.model.tiny import TINY_DIT, tiny_dit
from loading_fixtures import not_owned

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # lib.export: our DiT as checkpoints hold it
from lib.export import export_state_dict

BENCH = Path(__file__).resolve().parents[1] / "bench"

DTYPES = (
    torch.bfloat16,
    torch.float32,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
SHAPES = ((), (0,), (3, 0), (1,), (7,), (13, 17), (3, 5, 7), (4099,))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs and all) for the numeric dtypes; 0/1 for bool."""
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {f"{str(d).split('.')[-1]}.{i}": random_tensor(s, d, g) for d in DTYPES for i, s in enumerate(SHAPES)}
    path = tmp_path_factory.mktemp("reader") / "every_dtype.safetensors"
    save_file(state, path, metadata={"format": "pt"})
    return path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(("threads", "chunk_bytes"), [(8, 8 << 20), (3, 7), (2, 64), (1, 1000)])
def test_bytes_are_safetensors_bytes_for_every_dtype_and_shape_in_the_order_asked(every_dtype, threads, chunk_bytes):
    with safe_open(str(every_dtype), framework="pt") as f:
        expected = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle is not a mapping)
    keys = sorted(expected, key=lambda k: (hash(k) % 7, k))  # neither the file's order nor sorted
    assert {e.dtype for e in read_header(every_dtype).values()} >= {"BF16", "F32", "F16", "F8_E4M3", "I64", "BOOL"}
    with TensorReader([every_dtype], threads=threads, chunk_bytes=chunk_bytes, window_bytes=100) as reader:
        got = list(reader.read(keys))
    assert len(got) == len(keys)
    for key, tensor in zip(keys, got, strict=True):
        want = expected[key]
        assert (tensor.dtype, tensor.shape) == (want.dtype, want.shape), key
        assert as_bytes(tensor) == as_bytes(want), key
        storage = tensor.untyped_storage()
        assert tensor.data_ptr() % 64 == 0 and storage.nbytes() == tensor.nbytes, key  # a buffer of its own
    assert reader.bytes_read == sum(t.nbytes for t in expected.values())


def test_a_large_tensor_is_read_in_chunks_by_several_threads(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    state = {"big": random_tensor((1_000_003,), torch.bfloat16, g), "odd": random_tensor((3, 333), torch.float32, g)}
    path = tmp_path / "big.safetensors"
    save_file(state, path)
    calls: list[tuple[str, int]] = []
    preadv = os.preadv

    def spy(fd, buffers, offset):
        calls.append((threading.current_thread().name, sum(len(b) for b in buffers)))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    with TensorReader([path], threads=4, chunk_bytes=4096) as reader:
        big, odd = reader.read(["big", "odd"])
    assert as_bytes(big) == as_bytes(state["big"]) and as_bytes(odd) == as_bytes(state["odd"])
    data_calls = [c for c in calls if c[0].startswith("h3serve-read")]
    assert len({name for name, _ in data_calls}) > 1 and max(size for _, size in data_calls) <= 4096
    assert len(data_calls) >= 2_000_006 // 4096


def test_the_window_bounds_what_is_read_ahead(tmp_path):
    g = torch.Generator().manual_seed(2)
    state = {f"t{i:02d}": random_tensor((25_000,), torch.float32, g) for i in range(20)}  # 100 kB each
    state["t07"] = random_tensor((300_000,), torch.float32, g)  # 1.2 MB, more than the window
    path = tmp_path / "many.safetensors"
    save_file(state, path)
    keys = sorted(state)
    with TensorReader([path], threads=4, window_bytes=250_000) as reader:
        for key, tensor in zip(keys, reader.read(keys), strict=True):
            assert as_bytes(tensor) == as_bytes(state[key])
    assert 0 < reader.peak_ahead <= 1_200_000  # one tensor larger than the window is read alone
    with TensorReader([path], threads=4, window_bytes=250_000) as reader:
        small = [k for k in keys if k != "t07"]
        list(reader.read(small))
    assert 100_000 <= reader.peak_ahead <= 250_000
    with TensorReader([path]) as reader:  # default: the largest tensor, at least MIN_WINDOW (here: the whole file)
        list(reader.read(keys))
    assert reader.peak_ahead <= max(MIN_WINDOW, 1_200_000)


def test_files_are_opened_once_and_closed_after_the_load_even_one_stopped_early(every_dtype, tmp_path):
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.ones(3)}, other)
    before = open_fds()
    reader = TensorReader([every_dtype, other, every_dtype])
    assert open_fds() == before + 2
    stream = reader.read(["x", *sorted(reader.entries)])
    next(stream)
    stream.close()  # leaves with reads in flight
    reader.close()
    assert open_fds() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("h3serve-read")]


def test_truncated_or_corrupt_files_name_the_file_and_key(tmp_path):
    state = {"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(1000, dtype=torch.int64)}
    path = tmp_path / "whole.safetensors"
    save_file(state, path)
    data = path.read_bytes()
    last = max(read_header(path).values(), key=lambda e: e.offset)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: last.offset + 8])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(cut))}: key '{last.key}'.*truncated"):
        TensorReader([cut])
    for name, content, words in [
        ("empty.safetensors", b"", "less than the 8-byte header length"),
        ("header_cut.safetensors", data[:20], "truncated or corrupt"),
        ("not_json.safetensors", (12).to_bytes(8, "little") + b"{not json!!}", "corrupt header"),
    ]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / name)) + ".*" + words):
            read_header(tmp_path / name)
    bad = json.dumps({"a": {"dtype": "F32", "shape": [11], "data_offsets": [0, 40]}}).encode()
    (tmp_path / "sizes.safetensors").write_bytes(len(bad).to_bytes(8, "little") + bad + bytes(40))
    with pytest.raises(CheckpointError, match=r"sizes.safetensors: key 'a': data_offsets hold 40 bytes.*44"):
        read_header(tmp_path / "sizes.safetensors")


def test_a_file_cut_short_after_it_was_opened_fails_the_read_naming_file_and_key(tmp_path):
    path = tmp_path / "shrinks.safetensors"
    save_file({"w": torch.randn(1000, 100)}, path)
    before = open_fds()
    with TensorReader([path], chunk_bytes=10_000) as reader:
        os.truncate(path, reader.entries["w"].offset + 50_000)
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: cannot read key 'w'.*truncated"):
            list(reader.read(["w"]))
    assert open_fds() == before


# ---- the DiT through the reader -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny DiT as the original shards (interleaved QKV, built on load) and as a stacked single file."""
    model, root = tiny_dit(), tmp_path_factory.mktemp("dit")
    folder = write_sharded(root / "original", export_state_dict(model, "interleaved"), "original")
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    single = root / "stacked.safetensors"
    save_file(export_state_dict(model, "stacked"), single)
    return {"original": folder, "stacked": single}


def files_of(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def same_bytes(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if sa[k].dtype != sb[k].dtype or as_bytes(sa[k]) != as_bytes(sb[k])]


def bench_load(monkeypatch) -> ModuleType:
    """bench/load.py as a module (bench/ is no package; the script imports `lib` from beside it)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_load", BENCH / "load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8-hook"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["original", "stacked"])
def test_a_dit_read_by_the_reader_is_bitwise_the_mmap_load_and_owns_its_tensors(
    tiny_folders, monkeypatch, layout, dtype, fp8
):
    """The reader against bench/load.py's comparison path: safetensors' own mmap, built from the same plan."""
    from h3serve.accel.linear import Fp8LoadHook

    path = tiny_folders[layout]
    kwargs = dict(dtype=dtype, config=TINY_DIT, qkv_layout=None if layout == "original" else "stacked")
    new = load_dit(path, hook=Fp8LoadHook() if fp8 else None, **kwargs)
    old = bench_load(monkeypatch).mmap_load(path, device="cpu", hook=Fp8LoadHook() if fp8 else None, **kwargs)
    assert same_bytes(new, old) == []
    assert not_owned(new, files_of(path)) == []
    if fp8:
        assert new.blocks[0].attn.qkv_proj.weight.dtype == torch.float8_e4m3fn


def test_a_buffer_read_at_its_final_dtype_for_the_cpu_is_the_model_tensor_itself(tiny_folders, monkeypatch):
    """No second copy: each tensor stored as it is used (here all but the fused QKV, which the original shards
    interleave per head) is the reader's buffer."""
    handed: list[torch.Tensor] = []  # kept alive, so that no later allocation takes one's address
    read = TensorReader.read

    def spy(self, keys):
        for tensor in read(self, keys):
            handed.append(tensor)
            yield tensor

    monkeypatch.setattr(TensorReader, "read", spy)
    model = load_dit(tiny_folders["original"], dtype=torch.bfloat16)
    buffers = {t.data_ptr() for t in handed if t.numel()}
    state = model.state_dict()
    copied = sorted(k for k, t in state.items() if t.numel() and t.data_ptr() not in buffers)
    assert copied == sorted(k for k in state if k.endswith("attn.qkv_proj.weight"))


def test_a_load_to_another_device_builds_there(tiny_folders):
    """For a device other than the CPU the buffers go there at their stored dtype and are built there (run here on
    the meta device, which has every op and no data: the CUDA branch's plumbing, shapes and dtypes)."""
    model = load_dit(tiny_folders["original"], device="meta", dtype=torch.bfloat16)
    cpu = load_dit(tiny_folders["original"], dtype=torch.bfloat16)
    got = {k: (t.device.type, t.dtype, t.shape) for k, t in model.state_dict().items()}
    assert got == {k: ("meta", t.dtype, t.shape) for k, t in cpu.state_dict().items()}


def test_the_load_reports_its_bytes_and_rate(tiny_folders, caplog):
    folder = tiny_folders["original"]
    stats: list[LoadStats] = []
    with caplog.at_level(logging.INFO, logger="h3serve.checkpoint.dit"):
        load_dit(folder, on_stats=stats.append)
    stored = sum(e.nbytes for f in files_of(folder) for e in read_header(f).values())
    assert len(stats) == 1 and stats[0].bytes_read == stored and stats[0].threads > 0
    assert re.search(r"DiT: \d+\.\d GB in \d+\.\d s \(\d+\.\d\d GB/s\)", caplog.text)
    assert str(LoadStats(bytes_read=3_000_000_000, seconds=1.5, tensors=1, threads=8)) == "3.0 GB in 1.5 s (2.00 GB/s)"


def test_mapped_tensors_are_not_read(tiny_folders):
    folder = tiny_folders["original"]
    stats: list[LoadStats] = []
    model = load_dit(folder, mapped=lambda name: name.endswith("adaln_proj.linear.weight"), on_stats=stats.append)
    state = model.state_dict()
    mapped = [k for k in state if k.endswith("adaln_proj.linear.weight")]
    stored = sum(e.nbytes for f in files_of(folder) for e in read_header(f).values())
    assert stats[0].bytes_read == stored - sum(state[k].nbytes for k in mapped)
    owned = not_owned(model, files_of(folder))
    assert sorted(m.split(":")[0] for m in owned) == sorted(mapped)  # those stay views of the file's mapping


def test_a_load_that_stops_on_a_bad_tensor_closes_its_files(tiny_folders, tmp_path):
    state = export_state_dict(tiny_dit(), "stacked")
    state["blocks.1.mlp.fc2.weight"] = state["blocks.1.mlp.fc2.weight"][:, :-1].contiguous()
    path = tmp_path / "bad.safetensors"
    save_file(state, path)
    before = open_fds()
    with pytest.raises(CheckpointError, match=r"bad.safetensors: key 'blocks.1.mlp.fc2.weight' .*wrong shape"):
        load_dit(path, config=TINY_DIT, qkv_layout="stacked")
    assert open_fds() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("h3serve-read")]


# ---- the load's memory --------------------------------------------------------------------------------------------

# ~250 MB. Its AdaLN projections (36 MiB) are over glibc's 32 MiB mmap threshold, as every block tensor of the
# released DiT is (77 to 520 MB): such buffers are mapped and unmapped per allocation. Smaller ones come from the
# heap, where freed memory stays resident, fragmented, for later allocations: a load made of those alone holds more.
HIDDEN = 1024
MEMORY_DIT = DiTConfig(
    hidden_size=HIDDEN,
    num_layers=3,
    num_attention_heads=8,
    attention_head_dim=128,
    ffn_hidden_size=2816,
    text_dim=1024,
    time_embed_hidden_size=HIDDEN,
    time_embed_dim=HIDDEN,
    adaln_out_features=NUM_BLOCK_MODULATIONS * NUM_MODALITIES * HIDDEN,
    final_adaln_out_features=2 * HIDDEN,
)

# Run in a fresh interpreter, so that its peak RSS is the load's: the high-water mark is reset (clear_refs) just
# before the load where Linux allows it, else the process's whole peak (nothing before the load comes near it).
# "keep": a plain CPU load, the model kept. "away": each tensor handed to a hook that takes 5 ms and sends it away
# (to the meta device), as a CUDA load sends it to the GPU: a consumer slower than the reads, so that the read-ahead
# runs as far as it may, and nothing kept on the host. "control": "away" with a read-ahead as deep as the file.
# The DiT is built on the meta device once before the measurement: torch's first meta-device op (the RoPE arange)
# imports torch.fx and sympy, ~150 MB of modules that are the process's, not the load's (a DiT-only load no longer
# imports transformers, which had imported them before).
MEASURE = """
import json, resource, sys, time
from pathlib import Path
import torch
from h3serve.checkpoint import reader
from h3serve.checkpoint.dit import load_dit
from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT

with torch.device("meta"):
    H3DiT(DiTConfig.from_json(Path(sys.argv[1]) / "config.json"))

class Away:
    def transform(self, name, tensor):
        time.sleep(0.005)
        return {name: torch.empty_like(tensor, device="meta")}

    def prepare(self, module):
        pass

def status():
    lines = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(lines[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

mode = sys.argv[2]
if mode == "control":
    reader.MIN_WINDOW = 1 << 40
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = True
except OSError:
    reset = False
before = status()
stats = []
model = load_dit(sys.argv[1], dtype=torch.bfloat16, hook=None if mode == "keep" else Away(), on_stats=stats.append)
peak = status()["VmHWM"] if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({
    "extra": peak - before["VmRSS"], "baseline": before["VmRSS"], "reset": reset, "bytes_read": stats[0].bytes_read,
    "kept": sum(t.nbytes for t in model.state_dict().values() if not t.is_meta), "seconds": stats[0].seconds,
}))
"""
MODES = ("keep", "away", "control")


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory) -> dict[str, dict]:
    """The three measurements (MEASURE) of a ~250 MB DiT in the original sharded layout (random bf16 weights,
    float32 islands), run side by side (each in its own process: its peak is its own)."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in H3DiT(MEMORY_DIT).state_dict().items()}
    g = torch.Generator().manual_seed(3)
    state = {
        k: torch.randn(s, generator=g).to(torch.float32 if is_fp32_name(k) else torch.bfloat16)
        for k, s in shapes.items()
    }
    folder = write_sharded(tmp_path_factory.mktemp("memory"), state, "original", shards=2)
    (folder / "config.json").write_text(json.dumps(MEMORY_DIT.to_dict()))
    del state
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), *sys.path])}
    runs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", MEASURE, str(folder), mode], stdout=subprocess.PIPE, text=True, env=env
        )
        for mode in MODES
    }
    results = {}
    for mode, run in runs.items():
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0, (mode, out)
        results[mode] = json.loads(out.strip().splitlines()[-1])
    largest = max(e.nbytes for f in files_of(folder) for e in read_header(f).values())
    return {"largest": largest, **results}


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@pytest.mark.parametrize("mode", ["keep", "away"])
def test_a_load_holds_at_most_the_documented_window_beside_what_it_keeps(memory_runs, mode):
    """Beside what it keeps (the model, on the CPU), a load holds the read-ahead window (the largest tensor, at least
    MIN_WINDOW) and the tensor in hand while it is built: bounded by those, not by the checkpoint. Kept on the CPU
    at its stored dtype, a read buffer is the model's tensor (no second copy). Sent away by a slow consumer (the
    GPU's case), the host holds the window only; the control, a read-ahead as deep as the file, shows that the
    measurement would see more."""
    largest = memory_runs["largest"]
    window = max(MIN_WINDOW, largest)
    slack = 64 << 20  # the thread pool, the interpreter's and the allocator's own (freed heap kept for reuse)
    run = memory_runs[mode]
    bound = run["kept"] + window + largest + slack
    print(
        f"{mode}: read {mib(run['bytes_read'])}, kept {mib(run['kept'])}, extra {mib(run['extra'])}, bound {mib(bound)}"
    )
    assert run["bytes_read"] > 150e6 and run["kept"] == (run["bytes_read"] if mode == "keep" else 0)
    assert run["extra"] <= bound, (run, bound)
    if mode == "away":
        control = memory_runs["control"]
        print(f"control, read-ahead unbounded: extra {mib(control['extra'])}")
        assert control["extra"] > bound + 32 * 2**20, (control, bound)
