"""FA4: the DiT's attention through FlashAttention-4's forward kernel (the `flash-attn-4` package, CuTe DSL). Exact
attention, like cuDNN's: the two differ only in the order of BF16 roundings (3e-3 relative at H3's shapes on an H200,
where FA4 ran 1.17x cuDNN's speed and its reruns were bitwise: bench/results/README.md).

- `fa4_sdpa`: an `ops.AttentionKernel` over (B, H, S, D). It hands FA4 the (B, S, H, D) memory the DiT already has (Q,
  K and V are views of the fused QKV projection: no copy) through `h3serve::fa4_attention`, a custom op with a fake,
  so a compiled block traces it as one opaque call, and returns FA4's (B, S, H, D) output as (B, H, S, D) again.
- `missing(device)`: why this machine cannot run FA4 (no GPU, below sm90, the package absent); `accel.profile.check`
  refuses an explicit FA4 with it, before any weight loads.
- `self_test(device, head_dim)`: FA4 on seeded operands at a few row counts (odd, so a partial tile is always
  there), compared with float32 attention of the same BF16 operands, and a rerun compared bit for bit. It compiles
  (or loads from the persistent cache, `accel.caches`) the very kernel the DiT then runs.
`accel.attention.resolve` makes the start's choice from these.

The package is imported only on CUDA, at the self-test or the first call: FA4 reads its cache variables when it is
imported, and `H3_CACHE_DIR` sets them first (`startup.preflight`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from dataclasses import dataclass

import torch

DIST = "flash-attn-4"
INSTALL = "pip install 'h3serve[fa4]' (flash-attn-4[cu13]==4.0.0b36, for a torch built with CUDA 13)"
CAPABILITY = (9, 0)  # FA4's Hopper forward kernel and newer
# The GPU generations `auto` picks FA4 on: Hopper (sm90: measured for H3 on an H200) and datacenter Blackwell (sm100,
# sm103: FA4's first target). Not sm12x (RTX 50, RTX PRO, DGX Spark's GB10): FA4 has a kernel there, but it was not
# measured for H3 here and a peer reported FA4 failing at H3's packed shape on SM121; an explicit FA4 still runs there.
AUTO_MAJORS = (9, 10)
ROWS = (1, 131, 2053)  # the self-test's row counts: odd, below, at and over FA4's tiles
HEADS = 4  # the self-test's heads: a kernel is compiled per head size and dtype, not per head count
TOLERANCE = 1e-2  # relative Frobenius error against float32 attention of the same operands (the measured 3e-3 x 3)
SEED = 0


def version() -> str | None:
    """The installed flash-attn-4's version (its metadata; nothing imported), or None."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Machine:
    """What FA4's refusals and `auto`'s choice depend on: the GPU's compute capability (None: no CUDA GPU), the
    installed flash-attn-4's version (None: not installed) and whether `flash_attn.cute` can be found."""

    capability: tuple[int, int] | None
    version: str | None
    importable: bool

    @classmethod
    def of(cls, device: torch.device | str | None = None) -> Machine:
        """This machine's facts for `device` (the current CUDA device when None). Imports nothing of FA4."""
        capability = tuple(torch.cuda.get_device_capability(device)) if torch.cuda.is_available() else None
        installed = version()
        importable = installed is not None and importlib.util.find_spec("flash_attn.cute") is not None
        return cls(capability, installed, importable)  # type: ignore[arg-type]


def missing(device: torch.device | str | None = None, machine: Machine | None = None) -> str | None:
    """Why this machine (`machine`: its facts, read for `device` when None) cannot run FA4 (the message a refusal
    carries), or None."""
    machine = Machine.of(device) if machine is None else machine
    allowed = "allowed: CUDNN_ATTN, TORCH_SDPA, auto"
    if machine.capability is None:
        return f"attention FA4 needs a CUDA GPU ({allowed})"
    major, minor = machine.capability
    if (major, minor) < CAPABILITY:
        return f"attention FA4 needs sm90 or newer, this GPU is sm{major}{minor} ({allowed})"
    if machine.version is None:
        return f"attention FA4 needs {DIST}, which is not installed: {INSTALL} ({allowed})"
    if not machine.importable:
        return (
            f"attention FA4: {DIST} {machine.version} is installed but flash_attn.cute is not importable: {INSTALL} "
            f"({allowed})"
        )
    return None


