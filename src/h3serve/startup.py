"""One start-up path for every command that builds, or checks it could build, an engine: `check`, `check
--preflight`, `serve` and `render`.

    plan(settings, task_type)          the model folder, the adapters, the split's heads: from files, no hardware
    preflight(plan, say)               this machine: the FP8 GEMM's and the attention's self-tests choose the
                                       profile; the rendezvous address (several nodes), the memory plan
    launch(plan)                       the engine: one process, or a worker per GPU

A service checks its own folders, job store and port after the preflight (`service.folders.check_service`).

Each step refuses with a SettingError naming its setting (`h3serve.errors`), so a setting is refused the same way,
in the same words, by every command, before any weight loads. The settings themselves (values, rules between them,
the profile against the hardware) are `settings.load_settings`'s, which runs first. What is not one setting's fault
(the memory plan not fitting) is a StartupError.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from h3serve.accel.profile import Linear, Offload
from h3serve.config import TINY_DIT, DiTConfig
from h3serve.errors import SettingError, shown_path
from h3serve.parallel.plan import check_heads
from h3serve.settings import SETTING_OF, EngineSettings, Settings

if TYPE_CHECKING:
    from h3serve.accel.profile import Profile
    from h3serve.checkpoint.folder import ModelFolder
    from h3serve.parallel.nodes import NodePlan
    from h3serve.pipeline.admission import Admission
    from h3serve.pipeline.budget import Budget
    from h3serve.pipeline.engine import RenderEngine
    from h3serve.pipeline.placement import Placement


class StartupError(ValueError):
    """A start refused for a reason that is no single setting's (the memory plan does not fit this machine)."""


@dataclass(frozen=True)
class LaunchPlan:
    """What a start will load and how, checked before any weight loads. `profile` and `budget` are set by
    `preflight` (None before: the machine was not asked)."""

    settings: EngineSettings
    task_type: str  # which DiTs load: fl2va, ref2va or both (a render's: its task's DiT)
    folder: ModelFolder | None  # None: the built-in tiny model
    adapters: tuple = ()  # checkpoint adapters, read and checked against the DiT; nothing merged yet
    library: Any = None  # the run-time adapters (`checkpoint.adapters.library.AdapterLibrary`), read and checked
    profile: Profile | None = None  # the profile that will run: the FP8 scaling and the attention chosen
    budget: Budget | None = None  # the memory plan (a model folder, or the tiny model with a placement asked for)
    placement: Placement | None = None  # where each part lives (`pipeline.placement`); None: all resident
    notes: tuple[str, ...] = ()  # what the checks found worth saying (the self-tests' lines)

    @property
    def dit_config(self) -> DiTConfig:
        return self.folder.dit if self.folder is not None else TINY_DIT

    @functools.cached_property
    def admission(self) -> Admission:
        """What the engine will accept (`pipeline.admission`): the same object the loaded engine builds, so that
        `render` refuses a request before any weight loads exactly as the engine would after."""
        from h3serve.checkpoint.adapters.library import Catalog
        from h3serve.pipeline.admission import Admission
        from h3serve.pipeline.rules import RELEASED_RULES, TINY_RULES

        rules = TINY_RULES if self.folder is None else RELEASED_RULES
        step_cache = self.settings.cache_backend != "none"
        max_rows = self.placement.max_rows if self.placement is not None else None
        ranks = self.settings.ranks
        catalog = self.library.catalog if self.library is not None else Catalog()
        return Admission.build(self.task_type, rules, self.dit_config, step_cache, self.adapters, max_rows, ranks,
                               catalog)  # fmt: skip


def plan(settings: EngineSettings, task_type: str) -> LaunchPlan:
    """The model folder (every config read, every weight header opened), the adapters (recognised and checked
    against the DiT), and the split's heads. No weights, no hardware; torch only when there is a folder or an
    adapter to read (so `check` without --preflight stays quick)."""
    folder = model_folder(settings, task_type)
    adapters = read_adapters(settings, folder, task_type)
    library = read_library(settings, folder, task_type)
    config = folder.dit if folder is not None else TINY_DIT
    check_heads(config, settings.num_gpus, settings.nnodes)
    return LaunchPlan(settings, task_type, folder, adapters, library)


