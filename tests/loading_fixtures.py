"""Whether a loaded module owns its tensors: no byte of them inside a mapping of the files it was read from, each in a
64-byte aligned allocation of its own (what `assign_from_checkpoint` promises; issue 22)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from pathlib import Path

from torch import nn

ALIGNMENT = 64


def mapped_ranges(files: Iterable[Path]) -> list[tuple[int, int]]:
    """[start, end) of every mapping of `files` in this process (Linux's /proc/self/maps)."""
    names = {str(Path(f).resolve()) for f in files}
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in names:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def not_owned(module: nn.Module, files: Iterable[Path]) -> list[str]:
    """'name: why' for each parameter and buffer of `module` that is not in an aligned allocation of its own."""
    files = list(files)
    assert files, "no checkpoint files given"
    ranges = mapped_ranges(files)
    found = []
    for name, tensor in chain(module.named_parameters(), module.named_buffers()):
        storage = tensor.untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        if any(start < hi and lo < end for lo, hi in ranges):
            found.append(f"{name}: a view into the mapped checkpoint file")
        elif tensor.data_ptr() % ALIGNMENT:
            found.append(f"{name}: at data_ptr % {ALIGNMENT} = {tensor.data_ptr() % ALIGNMENT}")
        elif storage.nbytes() != tensor.nbytes:
            found.append(f"{name}: shares a {storage.nbytes()}-byte storage ({tensor.nbytes} bytes its own)")
    return found
