"""Linear-layer backends, applied to the DiT's block linears from outside the model.

    BF16     the model's own nn.Linear in the compute dtype (the exact profile)
    CUTLASS  FP8 e4m3 weights with one scale per output channel, made once from the weights; activations quantized
             per row at run time (dynamic scales); torch._scaled_mm's rowwise-scaled FP8 GEMM (a CUTLASS kernel on
             sm90) with fast accumulation (`Fp8Linear.fast_accum`), output in the compute dtype (measured against
             the bf16 GEMM in bench/results/README.md).

How the CUTLASS GEMM applies the scales (`Fp8Scaling`, per layer: `Fp8Linear.scaling`, `set_scaling`):

    ROWWISE   the scales go into the GEMM (`torch._scaled_mm` with (M, 1) and (1, N) scales, output in the compute
              dtype): one kernel, the default
    EPILOGUE  the GEMM with unit per-tensor scales and a float32 output, then y * row scales * column scales and the
              cast as separate element-wise work (fused by Inductor under torch.compile): the same product up to
              float32 rounding order, for GPUs whose cuBLAS refuses rowwise scales (CUBLAS_STATUS_NOT_SUPPORTED has
              been reported on sm120/sm121, e.g. GB10) while it runs per-tensor ones. It costs a float32 (M, N)
              round trip: bench/dit_step.py times both (`CUTLASS_EPILOGUE`).

Which one a GPU runs correctly is measured at start, before any weight loads: `h3serve.accel.fp8_check.self_test`.

Which layers: the four GEMMs of every block and refiner block (fused QKV, attention out, fc1, fc2): 248 of the
forward's ~250 TFLOP. The fp32 islands (patch projections, timestep MLP, output heads) are never quantized; the
AdaLN projections (M <= 4 rows, so matrix-vector work) and the condition projection (once per request) stay in
the compute dtype here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch
from torch import nn

from h3serve.model.dit import REPEATED_BLOCKS

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
QUANTIZED = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


class Fp8Scaling(enum.StrEnum):
    """Where an Fp8Linear's GEMM applies the row and column scales (see the module docstring)."""

    ROWWISE = "ROWWISE"
    EPILOGUE = "EPILOGUE"


