"""Memory budgets: what a profile keeps on the device and in host memory, and the DiT's activations.

One counter (`count_bytes`), two sources:
- `plan_budget(folder, profile, rules)`: from a checkpoint folder's configurations alone. The components are built on
  the meta device (nothing is read) and given the profile's own load-time transforms, the same code a load runs
  (`accel.apply.load_plan`'s hooks, `prepare`, and `accel.vae.decoder_weights_to`); the plan says where each tensor
  is (`LoadPlan.where`: the device, page-locked host memory, or the checkpoint's mapping). `h3serve check
  --preflight` and `h3serve serve` compare it with the free memory before any weight loads.
- `loaded_budget(components, profile, rules)`: the same rows, counted from the tensors actually loaded.

Activations: per packed row about 2 bytes x (3 hidden + 6 attention width + 3 ffn), what one block holds at once (its
input, QKV, the normed and rotated q and k, the attention output, fc1's output and the gated product). Checked
against the H200's measured peaks by tests/test_budget.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from h3serve.config import AUDIO_SHIFT, DEFAULT_STEPS, NUM_BLOCK_MODULATIONS, VIDEO_SHIFT, DiTConfig
from h3serve.vocab import TASK_ANCHORS, TASK_TYPES, DiTKind, Task, TaskType

if TYPE_CHECKING:
    from h3serve.accel.profile import Profile
    from h3serve.checkpoint.folder import ModelFolder
    from h3serve.model.components import Components
    from h3serve.pipeline.rules import RequestRules

GIB = 2**30
REFERENCE_ROWS = 6435  # T2VA 768x448, 56 frames, 537 prompt rows: the benchmarks' reference shape
# Beyond weights and the DiT's activations: the CUDA context, cuBLAS/cuDNN workspaces, the allocator's slack and a
# window of the video decode. At the reference request on the H200 the peak beyond resident weights and activations
# stayed far below this (bench/results/README.md, the whole-render runs); 2 GiB leaves room for larger decodes.
OVERHEAD_GIB = 2.0
# On one pool (an integrated GPU), the process's own host memory beyond what the plan lists: the interpreter, torch
# and the CUDA libraries' anonymous pages (measured on the H200: bench/results/README.md, the one-box runs).
PROCESS_HOST_GIB = 3.0


# The CUTLASS GEMM's EPILOGUE scaling (`accel.linear.Fp8Scaling`) makes a float32 (M, N) output before it scales and
# rounds it: per element of fc1's output (the widest GEMM, N = 2 ffn), bytes beyond the bf16 result the rows above
# count. Compiled (the scaling fused): measured 4.7 at the default shape on the H200 (90.06 against 85.27 GiB,
# bench/results/README.md); eager keeps the float32 products apart (not measured): three float32 temporaries.
EPILOGUE_BYTES = {"compile": 6, "eager": 12}


def dit_activation_bytes(cfg: DiTConfig, rows: int, epilogue: str | None = None) -> int:
    """What one block holds at once for `rows` packed rows; `epilogue`: the execution mode ("compile" or "eager")
    when the block linears run the EPILOGUE scaling, whose float32 GEMM outputs add to it."""
    extra = 0 if epilogue is None else rows * 2 * cfg.ffn_hidden_size * EPILOGUE_BYTES[epilogue]
    return rows * 2 * (3 * cfg.hidden_size + 6 * cfg.inner_dim + 3 * cfg.ffn_hidden_size) + extra


PLANNED_TEXT_ROWS = 1024  # the prompt rows the memory plan allows for (a long prompt with two keyframes)


def largest_request_rows(cfg: DiTConfig, rules: RequestRules, text_rows: int = PLANNED_TEXT_ROWS) -> int:
    """Packed rows of the largest request the rules allow: FL2VA (two keyframes), the largest 16:9 canvas, the most
    frames, `text_rows` prompt rows."""
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.rules import resolve_canvas

    width, height = resolve_canvas(16, 9, rules.canvas)
    geometry = MediaGeometry.from_pixels(height, width, rules.frames.max_frames)
    layout = build_layout([1] * text_rows, geometry, TASK_ANCHORS[Task.FL2VA], patch_size=cfg.patch_size)
    return int(layout.token_tags.numel())


def default_request_rows(cfg: DiTConfig, rules: RequestRules, text_rows: int = PLANNED_TEXT_ROWS) -> int:
    """Packed rows of the default request (T2VA at the default 16:9 canvas and frame count) with `text_rows` prompt
    rows."""
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.rules import resolve_canvas

    width, height = resolve_canvas(16, 9, rules.canvas)
    geometry = MediaGeometry.from_pixels(height, width, rules.frames.default_frames)
    layout = build_layout([1] * text_rows, geometry, TASK_ANCHORS[Task.T2VA], patch_size=cfg.patch_size)
    return int(layout.token_tags.numel())


DEVICE, HOST, MAPPED = "device", "host", "mapped"  # where a counted tensor is (`LoadPlan.where`)
STREAMED = "streamed"  # waiting in host memory to stream in (`pipeline.placement`): the engine counts those apart
TEXT_LAYERS = "language_model.layers"  # the text encoder's decoder layers, in the Qwen3-VL model


@dataclass(frozen=True)
class Streamable:
    """What could wait in host memory and stream in (`pipeline.placement`), in GiB: one DiT block's weights (its AdaLN
    weights apart: they live where the profile puts them), one text-encoder decoder layer, the video VAE (both its
    encoder and decoder visit the device when they run); and the DiT's activations per packed row."""

    dit_block: float
    dit_blocks: int
    text_layer: float
    text_layers: int
    video_vae: float
    activation_per_row: float


