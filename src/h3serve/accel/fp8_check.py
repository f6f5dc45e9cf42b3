"""A start-up self-test of the FP8 GEMM path: which `Fp8Scaling` this device runs correctly, if any.

The CUTLASS linears' GEMM is `Fp8Linear.matmul_rows`. On some GPUs its rowwise-scaled `torch._scaled_mm` has been
reported to fail (CUBLAS_STATUS_NOT_SUPPORTED on sm120/sm121, e.g. GB10) while per-tensor scales run, and a fallback
to produce garbage at odd row counts. So before any weight loads, `self_test(device)` runs that GEMM, each scaling in
turn, at the shapes the engine will run (`default_shapes`), on seeded random operands made on the device and quantized
as the engine quantizes (`quantize_rows`, `quantize_weight`), and compares every output with the exact product of the
same e4m3 operands and scales. The first scaling that passes every shape is the choice; a kernel's exception is a
result (recorded with its shape), never raised.

Shapes (M, K, N): the four block linears of the DiT (fused QKV, attention out, fc1, fc2: `shapes_for`) at M = 1, 3
(edge cases), 537 (the reference prompt's text rows, what the refiner blocks run), 6435 (the reference T2VA
768x448x56 packed rows) and 38247 (the released default request, 1344x768x124: the largest the engine serves on one
GPU), every one odd; then the text encoder's distinct decoder-layer GEMMs (`text_encoder_shapes`) at M = 1, 3, 537.
Cost on an H200 (estimated from the FLOPs; tests/test_gpu_fp8_check.py measures it, < 2 s asserted): ~35 TFLOP of
FP8 GEMM per scaling, ~40 ms at the H200's FP8 rate, plus a few GB of element-wise traffic per large shape; the
float32 reference is kept cheap by comparing at most `REFERENCE_ROWS` sampled rows of each output (`reference_rows`:
every ceil(M / 2048)-th row, 19 at M = 38247, so every 64- or 128-row tile of a GEMM has sampled rows, plus the last
`TAIL_ROWS` rows, where the partial tile of an odd M sits); finiteness is checked on the whole output.

Operands: activations randn with each row's magnitude spread over 2^-4..2^4 and weights with each output channel's
over 2^-3..2^3, so that a scale applied to the wrong row or column (or not at all) is a gross error, not a small one.

Tolerance (`TOLERANCE`, relative Frobenius error 1e-2): the reference is the exact product of the quantized operands,
so quantization error cancels and what remains is the kernel's own: the bfloat16 output rounding (~1.7e-3 relative,
measured on random data) and fast accumulation's partial sums (DeepSeek-V3 reports ~14 significant bits kept per
Hopper tensor-core accumulation; an estimated ~1e-3 at these K, and the whole-forward error of fast against promoted
accumulation is the same in bench/results/README.md). 1e-2 leaves ~4x margin over both; a misapplied scale, a missing
or stale tile, or garbage rows are 2e-2 and more (one zeroed row of typical size among 2048 sampled is ~2e-2).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from h3serve.accel.linear import Fp8Linear, Fp8Scaling, parse_scaling, quantize_rows, quantize_weight
from h3serve.accel.profile import Fp8Scaling as ProfileScaling
from h3serve.accel.profile import Profile, ProfileError
from h3serve.config import DiTConfig

# The row counts each DiT block linear is tested at (see the module docstring): all odd.
DIT_ROWS = (1, 3, 537, 6435, 38247)
TEXT_ROWS = (1, 3, 537)
TOLERANCE = 1e-2
REFERENCE_ROWS = 2048  # the most rows of one output compared with the float32 reference (plus the tail)
TAIL_ROWS = 160  # the last rows, always compared: a partial last tile of up to 128 rows and its neighbour's
SEED = 0
OUT_DTYPE = torch.bfloat16  # the compute dtype the engine runs its FP8 linears in

Shape = tuple[int, int, int]  # (M, K, N): (M, K) activations times the transpose of an (N, K) weight
# The GEMM under test: called as matmul(layer, q, scale) with `layer.scaling` the scaling being tested, q (M, K) e4m3
# and scale (M, 1) float32 as `quantize_rows` makes them; returns (M, N). Tests inject a broken one here.
Matmul = Callable[[Fp8Linear, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Fp8CheckResult:
    """`choice`: the first scaling that passed every shape (None: none did, FP8 linears cannot run here). `results`:
    per scaling tested (its name), "ok" or why it failed (the shape, then the exception or the error measured against
    the bound). `seconds`: the whole test's wall time."""

    choice: Fp8Scaling | None
    seconds: float
    results: dict[str, str]

    def describe(self) -> str:
        """One line for logs and health."""
        verdict = f"{self.choice.value}" if self.choice is not None else "no scaling passed"
        others = "; ".join(f"{name}: {why}" for name, why in self.results.items() if name != self.choice)
        return f"FP8 GEMM self-test: {verdict} in {self.seconds:.2f} s" + (f" ({others})" if others else "")