def parse_scaling(value: str) -> Fp8Scaling:
    """`value` as an Fp8Scaling; a ValueError naming the setting and the allowed values otherwise."""
    try:
        return Fp8Scaling(value)
    except ValueError:
        allowed = ", ".join(s.value for s in Fp8Scaling)
        raise ValueError(f"scaling must be one of {allowed}, got {value!r}") from None


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (N, K) e4m3 and (1, N) float32 scales, one per output channel (row): w ~= q * scale."""
    amax = weight.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)  # (N, 1)
    scale = amax / FP8_MAX
    q = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.t().contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> (M, K) e4m3 and (M, 1) float32 scales, one per row (dynamic: from this call's values)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W stored in e4m3; see the module docstring.

    `fast_accum`: the GEMM's FP8 fast accumulation on sm90 (no periodic promotion of the partial sums to float32), as
    torchao's float8 linear runs its forward GEMM: faster at the same error against the reference (bench/dit_step.py
    measures it against a subclass that turns it off, bench/lib/variants.py; bench/results/README.md).

    `scaling`: where the GEMM applies the scales (`Fp8Scaling`; ROWWISE unless set). EPILOGUE needs a float32 unit
    scale on the weight's device, made once when the scaling is set (a non-persistent buffer, so it follows `.to()`
    and is in no state dict); a ROWWISE layer has none, so checkpoint loading and meta placeholders never see it."""

    fast_accum = True

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        scaling: Fp8Scaling = Fp8Scaling.ROWWISE,
    ):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)  # (N, K) e4m3, row-major: weight.t() is the column-major B
        self.register_buffer("scale", scale)  # (1, N) float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._scaling = Fp8Scaling.ROWWISE
        self.scaling = scaling

    @property
    def scaling(self) -> Fp8Scaling:
        return self._scaling

    @scaling.setter
    def scaling(self, value: Fp8Scaling) -> None:
        value = parse_scaling(value)
        if value is Fp8Scaling.EPILOGUE and "unit_scale" not in self._buffers:
            if self.weight.is_meta:
                raise ValueError("scaling EPILOGUE: set it once the weights are on their device (these are on meta)")
            # () float32 1.0 for both operands of the per-tensor GEMM: made here once, never per call.
            unit = torch.ones((), dtype=torch.float32, device=self.weight.device)
            self.register_buffer("unit_scale", unit, persistent=False)
        self._scaling = value

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        q, scale = quantize_weight(linear.weight)
        return cls(q, scale, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        q, scale = quantize_rows(rows)
        return self.matmul_rows(q, scale, x.dtype).reshape(*x.shape[:-1], self.out_features)

    def matmul_rows(
        self, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The GEMM on activations already quantized as `quantize_rows` does ((M, K) e4m3, (M, 1) float32 scales), so
        that a fused pass can quantize them where it makes them (`h3serve.accel.fused`). Returns (M, N). `weight`:
        (N, K') e4m3 in place of the layer's own, under the same column scales (a run-time adapter's wide GEMM,
        `accel.lora.LoraLinear`, whose rows carry K' - K more columns)."""
        weight = self.weight if weight is None else weight
        if self._scaling is Fp8Scaling.EPILOGUE:
            unit = self.unit_scale
            y = torch._scaled_mm(
                q, weight.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32, use_fast_accum=self.fast_accum
            )  # (M, N) float32, unscaled
            y = (y * scale * self.scale).to(out_dtype)  # (M, 1) row scales, (1, N) column scales
        else:
            y = torch._scaled_mm(
                q,
                weight.t(),
                scale_a=scale,
                scale_b=self.scale,
                out_dtype=out_dtype,
                use_fast_accum=self.fast_accum,
            )
        return y if self.bias is None else y + self.bias

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic in float32 (dequantized operands, exact products): what `forward` approximates with
        its FP8 GEMM, whichever the scaling. Runs anywhere; tests and checks only."""
        rows = x.reshape(-1, self.in_features)
        q, scale = quantize_rows(rows)
        y = (q.float() * scale) @ (self.weight.float() * self.scale.t()).t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def set_scaling(model: nn.Module, scaling: Fp8Scaling | str) -> int:
    """Set `scaling` on every Fp8Linear in `model` (a DiT's block linears, a text encoder's decoder layers, or a
    single layer); returns how many. Call it after the weights are on their device."""
    scaling = parse_scaling(scaling)
    count = 0
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.scaling = scaling
            count += 1
    return count


def block_linears(model: nn.Module):
    """(full name, parent module, attribute) of every block linear of `model` that the FP8 backend replaces."""
    for name, module in model.named_modules():
        if isinstance(module, REPEATED_BLOCKS):
            for path in QUANTIZED:
                parent_path, leaf = path.rsplit(".", 1)
                yield f"{name}.{path}", module.get_submodule(parent_path), leaf


def quantize_blocks(model: nn.Module) -> int:
    """Replace the block linears of an already loaded `model` by Fp8Linear in place, one at a time (each BF16 weight
    is released as soon as its FP8 copy exists); returns how many it replaced (none already FP8). A checkpoint load
    quantizes through `Fp8LoadHook` instead."""
    return replace_block_linears(model, lambda m: Fp8Linear.from_linear(m) if isinstance(m, nn.Linear) else None)


def replace_block_linears(model: nn.Module, convert: Callable[[nn.Module], nn.Module | None]) -> int:
    """Replace each block linear by `convert(module)` in place, one at a time (`convert` returns None to leave one
    as it is), each old module released as soon as its replacement is in place (a benchmark that switches back keeps
    its own references: bench/dit_step.py). Returns how many it replaced; refuses a model without any."""
    found = replaced = 0
    for _, parent, leaf in block_linears(model):
        found += 1
        new = convert(getattr(parent, leaf))
        if new is not None:
            setattr(parent, leaf, new)
            replaced += 1
    if not found:
        raise ValueError(f"{type(model).__name__} has no block linears to quantize")
    return replaced


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(getattr(p, leaf), Fp8Linear) for _, p, leaf in block_linears(model))


class Fp8LoadHook:
    """Quantizes the block linears while the DiT loads (`load_dit(hook=...)`): each BF16 weight is turned into its
    e4m3 weight and scales as it is read, so the BF16 block weights never exist together (no 38 GiB detour)."""

    allow_bias = False  # H3's block linears have none

    def quantizes(self, module_name: str) -> bool:
        return _is_block_linear(module_name)

    def linears(self, module: nn.Module):
        """(parent, attribute) of every linear this hook quantizes, on the meta module."""
        for _, parent, leaf in block_linears(module):
            yield parent, leaf

    def transform(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not (name.endswith(".weight") and self.quantizes(name.removesuffix(".weight"))):
            return {name: tensor}
        q, scale = quantize_weight(tensor)
        return {name: q, name.removesuffix(".weight") + ".scale": scale}

    def prepare(self, module: nn.Module) -> None:
        """On the meta module: the linears become Fp8Linear placeholders of the same shapes."""
        for parent, leaf in list(self.linears(module)):
            linear = getattr(parent, leaf)
            if linear.bias is not None and not self.allow_bias:
                raise ValueError(f"{leaf}: block linears have no bias in H3; refusing to quantize one that has")
            n, k = linear.weight.shape
            with torch.device("meta"):
                bias = None if linear.bias is None else torch.empty(n, dtype=linear.bias.dtype)
                placeholder = Fp8Linear(torch.empty(n, k, dtype=FP8), torch.empty(1, n, dtype=torch.float32), bias)
            setattr(parent, leaf, placeholder)


_SUFFIXES = tuple("." + q for q in QUANTIZED)


def _is_block_linear(module_name: str) -> bool:
    return module_name.startswith(("blocks.", "token_refiner.blocks.")) and module_name.endswith(_SUFFIXES)


DECODER_LAYERS = "language_model.layers."  # in the Qwen3-VL model the text encoder wraps (as `model`)
TEXT_LAYERS = "model." + DECODER_LAYERS


def _decoder_layer_linears(model: nn.Module, prefix: str):
    """(parent, attribute) of every nn.Linear directly under a module whose name starts with `prefix`."""
    for name, module in model.named_modules():
        if name.startswith(prefix):
            for leaf, child in module.named_children():
                if isinstance(child, nn.Linear):
                    yield module, leaf


def is_text_quantized(text_encoder: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for n, m in text_encoder.named_modules() if n.startswith(TEXT_LAYERS))


class TextFp8LoadHook(Fp8LoadHook):
    """The FP8 text encoder made while it loads (`load_text_encoder(hook=...)`): the decoder layers' linears are
    quantized as their weights are read, so the 47 GiB BF16 text encoder never exists whole on the device."""

    allow_bias = True

    def quantizes(self, module_name: str) -> bool:
        return module_name.startswith(DECODER_LAYERS) and module_name.endswith("_proj")

    def linears(self, module: nn.Module):
        for parent, leaf in _decoder_layer_linears(module, DECODER_LAYERS):
            if not leaf.endswith("_proj"):
                raise ValueError(f"decoder-layer linear {leaf!r} is not one the FP8 text encoder knows (*_proj)")
            yield parent, leaf


def quantize_text_encoder(text_encoder: nn.Module) -> int:
    """The seed's FP8 text encoder: every linear of the Qwen3-VL decoder layers (q, k, v, o, gate, up, down) becomes
    an Fp8Linear, one at a time (each BF16 weight released as its FP8 copy is made). The vision tower, the embedding
    and the norms stay as loaded. Returns the number of layers quantized."""
    # (parent, name) pairs only: a list of the linears themselves would keep every BF16 weight alive to the end.
    count = 0
    for module, leaf in list(_decoder_layer_linears(text_encoder, TEXT_LAYERS)):
        setattr(module, leaf, Fp8Linear.from_linear(getattr(module, leaf)))
        count += 1
    if not count:
        raise ValueError(f"no decoder-layer linears under {TEXT_LAYERS!r} to quantize")
    return count