def auto_refusal(device: torch.device | str | None = None, machine: Machine | None = None) -> str | None:
    """Why `auto` does not pick FA4 on this machine (the reason shown beside the choice), or None."""
    machine = Machine.of(device) if machine is None else machine
    why = missing(machine=machine)
    if why is not None:
        return why.removeprefix("attention ").rsplit(" (allowed:", 1)[0]
    major, minor = machine.capability  # type: ignore[misc]
    if major not in AUTO_MAJORS:
        return (
            f"FA4 is chosen by default on sm90 and sm100 only, this GPU is sm{major}{minor} (not measured for H3 "
            "there): set attention FA4 to run it"
        )
    return None


# ---- the kernel --------------------------------------------------------------------------------------------------
def fa4_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Softmax attention over (B, H, S, D), scale 1/sqrt(D), by FA4; the output (B, H, S, D) over (B, S, H, D)
    memory, as cuDNN writes it (the out projection reads rows of heads side by side)."""
    out = torch.ops.h3serve.fa4_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal)
    return out.transpose(1, 2)


@torch.library.custom_op("h3serve::fa4_attention", mutates_args=())
def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """FA4's forward over q, k, v (B, S, H, D), half precision, unit channel stride (other strides free: views of one
    projection); returns (B, S, H, D), contiguous."""
    from flash_attn.cute import flash_attn_func

    out, _ = flash_attn_func(q, k, v, causal=causal)
    return out


@fa4_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


# ---- the start-up self-test -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fa4CheckResult:
    """`why`: None when every row count passed and the rerun was bitwise, else what failed (the row count, then the
    exception or the error against the bound). `error`: the largest relative error seen. `seconds`: wall time, the
    package's import and the kernel's compile (or its load from the persistent cache) included; `import_seconds`:
    the import alone (the CUTLASS DSL; the same cold or warm), so that the rest is what a warm cache saves."""

    why: str | None
    error: float
    seconds: float
    version: str | None
    import_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.why is None

    def describe(self) -> str:
        verdict = f"error {self.error:.1e}, rerun bitwise" if self.ok else f"failed: {self.why}"
        took = f"{self.seconds:.2f} s (import {self.import_seconds:.2f} s)"
        return f"{DIST} {self.version} self-test in {took}: {verdict}"


def self_test(device: torch.device | str, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> Fa4CheckResult:
    """FA4 at `ROWS` rows, `HEADS` heads of `head_dim`, in `dtype`, on `device`, through the op the engine calls, on Q,
    K and V as strided views of one tensor (as the fused projection gives them), against float32 attention of the
    same operands; the largest row count run twice and compared bit for bit. Raises for nothing the kernel does."""
    device = torch.device(device)
    start = time.perf_counter()
    worst, why, imported = 0.0, None, 0.0
    try:
        import flash_attn.cute  # noqa: F401  (timed apart: the kernels' compile or load is what follows)

        imported = time.perf_counter() - start
        generator = torch.Generator(device=device).manual_seed(SEED)
        with torch.inference_mode(), torch.cuda.device(device):
            for rows in ROWS:
                qkv = torch.randn(1, rows, 3, HEADS, head_dim, device=device, generator=generator).to(dtype)
                q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (1, H, S, D) views
                got = fa4_sdpa(q, k, v, False)
                want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
                error = ((got.float() - want).norm() / want.norm().clamp_min(1e-30)).item()
                worst = max(worst, error)
                if not error <= TOLERANCE:  # NaN fails too
                    why = f"S={rows}: relative error {error:.1e} against float32 attention (bound {TOLERANCE:.0e})"
                    break
            else:
                if not torch.equal(fa4_sdpa(q, k, v, False), got):
                    why = f"S={ROWS[-1]}: a rerun on the same operands gave other bits"
            torch.cuda.synchronize(device)
    except Exception as err:  # a compile or launch failure is a result, not a crash
        why = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
    return Fa4CheckResult(why, worst, time.perf_counter() - start, version(), imported)