def shapes_for(config: DiTConfig, rows: Sequence[int] = DIT_ROWS) -> list[Shape]:
    """(M, K, N) of the DiT's four quantized block linears (`h3serve.accel.linear.QUANTIZED`) at each row count."""
    h, inner, ffn = config.hidden_size, config.inner_dim, config.ffn_hidden_size
    linears = (
        (h, 3 * inner),  # attn.qkv_proj: fused [q; k; v]
        (inner, h),  # attn.out_proj
        (h, 2 * ffn),  # mlp.fc1: [gate; value]
        (ffn, h),  # mlp.fc2
    )
    return [(m, k, n) for m in rows for k, n in linears]


def text_encoder_shapes(
    rows: Sequence[int] = TEXT_ROWS,
    *,
    hidden: int = 5120,
    intermediate: int = 25600,
    heads: int = 64,
    kv_heads: int = 8,
    head_dim: int = 128,
) -> list[Shape]:
    """(M, K, N) of the text encoder's distinct decoder-layer GEMMs (q, k and v, o, gate and up, down) at each row
    count; the defaults are Qwen3-VL-32B's text config, which H3's text encoder truncates (`model.text_encoder`)."""
    linears = dict.fromkeys(
        (
            (hidden, heads * head_dim),  # q_proj
            (hidden, kv_heads * head_dim),  # k_proj, v_proj
            (heads * head_dim, hidden),  # o_proj
            (hidden, intermediate),  # gate_proj, up_proj
            (intermediate, hidden),  # down_proj
        )
    )
    return [(m, k, n) for m in rows for k, n in linears]


def default_shapes() -> list[Shape]:
    """What `self_test` runs unless told: the released DiT's block GEMMs, then the text encoder's."""
    return shapes_for(DiTConfig()) + text_encoder_shapes()


def resolve(profile: Profile) -> tuple[Profile, Fp8CheckResult | None]:
    """The profile with its `fp8_scaling` chosen on its device, and the self-test's result: run when a CUTLASS linear
    runs on CUDA (None otherwise: the profile as given). auto tests ROWWISE then EPILOGUE; a named scaling is tested
    alone. ProfileError when what was tested failed: the FP8 linears would compute wrong numbers here."""
    if not (profile.cuda and profile.fp8_gemm):
        return profile, None
    auto = profile.fp8_scaling == ProfileScaling.AUTO
    scalings = (Fp8Scaling.ROWWISE, Fp8Scaling.EPILOGUE) if auto else (Fp8Scaling(profile.fp8_scaling.value),)
    result = self_test(profile.torch_device, scalings=scalings)
    if result.choice is None:
        dit = profile.linear == "CUTLASS"
        tried = "neither FP8 GEMM scaling (ROWWISE, EPILOGUE)" if auto else f"fp8_scaling {profile.fp8_scaling}"
        instead = ("linear BF16 or HUMMING" if dit else "") + (", " if dit and profile.text_linear == "CUTLASS" else "")
        instead += "text_linear BF16" if profile.text_linear == "CUTLASS" else ""
        raise ProfileError(
            "fp8_scaling" if not auto else "linear" if dit else "text_linear",
            f"CUTLASS: {tried} computed correctly on {profile.device} ({result.describe()}): use {instead}"
            + ("" if auto else ", or leave fp8_scaling auto to try both"),
        )
    return dataclasses.replace(profile, fp8_scaling=ProfileScaling(result.choice.value)), result