def preflight(launch_plan: LaunchPlan, *, say: Callable[[str], None]) -> LaunchPlan:
    """The plan on this machine: the kernel caches set up, the FP8 GEMM's scaling chosen by its self-test, node 0's
    rendezvous address, then the memory plan against what is free (a model folder only). The settings were checked
    against the hardware by `load_settings(check_profile=True)`. `say`: where the self-test's line goes. A service's
    own folders, job store and port are the service's check (`service.folders.check_service`), which runs after."""
    settings = launch_plan.settings
    if settings.cache_dir is not None:  # before the self-test, which may compile kernels
        from h3serve.accel.caches import use_cache_dir

        say(f"kernel caches: {use_cache_dir(settings.cache_dir)}")
    profile, fp8_line = check_fp8(settings.profile())
    profile, attention_line = check_attention(profile, launch_plan.dit_config)
    notes = tuple(line for line in (fp8_line, attention_line) if line is not None)
    for note in notes:
        say(note)
    if settings.nnodes > 1:
        say(node_plan(launch_plan, profile).rendezvous_line())
        if settings.node_rank == 0:
            check_rendezvous(settings)
    budget, placement = None, None
    tiny_default = settings.offload == Offload.AUTO and settings.device_memory_gib is None
    if launch_plan.folder is not None or not tiny_default:  # the tiny model needs no plan unless one is asked for
        budget, placement = check_memory(settings, launch_plan.folder, profile=profile, task_type=launch_plan.task_type,
                                         library=launch_plan.library)  # fmt: skip
        say(f"placement: {placement.describe()}")
    return dataclasses.replace(launch_plan, profile=profile, budget=budget, placement=placement, notes=notes)


def launch(launch_plan: LaunchPlan) -> RenderEngine:
    """The engine of a preflighted plan: one process, or H3_NUM_GPUS workers. What a worker could not load is the
    model's setting's fault (or an adapter's); the rest is the GPUs'."""
    if launch_plan.profile is None:
        raise ValueError("launch needs a preflighted plan (startup.preflight): the machine was not asked")
    from h3serve.parallel.nodes import NodeMissing
    from h3serve.parallel.workers import WorkerError, load_engine
    from h3serve.pipeline.context import NodeLost
    from h3serve.pipeline.placement import RESIDENT

    settings = launch_plan.settings
    nodes = node_plan(launch_plan, launch_plan.profile) if settings.nnodes > 1 else None
    try:
        return load_engine(
            launch_plan.folder,
            launch_plan.profile,
            task_type=launch_plan.task_type,
            step_cache=settings.step_cache(),
            adapters=launch_plan.adapters,
            library=launch_plan.library,
            num_gpus=settings.num_gpus,
            placement=launch_plan.placement or RESIDENT,
            nodes=nodes,
        )
    except (NodeMissing, NodeLost) as err:
        raise SettingError("nnodes", f"{settings.nnodes}: {err}") from err
    except WorkerError as err:
        if err.input_error:
            raise SettingError("model", f"{shown_path(settings.model)}: {err}") from err
        raise SettingError("num_gpus", f"{settings.num_gpus}: {err}") from err
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError and names the file and key
        raise SettingError("model", f"{shown_path(settings.model)}: {err}") from err


def node_plan(launch_plan: LaunchPlan, profile: Profile) -> NodePlan:
    """This node's place among H3_NNODES nodes, and what it runs (compared with the other nodes at the handshake)."""
    from h3serve.parallel.nodes import NodePlan, identity
    from h3serve.parallel.plan import split_address

    s = launch_plan.settings
    host, port = split_address(s.dist_init_addr or "")
    key = s.node_secret
    assert key is not None  # the settings' rule: required with several nodes
    what = identity(launch_plan.folder, profile, launch_plan.task_type, s.step_cache(), launch_plan.adapters,
                    s.num_gpus, launch_plan.library)  # fmt: skip
    return NodePlan(s.nnodes, s.node_rank, host, port, s.num_gpus, float(s.node_timeout), float(s.node_grace), what,
                    key)  # fmt: skip


def join(launch_plan: LaunchPlan, stopping: threading.Event) -> None:
    """Node K > 0: join node 0 and run this node's ranks for every start of the group until `stopping` is set.
    SettingError("node_key") / ("nnodes") when node 0 refuses this node or never answers."""
    if launch_plan.profile is None:
        raise ValueError("join needs a preflighted plan (startup.preflight): the machine was not asked")
    from h3serve.parallel.nodes import NodeMissing, NodeRefused, join_node
    from h3serve.parallel.workers import NodeRanks, WorkerSpec
    from h3serve.pipeline.placement import RESIDENT

    s = launch_plan.settings
    plan = node_plan(launch_plan, launch_plan.profile)
    spec = WorkerSpec(launch_plan.folder, launch_plan.profile, s.num_gpus, launch_plan.task_type, s.step_cache(),
                      launch_plan.adapters, placement=launch_plan.placement or RESIDENT, nnodes=s.nnodes,
                      declaration=s.adapter_declaration())  # fmt: skip
    try:
        join_node(plan, lambda store, generation: NodeRanks(spec, s.node_rank, store), stopping)
    except NodeRefused as err:
        # The setting node 0 named (the key for a failed proof, the model for a node that runs something else).
        what = f"{s.node_rank}: refused" if err.setting == "node_rank" else "refused"
        raise SettingError(err.setting, f"{what}: {err.reason}") from err
    except NodeMissing as err:
        raise SettingError("dist_init_addr", str(err)) from err


