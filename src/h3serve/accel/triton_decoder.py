"""The Triton source of `h3serve.accel.vae`'s decoder passes (imported only where Triton is). Each kernel computes
what its reference in `h3serve.model.video_vae` computes, value for value: every product, sum and quotient rounded
where eager rounds it (to the activations' dtype between two ops, float32 inside one), no sum reordered, and no
multiply-add contracted into one FMA that eager does not contract (launched with `enable_fp_fusion=False`, so each
product is rounded before its add, as eager's two kernels do; the norms' explicit FMAs are torch's own, below).

residual  x + y * scale: the block's residual add (x, scale float32; y the projection's output)
swiglu    up * silu(gate) of the feed-forward's `[gate | up]` rows: silu = g / (1 + exp(-g)) in float32 (libdevice's
          expf, torch's CUDA silu's), rounded, then the product, rounded
qk        the qk-norm (rms over each head's channels, no weight) rounded to the activations' dtype, then the
          rotate-half rotary on the leading R channels of each head: q and k in one launch, read in place from the
          fused projection's output
norm, residual_norm   rms_norm with the block's weight, written in the projection's dtype (what autocast's cast
          makes of torch's float32 output), after the residual add in the same pass

The norms are the one place with a sum. torch's CUDA rms_norm (`vectorized_layer_norm_kernel<T, float, true>` in
ATen's layer_norm_kernel.cu, taken for every contiguous row of a multiple of 4 channels) adds the squares in a fixed
order, and `_row_sum_squares` follows it: 128 threads per row, thread t reads vectors of 4 channels at t, t + 128,
... and adds each square to its sum with one fused multiply-add, in channel order; then the 32 lanes of a warp halve
(lane l takes lane l + 16, then + 8, ... + 1), and the 4 warps halve the same way. The mean of squares is an IEEE
division by the width, its reciprocal square root the approximate `rsqrt.approx.f32` (CUDA's rsqrtf), and the
output `weight * (rstd * x)`. tests/test_gpu_decode.py holds every pass to its reference bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

# Triton's interpreter (tests/interpreted_kernels.py, the CPU tier) has no libdevice: there the two libdevice calls
# are numpy's exp and 1 / sqrt. Read at import, as Triton reads it; on a GPU the kernels are libdevice's alone.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BLOCK = 2048  # elements per program of the element-wise passes
WARPS = 8


@triton.jit
def _exp(x):
    if _INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)  # CUDA's expf, as torch's silu calls it


@triton.jit
def _rsqrt(x):
    if _INTERPRET:
        return tl.rsqrt(x)
    else:
        return libdevice.rsqrt(x)  # CUDA's rsqrtf (rsqrt.approx.f32), as torch's rms_norm calls it


@triton.jit
def _r(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE, back in float32 (eager's rounding between two ops; none for float32)."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _residual_kernel(x_ptr, y_ptr, scale_ptr, out_ptr, total, N, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    y = tl.load(y_ptr + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + i % N, mask=mask, other=0.0)
    tl.store(out_ptr + i, x + y * s, mask=mask)


@triton.jit
def _swiglu_kernel(f_ptr, out_ptr, total, H, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    row, col = i // H, i % H
    gate = tl.load(f_ptr + row * 2 * H + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(f_ptr + row * 2 * H + H + col, mask=mask, other=0.0).to(tl.float32)
    silu = _r(tl.div_rn(gate, 1.0 + _exp(-gate)), DTYPE)
    tl.store(out_ptr + i, (up * silu).to(DTYPE), mask=mask)


THREADS = 128  # torch's rms_norm block: 4 warps of 32 lanes per row
VEC = 4  # channels a thread reads at a time (the kernels spell it out: a global in a kernel must be constexpr)


@triton.jit
def _squares4(v, acc, R: tl.constexpr, L: tl.constexpr):
    """acc + v[..., 0]^2, then + v[..., 1]^2, ... + v[..., 3]^2, each one fused multiply-add (nvcc contracts torch's
    `sum + val * val`: on the H200, 2026-12-03, the products rounded first missed torch's norm in 222,976 of 3.7 M
    values, the fused ones in none): v (R, L, 4)."""
    a, b = tl.split(tl.reshape(v, (R, L, 2, 2)))  # a: channels 0 and 2 of each vector, b: 1 and 3
    e0, e2 = tl.split(a)
    e1, e3 = tl.split(b)
    acc = tl.fma(e0, e0, acc)
    acc = tl.fma(e1, e1, acc)
    acc = tl.fma(e2, e2, acc)
    return tl.fma(e3, e3, acc)


@triton.jit
def _halve(s, R: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr):
    """(R, G, 2 * HALF) -> (R, G, HALF): lane l plus lane l + HALF within each group (a warp's shuffle-down step)."""
    a, b = tl.split(tl.permute(tl.reshape(s, (R, G, 2, HALF)), (0, 1, 3, 2)))
    return a + b


@triton.jit
def _row_sum_squares(x_ptr, y_ptr, scale_ptr, rows, r_mask, N: tl.constexpr, R: tl.constexpr, LANES: tl.constexpr,
                     ADD: tl.constexpr):  # fmt: skip
    """The sum of squares of R rows of N contiguous channels starting at x_ptr + rows (of x + y * scale with ADD,
    recomputed as `_norm_kernel` computes it), added in torch's order. LANES: the threads that read anything
    (min(128, N / 4)); the others hold 0, and adding 0 changes no sum, so they are left out."""
    V: tl.constexpr = 4  # VEC
    J: tl.constexpr = N // (V * LANES)  # vectors per thread
    t = tl.arange(0, LANES)
    e = tl.arange(0, V)
    acc = tl.zeros((R, LANES), tl.float32)
    m = r_mask[:, None, None]
    for j in tl.static_range(J):
        off = (j * LANES + t[None, :, None]) * V + e[None, None, :]
        v = tl.load(x_ptr + rows[:, None, None] + off, mask=m, other=0.0).to(tl.float32)
        if ADD:
            y = tl.load(y_ptr + rows[:, None, None] + off, mask=m, other=0.0).to(tl.float32)
            v = v + y * tl.load(scale_ptr + off)
        acc = _squares4(v, acc, R, LANES)
    W: tl.constexpr = LANES // 32 if LANES > 32 else 1  # warps
    L: tl.constexpr = LANES // W  # lanes per warp that read anything
    s = tl.reshape(acc, (R, W, L))
    if L >= 32:
        s = _halve(s, R, W, 16)
    if L >= 16:
        s = _halve(s, R, W, 8)
    if L >= 8:
        s = _halve(s, R, W, 4)
    if L >= 4:
        s = _halve(s, R, W, 2)
    if L >= 2:
        s = _halve(s, R, W, 1)
    s = tl.reshape(s, (R, 1, W))
    if W >= 4:
        s = _halve(s, R, 1, W // 2)  # warps w and w + 2
    if W >= 2:
        s = _halve(s, R, 1, 1)
    return tl.reshape(s, (R,))


@triton.jit
def _rstd(total, eps, N: tl.constexpr):
    ms = tl.div_rn(total, tl.full(total.shape, N, tl.float32))
    return _rsqrt(ms + eps)


@triton.jit
def _norm_kernel(x_ptr, y_ptr, scale_ptr, w_ptr, xo_ptr, out_ptr, n_rows, eps, N: tl.constexpr, R: tl.constexpr,
                 LANES: tl.constexpr, ADD: tl.constexpr, OUT: tl.constexpr):  # fmt: skip
    """R rows: with ADD, x + y * scale written to xo (float32); then rms_norm(., w) of it written to out as OUT."""
    r = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    r_mask = r < n_rows
    rows = r * N
    total = _row_sum_squares(x_ptr, y_ptr, scale_ptr, rows, r_mask, N, R, LANES, ADD)
    rstd = _rstd(total, eps, N)
    c = tl.arange(0, N)
    idx = rows[:, None] + c[None, :]
    m = r_mask[:, None]
    x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float32)
    if ADD:
        x = x + tl.load(y_ptr + idx, mask=m, other=0.0).to(tl.float32) * tl.load(scale_ptr + c)[None, :]
        tl.store(xo_ptr + idx, x, mask=m)
    tl.store(out_ptr + idx, (tl.load(w_ptr + c)[None, :] * (rstd[:, None] * x)).to(OUT), mask=m)


@triton.jit
def _norm_rope_one(x_ptr, out_ptr, r, r_mask, in_stride, cos_ptr, sin_ptr, cs_stride, S, H, eps,
                   D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr,
                   LANES: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """R head vectors (rows r of (B*S*H)): their rms_norm rounded to DTYPE, then the rotary; out contiguous."""
    rstd = _rstd(_row_sum_squares(x_ptr, x_ptr, x_ptr, r * in_stride, r_mask, D, R, LANES, False), eps, D)
    rstd = rstd[:, None]
    c = tl.arange(0, BLOCK_D)
    m_half = r_mask[:, None] & (c[None, :] < HALF)
    m_rest = r_mask[:, None] & (c[None, :] < D - 2 * HALF)
    pos = (r // H) % S
    cs = pos[:, None] * cs_stride + c[None, :]
    # The tables rounded to the activations' dtype first, as `apply_rotary` does.
    cos1 = _r(tl.load(cos_ptr + cs, mask=m_half, other=0.0), DTYPE)
    sin1 = _r(tl.load(sin_ptr + cs, mask=m_half, other=0.0), DTYPE)
    cos2 = _r(tl.load(cos_ptr + HALF + cs, mask=m_half, other=0.0), DTYPE)
    sin2 = _r(tl.load(sin_ptr + HALF + cs, mask=m_half, other=0.0), DTYPE)
    base = r[:, None] * in_stride + c[None, :]
    y1 = _r(rstd * tl.load(x_ptr + base, mask=m_half, other=0.0).to(tl.float32), DTYPE)
    y2 = _r(rstd * tl.load(x_ptr + base + HALF, mask=m_half, other=0.0).to(tl.float32), DTYPE)
    y3 = rstd * tl.load(x_ptr + base + 2 * HALF, mask=m_rest, other=0.0).to(tl.float32)
    # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], each product and the sum rounded as eager's
    o1 = _r(y1 * cos1, DTYPE) + _r(-y2 * sin1, DTYPE)
    o2 = _r(y2 * cos2, DTYPE) + _r(y1 * sin2, DTYPE)
    out = r[:, None] * D + c[None, :]
    tl.store(out_ptr + out, o1.to(DTYPE), mask=m_half)
    tl.store(out_ptr + out + HALF, o2.to(DTYPE), mask=m_half)
    tl.store(out_ptr + out + 2 * HALF, y3.to(DTYPE), mask=m_rest)


@triton.jit
def _qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, rows, in_stride, S, H, cs_stride, eps,
               D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, R: tl.constexpr, LANES: tl.constexpr,
               DTYPE: tl.constexpr):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    r_mask = r < rows
    _norm_rope_one(q_ptr, qo_ptr, r, r_mask, in_stride, cos_ptr, sin_ptr, cs_stride, S, H, eps, D, HALF, BLOCK_D, R,
                   LANES, DTYPE)  # fmt: skip
    _norm_rope_one(k_ptr, ko_ptr, r, r_mask, in_stride, cos_ptr, sin_ptr, cs_stride, S, H, eps, D, HALF, BLOCK_D, R,
                   LANES, DTYPE)  # fmt: skip


def residual(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x, y = x.contiguous(), y.contiguous()
    # eager's type promotion: the first block's stream is the embedding's dtype, float32 after the add
    out = torch.empty(x.shape, dtype=torch.promote_types(torch.promote_types(x.dtype, y.dtype), scale.dtype),
                      device=x.device)  # fmt: skip
    total = x.numel()
    _residual_kernel[(triton.cdiv(total, BLOCK),)](
        x, y, scale, out, total, x.shape[-1], BLOCK=BLOCK, num_warps=WARPS, enable_fp_fusion=False
    )
    return out


def swiglu(f: torch.Tensor) -> torch.Tensor:
    f = f.contiguous()
    h = f.shape[-1] // 2
    out = f.new_empty((*f.shape[:-1], h))
    total = out.numel()
    _swiglu_kernel[(triton.cdiv(total, BLOCK),)](
        f, out, total, h, BLOCK=BLOCK, DTYPE=_TL[f.dtype], num_warps=WARPS, enable_fp_fusion=False
    )
    return out


def _lanes(n: int) -> int:
    """The threads of torch's rms_norm block that read channels of an n-wide row (n a multiple of 4, n / 4 a power of
    two up to 128 or a multiple of 128)."""
    vectors = n // VEC
    if n % VEC or not (vectors % THREADS == 0 or (vectors <= THREADS and vectors & (vectors - 1) == 0)):
        raise ValueError(f"no exact norm pass for rows of {n} channels (a multiple of 4, n/4 a power of 2 or of 128)")
    return min(vectors, THREADS)


def _projection_dtype() -> torch.dtype:
    """The dtype the projection after a norm computes in: autocast's, else the norm's float32."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.float32


# (rows per program, warps): the block norms' (2048 channels) and the qk pass's (64-channel head vectors). Any choice
# adds in the same order; these are the first that ran (not tuned: bench/results/README.md, 2026-12-03, issue 41).
LAUNCH = {"norm": (4, 4), "qk": (32, 4)}


def _norm(x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, stream: torch.Tensor,
          eps: float, add: bool) -> torch.Tensor:  # fmt: skip
    """`_norm_kernel` over x's rows (x + y * scale written to `stream` first, with `add`): the norm, in the
    projection's dtype."""
    rows_per, warps = LAUNCH["norm"]
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=_projection_dtype(), device=x.device)
    rows = x.numel() // n
    _norm_kernel[(triton.cdiv(rows, rows_per),)](
        x, y, scale, weight, stream, out, rows, eps, N=n, R=rows_per, LANES=_lanes(n), ADD=add, OUT=_TL[out.dtype],
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x.float(), weight, eps) in the projection's dtype."""
    x = x.contiguous()
    return _norm(x, x, weight, weight, x, eps, add=False)


def residual_norm(
    x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y * scale, rms_norm of it with weight) in one pass: the stream in float32 (eager's promotion), the
    norm in the projection's dtype."""
    x, y = x.contiguous(), y.contiguous()
    stream = torch.empty(x.shape, dtype=torch.promote_types(torch.promote_types(x.dtype, y.dtype), scale.dtype),
                         device=x.device)  # fmt: skip
    if stream.dtype != torch.float32:
        raise ValueError(f"the residual norm pass keeps a float32 stream, not {stream.dtype}")
    return stream, _norm(x, y, scale, weight, stream, eps, add=True)


def qk(
    q: torch.Tensor, k: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (B, S, H, D) views of the fused projection (each head's D channels contiguous, heads at one stride);
    cos, sin: (S, R) float32 -> the normed, rotated q and k, (B, S, H, D) contiguous in q's dtype."""
    b, s, h, d = q.shape
    if q.stride() != k.stride() or q.stride(3) != 1 or q.stride(1) != h * q.stride(2) or q.stride(0) != s * q.stride(1):
        q, k = q.contiguous(), k.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    r = cos.shape[-1]
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=q.device),
    )
    rows, (rows_per, warps) = b * s * h, LAUNCH["qk"]
    _qk_kernel[(triton.cdiv(rows, rows_per),)](
        q, k, cos, sin, q_out, k_out, rows, q.stride(2), s, h, cos.stride(0), eps,
        D=d, HALF=r // 2, BLOCK_D=triton.next_power_of_2(max(r // 2, d - r)), R=rows_per, LANES=_lanes(d),
        DTYPE=_TL[q.dtype], num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out
