"""Fused passes for the DiT's hot path, each beside the plain reference it replaces, and the block written over them.

qk_norm_rope  the attention's per-head RMSNorm of q and k and the partial rotate-half RoPE in one pass over q and k
              (`triton_qk_norm_rope`); `exact`: torch's own rms_norm first, then the kernel's rotary alone.
norm_modulate [x + gate * y, stored,] then RMSNorm and AdaLN modulation, the modulation rows gathered from the
              block's table by each row's index [, quantized for an FP8 GEMM]: the block's two pre-GEMM passes
swiglu        value * silu(gate) of fc1's output [, quantized for fc2]
quantize_rows the attention output, quantized for out_proj
modulate, gated_residual   the exact passes' pieces (no sum in either)

`block_forward` is `Block.forward` written over a `BlockPasses` value, one field per pass, each pass's signature
stated once (a `Protocol`; the Triton op's schema and the reference take the same parameters): `compile_passes`
(what the compiled block traces on CUDA), `exact_passes` (what eager runs on CUDA: every sum stays torch's own, each
RMSNorm torch's `rms_norm`, whose reduction order no other kernel repeats, so eager keeps the reference ops' numbers
bit for bit), or `REFERENCES` (the passes' plain compositions, with which the restructured block is checked bit for
bit against `Block.forward` on the CPU, tests/test_fused_block.py). `eager_rounding`: each kernel rounds its
intermediates to the activations' dtype where eager does; without it they stay float32, as Inductor's fused code
keeps them.

The Triton kernels are `torch.library.triton_op`s (`triton_kernels()`), so `torch.compile` traces them into the
compiled block as kernels of their own and eager calls launch them directly. They need a CUDA device and Triton
(`available`). Nothing here is process state: `accel.apply` hands each model the passes it runs. What each pass
costs and buys is measured by bench/fused_passes.py and bench/dit_step.py (bench/results/README.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch
import torch.nn.functional as F

from h3serve.accel.linear import Fp8Linear, quantize_rows
from h3serve.model import ops
from h3serve.model.dit import MODULATIONS, Block, Rope


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
    *,
    op: Callable,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.qk_norm_rope_reference` in one Triton pass, `op` (`triton_kernels()["qk_norm_rope"]`). `exact` (the
    eager passes' qk pass): bit for bit the reference, torch's `rms_norm` of q and k, then the kernel's rotary alone
    (one pass over q and k where the reference's rotary takes eight kernels)."""
    check_shapes(q, k, cos, sin)
    if exact:
        q, k = ops.qk_norm(q, k, q_weight, k_weight, eps)
    return op(q, k, q_weight, k_weight, eps, cos.float(), sin.float(), norm=not exact)


def qk_kernel(kernels: Mapping[str, Callable], exact: bool) -> ops.QkNormRopeKernel:
    """The qk-norm + rotary kernel an `Attention` module runs (`Attention.qk_kernel`) over Triton's op."""
    return functools.partial(qk_norm_rope, op=kernels["qk_norm_rope"], exact=exact)


@functools.cache
def triton_kernels() -> Mapping[str, Callable]:
    """The Triton passes by name (imported and registered once; nothing compiles until a first call). A read-only
    table: which of them a model runs is the model's own choice (`accel.apply`)."""
    if not available():
        raise ValueError("the fused kernels need a CUDA device and Triton")
    from h3serve.accel import triton_block
    from h3serve.accel.triton_qk_norm_rope import qk_norm_rope_fused

    return MappingProxyType(
        {
            "qk_norm_rope": qk_norm_rope_fused,
            "norm_modulate": triton_block.norm_modulate_op,
            "swiglu": triton_block.swiglu_op,
            "quantize_rows": triton_block.quantize_rows_op,
            "modulate": triton_block.modulate_op,
            "gated_residual": triton_block.gated_residual_op,
        }
    )


# ---- the block passes -------------------------------------------------------------------------------------------
# Each pass's signature, stated once: the Triton op of the same name (`triton_kernels()`, its registered schema) and
# the reference below take these parameters in this order, and `block_forward` names every one after the tensors.
# x, y: (S, N) rows of the residual stream; table: (TABLE_ROWS, 6N) a block's modulation rows, each the six vectors of
# `MODULATIONS` side by side; indices: (S,) each row's table row (t_index * 3 + tag); gate, shift, scale: which of
# the six (a chunk index, `CHUNK`). `quantize`: the output as `quantize_rows` makes it ((S, N) e4m3 and (S, 1) float32
# scales) for an FP8 GEMM, else the activations' dtype and an empty (0, 1) for the scales. `eager_rounding`: the
# kernel rounds its intermediates to the activations' dtype where eager does, else keeps them float32 (as Inductor's
# fused code does); the references are eager, so it changes nothing there.