@dataclass(frozen=True)
class Budget:
    """GiB per row; `device_need`, `host_need` and (one pool) `pool_need` are what a start needs free.

    `host` is what the process holds in host memory that the kernel cannot evict (page-locked AdaLN weights and
    tables); `mapped` is page cache (AdaLN weights read from the checkpoint's mapping), shown but never counted: the
    kernel evicts it and reads it again. `shared`: the device's memory is the host's (an integrated GPU), so the plan
    counts the GPU's allocations, the host part and the process's own host memory in one pool."""

    device: dict[str, float]  # weights per component on the device
    host: dict[str, float]  # what waits in page-locked host memory (AdaLN weights, tables)
    activations_reference: float
    activations_largest: float
    largest_rows: int
    mapped: dict[str, float] = field(default_factory=dict)  # page cache: evictable, not counted
    activations_default: float = 0.0
    default_rows: int = 0
    shared: bool = False
    streamable: Streamable | None = None

    @property
    def device_weights(self) -> float:
        return sum(self.device.values())

    @property
    def device_need(self) -> float:
        return self.device_weights + self.activations_largest + OVERHEAD_GIB

    @property
    def host_need(self) -> float:
        return sum(self.host.values())

    def pool_need(self, activations: float | None = None) -> float:
        """One pool (an integrated GPU): the GPU's need (at the largest request, or with `activations`), the host
        part and the process's own host memory (`PROCESS_HOST_GIB`); page cache left out."""
        acts = self.activations_largest if activations is None else activations
        return self.device_weights + acts + OVERHEAD_GIB + self.host_need + PROCESS_HOST_GIB

    def table(self) -> str:
        """Rows with a device column and a page-locked host column (the page cache apart); with one pool, its
        totals."""
        rows: list[tuple[str, float | None, float | None]] = [(k, v, None) for k, v in self.device.items()]
        rows += [(k, None, v) for k, v in self.host.items()]
        rows += [
            (f"activations at the reference shape ({REFERENCE_ROWS} rows)", self.activations_reference, None),
            (f"activations at the default request ({self.default_rows} rows)", self.activations_default, None),
            (f"activations at the largest request ({self.largest_rows} rows)", self.activations_largest, None),
            ("overhead (CUDA context, workspaces, decode window)", OVERHEAD_GIB, None),
        ]
        if self.shared:
            rows.append(("the process's own host memory (torch, CUDA libraries)", None, PROCESS_HOST_GIB))
        need_host = self.host_need + (PROCESS_HOST_GIB if self.shared else 0.0)
        rows.append(("need (weights + largest activations + overhead; host part)", self.device_need, need_host))
        width = max(len(name) for name, _, _ in rows)
        cell = lambda v: f"{v:10.2f}" if v is not None else " " * 10  # noqa: E731
        lines = [f"{'':<{width}}  {'device GiB':>10}  {'host GiB':>10}"]
        lines += [f"{name:<{width}}  {cell(d)}  {cell(h)}" for name, d, h in rows]
        for name, value in self.mapped.items():
            lines.append(f"page cache, evictable, not counted: {name} {value:.2f} GiB")
        if self.shared:
            lines.append(
                f"one pool (the device's memory is the host's): {self.pool_need():.2f} GiB at the largest request, "
                f"{self.pool_need(self.activations_default):.2f} GiB at the default request"
            )
        return "\n".join(lines)


