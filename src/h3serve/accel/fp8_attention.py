"""CUDNN_FP8: the DiT's attention in FP8 through cuDNN's fused FP8 SDPA (nvidia-cudnn-frontend). Opt-in and lossy.

Per call, for q, k, v (B, H, S, D) in the activations' dtype (`fp8_sdpa`, an `ops.AttentionKernel`):
1. Scales from the tensors of this call (`Scales.of`):
   - K is smoothed: each head's mean over the rows is subtracted, channel by channel. Under softmax this changes
     nothing: every logit of a query row moves by the same q . mean. It takes out what the heads' keys share (the
     outlier channels H3's last blocks show), so what is left fills e4m3's range.
   - Q and K per head. cuDNN's FP8 graph takes one descale per tensor, and every head's logits need
     descale * scale_q[h] * scale_k[h] = 1. So the heads' scale products are held equal,
     C = 448^2 / max_h(amax_q[h] amax_k[h]). Each head's slack, r[h] = amax_q[h] amax_k[h] / max <= 1, is split
     evenly between its q and k: scale_q[h] = 448 sqrt(r[h]) / amax_q[h], scale_k[h] = 448 sqrt(r[h]) / amax_k[h].
     The head with the largest product fills the range in both; another loses range only by the square root of
     how much smaller its product is.
   - V is smoothed too, and its mean added back to the output: O = P (V - mean) + mean, the probabilities of a row
     summing to 1. What the rows share (the AdaLN shift of a modality's rows goes into every v) would otherwise fill
     the output's range, and a long sequence's nearly even attention averages the rest to a small part of it.
   - V per head, scale_v[h] = 448 / amax_v[h] (of the smoothed v). O - mean is a convex combination of V - mean's
     rows, so |O[h] - mean| <= amax_v[h]. Head h's output comes back multiplied by scale_v[h] * OUTPUT_SCALE and is
     divided by it after.
   - The softmax probabilities: exp(s - running max) <= 1, at scale 448 (e4m3's largest value).
2. cuDNN's FP8 SDPA, e4m3 in and e4m3 out (`h3serve::cudnn_fp8_sdpa`). It is a custom op, so a compiled block traces
   it as one opaque call. Graphs are built once per shape and kept (`_graph`).
3. The output is descaled per head, V's mean added, in the activations' dtype.

What the design buys is measured against per-tensor scales without smoothing, a variant composed from this module's
`Scales`, `to_e4m3` and `dequantize` in bench/lib/variants.py (bench/dit_step.py's CUDNN_FP8_NAIVE); never served.

cuDNN needs Hopper (sm90) or newer, and its FP8 attention on Hopper writes e4m3 only (a bfloat16 output is
Blackwell's). `missing` says what this machine lacks; `accel.profile.check` refuses the backend with it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

try:  # the two Triton passes over q, k, v (imported here, not under a compile's trace)
    from h3serve.accel import triton_fp8_attention as PASSES
except ImportError:  # no Triton: torch's ops
    PASSES = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(E4M3).max
OUTPUT_SCALE = 0.5  # headroom for the output: the e4m3 probabilities can sum a little over the fp32 row sum
MIN_AMAX = 1e-6  # a head of zeros gets this amax (any finite scale quantizes zeros to zeros)
MIN_CUDNN = 91400  # the cuDNN backend the frontend's own FP8 SDPA tests ask for
CAPABILITY = (9, 0)  # Hopper
INSTALL = "pip install 'h3serve[fp8-attention]' (nvidia-cudnn-frontend)"


def missing(device: torch.device | None = None) -> str | None:
    """Why this machine cannot run CUDNN_FP8 (the message a refusal carries), or None."""
    allowed = "allowed: CUDNN_ATTN, TORCH_SDPA"
    if not torch.cuda.is_available():
        return f"attention CUDNN_FP8 needs a CUDA GPU ({allowed})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < CAPABILITY:
        return (
            f"attention CUDNN_FP8 needs cuDNN's FP8 attention (sm90 or newer), this GPU is sm{major}{minor} ({allowed})"
        )
    try:
        import cudnn
    except ImportError as err:
        return f"attention CUDNN_FP8 needs the cuDNN frontend, not importable here ({err}): {INSTALL} ({allowed})"
    version = cudnn.backend_version()
    if version < MIN_CUDNN:
        return f"attention CUDNN_FP8 needs cuDNN 9.14 or newer, this one is {version} ({allowed})"
    return None


@dataclass(frozen=True)
class Scales:
    """One call's quantization: per-head multipliers (H,) float32 for q, k, v, the one descale the logits need
    (1,) float32 (1 / (scale_q[h] scale_k[h]), the same for every head), and V's mean (B, H, 1, D) float32 that the
    output gets back (None: v was not smoothed)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale: torch.Tensor
    v_mean: torch.Tensor | None = None

    @classmethod
    def of(
        cls, amax_q: torch.Tensor, amax_k: torch.Tensor, amax_v: torch.Tensor, v_mean: torch.Tensor | None = None
    ) -> Scales:
        """From each head's amax (H,) float32 of q and the smoothed k and v (equal entries: per-tensor scales)."""
        aq, ak, av = (a.clamp_min(MIN_AMAX) for a in (amax_q, amax_k, amax_v))
        product = aq * ak
        largest = product.amax()
        share = (product / largest).sqrt()  # sqrt(r[h]): each of q and k gives up this much of the range
        return cls(
            q=E4M3_MAX * share / aq,
            k=E4M3_MAX * share / ak,
            v=E4M3_MAX / av,
            descale=(largest / E4M3_MAX**2).reshape(1),
            v_mean=v_mean,
        )


