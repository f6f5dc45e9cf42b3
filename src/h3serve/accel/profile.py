"""The profile: how an engine runs (device, precision, backends), as one frozen value.

Everything a command or a module needs to know about profiles lives here: the backend names (the seed's operator
names, as enums), the defaults per device, and the rules between settings. `Profile(...)` checks names and rules
only, so a CUDA profile can be built and inspected on a machine without a GPU; `check(profile)` asks the hardware
(CUDA present, cuDNN, FP8 tensor cores, Humming installed) and is what an engine calls before any weight loads.
Every refusal is a `ProfileError` that names the setting and what is allowed.

torch is imported lazily: `h3serve --help` and `h3serve ready` read this module without paying for torch.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Attention(enum.StrEnum):
    """TORCH_SDPA: torch's scaled_dot_product_attention with its own backend choice (the reference).
    CUDNN_ATTN: the same call held to cuDNN's fused attention (fails rather than falls back).
    FA4: the DiT's attention through FlashAttention-4's forward kernel (exact attention; sm90 or newer and the `fa4`
    extra, `accel.fa4`); the decoders' attention runs CUDNN_ATTN under it.
    CUDNN_FP8: the DiT's attention in FP8 through cuDNN's FP8 SDPA, per-head scales, smoothed keys and values (opt-in,
    lossy; Hopper or newer and the `fp8-attention` extra); the decoders' attention runs CUDNN_ATTN under it.
    auto: chosen by `resolve_attention` where no hardware decides, else at start on the device
    (`accel.attention.resolve`: FA4 where it is installed and passes its self-test on a GPU it is chosen for, else
    CUDNN_ATTN). An engine never runs `auto`."""

    AUTO = "auto"
    CUDNN_ATTN = "CUDNN_ATTN"
    CUDNN_FP8 = "CUDNN_FP8"
    FA4 = "FA4"
    TORCH_SDPA = "TORCH_SDPA"


class Execution(enum.StrEnum):
    """eager (on CUDA the exact passes: bit for bit the reference ops) or regional torch.compile of the blocks."""

    COMPILE = "compile"
    EAGER = "eager"


class Linear(enum.StrEnum):
    """The DiT's block linears: BF16 (the model's own, exact), CUTLASS (FP8 e4m3, lossy), HUMMING (FP8 through
    Humming's batch-invariant GEMMs: the deterministic profile, eager and no step cache only)."""

    BF16 = "BF16"
    CUTLASS = "CUTLASS"
    HUMMING = "HUMMING"

    @property
    def streams(self) -> bool:
        """Whether these block linears' weights can wait in host memory and stream in (`pipeline.placement`):
        HUMMING's FP8 layout is made on the device and does not. The one home of that rule: the settings refuse
        H3_OFFLOAD=all with it, the start-up plans `auto` as none, and the engine refuses a streaming placement."""
        return self != Linear.HUMMING


class TextLinear(enum.StrEnum):
    """The text encoder's decoder-layer linears: BF16 (exact) or CUTLASS (FP8, opt-in, lossy)."""

    BF16 = "BF16"
    CUTLASS = "CUTLASS"


class AdalnWeights(enum.StrEnum):
    """Where the DiT blocks' AdaLN weights (13 B parameters, 24.2 GiB in BF16) live; they only make each schedule's
    modulation tables (`accel.adaln`). device: resident on the compute device. pinned: a page-locked host copy,
    copied in one block at a time (the default on a discrete GPU). mapped: never copied at load; read from the
    memory-mapped checkpoint (page cache the kernel can evict and re-read) one block at a time when a schedule's
    tables are made (the default on an integrated GPU, whose host memory is its memory; needs a checkpoint)."""

    DEVICE = "device"
    MAPPED = "mapped"
    PINNED = "pinned"


class Fp8Scaling(enum.StrEnum):
    """How the CUTLASS linears' FP8 GEMM applies its row and column scales (`accel.linear`): ROWWISE inside the GEMM
    (rowwise-scaled `_scaled_mm`), EPILOGUE after a per-tensor GEMM to float32 (for GPUs whose cuBLAS refuses or
    miscomputes rowwise scales). auto: whichever passes the start-up self-test first, in that order
    (`accel.fp8_check`); a named one is self-tested too, and refused if it fails."""

    AUTO = "auto"
    EPILOGUE = "EPILOGUE"
    ROWWISE = "ROWWISE"


class Offload(enum.StrEnum):
    """Where the weights wait between their uses (`pipeline.placement`): auto (in page-locked host memory, streamed in,
    only what the device memory cannot hold), all (every streamable part), none (everything resident)."""

    AUTO = "auto"
    ALL = "all"
    NONE = "none"

    def planned(self, linear: Linear | str, cuda: bool) -> Offload:
        """What this setting plans with these block linears on this device: none where nothing can stream (HUMMING,
        `Linear.streams`; `all` is refused with it before) and for `auto` off CUDA (the CPU streams only when told
        to: the tests' path)."""
        if not Linear(linear).streams or (self == Offload.AUTO and not cuda):
            return Offload.NONE
        return self


class DType(enum.StrEnum):
    """The DiT block stack's and text encoder's precision (the DiT's fp32 islands and both VAEs stay float32)."""

    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class VaeAutocast(enum.StrEnum):
    """The video decoder's autocast: float16 (the released recipe, CUDA only) or none."""

    FLOAT16 = "float16"
    NONE = "none"


# The backend fields of a profile and their enums: the registries below and the settings schema take their names.
CHOICES: dict[str, type[enum.StrEnum]] = {
    "dtype": DType,
    "vae_autocast": VaeAutocast,
    "attention": Attention,
    "execution": Execution,
    "linear": Linear,
    "text_linear": TextLinear,
    "adaln_weights": AdalnWeights,
    "fp8_scaling": Fp8Scaling,
}
# The defaults per device type. On CUDA the seed's profile (cuDNN attention, regional compile, CUTLASS FP8 block
# linears; BF16 is the exact profile, one setting away). On the CPU the only values that run there.
DEFAULTS: dict[str, dict[str, enum.StrEnum]] = {
    "cuda": {
        "dtype": DType.BFLOAT16,
        "vae_autocast": VaeAutocast.FLOAT16,
        "attention": Attention.AUTO,  # FA4 where it runs, else CUDNN_ATTN (`accel.attention.resolve`)
        "execution": Execution.COMPILE,
        "linear": Linear.CUTLASS,
        "text_linear": TextLinear.BF16,
        "adaln_weights": AdalnWeights.PINNED,  # MAPPED on an integrated GPU (`INTEGRATED_DEFAULTS`)
        "fp8_scaling": Fp8Scaling.AUTO,
    },
    "cpu": {
        "dtype": DType.FLOAT32,
        "vae_autocast": VaeAutocast.NONE,
        "attention": Attention.TORCH_SDPA,
        "execution": Execution.EAGER,
        "linear": Linear.BF16,
        "text_linear": TextLinear.BF16,
        "adaln_weights": AdalnWeights.DEVICE,
        "fp8_scaling": Fp8Scaling.AUTO,
    },
}
# An integrated GPU (a DGX Spark's GB10) shares the host's memory: page-locked host copies take from the GPU's own
# pool, so the AdaLN weights stay in the page cache and fewer schedules' tables are kept.
INTEGRATED_DEFAULTS: dict[str, Any] = {"adaln_weights": AdalnWeights.MAPPED, "adaln_tables_kept": 2}
TABLES_KEPT = 4  # schedules whose AdaLN tables are kept, elsewhere
MAX_TABLES_KEPT = 64
# What the CPU runs, whatever the dtype: everything else needs CUDA.
CPU_ONLY = ("vae_autocast", "attention", "execution", "linear", "text_linear")  # adaln_weights: device or mapped
FP8_LINEARS = (Linear.CUTLASS, Linear.HUMMING)  # block linears stored as e4m3 weights (quantized as they load)
CUDNN = (Attention.CUDNN_ATTN, Attention.CUDNN_FP8)  # the backends held to cuDNN (half precision only)
HALF_ONLY = (*CUDNN, Attention.FA4)  # the backends with no float32 kernel
DEVICE = re.compile(r"^(cpu|cuda)(?::(\d{1,3}))?$")
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89) and newer