def count_bytes(module: nn.Module, where: Callable[[str], str]) -> dict[str, int]:
    """Bytes of a module's parameters and buffers by where they are (`where(name)`: DEVICE, HOST or MAPPED), each
    counted once at its dtype; in page-locked host memory at the power of two the pinned allocator takes for it
    (`pinned_bytes`). The one counter of the plan (meta tensors) and of a load."""
    out = {DEVICE: 0, HOST: 0, MAPPED: 0, STREAMED: 0}
    seen: set[int] = set()
    for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        if id(t) in seen:
            continue
        seen.add(id(t))
        place = where(name)
        size = t.numel() * t.element_size()
        out[place] += pinned_bytes(size) if place == HOST else size
    return out


def pinned_bytes(size: int) -> int:
    """What torch's page-locked host allocator takes for `size` bytes: the next power of two (a released block's
    AdaLN weight of 496 MiB takes 512; a table of 756 KiB takes 1 MiB, as measured on the H200)."""
    return 0 if size == 0 else 1 << (size - 1).bit_length()


def _dit_name(kind: str) -> str:
    return "dit" if kind == DiTKind.FL2VA else "ref_dit"


def _budget(
    sizes: dict[str, dict[str, int]],
    cfg: DiTConfig,
    rules: RequestRules,
    tables_bytes: int,
    tables_label: str,
    tables_on_device: bool,
    shared: bool,
    epilogue: str | None = None,
    parts: tuple[float, int, float, int] | None = None,
) -> Budget:
    """A budget from each component's bytes by place (`count_bytes`) and the kept tables' bytes (on the device, or
    in page-locked host memory when the AdaLN weights are off it)."""
    device = {name: where[DEVICE] / GIB for name, where in sizes.items()}
    pinned = sum(where[HOST] for where in sizes.values())
    mapped = sum(where[MAPPED] for where in sizes.values())
    host: dict[str, float] = {"adaln_weights (page-locked)": pinned / GIB} if pinned else {}
    (device if tables_on_device else host)[tables_label] = tables_bytes / GIB
    largest, default = largest_request_rows(cfg, rules), default_request_rows(cfg, rules)
    streamable = None
    if parts is not None:
        block, blocks, layer, layers = parts
        per_row = dit_activation_bytes(cfg, 1, epilogue) / GIB
        video = sum(sizes["video_vae"].values()) / GIB  # wherever it is now (a visiting one waits in host memory)
        streamable = Streamable(block, blocks, layer, layers, video, per_row)
    return Budget(
        device=device,
        host=host,
        activations_reference=dit_activation_bytes(cfg, REFERENCE_ROWS, epilogue) / GIB,
        activations_largest=dit_activation_bytes(cfg, largest, epilogue) / GIB,
        largest_rows=largest,
        mapped={"adaln_weights (mapped)": mapped / GIB} if mapped else {},
        activations_default=dit_activation_bytes(cfg, default, epilogue) / GIB,
        default_rows=default,
        shared=shared,
        streamable=streamable,
    )