# ---- the checks, each one setting's -----------------------------------------------------------------------------
def model_folder(settings: EngineSettings, task_type: str) -> ModelFolder | None:
    """The released checkpoint folder, resolved and checked for the DiTs `task_type` loads; None for the tiny model
    (where a QKV layout, which only a single-file DiT needs, is refused)."""
    if settings.model is None:
        if settings.qkv_layout is not None:
            raise SettingError(
                "qkv_layout", "applies to a model whose DiT is a single file; the built-in tiny model has none"
            )
        return None
    from h3serve.checkpoint.folder import resolve_model_folder  # imports torch: only when there is a folder to read

    try:
        folder = resolve_model_folder(settings.model, qkv_layout=settings.qkv_layout)
    except (ValueError, OSError) as err:
        raise SettingError("model", f"{shown_path(settings.model)}: {err}") from err
    try:
        folder.check_task_type(task_type)
    except ValueError as err:
        setting = "task_type" if isinstance(settings, Settings) else "model"  # render's task picks its DiT
        raise SettingError(setting, f"{getattr(settings, setting)}: {err}") from err
    return folder


def read_adapters(settings: EngineSettings, folder: ModelFolder | None, task_type: str) -> tuple:
    """The H3_LORA adapter files, each recognised and checked against the DiT's config and the DiTs that load
    (headers and factors only; nothing merges yet)."""
    files = settings.adapter_files()
    if not files:
        return ()
    from h3serve.checkpoint.adapters import AdapterError, read_adapter
    from h3serve.pipeline.admission import check_adapter_kinds

    config = folder.dit if folder is not None else TINY_DIT
    try:
        adapters = tuple(read_adapter(path, scale, config=config) for path, scale in files)
    except (AdapterError, OSError) as err:
        raise SettingError("lora", str(err)) from err
    check_adapter_kinds(adapters, task_type)  # SettingError("lora") itself
    return adapters


def read_library(settings: EngineSettings, folder: ModelFolder | None, task_type: str):
    """The H3_ADAPTERS library: every declared file read and checked against the DiT (`AdapterLibrary`), held in
    host memory (page-locked where the engine runs on a GPU) within H3_ADAPTER_CACHE_GIB; None when none are
    declared."""
    declaration = settings.adapter_declaration()
    if declaration is None:
        return None
    from h3serve.checkpoint.adapters import AdapterError
    from h3serve.pipeline.admission import check_declared_kinds

    config = folder.dit if folder is not None else TINY_DIT
    try:
        library = declaration.open(config, pin=settings.profile().cuda)
    except (AdapterError, OSError) as err:
        raise SettingError("adapters", str(err)) from err
    except ValueError as err:  # larger than the cache
        raise SettingError("adapter_cache_gib", str(err)) from err
    check_declared_kinds(library.catalog, task_type)  # SettingError("adapters") itself
    return library


def with_adapters(budget: Budget, library: Any, config: DiTConfig, profile: Profile, task_type: str) -> Budget:
    """`budget` with the run-time adapters counted: each loaded DiT's device buffers (`accel.lora`), and the host
    cache's factors (page-locked where the engine runs on a GPU: the kernel cannot evict them)."""
    from h3serve.checkpoint.adapters.formats import Names
    from h3serve.checkpoint.adapters.library import buffer_bytes
    from h3serve.vocab import TASK_TYPES

    element = profile.torch_dtype.itemsize
    fp8 = profile.linear == Linear.CUTLASS  # Fp8Linear bases: the down factor's FP8 copy too (accel.lora)
    buffers = buffer_bytes(library.catalog, Names.of(config).shapes, element, fp8) * len(TASK_TYPES[task_type])
    cache = min(library.cache_bytes, sum(e.nbytes for e in library.catalog.entries.values()))
    device = {**budget.device, "adapter buffers": buffers / 2**30}
    host = {**budget.host, "adapter cache": cache / 2**30} if profile.cuda else budget.host
    return dataclasses.replace(budget, device=device, host=host)


