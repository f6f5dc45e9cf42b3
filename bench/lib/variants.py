"""The variants the DiT benchmarks measure, as data, and the pieces only a comparison needs.

A profile name is ATTENTION+execution+LINEAR. Each becomes a `Profile` (`profile`), `Compiler` options
(`accel.apply.profile_compiler`) and the Triton passes (`accel.apply.Passes`), given to the DiT by the engine's own
`accel.apply`, so a benchmark runs what the engine runs. An attention backend that some machines cannot run (FA4: a
CUDA GPU of sm90 or newer, its package) says why in `missing`, which the benchmarks ask before they measure it. What
no profile serves is built here from the engine's public pieces, never as a branch in production: CUDNN_FP8_NAIVE
(per-tensor FP8 attention scales, `naive_sdpa`), `compile-fp32accum` (FP8 GEMMs without fast accumulation,
`Fp32AccumLinear`) and `compile-graph` (a CUDA-graph replay of each forward, `GraphReplay`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from h3serve.accel import fa4, humming, linear
from h3serve.accel.apply import Passes, apply, profile_compiler
from h3serve.accel.compile import GraphCounter, uncompile_repeated_blocks
from h3serve.accel.fp8_attention import Scales, dequantize, to_e4m3
from h3serve.accel.linear import Fp8Linear
from h3serve.accel.profile import Profile
from h3serve.model.components import Components

# The linears measured, as profile values: CUTLASS_EPILOGUE is CUTLASS's e4m3 weights with the EPILOGUE scaling
# (`accel.linear.Fp8Scaling`: a per-tensor GEMM to float32, then the row and column scales and the cast), the fallback
# for GPUs whose rowwise-scaled GEMM fails (`accel.fp8_check`); measured only where `--only` names it (`NAMED_ONLY`).
LINEARS = {
    "BF16": {"linear": "BF16"},
    "CUTLASS": {"linear": "CUTLASS"},
    "CUTLASS_EPILOGUE": {"linear": "CUTLASS", "fp8_scaling": "EPILOGUE"},
    "HUMMING": {"linear": "HUMMING"},
}
NAMED_ONLY = ("CUTLASS_EPILOGUE",)
# Our attention backends measured; CUDNN_FP8_NAIVE is CUDNN_FP8 with per-tensor scales and no K or V smoothing
# (`naive_sdpa`: what the design's scales buy, never served). FA4: FlashAttention-4's forward kernel (`accel.fa4`),
# measured only where it runs (`missing`).
ATTENTIONS = ("TORCH_SDPA", "CUDNN_ATTN", "FA4", "CUDNN_FP8", "CUDNN_FP8_NAIVE")
FP8_ATTENTIONS = ("CUDNN_FP8", "CUDNN_FP8_NAIVE")
# The exact profile (bit for bit the reference ops, and the peer's eager output at the reference shape).
EXACT = "CUDNN_ATTN+eager+BF16"
AUTOTUNE = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON", "epilogue_fusion": True}


@dataclass(frozen=True)
class Execution:
    """How one measured variant executes: the profile's execution (eager or compile), the Triton passes, the
    compiler's options (`profile_compiler`), and what only a benchmark runs: FP8 GEMMs with float32 accumulation,
    each forward a CUDA-graph replay."""

    execution: str
    passes: Passes = Passes.ALL
    compiler: dict = field(default_factory=dict)
    fp32_accum: bool = False
    graph: bool = False


# eager: the engine's (on CUDA the exact passes: bit for bit the reference ops); eager-unfused: the reference ops alone
# (what the exact passes save). compile: the engine's (the row count symbolic; on CUDA the fused block passes and the
# fused qk-norm + rotary pass). compile-graph: the same, each forward a replay of one CUDA graph (measured, not what
# the engine runs). compile-qk: the fused qk-norm + rotary pass alone; compile-unfused: neither (what the passes
# save). compile-static: static shapes, unfused (a recompile for every new row count; what the symbolic row count
# costs). compile-autotune: Inductor's max-autotune (Triton GEMM templates timed against cuBLAS, epilogues fused into
# the GEMMs where a template wins): not served (its choice is timed, so it can differ from one process to the next).
# compile-fp32accum (CUTLASS): the FP8 GEMMs' partial sums promoted to float32: what fast accumulation saves and costs.
EXECUTIONS = {
    "eager": Execution("eager"),
    "eager-unfused": Execution("eager", Passes.NONE),
    "compile": Execution("compile"),
    "compile-graph": Execution("compile", graph=True),
    "compile-qk": Execution("compile", Passes.QK),
    "compile-unfused": Execution("compile", Passes.NONE),
    "compile-static": Execution("compile", Passes.NONE, {"dynamic": False}),
    "compile-autotune": Execution("compile", compiler={"inductor_config": AUTOTUNE}),
    "compile-fp32accum": Execution("compile", fp32_accum=True),
}


def profile(attn: str, execution: str, linear: str) -> Profile:
    """The engine's profile a variant runs (a CUDA value whatever the device: the --tiny dry run applies it on the
    CPU, with the passes off)."""
    values = {"attention": "CUDNN_FP8" if attn == "CUDNN_FP8_NAIVE" else attn, **LINEARS[linear]}
    return Profile.for_device("cuda", execution=EXECUTIONS[execution].execution, vae_autocast="none", **values)


def alone(dit: nn.Module) -> Components:
    """`dit` as the only model `accel.apply` measures: the VAEs are the tiny model's, built on the meta device (no
    memory, no weights), so that `apply` gives them what it gives a real model's (attention kernels, the tile batch,
    the decoder's passes on CUDA) and never meets a shape it does not know; the text encoder is an empty stand-in
    (`apply` touches it only for FP8 text linears, which no DiT variant asks for)."""
    from h3serve.model.audio_vae import AudioVAE
    from h3serve.model.tiny import TINY_AUDIO_VAE, TINY_VIDEO_VAE
    from h3serve.model.video_vae import VideoVAE

    with torch.device("meta"):
        video_vae, audio_vae = VideoVAE(TINY_VIDEO_VAE), AudioVAE(TINY_AUDIO_VAE)
    return Components(dit=dit, text_encoder=nn.Module(), video_vae=video_vae, audio_vae=audio_vae, name="a DiT")


def configure(dit, attn: str, execution: str, linear: str, dev: str) -> GraphCounter | None:
    """Set `dit` up for the variant through `accel.apply` (its block linears already swapped: `swap_linears`);
    returns the compile's graph counter (None when eager)."""
    variant = EXECUTIONS[execution]
    prof = profile(attn, execution, linear)
    accumulate(dit, fp32=variant.fp32_accum)  # before apply, which keeps already quantized layers as they are
    compiler = profile_compiler(prof, **variant.compiler) if variant.execution == "compile" else None
    counter = apply(alone(dit), prof, compiler, variant.passes if dev == "cuda" else Passes.NONE)
    if attn == "CUDNN_FP8_NAIVE":
        for block in dit.blocks:
            block.attn.kernel = naive_sdpa
    return counter