def _tables(cfg: DiTConfig, profile: Profile, dits: int) -> tuple[int, str]:
    """The AdaLN tables of the schedules the profile keeps: bytes and their row label. In page-locked host memory
    (weights off the device) each table takes a power of two: torch's pinned-memory allocator rounds every block up
    to one (1 MiB for a released table of 756 KiB; measured on the H200: bench/results/README.md, the one-box runs)."""
    from h3serve.model.dit import TABLE_ROWS
    from h3serve.pipeline.schedule import DualSchedule

    steps = DualSchedule.build(DEFAULT_STEPS, VIDEO_SHIFT, AUDIO_SHIFT).num_steps  # the default schedule's forwards
    per_block = TABLE_ROWS * NUM_BLOCK_MODULATIONS * cfg.hidden_size * profile.torch_dtype.itemsize
    if profile.adaln_off_device:
        per_block = pinned_bytes(per_block)
    kept = profile.adaln_tables_kept
    label = f"adaln_tables ({kept} schedule{'s' if kept > 1 else ''} of {steps} steps{' per DiT' if dits > 1 else ''})"
    return dits * kept * steps * cfg.num_layers * per_block, label


def plan_budget(
    folder: ModelFolder, profile: Profile, rules: RequestRules, task_type: str = TaskType.FL2VA, shared: bool = False
) -> Budget:
    """The budget of loading `folder` under `profile`, from its configurations (see the module docstring).
    `task_type`: which DiTs load (fl2va, ref2va or both); both are two DiTs of one size, each with its own AdaLN
    weights and tables. `shared`: the device's memory is the host's (an integrated GPU: `free_memory`)."""
    from transformers import Qwen3VLConfig

    from h3serve.accel.apply import load_plan
    from h3serve.accel.vae import decoder_weights_to
    from h3serve.model.audio_vae import AudioVAE
    from h3serve.model.dit import FP32_MODULES, H3DiT
    from h3serve.model.text_encoder import TEXT_ENCODER_LAYER, truncated_qwen3vl
    from h3serve.model.video_vae import VideoVAE

    plan = load_plan(profile)
    with torch.device("meta"):
        dit = H3DiT(folder.dit).to(profile.torch_dtype)
        for name in FP32_MODULES:  # as the loader keeps them
            dit.get_submodule(name).float()
        qwen_cfg = Qwen3VLConfig.from_pretrained(str(folder.text_encoder), local_files_only=True)
        text = truncated_qwen3vl(qwen_cfg, TEXT_ENCODER_LAYER, vision=True).to(profile.torch_dtype)
        video = VideoVAE(folder.video_vae_config)
        audio = AudioVAE(folder.audio_vae_config)
    # The profile's load-time transforms, on the meta models: what a load makes of each.
    for module, hook in ((dit, plan.dit_hook), (text, plan.text_hook)):
        if hook is not None:
            hook.prepare(module)
    if profile.vae_autocast_dtype is not None:
        decoder_weights_to(video, profile.vae_autocast_dtype)

    dit_sizes = count_bytes(dit, plan.where)
    on_device = lambda _: DEVICE  # noqa: E731
    dits = TASK_TYPES[task_type]
    sizes = {_dit_name(kind): dit_sizes for kind in dits}
    sizes |= {"text_encoder": count_bytes(text, on_device)}
    sizes |= {"video_vae": count_bytes(video, on_device), "audio_vae": count_bytes(audio, on_device)}
    tables, label = _tables(folder.dit, profile, len(dits))
    parts = _parts(dit, text)
    return _budget(sizes, folder.dit, rules, tables, label, not plan.off_device, shared, _epilogue(profile), parts)


