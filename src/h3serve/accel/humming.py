"""The HUMMING linear backend: deterministic, batch-invariant FP8 block linears through Humming's JIT GEMMs.

    HUMMING  FP8 e4m3 weights with one scale per output channel, bitwise the CUTLASS backend's (`quantize_weight`);
             activations quantized per row at run time with the CUTLASS backend's own `quantize_rows` (so both
             backends multiply the same e4m3 operands); the GEMM is Humming's (the optional package
             humming-kernels==0.1.20, import name `humming`, the quantized GEMM library of vLLM), JIT-compiled per
             layer shape and run in its batch-invariant mode with fp32 accumulation.

What it trades. Batch invariant: the compute config `use_batch_invariant` drops Stream-K and split-K and keeps one
K tile (128) for every row count, so each output row's bits depend on that row only, never on how many rows share
the call, and a rerun is bitwise the same (CUTLASS does not promise the first). For that it gives up speed: eager
only, where CUTLASS runs under regional compile, and slower per GEMM than CUTLASS (bench/humming_check.py measures
both at the reference shape; results in bench/results/README.md); the first use of a layer shape JIT-compiles its
kernels, seconds per shape (cubins cached in HUMMING_CACHE_DIR, which H3_CACHE_DIR points at `<dir>/humming`).
Numerically, Humming's sm90 epilogue multiplies the fp32 accumulator by the row scale, rounds to bfloat16, then
multiplies by the channel scale in bfloat16 (the scales are stored rounded to bfloat16), where CUTLASS applies both
scales in fp32 before its one rounding: two more bf16 roundings, far below FP8's own error. No step cache either (the
settings refuse both): it is the deterministic profile, not the fast one.

Which layers: the four GEMMs of every block and refiner block (fused QKV, attention out, fc1, fc2), as CUTLASS.
The weights are turned into Humming's layout (padded to N % 256 and K % 128, as vLLM does; the released shapes need
no padding) on the GPU when a layer is replaced; the e4m3 copy is then released unless kept for `reference`.

`humming` is imported lazily (inside functions): this module imports, and its CPU parts (quantization, `reference`,
`available`) run, on a machine without the package or a GPU.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from h3serve.accel.linear import FP8, Fp8Linear, block_linears, quantize_rows, quantize_weight, replace_block_linears

HUMMING_PACKAGE = "humming-kernels"
HUMMING_VERSION = "0.1.20"
INSTALL_HINT = f"pip install 'h3serve[humming]', or pip install {HUMMING_PACKAGE}=={HUMMING_VERSION}"
# Batch invariant (no Stream-K / split-K: one K partition and K tile for every row count), fp32 accumulation.
COMPUTE_CONFIG = {"use_batch_invariant": True, "use_f16_accum": False, "gemm_type": "dense"}
_COMPUTE_CONFIG_JSON = json.dumps(COMPUTE_CONFIG)
# Humming's output (and bf16 scale) dtype; the engine's compute dtype on CUDA.
COMPUTE_DTYPE = torch.bfloat16
# What vLLM pads to (HummingLinearKernel); the released H3 shapes are multiples already.
PAD_N, PAD_K = 256, 128
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores


def _import_error() -> str | None:
    """None if `humming` imports and is the pinned version, else why not (naming the package to install)."""
    try:
        import humming
    except Exception as err:  # ImportError, or a broken install failing inside its own imports
        return (
            f"HUMMING needs the optional package {HUMMING_PACKAGE}=={HUMMING_VERSION} ({INSTALL_HINT}); "
            f"import failed: {type(err).__name__}: {err}"
        )
    found = getattr(humming, "__version__", "unknown")
    if found != HUMMING_VERSION:
        return (
            f"HUMMING is built against {HUMMING_PACKAGE}=={HUMMING_VERSION} (its weight layout and internal API), "
            f"found {found} at {getattr(humming, '__file__', '?')}; install the pinned version ({INSTALL_HINT})"
        )
    return None


def available(device: torch.device | str | None = None, kind: str = "linear") -> str | None:
    """None if HUMMING can run on `device` (default: the current CUDA device), else a message naming what is
    missing: a CUDA device, FP8 tensor cores (sm89+), or the package."""
    if device is None:
        if not torch.cuda.is_available():
            return f"{kind} HUMMING needs a CUDA device; CUDA is not available on this machine (allowed: BF16)"
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return f"{kind} HUMMING needs a CUDA device (allowed on {device.type}: BF16)"
    if not torch.cuda.is_available():
        return f"{kind} HUMMING needs a CUDA device; CUDA is not available on this machine (allowed: BF16)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (
            f"{kind} HUMMING needs FP8 tensor cores (sm89 or newer), this GPU is sm{major}{minor} "
            f"(allowed: BF16, or CUTLASS on sm89+)"
        )
    missing = _import_error()
    return None if missing is None else f"{kind} {missing}"


def check(device: torch.device | str, kind: str = "linear") -> None:
    """Refuse HUMMING where it cannot run (ValueError with `available`'s message). Called before any weight loads."""
    missing = available(device, kind)
    if missing is not None:
        raise ValueError(missing)


def _humming_layout(weight: torch.Tensor, scale: torch.Tensor, device: torch.device):
    """(N, K) e4m3 weight and (1, N) float32 scales -> Humming's LayerConfig and its (weight, weight_scale) tensors,
    via Humming's own schema and transform (the ones vLLM's HummingLinearKernel uses). Pure tensor reshuffling on
    `device` (padding, a permutation, the scales cast to bf16); nothing compiles here."""
    from humming import dtypes
    from humming.config import InputQuantizationMode, WeightScaleType
    from humming.schema import HummingInputSchema, HummingWeightSchema
    from humming.transform import prepare_layer_config, transform_humming_tensors

    n, k = weight.shape
    weight_schema = HummingWeightSchema(
        b_dtype=dtypes.float8e4m3,
        bs_dtype=dtypes.DataType.from_torch_dtype(COMPUTE_DTYPE),  # the kernel's channel scales are 16-bit
        weight_scale_type=WeightScaleType.CHANNEL,
    )
    input_schema = HummingInputSchema(a_dtype=dtypes.float8e4m3, input_quant_mode=InputQuantizationMode.DynamicToken)
    # The "humming" schema's tensors: the e4m3 bytes as int32 words along K (N, K/4), one scale per row (N, 1).
    tensors = {
        "weight": weight.contiguous().view(torch.int32),
        "weight_scale": scale.t().contiguous().to(COMPUTE_DTYPE),
    }
    with torch.cuda.device(device):
        config = prepare_layer_config(
            shape_n=n,
            shape_k=k,
            weight_schema=weight_schema,
            input_schema=input_schema,
            pad_n_to_multiple=PAD_N,
            pad_k_to_multiple=PAD_K,
            has_bias=False,
            torch_dtype=COMPUTE_DTYPE,
            device=device,
            tensors=tensors,
        )
        out = transform_humming_tensors(config, tensors)
    if set(out) != {"weight", "weight_scale"}:
        raise RuntimeError(f"Humming's transform returned {sorted(out)}, expected weight and weight_scale")
    return config, (out["weight"], out["weight_scale"])


class HummingLinear(nn.Module):
    """y = x W^T with W stored in e4m3 and multiplied by Humming's batch-invariant GEMM; see the module docstring.

    Buffers: `scale` (1, N) float32, the per-channel scales exactly as `quantize_weight` made them; `weight` (N, K)
    e4m3, the same bytes as Fp8Linear's, until `prepare` (kept after it only with `keep_fp8`, for `reference`);
    after `prepare`, `humming_weight` and `humming_scale` in Humming's layout and `layer_config` describing them.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, *, fused_quant: bool = False):
        super().__init__()
        if weight.dtype != FP8 or weight.ndim != 2:
            raise ValueError(f"weight must be a 2-D {FP8} tensor, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        if scale.dtype != torch.float32 or tuple(scale.shape) != (1, n):
            raise ValueError(f"scale must be float32 of shape (1, {n}), got {scale.dtype} {tuple(scale.shape)}")
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", weight)  # (N, K) e4m3; None once prepared unless kept
        self.register_buffer("scale", scale)  # (1, N) float32
        self.register_buffer("humming_weight", None)
        self.register_buffer("humming_scale", None)
        self.layer_config = None  # humming.config.LayerConfig once prepared
        # Quantize the activations with Humming's fused per-row kernel instead of `quantize_rows` (one kernel for
        # several torch ops; its scale arithmetic is its own, so not bitwise the CUTLASS backend's operands). Fixed
        # per layer when it is made: off for every layer the backend makes; bench/humming_check.py makes a layer
        # with it on to measure both.
        self.fused_quant = fused_quant

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, keep_fp8: bool = False, fused_quant: bool = False) -> HummingLinear:
        """Quantize `linear`'s weight (bitwise as Fp8Linear.from_linear); on a CUDA device also `prepare` it."""
        if linear.bias is not None:
            raise ValueError(
                f"HUMMING: block linears have no bias in H3; refusing a {linear.in_features}->{linear.out_features} "
                "linear that has one"
            )
        with torch.no_grad():
            q, scale = quantize_weight(linear.weight)
        module = cls(q, scale, fused_quant=fused_quant)
        if q.is_cuda:
            module.prepare(keep_fp8=keep_fp8)
        return module

    @classmethod
    def from_fp8(cls, fp8: Fp8Linear, *, keep_fp8: bool = False) -> HummingLinear:
        """The same e4m3 weight and scales as an Fp8Linear (e.g. made by `Fp8LoadHook` while the checkpoint loads,
        so the BF16 block weights never exist together); on a CUDA device also `prepare` it."""
        if fp8.bias is not None:
            raise ValueError("HUMMING: block linears have no bias in H3; refusing an Fp8Linear that has one")
        module = cls(fp8.weight, fp8.scale)
        if fp8.weight.is_cuda:
            module.prepare(keep_fp8=keep_fp8)
        return module

    @property
    def prepared(self) -> bool:
        return self.layer_config is not None

    @torch.no_grad()
    def prepare(self, *, keep_fp8: bool = False) -> None:
        """Turn the e4m3 weight and scales into Humming's layout, on the weight's CUDA device (no kernel compiles
        here: the GEMM compiles at the first forward of each layer shape). Releases the e4m3 copy unless
        `keep_fp8`."""
        if self.prepared:
            return
        if self.weight is None or not self.weight.is_cuda:
            where = "none" if self.weight is None else self.weight.device
            raise RuntimeError(f"HummingLinear.prepare needs the e4m3 weight on a CUDA device, it is on {where}")
        missing = available(self.weight.device)
        if missing is not None:
            raise RuntimeError(missing)
        n, k = self.out_features, self.in_features
        if k % 16:
            # e4m3 rows viewed as int32 words, and 16-byte aligned rows for the activations' TMA loads.
            raise ValueError(f"HUMMING needs in_features divisible by 16, got {k}")
        try:
            config, out = _humming_layout(self.weight, self.scale, self.weight.device)
        except Exception as err:
            raise RuntimeError(f"HUMMING could not transform the {n}x{k} weight into its layout: {err}") from err
        self.humming_weight, self.humming_scale = out
        self.layer_config = config
        if not keep_fp8:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepared:
            raise RuntimeError(
                "HummingLinear is not prepared: its weights must be turned into Humming's layout on the GPU first "
                "(from_linear does it for a CUDA linear; else move it to CUDA and call prepare())"
            )
        if x.dtype != COMPUTE_DTYPE or x.device != self.humming_weight.device:
            raise ValueError(
                f"HummingLinear takes {COMPUTE_DTYPE} input on {self.humming_weight.device}, got {x.dtype} on "
                f"{x.device}"
            )
        from humming.forward import humming_forward

        rows = x.reshape(-1, self.in_features)  # (M, K)
        if rows.shape[0] == 0:
            return x.new_empty((*x.shape[:-1], self.out_features))
        if self.fused_quant:
            inputs, input_scale = rows.contiguous(), None  # Humming quantizes per row (dynamic_token) itself
        else:
            inputs, input_scale = quantize_rows(rows)  # (M, K) e4m3, (M, 1) float32: Fp8Linear's operands
        # No Stream-K locks are passed: a schedule that wanted Stream-K (not batch invariant) fails loudly.
        try:
            y = humming_forward(
                self.layer_config,
                inputs=inputs,
                weight=self.humming_weight,
                weight_scale=self.humming_scale,
                input_scale=input_scale,
                compute_config=_COMPUTE_CONFIG_JSON,
            )
        except Exception as err:
            raise RuntimeError(
                f"HUMMING GEMM failed for {rows.shape[0]}x{self.in_features} @ {self.in_features}x{self.out_features}"
                f" (the first call of a shape JIT-compiles into HUMMING_CACHE_DIR): {type(err).__name__}: {err}"
            ) from err
        return y.reshape(*x.shape[:-1], self.out_features)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Fp8Linear.reference over the same e4m3 weight and scales (float32 on dequantized operands): what `forward`
        approximates. Runs anywhere; needs the e4m3 weight (before `prepare`, or `keep_fp8`). Tests and checks only."""
        if self.weight is None:
            raise RuntimeError("HummingLinear.reference needs the e4m3 weight: prepare() released it (use keep_fp8)")
        return Fp8Linear(self.weight, self.scale, None).reference(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepared={self.prepared}"


def quantize_blocks(model: nn.Module, *, keep_fp8: bool = False) -> int:
    """Replace the block linears of an already loaded `model` by HummingLinear in place, one at a time, as
    h3serve.accel.linear.quantize_blocks does for CUTLASS: each BF16 weight (or Fp8Linear, as `Fp8LoadHook` loads
    them) is released as soon as its copy in Humming's layout exists; returns how many it replaced. `keep_fp8` keeps
    each layer's e4m3 weight for `reference`. On a CPU model the replacements hold e4m3 weights only (`reference`
    works, `forward` refuses)."""

    def convert(module: nn.Module) -> nn.Module | None:
        if isinstance(module, nn.Linear):
            return HummingLinear.from_linear(module, keep_fp8=keep_fp8)
        if isinstance(module, Fp8Linear):
            return HummingLinear.from_fp8(module, keep_fp8=keep_fp8)
        return None

    return replace_block_linears(model, convert)


def is_humming(model: nn.Module) -> bool:
    return any(isinstance(getattr(p, leaf), HummingLinear) for _, p, leaf in block_linears(model))