def reference_rows(m: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rows of an (m, N) output compared with the reference: all up to `REFERENCE_ROWS + TAIL_ROWS`, else evenly
    strided rows and the last `TAIL_ROWS`; sorted, each once."""
    if m <= REFERENCE_ROWS + TAIL_ROWS:
        return torch.arange(m, device=device)
    step = math.ceil((m - TAIL_ROWS) / REFERENCE_ROWS)
    strided = torch.arange(0, m - TAIL_ROWS, step, device=device)
    return torch.cat([strided, torch.arange(m - TAIL_ROWS, m, device=device)])


def self_test(
    device: torch.device | str,
    shapes: Sequence[Shape] | None = None,
    scalings: Sequence[Fp8Scaling | str] = (Fp8Scaling.ROWWISE, Fp8Scaling.EPILOGUE),
    matmul: Matmul | None = None,
) -> Fp8CheckResult:
    """Run the FP8 GEMM under each of `scalings` at `shapes` (`default_shapes()`; small ones on a CPU) on `device`;
    see the module docstring. Needs nothing but the device; raises for nothing the kernels do (an unknown scaling
    name is a ValueError). A scaling is not run again after its first failure."""
    device = torch.device(device)
    shapes = default_shapes() if shapes is None else list(shapes)
    order = tuple(dict.fromkeys(parse_scaling(s) for s in scalings))
    call = _engine_matmul if matmul is None else matmul
    failures: dict[Fp8Scaling, str] = {}
    start = time.perf_counter()
    with torch.inference_mode():
        for i, (m, k, n) in enumerate(shapes):
            pending = [s for s in order if s not in failures]
            if not pending:
                break
            where = f"M={m} K={k} N={n}"
            try:
                case = _Case.make(m, k, n, device, seed=SEED + i)
            except Exception as err:  # the operands themselves: nothing of any scaling can run
                failures.update({s: f"{where}: making the operands: {_text(err)}" for s in pending})
                break
            for scaling in pending:
                why = case.check(scaling, call)
                if why is not None:
                    failures[scaling] = f"{where}: {why}"
            del case
    try:
        _sync(device)
        seconds = time.perf_counter() - start
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the operands' blocks back to the device before the weights load
    except Exception as err:  # a device error that outlived its kernel: nothing measured can be trusted
        seconds = time.perf_counter() - start
        failures.update({s: f"after the last shape: {_text(err)}" for s in order if s not in failures})
    choice = next((s for s in order if s not in failures), None)
    return Fp8CheckResult(choice, seconds, {s.value: failures.get(s, "ok") for s in order})


def _engine_matmul(layer: Fp8Linear, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return layer.matmul_rows(q, scale, OUT_DTYPE)


@dataclass
class _Case:
    """One shape's operands and its float32 reference on the sampled rows."""

    layer: Fp8Linear  # the (N, K) e4m3 weight and (1, N) scales
    q: torch.Tensor  # (M, K) e4m3
    scale: torch.Tensor  # (M, 1) float32
    rows: torch.Tensor  # (R,) the compared rows
    reference: torch.Tensor  # (R, N) float32

    @classmethod
    def make(cls, m: int, k: int, n: int, device: torch.device, seed: int) -> _Case:
        gen = torch.Generator(device=device).manual_seed(seed)

        def spread(count: int, octaves: float) -> torch.Tensor:  # (count, 1) magnitudes 2^-octaves .. 2^octaves
            return torch.exp2((torch.rand(count, 1, generator=gen, device=device) * 2 - 1) * octaves)

        x = torch.randn(m, k, generator=gen, device=device, dtype=OUT_DTYPE) * spread(m, 4).to(OUT_DTYPE)
        w = torch.randn(n, k, generator=gen, device=device, dtype=OUT_DTYPE) * (0.02 * spread(n, 3)).to(OUT_DTYPE)
        q, scale = quantize_rows(x)
        del x
        wq, w_scale = quantize_weight(w)
        del w
        rows = reference_rows(m, device)
        # The scales factor out of each dot product, so this is the product of the dequantized operands
        # (`Fp8Linear.reference`) with exact float32 products: e4m3 values are exact in float32 (and in TF32, should
        # the process allow it), so only the float32 accumulation rounds.
        picked = q.view(torch.uint8).index_select(0, rows).view(q.dtype)  # (R, K) (as bytes: any device gathers them)
        reference = (picked.float() @ wq.float().t()) * scale.index_select(0, rows) * w_scale
        return cls(Fp8Linear(wq, w_scale, None), q, scale, rows, reference)

    def check(self, scaling: Fp8Scaling, matmul: Matmul) -> str | None:
        """None if the GEMM under `scaling` runs and matches the reference, else why not."""
        try:
            self.layer.scaling = scaling
            y = matmul(self.layer, self.q, self.scale)
            if tuple(y.shape) != (self.q.shape[0], self.layer.out_features):
                return f"output of shape {tuple(y.shape)}"
            bad = int((~torch.isfinite(y)).sum().item())  # synchronises: an asynchronous kernel error surfaces here
            if bad:
                return f"non-finite output ({bad} of {y.numel()} values)"
            got = y.index_select(0, self.rows).float()
            err = ((got - self.reference).norm() / self.reference.norm()).item()
        except Exception as err:  # what the self-test is for: a kernel that cannot run here is a result
            return _text(err)
        if not err <= TOLERANCE:  # also NaN
            return f"relative error {err:.3g} > {TOLERANCE:g} against the float32 reference"
        return None


def _text(err: Exception) -> str:
    """An exception as one short line: its type and its message's first line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