def check_fp8(profile: Profile) -> tuple[Profile, str | None]:
    """The profile with its FP8 GEMM scaling chosen by the start-up self-test on its device (`accel.fp8_check`), and
    the test's line (None when no CUTLASS linear runs on CUDA). Nothing is loaded: the test makes its own operands."""
    from h3serve.accel.fp8_check import resolve
    from h3serve.accel.profile import ProfileError

    try:
        chosen, result = resolve(profile)
    except ProfileError as err:
        raise SettingError(SETTING_OF.get(err.setting, "linear_backend"), str(err)) from err
    return chosen, None if result is None else result.describe()


def check_attention(profile: Profile, config: DiTConfig) -> tuple[Profile, str | None]:
    """The profile with its attention chosen on its device (`accel.attention.resolve`: `auto` becomes FA4 or
    CUDNN_ATTN, an explicit FA4 is self-tested), and the line that says so (None when there was nothing to choose).
    After the kernel caches are set: FA4 reads its cache folder when it is imported."""
    from h3serve.accel.attention import resolve
    from h3serve.accel.profile import ProfileError

    try:
        return resolve(profile, config.attention_head_dim)
    except ProfileError as err:
        raise SettingError(SETTING_OF.get(err.setting, "diffusion_attention_backend"), str(err)) from err


def check_rendezvous(settings: EngineSettings) -> None:
    """Node 0 can listen at H3_DIST_INIT_ADDR and on the next port (the group's store)."""
    from h3serve.parallel.plan import split_address

    host, port = split_address(settings.dist_init_addr or "")
    check_port(host, port, "dist_init_addr", "node 0's rendezvous")
    check_port(host, port + 1, "dist_init_addr", f"the process group's store: PORT+1 of {host}:{port}")