class NormModulate(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None,
        weight: torch.Tensor,
        table: torch.Tensor,
        indices: torch.Tensor,
        *,
        eps: float,
        gate: int,
        shift: int,
        scale: int,
        quantize: bool,
        eager_rounding: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[x = x + gate * y;] h = modulate(rms_norm(x, weight, eps), shift, scale) [-> quantize_rows(h)]: a block's
        AdaLN pass before a GEMM. Returns (x, h or its e4m3 rows, the scales); x is empty (0, N) from a kernel
        without `y` (`gate` is not read then)."""
        ...


class Swiglu(Protocol):
    def __call__(self, f: torch.Tensor, *, quantize: bool, eager_rounding: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """fc1's output (S, 2F) as `[gate | value]` -> value * silu(gate) (S, F) [-> quantize_rows]; (h, scales)."""
        ...


class QuantizeRows(Protocol):
    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, N) -> (S, N) e4m3 and (S, 1) float32 scales, `quantize_rows` (the attention output, for out_proj)."""
        ...


class Modulate(Protocol):
    def __call__(
        self, n: torch.Tensor, table: torch.Tensor, indices: torch.Tensor, *, shift: int, scale: int, quantize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """AdaLN modulation of rows already normalised (n * (1 + scale) + shift) [-> quantize_rows]; (h, scales)."""
        ...


class GatedResidual(Protocol):
    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, indices: torch.Tensor, *, gate: int
    ) -> torch.Tensor:
        """x + gate * y, the residual stream as stored."""
        ...


@dataclass(frozen=True)
class BlockPasses:
    """The passes `block_forward` runs, one field per pass, each of the signature its Protocol states.

    `modulate` and `gated_residual` with torch's `rms_norm` between them are what the exact passes' `norm_modulate`
    is made of (`exact_passes`); `gated_residual` is also the block's last residual add."""

    norm_modulate: NormModulate
    swiglu: Swiglu
    quantize_rows: QuantizeRows
    modulate: Modulate
    gated_residual: GatedResidual

    @classmethod
    def from_kernels(cls, kernels: Mapping[str, Callable]) -> BlockPasses:
        """Triton's passes as they are registered (`triton_kernels()`): each op's schema is its pass's signature, so
        the op itself is the field (called by keyword, as an op takes its schema's names)."""
        return cls(**{field.name: kernels[field.name] for field in dataclasses.fields(cls)})


