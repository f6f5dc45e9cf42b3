"""What `serve` and `check --preflight` check of the host before any weight loads: the model folder, the output folder,
the port, and the profile's memory budget against the free memory. Each refusal is a PreflightError: one line naming
the setting and what is wrong."""

from __future__ import annotations

import os
from pathlib import Path


class PreflightError(ValueError):
    """A host check that failed; the message names the setting (its environment name and flag)."""


def check_model(settings):
    if settings.model is None:
        if settings.qkv_layout is not None:
            raise PreflightError(
                "H3_QKV_LAYOUT (--qkv-layout) applies to a model whose DiT is a single file; none is set"
            )
        return None
    from h3serve.checkpoint.folder import resolve_model_folder  # imports torch: only when there is a folder to read

    try:
        folder = resolve_model_folder(settings.model, qkv_layout=settings.qkv_layout)
    except (ValueError, OSError) as err:
        raise PreflightError(f"H3_MODEL (--model) {settings.model}: {err}") from err
    try:
        folder.check_task_type(settings.task_type)
    except ValueError as err:
        raise PreflightError(f"H3_TASK_TYPE (--task-type) {settings.task_type}: {err}") from err
    return folder


def check_output_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PreflightError(f"H3_OUTPUT_DIR (--output-dir) {path}: cannot create it ({err})") from err
    if not os.access(path, os.W_OK | os.X_OK):
        raise PreflightError(f"H3_OUTPUT_DIR (--output-dir) {path}: not writable")


def check_port(host: str, port: int) -> None:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As uvicorn binds: with SO_REUSEADDR, a port whose old connections linger in TIME_WAIT or FIN_WAIT (a server
        # killed while clients were connected) is free to listen on again; a port someone listens on is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise PreflightError(
                f"H3_BIND_HOST/H3_API_PORT {host}:{port}: cannot listen there ({err.strerror})"
            ) from err


def check_memory(settings, folder, free: tuple[float, float, bool] | list | None = None, profile=None):
    """The profile's memory budget for `folder` against the free memory (`free`: device GiB, host GiB, shared, or one
    such tuple per GPU; read from the machine when None). With H3_NUM_GPUS > 1 on CUDA every GPU must hold the whole
    budget (each rank loads the whole model; the activations are counted whole, an upper bound) and the host every
    rank's host part. `profile`: the one that will run (the FP8 self-test's choice made: `check_fp8`); None: the
    settings'. Returns the budget; raises PreflightError naming what does not fit, and where."""
    import torch

    from h3serve.pipeline.budget import check_fits, free_memory, plan_budget
    from h3serve.pipeline.rules import RELEASED_RULES

    profile = settings.profile() if profile is None else profile
    gpus = settings.num_gpus if profile.cuda else 1
    frees = free if isinstance(free, list) else [free] * gpus
    devices = [torch.device("cuda", rank) if gpus > 1 else profile.torch_device for rank in range(gpus)]
    frees = [given or free_memory(device) for given, device in zip(frees[:gpus], devices, strict=True)]
    shared = any(one_pool for _, _, one_pool in frees)
    budget = plan_budget(folder, profile, RELEASED_RULES, task_type=settings.task_type, shared=shared)
    problems = []
    for rank, (device_free, host_free, shared) in enumerate(frees):
        where = f"cuda:{rank}: " if gpus > 1 else ""
        for problem in check_fits(budget, device_free, host_free, shared, ranks=gpus):
            problem = problem if "host memory" in problem else where + problem  # one host for every rank
            if problem not in problems:
                problems.append(problem)
    if problems:
        raise PreflightError(
            f"not enough memory for profile {profile.linear}/{profile.text_linear} on {profile.device}: "
            + "; ".join(problems)
            + f"\n{budget.table()}\n(what makes it smaller: H3_LINEAR_BACKEND=CUTLASS, H3_TEXT_ENCODER_LINEAR=CUTLASS "
            "(FP8), H3_ADALN_WEIGHTS=mapped, a smaller H3_ADALN_TABLES_KEPT)"
        )
    return budget


def check_fp8(profile):
    """The profile with its FP8 GEMM scaling chosen by the start-up self-test on its device (`accel.fp8_check`), and
    the test's line for the log (None when no CUTLASS linear runs on CUDA); PreflightError when none computes
    correctly. Nothing is loaded: the test makes its own operands."""
    from h3serve.accel.fp8_check import resolve
    from h3serve.accel.profile import ProfileError
    from h3serve.settings import SETTING_OF, refusal

    try:
        chosen, result = resolve(profile)
    except ProfileError as err:
        raise PreflightError(str(refusal(SETTING_OF.get(err.setting, "linear_backend"), str(err)))) from err
    return chosen, None if result is None else result.describe()
