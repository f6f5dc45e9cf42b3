"""Fused kernels for the DiT's hot path, each replacing a plain reference op of `h3serve.model.ops` and checked
against it (tests/test_fused.py on the GPU; the references' own tests run on the CPU).

qk_norm_rope  the attention's per-head RMSNorm of q and k and the partial rotate-half RoPE, in one pass over q and k:
              each (row, head) is read once and written once, where Inductor's code for the same ops ran two
              reductions, a pointwise kernel and two concatenations (about 21 ms of the 514 ms compiled BF16
              forward at the reference shape; bench/results/2026-12-01-h200-dit-step.json).

The arithmetic follows the eager ops' roundings: the norm and its weight in float32, rounded once to the activations'
dtype (as eager's CUDA `rms_norm` measured; `triton_qk_norm_rope.ROUND_NORM`); the rotary tables rounded to that
dtype, each product rounded, then their sum. The sum of squares and the rsqrt are the kernel's own, so a few values
land a rounding step away from the reference ops (tests/test_fused.py bounds it).

The kernel is a `torch.library.triton_op`, so `torch.compile` traces it into the compiled block as a kernel of its
own (no graph break) and eager calls launch it directly. It needs a CUDA device and Triton (`available`).
"""

from __future__ import annotations

import functools

import torch

from h3serve.model import ops


@functools.cache
def available() -> bool:
    """Triton importable and a CUDA device present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_shapes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """What the fused kernel assumes; ValueError otherwise (the reference takes anything `apply_rotary` takes)."""
    if q.ndim != 3 or k.shape != q.shape or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q, k must be (S, H, D) with unit channel stride, got {tuple(q.shape)}, {tuple(k.shape)}")
    r = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[0] != q.shape[0] or r % 2 or r > q.shape[-1] or cos.stride(-1) != 1:
        raise ValueError(f"cos, sin must be (S, R) with R even and <= D, got {tuple(cos.shape)}, {tuple(sin.shape)}")


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.qk_norm_rope_reference` in one Triton pass (CUDA). The op is built by `build` (or `use`) first: a plain
    global read here, which `torch.compile` traces without a break."""
    check_shapes(q, k, cos, sin)
    if _FUSED is None:
        raise RuntimeError("the fused qk-norm + rotary op is not built; call fused.build() or fused.use(True) first")
    return _FUSED(q, k, q_weight, k_weight, eps, cos.float(), sin.float())


_FUSED = None


def build() -> None:
    """Import Triton and register the custom op (once; nothing compiles until the first call)."""
    global _FUSED
    if not available():
        raise ValueError("the fused qk-norm + rotary kernel needs a CUDA device and Triton")
    from h3serve.accel.triton_qk_norm_rope import qk_norm_rope_fused

    _FUSED = qk_norm_rope_fused


def use(enabled: bool) -> None:
    """Route `ops.qk_norm_rope` through the fused kernel (True) or the reference (False)."""
    if enabled:
        build()
    ops.use_qk_norm_rope_kernel(qk_norm_rope if enabled else None)