class ProfileError(ValueError):
    """A profile value or combination that cannot run. `setting` is the profile field it concerns (device, dtype,
    vae_autocast, attention, execution, linear, text_linear, step_cache); front ends rename it to their own."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


def device_type(device: str) -> str:
    """'cpu' or 'cuda' for a device string ('cuda:1' -> 'cuda'); ProfileError for anything else."""
    match = DEVICE.fullmatch(device)
    if match is None:
        raise ProfileError("device", f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if match.group(1) == "cpu" and match.group(2) is not None:
        raise ProfileError("device", f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return match.group(1)


@dataclass(frozen=True)
class Profile:
    """How an engine runs. Values may be given as the enums or their names; they are held as the enums.

    adaln_weights: where the DiT blocks' AdaLN weights live (`AdalnWeights`); adaln_tables_kept: how many schedules'
    AdaLN tables are kept (the least recently used goes first). fp8_scaling: the CUTLASS GEMM's scaling
    (`Fp8Scaling`; auto until the start-up self-test has chosen, `accel.fp8_check.resolve`).
    """

    device: str = "cpu"
    dtype: DType = DType.FLOAT32
    vae_autocast: VaeAutocast = VaeAutocast.NONE
    attention: Attention = Attention.TORCH_SDPA
    execution: Execution = Execution.EAGER
    linear: Linear = Linear.BF16
    text_linear: TextLinear = TextLinear.BF16
    adaln_weights: AdalnWeights = AdalnWeights.DEVICE
    adaln_tables_kept: int = TABLES_KEPT
    fp8_scaling: Fp8Scaling = Fp8Scaling.AUTO

    def __post_init__(self) -> None:
        for name, choice in CHOICES.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, choice(value))
            except ValueError:
                allowed = ", ".join(choice)
                raise ProfileError(name, f"{name} must be one of {allowed}, got {value!r}") from None
        kept = self.adaln_tables_kept
        if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept <= MAX_TABLES_KEPT:
            allowed = f"a whole number from 1 to {MAX_TABLES_KEPT}"
            raise ProfileError("adaln_tables_kept", f"adaln_tables_kept must be {allowed}, got {kept!r}")
        if self.linear == Linear.HUMMING and self.execution != Execution.EAGER:
            raise ProfileError(
                "linear",
                f"linear HUMMING runs eager only (it is the deterministic profile): set execution eager, got "
                f"{self.execution}",
            )
        if self.fp8_scaling != Fp8Scaling.AUTO and not self.fp8_gemm:
            raise ProfileError(
                "fp8_scaling",
                f"fp8_scaling {self.fp8_scaling} applies to CUTLASS linears, and this profile has none (linear "
                f"{self.linear}, text_linear {self.text_linear}): set one to CUTLASS, or leave fp8_scaling auto",
            )
        # HUMMING's rule holds anywhere; then what the device type runs, then the dtype's kernels.
        kind = device_type(self.device)
        object.__setattr__(self, "attention", resolve_attention(kind, self.dtype, self.execution, self.attention))
        if kind == "cpu":
            for name in CPU_ONLY:
                allowed = DEFAULTS["cpu"][name]
                if getattr(self, name) != allowed:
                    raise ProfileError(
                        name, f"{name} {getattr(self, name)} needs a CUDA device (allowed on cpu: {allowed})"
                    )
            if self.adaln_weights == AdalnWeights.PINNED:
                raise ProfileError(
                    "adaln_weights",
                    "adaln_weights pinned needs a CUDA device (on cpu the weights are in host memory already: device "
                    "or mapped)",
                )
        if self.attention in HALF_ONLY and self.dtype == DType.FLOAT32:
            raise ProfileError(
                "attention",
                f"attention {self.attention} has no float32 kernel: use dtype bfloat16, or attention TORCH_SDPA",
            )

    @classmethod
    def for_device(cls, device: str = "cpu", *, integrated: bool = False, **values: Any) -> Profile:
        """The device's defaults (`DEFAULTS`; `INTEGRATED_DEFAULTS` over them for an integrated GPU) with the values
        given (None: the default) put over them."""
        unknown = set(values) - set(CHOICES) - {"adaln_tables_kept"}
        if unknown:
            raise TypeError(f"unknown profile fields: {', '.join(sorted(unknown))}")
        kind = device_type(device)
        defaults: dict[str, Any] = {**DEFAULTS[kind], "adaln_tables_kept": TABLES_KEPT}
        if integrated and kind == "cuda":
            defaults |= INTEGRATED_DEFAULTS
        given = {k: v for k, v in values.items() if v is not None}
        return cls(device=device, **(defaults | given))

    @property
    def cuda(self) -> bool:
        return device_type(self.device) == "cuda"

    @property
    def quantized_linears(self) -> bool:
        """Whether the block linears are stored as e4m3 weights (CUTLASS, and HUMMING, which starts from them)."""
        return self.linear in FP8_LINEARS

    @property
    def fp8_gemm(self) -> bool:
        """Whether any linear runs the CUTLASS FP8 GEMM (`accel.linear.Fp8Linear`) whose scaling is self-tested."""
        return Linear.CUTLASS in (self.linear, self.text_linear)

    @property
    def adaln_off_device(self) -> bool:
        """Whether the AdaLN weights live off the compute device (pinned, or mapped on CUDA), so that only each
        schedule's tables, kept in page-locked host memory, are copied in one step at a time."""
        return self.cuda and self.adaln_weights != AdalnWeights.DEVICE

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return {DType.BFLOAT16: torch.bfloat16, DType.FLOAT32: torch.float32}[self.dtype]

    @property
    def vae_autocast_dtype(self) -> torch.dtype | None:
        import torch

        return torch.float16 if self.vae_autocast == VaeAutocast.FLOAT16 else None

    def as_dict(self) -> dict[str, Any]:
        """The profile as plain values (what logs, headers and /health show)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: str(v) if isinstance(v, enum.Enum) else v for k, v in values.items()}

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.as_dict().items())


def resolve_attention(kind: str, dtype: DType, execution: Execution, attention: Attention) -> Attention:
    """`attention` with `auto` chosen where no hardware decides it: on the CPU TORCH_SDPA (all it runs); on CUDA in
    float32 CUDNN_ATTN (which the dtype rule then refuses, naming what runs: an explicit choice); under eager on CUDA
    CUDNN_ATTN (eager is the exact and the deterministic profiles' mode, whose bits are measured with cuDNN's
    attention: they keep it). Otherwise (compile, half precision, CUDA) `auto` stays until the start asks the device
    (`accel.attention.resolve`). Any other value is returned as given."""
    if attention != Attention.AUTO:
        return attention
    if kind == "cpu":
        return Attention.TORCH_SDPA
    if dtype == DType.FLOAT32 or execution == Execution.EAGER:
        return Attention.CUDNN_ATTN
    return Attention.AUTO


def is_integrated(device: str) -> bool:
    """Whether `device` is an integrated GPU (its memory is the host's: a DGX Spark's GB10). Asks CUDA; False for the
    CPU or without CUDA."""
    if device_type(device) != "cuda":
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        return False  # no such GPU: `check` refuses it, naming the count
    return bool(torch.cuda.get_device_properties(torch.device(device)).is_integrated)


def check_step_cache(linear: Linear | str | None) -> None:
    """A step cache with these block linears: HUMMING is the deterministic profile and runs without one."""
    if linear == Linear.HUMMING:
        raise ProfileError(
            "linear", "linear HUMMING is the deterministic profile and runs without a step cache: set no step cache"
        )


def check(profile: Profile) -> None:
    """Refuse a profile this machine cannot run (ProfileError naming the setting and what is allowed). Nothing is
    loaded; CUDA is initialised when the profile names it."""
    if not profile.cuda:
        return
    import torch

    device = profile.torch_device
    if not torch.cuda.is_available():
        raise ProfileError("device", f"device {profile.device!r}: CUDA is not available on this machine (allowed: cpu)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ProfileError("device", f"device {profile.device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    if profile.attention in CUDNN and not torch.backends.cudnn.is_available():
        raise ProfileError(
            "attention",
            f"attention {profile.attention}: cuDNN is not available in this torch build (allowed: TORCH_SDPA)",
        )
    if profile.attention == Attention.CUDNN_FP8:
        from h3serve.accel import fp8_attention

        missing = fp8_attention.missing(device)
        if missing is not None:
            raise ProfileError("attention", missing)
    if profile.attention == Attention.FA4:  # an explicit FA4 never falls back; `auto` is resolved at start
        from h3serve.accel import fa4

        missing = fa4.missing(device)
        if missing is not None:
            raise ProfileError("attention", missing)
    fp8 = [name for name in ("linear", "text_linear") if getattr(profile, name) in FP8_LINEARS]
    if fp8:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_CAPABILITY:
            name = fp8[0]
            raise ProfileError(
                name,
                f"{name} {getattr(profile, name)} needs FP8 tensor cores (sm89 or newer), this GPU is sm{major}{minor} "
                "(allowed: BF16)",
            )
    if profile.linear == Linear.HUMMING:
        from h3serve.accel import humming

        missing = humming.available(device)
        if missing is not None:
            raise ProfileError("linear", missing)
