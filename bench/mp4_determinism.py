"""Byte-determinism of `write_mp4` on this machine's av version: numpy vs torch input, repeated encodes, and
thread counts. Prints which encodes match and, for the first mismatch, the MP4 atom path holding it.

    PYTHONPATH=src python bench/mp4_determinism.py
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import av
import numpy as np
import torch

from h3serve.media.mp4 import write_mp4

CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"udta", b"dinf"}


def atom_path(data: bytes, offset: int, start: int = 0, end: int | None = None, prefix: str = "") -> str:
    end = len(data) if end is None else end
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        size = size or end - pos
        if pos <= offset < pos + size:
            name = prefix + "/" + kind.decode("latin1")
            if kind in CONTAINERS:
                return atom_path(data, offset, pos + 8, pos + size, name)
            return f"{name} (+{offset - pos} of {size})"
        pos += size
    return prefix + "/?"


def main() -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (22, 128, 224, 3), dtype=np.uint8)
    audio = (rng.random((2, 29600), dtype=np.float32) - 0.5) * 0.5
    print("av", av.__version__, "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        out = {}
        for threads in (1, 4):
            for kind in ("np1", "np2", "torch1", "torch2"):
                f, a = (frames, audio) if kind.startswith("np") else (torch.from_numpy(frames), torch.from_numpy(audio))
                out[(threads, kind)] = write_mp4(
                    Path(tmp) / f"{kind}-{threads}.mp4", f, a, threads=threads
                ).read_bytes()
        for threads in (1, 4):
            base = out[(threads, "np1")]
            for kind in ("np2", "torch1", "torch2"):
                other = out[(threads, kind)]
                diffs = [i for i in range(min(len(base), len(other))) if base[i] != other[i]]
                where = atom_path(base, diffs[0]) if diffs else "-"
                print(
                    f"threads={threads} np1 vs {kind}: equal={base == other} sizes={len(base)},{len(other)} "
                    f"ndiff={len(diffs)} first={diffs[:3]} at {where}"
                )


if __name__ == "__main__":
    main()