def profile_linear(name: str) -> str:
    """The profile's linear backend of one of `LINEARS`."""
    return LINEARS[name]["linear"]


def wanted(linear: str, attn: str, execution: str) -> bool:
    """Which profiles a run without `--only` measures (`--only` may add compile-autotune, minutes of tuning); for a
    linear measured only when named (`NAMED_ONLY`), which of its profiles `--only` may name: its base's."""
    linear = profile_linear(linear)
    if execution == "compile-graph" and not torch.cuda.is_available():
        return False
    if execution == "compile-autotune":
        return False
    if execution == "compile-fp32accum":
        return linear == "CUTLASS"
    if linear == "HUMMING":  # eager only (batch invariance is its point; the settings refuse compile with it)
        return execution in ("eager", "eager-unfused")
    if attn in FP8_ATTENTIONS:
        return execution in ("eager", "compile")
    return execution in ("eager", "compile") or attn == "CUDNN_ATTN"


def missing(attn: str, dev: str) -> str | None:
    """Why a run on `dev` ("cuda", or "cpu": the --tiny dry run) cannot measure attention `attn`, or None. FA4 alone
    has a kernel that cannot run everywhere and no stand-in on the CPU (`accel.fa4.missing`: CUDA, sm90 or newer, the
    `fa4` extra); the others run, or record the error they meet, as before."""
    if attn != "FA4":
        return None
    if dev != "cuda":
        return "attention FA4 needs a CUDA GPU, and --tiny is a dry run on the CPU"
    return fa4.missing("cuda")