def _parts(dit: nn.Module, text: nn.Module) -> tuple[float, int, float, int]:
    """(one DiT block's streamable GiB, blocks, one text decoder layer's GiB, layers): what `Streamable` holds."""
    from h3serve.checkpoint.adapters.read import is_block_adaln

    block = count_bytes(dit.blocks[0], lambda name: MAPPED if is_block_adaln(f"blocks.0.{name}") else DEVICE)
    layers = text.get_submodule(TEXT_LAYERS)
    layer = count_bytes(layers[0], lambda name: DEVICE)
    return block[DEVICE] / GIB, len(dit.blocks), layer[DEVICE] / GIB, len(layers)


def tiny_budget(profile: Profile, task_type: str = TaskType.FL2VA, shared: bool = False) -> Budget:
    """The budget of the built-in tiny model under `profile` (built on the CPU to be counted: it is small), for a
    placement asked of it (`pipeline.placement`: H3_OFFLOAD, H3_DEVICE_MEMORY_GIB)."""
    from h3serve.model.tiny import tiny_components
    from h3serve.pipeline.rules import TINY_RULES

    components = tiny_components(device="cpu", dtype=profile.torch_dtype, task_type=task_type)
    return loaded_budget(components, profile, TINY_RULES, shared, built_elsewhere=True)


def _epilogue(profile: Profile) -> str | None:
    """The execution mode when the DiT's block linears run the EPILOGUE scaling (chosen: `accel.fp8_check.resolve`;
    auto, not yet self-tested, is planned as ROWWISE), else None."""
    from h3serve.accel.profile import Fp8Scaling, Linear

    if profile.linear != Linear.CUTLASS or profile.fp8_scaling != Fp8Scaling.EPILOGUE:
        return None
    return str(profile.execution)


def loaded_budget(
    components: Components, profile: Profile, rules: RequestRules, shared: bool = False, built_elsewhere: bool = False
) -> Budget:
    """The same budget, counted from the loaded tensors: a tensor off the profile's device type waits in host memory,
    unless the plan left it mapped. `built_elsewhere`: the components were built off the profile's device only to be
    counted (`tiny_budget`), so every tensor counts where the plan puts it."""
    from h3serve.accel.apply import load_plan

    plan = load_plan(profile)
    kind = profile.torch_device.type

    def where(module: nn.Module, dit: bool) -> Callable[[str], str]:
        tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(
            module.named_buffers(remove_duplicate=False)
        )

        def place(name: str) -> str:
            if built_elsewhere:
                return plan.where(name) if dit else DEVICE
            if dit and plan.where(name) == MAPPED:
                return MAPPED
            if tensors[name].device.type == kind:
                return DEVICE
            return HOST if dit else STREAMED  # a visiting video VAE

        return place

    sizes = {_dit_name(k): count_bytes(dit, where(dit, True)) for k, dit in components.dits.items()}
    for name in ("text_encoder", "video_vae", "audio_vae"):
        module = getattr(components, name)
        sizes[name] = count_bytes(module, where(module, False))
    tables, label = _tables(components.dit_config, profile, len(components.dits))
    parts = _parts(next(iter(components.dits.values())), components.text_encoder.model)
    epilogue = _epilogue(profile)
    return _budget(sizes, components.dit_config, rules, tables, label, not plan.off_device, shared, epilogue, parts)


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


