"""Persistent kernel caches: one folder (`H3_CACHE_DIR`) holding Inductor's compiled graphs and Triton's kernels
(and, when a Humming backend exists, its JIT cubins; FlashAttention-4's compiled kernels under FA4), so a restarted
process, or a recreated container with the folder mounted, reuses compiled kernels instead of compiling again. Their
contents are keyed by content hashes (FA4's by a fingerprint of its sources and versions), so sharing one folder
across versions is safe; a new torch simply adds entries.

Set once, at start, before anything compiles: the variables are read when the first kernel is compiled (FA4's when
the package is imported, which `accel.fa4` defers to the start's self-test).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Each cache's environment variable, and its subfolder of the cache directory.
CACHES = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "HUMMING_CACHE_DIR": "humming",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "fa4",
}
# Switches a cache needs beside its folder: FA4 keeps its kernels in memory only unless this is 1.
SWITCHES = {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}


def use_cache_dir(root: str | os.PathLike[str], environ: dict | None = None) -> dict[str, str]:
    """Point every kernel cache at a subfolder of `root` (created if needed); returns the variables set.

    A cache variable the operator already set to another folder is a conflict, refused rather than overridden or
    ignored (ValueError naming both). Inductor's own default, which torch writes into the environment when its
    compiler modules are imported (`_torch_default`), is no operator's choice: it is replaced."""
    environ = os.environ if environ is None else environ
    root = Path(root).expanduser().resolve()
    wanted = {var: str(root / sub) for var, sub in CACHES.items()}
    for var, path in wanted.items():
        current = environ.get(var)
        if current and Path(current).expanduser().resolve() != Path(path) and not _torch_default(var, current):
            raise ValueError(f"H3_CACHE_DIR puts {var} at {path}, but {var} is already set to {current}; unset one")
    for var, value in SWITCHES.items():
        if environ.get(var, value) != value:
            raise ValueError(f"H3_CACHE_DIR keeps FA4's kernels, which needs {var}={value}, but it is set to "
                             f"{environ[var]!r}; unset one")  # fmt: skip
    for path in wanted.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    environ.update(wanted)
    environ.update(SWITCHES)
    return {**wanted, **SWITCHES}


def _torch_default(var: str, value: str) -> bool:
    """Whether `value` of `var` is what torch itself put there: importing Inductor's runtime (torch.compile, a
    triton_op) sets TORCHINDUCTOR_CACHE_DIR to its default folder when it is unset. Only once torch is imported."""
    if var != "TORCHINDUCTOR_CACHE_DIR" or "torch" not in sys.modules:
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(value).expanduser().resolve() == Path(default_cache_dir()).expanduser().resolve()
