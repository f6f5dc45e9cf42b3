"""Memory budgets: what a profile keeps on the device and in host memory, and the DiT's activations.

Two sources, one accounting of activations:
- `plan_budget(folder, profile, rules)`: from a checkpoint folder's configurations alone (the components are built on
  the meta device, nothing is read), by the rules the profile applies at load: FP8 block linears and text-encoder
  linears are 1 byte per weight plus a float32 scale per output channel, the AdaLN weights wait in host memory unless
  kept resident, the video decoder's linears and convolutions are float16 under float16 autocast. `h3serve check
  --preflight` and `h3serve serve` compare it with the free memory before any weight loads.
- `Engine.memory_budget()`: the same rows, counted from the tensors actually loaded.

Activations: per packed row about 2 bytes x (3 hidden + 6 attention width + 3 ffn), what one block holds at once (its
input, QKV, the normed and rotated q and k, the attention output, fc1's output and the gated product). At the
reference shape (6435 rows) that is 1.2 GiB against 1.4 GiB measured above the resident weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from h3serve.config import DiTConfig

if TYPE_CHECKING:
    from h3serve.model.folder import ModelFolder
    from h3serve.pipeline.engine import Profile
    from h3serve.pipeline.request import RequestRules

GIB = 2**30
REFERENCE_ROWS = 6435  # T2VA 768x448, 56 frames, 537 prompt rows (PERFORMANCE.md's reference shape)
# Beyond weights and the DiT's activations: the CUDA context, cuBLAS/cuDNN workspaces, the allocator's slack and a
# window of the video decode. Measured at the reference request: peak minus resident weights minus activations
# was 0.1-0.2 GiB on the H200 (bench/results/2026-12-01-h200-render.json); 2 GiB leaves room for larger decodes.
OVERHEAD_GIB = 2.0


def dit_activation_bytes(cfg: DiTConfig, rows: int) -> int:
    return rows * 2 * (3 * cfg.hidden_size + 6 * cfg.inner_dim + 3 * cfg.ffn_hidden_size)


PLANNED_TEXT_ROWS = 1024  # the prompt rows the memory plan allows for (a long prompt with two keyframes)


def largest_request_rows(cfg: DiTConfig, rules: RequestRules, text_rows: int = PLANNED_TEXT_ROWS) -> int:
    """Packed rows of the largest request the rules allow: FL2VA (two keyframes), the largest 16:9 canvas, the most
    frames, `text_rows` prompt rows."""
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.request import resolve_canvas

    width, height = resolve_canvas(16, 9, rules.canvas)
    geometry = MediaGeometry.from_pixels(height, width, rules.frames.max_frames)
    layout = build_layout([1] * text_rows, geometry, ("first", "last"), patch_size=cfg.patch_size)
    return int(layout.token_tags.numel())


@dataclass(frozen=True)
class Budget:
    """GiB per row; `device_need` and `host_need` are what a start needs free."""

    device: dict[str, float]  # weights per component on the device
    host: dict[str, float]  # what waits in host memory (AdaLN weights and tables)
    activations_reference: float
    activations_largest: float
    largest_rows: int

    @property
    def device_weights(self) -> float:
        return sum(self.device.values())

    @property
    def device_need(self) -> float:
        return self.device_weights + self.activations_largest + OVERHEAD_GIB

    @property
    def host_need(self) -> float:
        return sum(self.host.values())

    def table(self) -> str:
        rows = [(f"device: {k}", v) for k, v in self.device.items()]
        rows += [("device: weights total", self.device_weights)]
        rows += [(f"host: {k}", v) for k, v in self.host.items()]
        rows += [
            (f"activations at the reference shape ({REFERENCE_ROWS} rows)", self.activations_reference),
            (f"activations at the largest request ({self.largest_rows} rows)", self.activations_largest),
            ("overhead (CUDA context, workspaces, decode window)", OVERHEAD_GIB),
            ("device need (weights + largest activations + overhead)", self.device_need),
            ("host need", self.host_need),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value:8.2f} GiB" for name, value in rows)


def _fp8_bytes(linear: nn.Linear) -> int:
    n, k = linear.weight.shape
    bias = 0 if linear.bias is None else n * linear.bias.element_size()
    return n * k + 4 * n + bias  # e4m3 weight, float32 scale per output channel


def plan_budget(
    folder: ModelFolder, profile: Profile, rules: RequestRules, schedules_kept: int = 4, task_type: str = "fl2va"
) -> Budget:
    """The budget of loading `folder` under `profile`, from its configurations (see the module docstring).
    `task_type`: which DiTs load (`model.folder.TASK_TYPES`); both are two DiTs of one size, each with its own AdaLN
    weights and tables."""
    from transformers import Qwen3VLConfig

    from h3serve.accel.linear import DECODER_LAYERS, _block_linears
    from h3serve.config import DEFAULT_STEPS
    from h3serve.model.audio_vae import AudioVAE
    from h3serve.model.dit import TABLE_ROWS, H3DiT, is_fp32_name
    from h3serve.model.folder import TASK_TYPES
    from h3serve.model.text_encoder import TEXT_ENCODER_LAYER, truncated_qwen3vl
    from h3serve.model.video_vae import VideoVAE

    dtype_bytes = profile.torch_dtype.itemsize
    cuda = profile.torch_device.type == "cuda"
    with torch.device("meta"):
        dit = H3DiT(folder.dit)
        qwen_cfg = Qwen3VLConfig.from_pretrained(str(folder.text_encoder), local_files_only=True)
        text = truncated_qwen3vl(qwen_cfg, TEXT_ENCODER_LAYER, vision=True)
        video = VideoVAE(folder.video_vae_config)
        audio = AudioVAE(folder.audio_vae_config)

    # The DiT: fp32 islands, the rest in the profile's dtype; FP8 block linears; AdaLN weights in host memory.
    quantized = {}
    if profile.linear in ("CUTLASS", "HUMMING"):
        quantized = {f"{name}.weight": getattr(parent, leaf) for name, parent, leaf in _block_linears(dit)}
    dit_bytes = adaln_bytes = 0
    for name, p in dit.named_parameters():
        if name in quantized:
            dit_bytes += _fp8_bytes(quantized[name])
        elif name.startswith("blocks.") and ".adaln_proj." in name and cuda and not profile.adaln_resident:
            adaln_bytes += p.numel() * dtype_bytes
        else:
            dit_bytes += p.numel() * (4 if is_fp32_name(name) else dtype_bytes)
    dit_bytes += sum(b.numel() * b.element_size() for b in dit.buffers())

    # The text encoder: the profile's dtype; FP8 decoder-layer linears when asked.
    text_bytes = 0
    fp8_text = profile.text_linear == "CUTLASS"
    for name, module in text.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if fp8_text and name.startswith(DECODER_LAYERS) and isinstance(module, nn.Linear) and leaf == "weight":
                text_bytes += _fp8_bytes(module) - (0 if module.bias is None else module.bias.numel() * dtype_bytes)
            else:
                text_bytes += p.numel() * dtype_bytes

    # The video VAE: float32, the decoder's linears and convolutions in the autocast dtype.
    from h3serve.accel.vae import CAST

    half = profile.vae_autocast_dtype
    video_bytes = sum(p.numel() * 4 for p in video.parameters())
    if half is not None:
        for module in (video.post_quant_conv, *video.decoder.modules()):
            if isinstance(module, CAST):
                video_bytes -= sum(p.numel() * (4 - half.itemsize) for p in module.parameters(recurse=False))
    audio_bytes = sum(t.numel() * 4 for t in (*audio.parameters(), *audio.buffers()))

    dits = TASK_TYPES[task_type]
    device = {
        **{("dit" if kind == "fl2va" else "ref_dit"): dit_bytes / GIB for kind in dits},
        "text_encoder": text_bytes / GIB,
        "video_vae": video_bytes / GIB,
        "audio_vae": audio_bytes / GIB,
    }
    # The AdaLN tables of the schedules kept: with the weights in host memory, so are they (one step's copied in).
    steps = DEFAULT_STEPS - 1
    tables = schedules_kept * steps * len(dit.blocks) * TABLE_ROWS * 6 * folder.dit.hidden_size * dtype_bytes
    host: dict[str, float] = {}
    if adaln_bytes:
        host["adaln_weights"] = len(dits) * adaln_bytes / GIB
    label = f"adaln_tables ({schedules_kept} schedules of {steps} steps{' per DiT' if len(dits) > 1 else ''})"
    (host if adaln_bytes else device)[label] = len(dits) * tables / GIB
    largest = largest_request_rows(folder.dit, rules)
    return Budget(
        device=device,
        host=host,
        activations_reference=dit_activation_bytes(folder.dit, REFERENCE_ROWS) / GIB,
        activations_largest=dit_activation_bytes(folder.dit, largest) / GIB,
        largest_rows=largest,
    )


def free_memory(device: torch.device) -> tuple[float, float, bool]:
    """(device free GiB, host available GiB, whether the two are one pool): CUDA's free memory, /proc/meminfo's
    MemAvailable; an integrated GPU (a DGX Spark's GB10) shares the host's memory."""
    host = _mem_available_gib()
    if device.type != "cuda":
        return host, host, True
    free, _ = torch.cuda.mem_get_info(device)
    return free / GIB, host, bool(torch.cuda.get_device_properties(device).is_integrated)


def _mem_available_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return math.inf  # unknown here: not a reason to refuse


def check_fits(budget: Budget, device_free: float, host_free: float, shared: bool) -> list[str]:
    """Why the budget does not fit the free memory (empty when it does)."""
    problems = []
    if shared:
        need = budget.device_need + budget.host_need
        if need > min(device_free, host_free):
            problems.append(
                f"needs {need:.1f} GiB of the shared memory (device {budget.device_need:.1f} + host "
                f"{budget.host_need:.1f}), {min(device_free, host_free):.1f} GiB free"
            )
        return problems
    if budget.device_need > device_free:
        problems.append(f"needs {budget.device_need:.1f} GiB on the device, {device_free:.1f} GiB free")
    if budget.host_need > host_free:
        problems.append(f"needs {budget.host_need:.1f} GiB of host memory, {host_free:.1f} GiB available")
    return problems