def check_fits(
    budget: Budget, device_free: float, host_free: float, shared: bool, ranks: int = 1, planned: bool = False
) -> list[str]:
    """Why the budget does not fit the free memory (empty when it does), each with the amount missing. `ranks`:
    processes that each hold it (a render split over GPUs: one device each, all their host parts in one host). One
    pool (`shared`): the GPU's need, the host part and the process's own host memory against what both have free.
    `planned`: `device_free` is H3_DEVICE_MEMORY_GIB, the memory the plan was told to stay within, named as such."""
    problems = []
    host_need = budget.host_need * ranks
    copies = f" ({ranks} ranks x {budget.host_need:.1f})" if ranks > 1 else ""
    if shared:
        need, free = budget.pool_need() * ranks, min(device_free, host_free)
        within = f"{gib_text(free)} GiB to plan within" if planned and free == device_free else f"{free:.1f} GiB free"
        if need > free:
            problems.append(
                f"needs {need:.1f} GiB of the shared memory (GPU {budget.device_need * ranks:.1f} + host "
                f"{host_need:.1f}{copies} + the process's own {PROCESS_HOST_GIB * ranks:.1f}; page cache not "
                f"counted), {within}: {need - free:.1f} GiB missing"
            )
        return problems
    if budget.device_need > device_free:
        within = f"{gib_text(device_free)} GiB to plan within" if planned else f"{device_free:.1f} GiB free"
        problems.append(
            f"needs {budget.device_need:.1f} GiB on the device, {within}: "
            f"{budget.device_need - device_free:.1f} GiB missing"
        )
    if host_need > host_free:
        problems.append(
            f"needs {host_need:.1f} GiB of host memory{copies}, {host_free:.1f} GiB available: "
            f"{host_need - host_free:.1f} GiB missing"
        )
    return problems


def gib_text(value: float) -> str:
    """GiB as a message writes an amount the operator gave: 0.1 precision, and a smaller one as given (0.0001, never
    0.0)."""
    return f"{value:.1f}" if value >= 0.1 or value == 0 else f"{value:.2g}"


# A change of setting saving less than this is not named as what makes a plan smaller (the table's 0.1 GiB).
WORTH_NAMING_GIB = 0.05


def smaller_settings(budget: Budget, profile: Profile, offload: str, *, folder: bool, planned: float | None) -> str:
    """What makes this plan smaller, naming only the settings that would change it here: not one already at its
    smallest (H3_OFFLOAD=all when every part streams), not one this device or model cannot take (FP8 off CUDA,
    mapped AdaLN weights without a checkpoint), not one that saves nothing worth naming. `offload`: the offload the
    plan ran with; `folder`: a checkpoint (not the built-in tiny model); `planned`: H3_DEVICE_MEMORY_GIB, if set."""
    from h3serve.accel.profile import AdalnWeights, Linear, Offload, TextLinear

    st = budget.streamable
    named: list[str] = []
    one_pool = budget.shared and profile.cuda  # an integrated GPU streams nothing; the CPU streams when told to
    # Only from none: auto streams, on CUDA, as much as all would where it must (the CPU's auto streams nothing).
    if st is not None and offload == Offload.NONE and Linear(profile.linear).streams and not one_pool:
        streamed = st.dit_blocks * st.dit_block + st.text_layers * st.text_layer + st.video_vae
        if streamed >= WORTH_NAMING_GIB:
            choice = "auto" if profile.cuda else "all"
            named.append(f"H3_OFFLOAD={choice} (up to {streamed:.1f} GiB of weights streamed from host memory)")
    if st is not None and profile.cuda:
        if profile.linear == Linear.BF16 and st.dit_blocks * st.dit_block / 2 >= WORTH_NAMING_GIB:
            named.append("H3_LINEAR_BACKEND=CUTLASS (FP8)")
        if profile.text_linear == TextLinear.BF16 and st.text_layers * st.text_layer / 2 >= WORTH_NAMING_GIB:
            named.append("H3_TEXT_ENCODER_LINEAR=CUTLASS (FP8)")
    if folder and profile.adaln_weights != AdalnWeights.MAPPED:
        named.append("H3_ADALN_WEIGHTS=mapped")
    tables = sum(v for k, v in (*budget.device.items(), *budget.host.items()) if k.startswith("adaln_tables"))
    kept = profile.adaln_tables_kept
    if kept > 1 and tables * (kept - 1) / kept >= WORTH_NAMING_GIB:
        named.append(f"a smaller H3_ADALN_TABLES_KEPT (now {kept}: {tables / kept:.1f} GiB each)")
    if planned is not None:
        named.append(f"a larger H3_DEVICE_MEMORY_GIB (now {gib_text(planned)}; at most what is free)")
    if not named:
        return "(no setting makes this plan smaller here: it needs more free memory, or another device)"
    return f"(what makes it smaller: {', '.join(named)})"