def _head_amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=(0, 2, 3)).float()


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * scale[h], saturated to e4m3's range and rounded to e4m3 (x's layout kept)."""
    return (x.float() * scale[None, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `quantize` runs the two Triton passes for these operands: on CUDA with Triton, self-attention shapes
    (q, k, v alike), a power-of-two head size and unit channel strides."""
    d = q.shape[-1]
    alike = q.shape == k.shape == v.shape and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    return q.is_cuda and alike and d & (d - 1) == 0 and PASSES is not None


def quantize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Scales]:
    """q, k, v (B, H, S, D) -> their e4m3 forms and the scales (the module docstring's step 1). On CUDA two Triton
    passes over q, k, v (`triton_fp8_attention`: the statistics, then the rounding), else torch's ops."""
    if fused(q, k, v):
        return _quantize_fused(q, k, v)
    return quantize_ops(q, k, v)


def quantize_ops(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Scales]:
    """`quantize` in torch's ops (the CPU's, and what the Triton passes are checked against)."""
    kf, vf = k.float(), v.float()
    v_mean = vf.mean(dim=2, keepdim=True)
    kf, vf = kf - kf.mean(dim=2, keepdim=True), vf - v_mean
    scales = Scales.of(_head_amax(q), _head_amax(kf), _head_amax(vf), v_mean=v_mean)
    return to_e4m3(q, scales.q), to_e4m3(kf, scales.k), to_e4m3(vf, scales.v), scales


def _quantize_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Scales]:
    """`quantize` over the Triton passes: the same scales, from partials reduced here in a fixed order (k's and v's
    means per channel, and the amax of x - mean from x's channel max and min, without a third read)."""
    qa, k_stats, v_stats = PASSES.stats(q, k, v)
    (k_mean, k_amax), (v_mean, v_amax) = (_smoothed(stats, k.shape[2]) for stats in (k_stats, v_stats))
    scales = Scales.of(qa.amax(dim=(0, 2)), k_amax, v_amax, v_mean=v_mean[:, :, None, :])
    rows = PASSES.quantize(q, k, v, scales.q, scales.k, scales.v, k_mean.contiguous(), v_mean.contiguous())
    q8, k8, v8 = (t.transpose(1, 2) for t in rows)
    return q8, k8, v8, scales