def norm_modulate_reference(
    x: torch.Tensor,
    y: torch.Tensor | None,
    weight: torch.Tensor,
    table: torch.Tensor,
    indices: torch.Tensor,
    eps: float,
    gate: int,
    shift: int,
    scale: int,
    quantize: bool,
    eager_rounding: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`NormModulate` as `Block.forward` computes it: the gate, shift and scale rows gathered from `table`'s chunks by
    `indices`. Returns x itself without `y`."""
    chunks = table.chunk(len(MODULATIONS), dim=-1)
    if y is not None:
        x = ops.gated_residual(x, chunks[gate].index_select(0, indices), y)
    h = F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = ops.modulate(h, chunks[shift].index_select(0, indices), chunks[scale].index_select(0, indices))
    if quantize:
        return x, *quantize_rows(h)
    return x, h, h.new_empty((0, 1), dtype=torch.float32)


def swiglu_reference(f: torch.Tensor, quantize: bool, eager_rounding: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`Swiglu` as `Block.forward` computes it."""
    gate, value = f.chunk(2, dim=-1)
    h = value * F.silu(gate)
    return quantize_rows(h) if quantize else (h, h.new_empty((0, 1), dtype=torch.float32))


def modulate_reference(
    n: torch.Tensor, table: torch.Tensor, indices: torch.Tensor, shift: int, scale: int, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Modulate` as `Block.forward` computes it, the shift and scale rows gathered from `table`."""
    chunks = table.chunk(len(MODULATIONS), dim=-1)
    h = ops.modulate(n, chunks[shift].index_select(0, indices), chunks[scale].index_select(0, indices))
    return quantize_rows(h) if quantize else (h, h.new_empty((0, 1), dtype=torch.float32))


def gated_residual_reference(
    x: torch.Tensor, y: torch.Tensor, table: torch.Tensor, indices: torch.Tensor, gate: int
) -> torch.Tensor:
    """`GatedResidual` as `Block.forward` computes it, the gate rows gathered from `table`."""
    return ops.gated_residual(x, table.chunk(len(MODULATIONS), dim=-1)[gate].index_select(0, indices), y)


# The passes' plain compositions: with them the restructured block is `Block.forward` bit for bit (on the CPU,
# tests/test_fused_block.py), and each kernel is checked against its own.
REFERENCES = BlockPasses(
    norm_modulate=norm_modulate_reference,
    swiglu=swiglu_reference,
    quantize_rows=quantize_rows,
    modulate=modulate_reference,
    gated_residual=gated_residual_reference,
)
# Where each modulation vector sits in a block's table row (a chunk index, not a denoise step).
CHUNK = {name: MODULATIONS.index(name) for name in MODULATIONS}


def compile_passes(passes: BlockPasses) -> BlockPasses:
    """What the compiled block runs (`accel.apply`) over `passes` (`BlockPasses.from_kernels(triton_kernels())`):
    their norm + modulation passes, their SwiGLU and row quantization with FP8 linears; the BF16 SwiGLU gate and the
    block's last gated residual stay the plain ops, left to Inductor (its pass for the gate is at its traffic floor;
    the residual is one pass either way)."""
    quantized_swiglu = passes.swiglu

    def swiglu(f: torch.Tensor, *, quantize: bool, eager_rounding: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if quantize:
            return quantized_swiglu(f, quantize=True, eager_rounding=eager_rounding)
        return swiglu_reference(f, quantize=False)

    return dataclasses.replace(passes, swiglu=swiglu, gated_residual=gated_residual_reference)


def exact_passes(passes: BlockPasses) -> BlockPasses:
    """The eager block's passes: exact, so eager stays bit for bit the reference ops (`Block.forward`).

    Every sum stays torch's own: each RMSNorm is torch's `rms_norm`, whose reduction order no other kernel repeats.
    Around it the passes do what has no sum, each value rounded where eager rounds: the gathered modulation rows with
    the gated residual adds and the modulation ([-> e4m3 for an FP8 GEMM]), and the SwiGLU gate. `passes`: Triton's
    (`BlockPasses.from_kernels(triton_kernels())`), or `REFERENCES`, with which the composition itself is checked on a
    CPU."""
    modulate, gated_residual = passes.modulate, passes.gated_residual

    def norm_modulate(
        x: torch.Tensor,
        y: torch.Tensor | None,
        weight: torch.Tensor,
        table: torch.Tensor,
        indices: torch.Tensor,
        *,
        eps: float,
        gate: int,
        shift: int,
        scale: int,
        quantize: bool,
        eager_rounding: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if y is not None:
            x = gated_residual(x, y, table, indices, gate=gate)
        n = F.rms_norm(x, (x.shape[-1],), weight, eps)
        return x, *modulate(n, table, indices, shift=shift, scale=scale, quantize=quantize)

    return dataclasses.replace(passes, norm_modulate=norm_modulate)


def _fp8(linear: torch.nn.Module) -> bool:
    """Whether the pass before `linear` quantizes its output for it (an FP8 GEMM's input): an Fp8Linear, or a
    run-time adapter's wrapper around one (`accel.lora.LoraLinear`, which takes the same rows)."""
    return isinstance(linear, Fp8Linear) or isinstance(getattr(linear, "base", None), Fp8Linear)


def _project(linear: torch.nn.Module, h: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block linear on a pass's output: already quantized rows for an Fp8Linear, else the layer itself."""
    return linear.matmul_rows(h, scales, dtype) if _fp8(linear) else linear(h)


def block_forward(
    block: Block,
    x: torch.Tensor,
    table: torch.Tensor,
    adaln_indices: torch.Tensor,
    rope: Rope,
    passes: BlockPasses,
    eager_rounding: bool = True,
) -> torch.Tensor:
    """`Block.forward` with its element-wise work done by `passes`: `compile_passes(...)` (what compile traces),
    `exact_passes(...)` (eager on CUDA), or `REFERENCES`. With FP8 block linears each GEMM's input is quantized by
    the pass that makes it; the second AdaLN pass takes the attention's gated residual add. The attention and the
    qk-norm + rotary are the block's own kernels (`Attention.kernel`, `.qk_kernel`)."""
    attn, mlp = block.attn, block.mlp
    dtype = x.dtype
    # x (S, hidden) -> h, the attention's input: no residual to add before the first pass (y None, `gate` unread)
    _, h, s = passes.norm_modulate(
        x, None, block.norm1.weight, table, adaln_indices, eps=block.norm1.eps, gate=0, shift=CHUNK["shift_msa"],
        scale=CHUNK["scale_msa"], quantize=_fp8(attn.qkv_proj), eager_rounding=eager_rounding,
    )  # fmt: skip
    q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in _project(attn.qkv_proj, h, s, dtype).chunk(3, dim=-1))
    q, k = attn.qk_kernel(q, k, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, *rope)
    out = ops.attention(q, k, v, kernel=attn.kernel).flatten(1).to(dtype)  # (S, inner)
    y = attn.out_proj.matmul_rows(*passes.quantize_rows(out), dtype) if _fp8(attn.out_proj) else attn.out_proj(out)
    # x + gate_msa * y, stored, -> h, the MLP's input
    x, h, s = passes.norm_modulate(
        x, y, block.norm2.weight, table, adaln_indices, eps=block.norm2.eps, gate=CHUNK["gate_msa"],
        shift=CHUNK["shift_mlp"], scale=CHUNK["scale_mlp"], quantize=_fp8(mlp.fc1), eager_rounding=eager_rounding,
    )  # fmt: skip
    h, s = passes.swiglu(_project(mlp.fc1, h, s, dtype), quantize=_fp8(mlp.fc2), eager_rounding=eager_rounding)
    return passes.gated_residual(x, _project(mlp.fc2, h, s, dtype), table, adaln_indices, gate=CHUNK["gate_mlp"])


def block_body(passes: BlockPasses, eager_rounding: bool) -> Callable:
    """The function a `Block` runs instead of its own forward (`accel.blocks.BlockStack.bodies`): `block_forward`
    over `passes`, called as `body(block, x, table, adaln_indices, rope)`."""
    return functools.partial(block_forward, passes=passes, eager_rounding=eager_rounding)