def check_port(host: str, port: int, setting: str = "api_port", role: str = "") -> None:
    """SettingError(setting) unless `host:port` can be listened on now, naming the port refused and, as `role`, what
    it is for (the rendezvous's store listens on PORT+1, a port the setting does not spell)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As uvicorn binds: with SO_REUSEADDR, a port whose old connections linger in TIME_WAIT or FIN_WAIT (a server
        # killed while clients were connected) is free to listen on again; a port someone listens on is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            what = f" ({role})" if role else ""
            raise SettingError(setting, f"{host}:{port}{what}: cannot listen there ({err.strerror})") from err


def check_memory(
    settings: EngineSettings,
    folder: ModelFolder | None,
    free: tuple[float, float, bool] | list | None = None,
    profile: Profile | None = None,
    task_type: str | None = None,
    library: Any = None,
) -> tuple[Budget, Placement]:
    """The profile's memory budget for `folder` (None: the built-in tiny model) and the placement of its parts
    (`pipeline.placement`: H3_OFFLOAD within H3_DEVICE_MEMORY_GIB or the free device memory) against the free memory
    (`free`: device GiB, host GiB, shared, or one such tuple per GPU; read from the machine when None). With
    H3_NUM_GPUS > 1 on CUDA every GPU must hold its placement (each rank loads the whole model; the activations are
    counted whole, an upper bound) and the host every rank's host part. `profile`: the one that will run (the FP8
    self-test's choice made); None: the settings'. `task_type`: the DiTs that load (None: the settings').
    `library`: the run-time adapters (their device buffers per DiT, their page-locked host cache). Returns
    both; StartupError naming what does not fit, and where, or SettingError("device_memory_gib") where what is free
    would hold it and H3_DEVICE_MEMORY_GIB does not."""
    import torch

    from h3serve.pipeline.budget import free_memory, plan_budget, smaller_settings, tiny_budget
    from h3serve.pipeline.placement import PlacementError, place
    from h3serve.pipeline.rules import RELEASED_RULES

    profile = settings.profile() if profile is None else profile
    task_type = task_type or getattr(settings, "task_type", "fl2va")
    gpus = settings.num_gpus if profile.cuda else 1
    frees = free if isinstance(free, list) else [free] * gpus
    devices = [torch.device("cuda", rank) if gpus > 1 else profile.torch_device for rank in range(gpus)]
    frees = [given or free_memory(device) for given, device in zip(frees[:gpus], devices, strict=True)]
    shared = any(one_pool for _, _, one_pool in frees)
    if folder is None:
        budget = tiny_budget(profile, task_type, shared=shared)
    else:
        budget = plan_budget(folder, profile, RELEASED_RULES, task_type=task_type, shared=shared)
    if library is not None:
        budget = with_adapters(budget, library, folder.dit if folder is not None else TINY_DIT, profile, task_type)
    planned = settings.device_memory_gib
    device_free = min(device for device, _, _ in frees)
    if planned is not None and planned > device_free:
        raise SettingError(
            "device_memory_gib",
            f"{planned:g} GiB is more than the {device_free:.1f} GiB free on {profile.device}"
            + (" (the least free of its GPUs)" if gpus > 1 else ""),
        )
    offload = settings.offload.planned(profile.linear, profile.cuda)
    hint = smaller_settings(budget, profile, offload, folder=folder is not None, planned=planned)
    try:
        one_pool = shared and profile.cuda  # an integrated GPU; the CPU streams when told to (the tests' path)
        pool = min(device_free, min(host for _, host, _ in frees)) if one_pool else device_free
        placement = place(budget, pool if planned is None else planned, offload, one_pool=one_pool)
    except PlacementError as err:
        least = min(range(gpus), key=lambda rank: frees[rank][0])
        where = f"cuda:{least}: " if gpus > 1 and planned is None else ""
        message = f"not enough memory for profile {profile.linear}/{profile.text_linear} on {profile.device}: "
        message += f"{where}{err}\n{budget.table()}\n{hint}"
        if planned is not None and _places(budget, pool, offload, one_pool):  # the free memory holds it: the setting
            raise SettingError("device_memory_gib", message) from None
        raise StartupError(message) from None
    problems, setting_short = [], False  # short: the plan fits what is free, not H3_DEVICE_MEMORY_GIB
    if not placement.streams and placement.max_rows is None:  # a limited one was planned against the pool
        problems, setting_short = _resident_problems(budget, frees, planned)
    elif placement.streams:
        problems = _pinned_problems(budget, placement, min(host for _, host, _ in frees), gpus)
    if problems:
        message = f"not enough memory for profile {profile.linear}/{profile.text_linear} on {profile.device}: "
        message += "; ".join(problems) + f"\n{budget.table()}\n{hint}"
        if setting_short:
            raise SettingError("device_memory_gib", message)
        raise StartupError(message)
    return budget, placement


def _resident_problems(budget: Budget, frees: list, planned: float | None) -> tuple[list[str], bool]:
    """What a placement with everything resident lacks on each GPU (`frees`: device GiB, host GiB, shared, per GPU;
    `planned`: H3_DEVICE_MEMORY_GIB), and whether only that setting falls short (what is free would hold it)."""
    from h3serve.pipeline.budget import check_fits

    gpus, limited, problems = len(frees), planned is not None, []
    for rank, (device_gib, host_free, one_pool) in enumerate(frees):
        where = f"cuda:{rank}: " if gpus > 1 else ""
        device_gib = device_gib if planned is None else planned
        for problem in check_fits(budget, device_gib, host_free, one_pool, ranks=gpus, planned=limited):
            problem = problem if "host memory" in problem else where + problem  # one host for every rank
            if problem not in problems:
                problems.append(problem)
    setting_short = limited and not any(check_fits(budget, d, h, pool, ranks=gpus) for d, h, pool in frees)
    return problems, setting_short


def _pinned_problems(budget: Budget, placement: Placement, host_free: float, gpus: int) -> list[str]:
    """What a streaming placement lacks of page-locked host memory: every rank pins its own copy, but rank 0 alone
    keeps the text encoder."""
    text = budget.streamable.text_layers * budget.streamable.text_layer if placement.text_streamed else 0.0
    need = (budget.host_need + placement.pinned_gib) * gpus - text * (gpus - 1)
    if need <= host_free:
        return []
    copies = f" ({gpus} ranks)" if gpus > 1 else ""
    return [
        f"the placement ({placement.describe()}) needs {need:.1f} GiB of page-locked host memory{copies} "
        f"({placement.pinned_gib:.1f} GiB streamed, {budget.host_need:.1f} GiB AdaLN weights and tables), "
        f"{host_free:.1f} GiB available: {need - host_free:.1f} GiB missing"
    ]


def _places(budget: Budget, device_gib: float, offload: Offload, one_pool: bool) -> bool:
    """Whether a placement of `budget` within `device_gib` exists (`pipeline.placement.place`)."""
    from h3serve.pipeline.placement import PlacementError, place

    try:
        place(budget, device_gib, offload, one_pool=one_pool)
    except PlacementError:
        return False
    return True