def _smoothed(stats: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor's partials (3, B, H, NB, D: sums, maxima, minima) -> its mean (B, H, D) and the amax (H,) of it less
    the mean."""
    mean = stats[0].sum(dim=2) / rows
    shifted = torch.maximum(stats[1].amax(dim=2) - mean, mean - stats[2].amin(dim=2))  # max |x - mean| per channel
    return mean, shifted.amax(dim=(0, 2))


def fp8_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Softmax attention over (B, H, S, D), scale 1/sqrt(D), in FP8 (the module docstring); the output in q's dtype,
    (B, H, S, D) over (B, S, H, D) memory."""
    if causal:
        raise ValueError("attention CUDNN_FP8 runs the DiT's unmasked attention only")
    q8, k8, v8, scales = quantize(q, k, v)
    o8 = torch.ops.h3serve.cudnn_fp8_sdpa(q8, k8, v8, scales.descale)
    return dequantize(o8, scales).to(q.dtype)


def dequantize(o8: torch.Tensor, scales: Scales) -> torch.Tensor:
    """The kernel's e4m3 output -> the attention's, float32: descaled per head, V's mean added back."""
    o = o8.float() * (1.0 / (scales.v * OUTPUT_SCALE))[None, :, None, None]
    return o if scales.v_mean is None else o + scales.v_mean


def reference(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """What `cudnn_fp8_sdpa` computes, in float32 from the same e4m3 operands, with the probabilities rounded to e4m3
    at their scale as the kernel does (against each row's true maximum, where the kernel's running maximum may be
    lower): the GPU tests' parity reference. Returns the e4m3-scaled output in float32 (before its e4m3 rounding)."""
    d = q8.shape[-1]
    logits = (q8.float() @ k8.float().transpose(-1, -2)) * (descale.float() / math.sqrt(d))
    p = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    total = p.sum(dim=-1, keepdim=True)
    p8 = (p * E4M3_MAX).to(E4M3).float() / E4M3_MAX
    return (p8 @ v8.float()) / total * OUTPUT_SCALE


# ---- the cuDNN graph ---------------------------------------------------------------------------------------------
# Tensor uids in a graph's variant pack.
Q, K, V, O, DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_S, SCALE_S, SCALE_O, AMAX_S, AMAX_O = range(12)


@dataclass(frozen=True)
class _Graph:
    graph: object  # cudnn.pygraph, built
    workspace: int  # bytes
    constants: dict[int, torch.Tensor]  # the fixed scales, on the device


@functools.cache
def _handle(device: int) -> object:
    import cudnn

    with torch.cuda.device(device):
        return cudnn.create_handle()


@functools.lru_cache(maxsize=64)
def _graph(shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...], device: int) -> _Graph:
    """The FP8 SDPA graph for q, k, v of these shapes (B, H, S, D; q's S may differ from k's) and strides, built once
    and kept (a new row count builds a new one)."""
    import cudnn

    b, h, s_q, s_kv, d = shape
    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=_handle(device))
    q = graph.tensor(uid=Q, dim=(b, h, s_q, d), stride=strides[0], data_type=fp8)
    k = graph.tensor(uid=K, dim=(b, h, s_kv, d), stride=strides[1], data_type=fp8)
    v = graph.tensor(uid=V, dim=(b, h, s_kv, d), stride=strides[2], data_type=fp8)
    one = {"dim": (1, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": f32}
    scalars = {uid: graph.tensor(uid=uid, **one) for uid in (DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_S, SCALE_S,
                                                               SCALE_O)}  # fmt: skip
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=q, k=k, v=v, descale_q=scalars[DESCALE_Q], descale_k=scalars[DESCALE_K], descale_v=scalars[DESCALE_V],
        descale_s=scalars[DESCALE_S], scale_s=scalars[SCALE_S], scale_o=scalars[SCALE_O], generate_stats=False,
        attn_scale=1.0 / math.sqrt(d), use_causal_mask=False,
    )  # fmt: skip
    o.set_uid(O).set_output(True).set_dim((b, h, s_q, d)).set_stride(_output_strides(b, h, s_q, d)).set_data_type(fp8)
    for uid, amax in ((AMAX_S, amax_s), (AMAX_O, amax_o)):
        amax.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    dev = torch.device("cuda", device)
    fixed = {DESCALE_K: 1.0, DESCALE_V: 1.0, DESCALE_S: 1.0 / E4M3_MAX, SCALE_S: E4M3_MAX, SCALE_O: OUTPUT_SCALE}
    constants = {uid: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=dev) for uid, value in fixed.items()}
    return _Graph(graph=graph, workspace=graph.get_workspace_size(), constants=constants)


def _output_strides(b: int, h: int, s: int, d: int) -> tuple[int, int, int, int]:
    """The output's (B, H, S, D) strides over (B, S, H, D) memory: rows of heads side by side, out_proj's input."""
    return (s * h * d, d, h * d, 1)


def _output(q: torch.Tensor, s_q: int) -> torch.Tensor:
    b, h, _, d = q.shape
    return q.new_empty((b, s_q, h, d), dtype=E4M3).transpose(1, 2)


@torch.library.custom_op("h3serve::cudnn_fp8_sdpa", mutates_args=())
def cudnn_fp8_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """cuDNN's FP8 SDPA over e4m3 q, k, v (B, H, S, D; any strides with unit channel stride), the logits' descale
    (1,) float32: the e4m3 output, times OUTPUT_SCALE, (B, H, S, D) over (B, S, H, D) memory."""
    import cudnn

    if not (q.dtype == k.dtype == v.dtype == E4M3) or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("cudnn_fp8_sdpa takes e4m3 q, k, v with unit channel stride")
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    b, h, s_q, d = q.shape
    built = _graph((b, h, s_q, k.shape[2], d), (q.stride(), k.stride(), v.stride()), device)
    out = _output(q, s_q)
    pack = {Q: q, K: k, V: v, O: out, DESCALE_Q: descale, **built.constants}
    pack[AMAX_S] = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
    pack[AMAX_O] = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
    workspace = torch.empty(built.workspace, dtype=torch.uint8, device=q.device)
    handle = _handle(device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    built.graph.execute(pack, workspace, handle=handle)
    return out


@cudnn_fp8_sdpa.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return _output(q, q.shape[2])