def swap_linears(dit, name: str) -> dict | None:
    """The linear's block linears in place of the BF16 ones, quantized as the loader quantizes them (`accel.apply`
    keeps them); the BF16 ones are returned by name for `restore` (the engine releases them; a benchmark switches
    back)."""
    if name == "BF16":
        return None
    kept = {name: getattr(parent, leaf) for name, parent, leaf in linear.block_linears(dit)}
    make = linear.Fp8Linear.from_linear if profile_linear(name) == "CUTLASS" else humming.HummingLinear.from_linear

    def convert(module: nn.Module) -> nn.Module:
        # Each BF16 layer goes to host memory as soon as its copy exists, as the engine releases it: the device
        # never holds the BF16 and the FP8 block linears together (61.8 GiB + 19 GiB would not fit an 80 GB card).
        new = make(module)
        module.to("cpu")
        return new

    linear.replace_block_linears(dit, convert)
    return kept


def restore(dit, kept: dict) -> None:
    """Put back the block linears `swap_linears` kept, on the DiT's device again (each swapped layer released as
    its BF16 one returns)."""
    device = next(p.device for p in dit.parameters() if p.device.type != "meta")
    for name, module in kept.items():
        parent, leaf = name.rsplit(".", 1)
        setattr(dit.get_submodule(parent), leaf, module.to(device))


def uncompile(model, *inputs: dict) -> None:
    """Back to eager, and the inputs' row-count marks (`compile` marks them dynamic) cleared for a static compile."""
    uncompile_repeated_blocks(model)
    for x in inputs:
        for t in (*x.values(), *x["rope"]):
            if torch.is_tensor(t) and hasattr(t, "_dynamo_dynamic_indices"):
                del t._dynamo_dynamic_indices


# ---- comparison-only pieces: built here from public pieces, never served ------------------------------------------


class Fp32AccumLinear(Fp8Linear):
    """`Fp8Linear` with the FP8 GEMM's fast accumulation off (partial sums promoted to float32): `compile-fp32accum`."""

    fast_accum = False


def accumulate(dit, fp32: bool) -> None:
    """The FP8 block linears as `Fp32AccumLinear` (`fp32`) or the served `Fp8Linear`: new layers over the same e4m3
    weights and scaling where the class differs."""
    kind = Fp32AccumLinear if fp32 else Fp8Linear

    def convert(module):
        if isinstance(module, Fp8Linear) and type(module) is not kind:
            return kind(module.weight, module.scale, module.bias, scaling=module.scaling)
        return None

    linear.replace_block_linears(dit, convert)


def naive_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """`fp8_attention.quantize` with one scale each for q, k and v (every head alike) and no smoothing: what the
    design's per-head scales and smoothed keys and values are measured against. Returns (q8, k8, v8, scales)."""
    scales = Scales.of(*(x.abs().amax().float().expand(x.shape[1]) for x in (q, k, v)))
    return to_e4m3(q, scales.q), to_e4m3(k, scales.k), to_e4m3(v, scales.v), scales


def naive_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """`fp8_attention.fp8_sdpa` over `naive_quantize`'s scales (CUDNN_FP8_NAIVE's attention kernel)."""
    if causal:
        raise ValueError("attention CUDNN_FP8_NAIVE runs the DiT's unmasked attention only")
    q8, k8, v8, scales = naive_quantize(q, k, v)
    o8 = torch.ops.h3serve.cudnn_fp8_sdpa(q8, k8, v8, scales.descale)
    return dequantize(o8, scales).to(q.dtype)


# ---- a forward replayed from a CUDA graph (the `compile-graph` execution) ----------------------------------------
# Measured at the reference shape on the H200 (2026-12-01): 495.2 ms per forward against 494.3 ms launched
# normally, so the engine does not capture its steps; this stays to measure it again.


class GraphReplay:
    """`fn()` (returning a tuple of tensors) run directly on the first call, so that any lazy initialisation happens
    outside a capture; captured in a CUDA graph on the second; replayed from then on. The results are copies of the
    graph's own tensors."""

    def __init__(self, fn: Callable[[], tuple[torch.Tensor, ...]]):
        self.fn = fn
        self.called = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()

    def __call__(self) -> tuple[torch.Tensor, ...]:
        if self.graph is None:
            if not self.called:
                self.called = True
                return self.fn()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # entering it synchronises and empties the allocator's cache
                self.outputs = tuple(self.fn())
        self.graph.replay()
        return tuple(t.clone() for t in self.outputs)
