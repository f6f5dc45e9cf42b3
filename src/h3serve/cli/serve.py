"""`h3serve serve`, `check` and `ready`: the service, its start-up checks without loading anything, and its
healthcheck."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from h3serve.cli.common import EXIT_ERROR, CliError, decimal_arg, read_settings, refusals
from h3serve.cli.signals import import_held


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from h3serve.settings import add_flags

    # allow_abbrev off: a prefix such as --api-key must not silently become --api-key-file (the key has no flag).
    p = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="run the HTTP service (vLLM-Omni/OpenAI video API)",
        description="Serve the video API. Every setting is a flag, an H3_* environment variable or a --config key "
        "(flags win over the environment, which wins over the file). Without --model the built-in tiny model is "
        "served. Settings, the model folder and the port are checked first, then the weights load, then the port "
        "opens: /health answers from then on and reports ready once the startup warmup render has passed.",
    )
    add_flags(p)
    p.set_defaults(func=cmd_serve)
    c = sub.add_parser(
        "check",
        allow_abbrev=False,
        help="validate the service settings (and the model folder) without loading weights; the hardware is "
        "checked with --preflight",
        description="Resolve the settings as `serve` would and print them (the key redacted), or print every "
        "violation and exit non-zero. Every rule between the settings is checked, the profile's included; whether "
        "this machine can run the profile (CUDA, cuDNN, FP8 tensor cores, Humming) and which device an unset "
        "H3_DEVICE becomes are checked with --preflight, as `serve` and `render` check them. Without --preflight no "
        "GPU is touched and torch is not imported (with --model, reading the model folder imports it).",
    )
    add_flags(c)
    c.add_argument(
        "--preflight",
        action="store_true",
        help="also check the host as `serve` will: the profile against this machine (CUDA, cuDNN, FP8 tensor cores, "
        "Humming), the model folder's shards, the output folder, the port, and the memory the profile needs against "
        "what is free (printed as a budget table)",
    )
    c.set_defaults(func=cmd_check)
    r = sub.add_parser(
        "ready",
        allow_abbrev=False,
        help="exit 0 if the server these settings describe reports ready (a container healthcheck)",
        description="Read the settings as `serve` does, ask http://<bind host>:<port>/ready (with the key when one "
        "is set; a wildcard bind is asked on loopback) and exit 0 only if it answers 200. Prints the answer.",
    )
    add_flags(r)
    r.add_argument("--timeout", type=decimal_arg, default=5.0, help="seconds to wait for the answer (5)")
    r.set_defaults(func=cmd_ready)


def cmd_check(args: argparse.Namespace) -> int:
    from h3serve import startup

    # The hardware (which initialises CUDA, and takes seconds to import torch for) only with --preflight.
    settings = read_settings(args, check_profile=args.preflight)
    with refusals():
        plan = startup.plan(settings, settings.task_type)
        print(json.dumps(settings.resolved(resolve_device=args.preflight), indent=2))
        for adapter in plan.adapters:
            print(f"adapter: {adapter.describe()}", file=sys.stderr)
        if not args.preflight:
            print("h3serve: settings ok (the hardware is checked with --preflight)", file=sys.stderr)
            return 0
        from h3serve.service.folders import check_service

        plan = startup.preflight(plan, say=print)
        if settings.node_rank == 0:  # another node serves nothing: its ranks only
            check_service(settings)
    budget = plan.budget
    if budget is None:  # the tiny model at its defaults: serve plans nothing for it; check shows what it would hold
        try:
            budget, placement = startup.check_memory(settings, None, profile=plan.profile, task_type=plan.task_type,
                                                     library=plan.library)  # fmt: skip
            print(f"placement: {placement.describe()}")
        except startup.StartupError as err:  # not a refusal: serve does not plan it, so does not refuse it either
            print(f"note: the built-in tiny model's memory plan: {err}")
    if budget is not None:
        print(budget.table())
        if settings.nnodes > 1:
            print(f"(this node's share: {settings.num_gpus} of the {settings.ranks} ranks, each holding this)")
        if settings.num_gpus > 1:
            print(f"(per GPU: each of the {settings.num_gpus} ranks holds this, checked against each GPU's free "
                  f"memory; the host holds {settings.num_gpus} copies of the host part)")  # fmt: skip
    checked = "settings, profile on this machine, FP8 GEMM, model folder, output folder, job store, port, memory"
    if settings.node_rank > 0:
        checked = "settings, profile on this machine, FP8 GEMM, model folder, memory (node 0 serves)"
    elif settings.nnodes > 1:
        checked += ", rendezvous address"
    print(f"h3serve: preflight ok ({checked})", file=sys.stderr)
    return 0


def cmd_ready(args: argparse.Namespace) -> int:
    import httpx

    settings = read_settings(args, check_profile=False)  # a healthcheck every 30 s must not initialise CUDA
    host = settings.bind_host
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    url = f"http://{f'[{host}]' if ':' in host else host}:{settings.api_port}/ready"
    headers = {"Authorization": f"Bearer {settings.key}"} if settings.key else {}
    try:
        answer = httpx.get(url, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as err:
        raise CliError(f"{url}: no answer ({type(err).__name__}: {err})") from err
    print(f"{url}: {answer.status_code} {answer.text.strip()[:200]}")
    return 0 if answer.status_code == 200 else EXIT_ERROR


def cmd_serve(args: argparse.Namespace) -> int:
    import_held("uvicorn", "h3serve.service.app")
    from h3serve import startup
    from h3serve.errors import SettingError
    from h3serve.service.folders import check_service
    from h3serve.service.store import SERVER, FolderBusy, FolderLock

    logging.getLogger("h3serve").setLevel(logging.INFO)
    log = logging.getLogger("h3serve.serve")
    # Everything is checked before any weight loads: settings, the model folder, adapters, the output folder, the
    # port, the FP8 GEMM and the memory plan (the seed's free-memory gate: a start that cannot fit stops here).
    settings = read_settings(args)
    log.info("settings: %s", json.dumps(settings.resolved(), sort_keys=True))
    if settings.node_rank > 0:
        return _serve_node(settings, log)
    with refusals():
        plan = startup.plan(settings, settings.task_type)
        plan = startup.preflight(plan, say=log.info)
        check_service(settings)
    # The output folder is this server's from here on, before any weight loads: of two servers started on one folder
    # at the same instant (both past the preflight's look at the lock), the second is refused now, not after its load.
    try:
        folder_lock = FolderLock(settings.output_dir, SERVER)
    except FolderBusy as err:
        raise CliError(str(SettingError("output_dir", str(err)))) from err
    try:
        return _serve(settings, plan, folder_lock, log)
    finally:
        folder_lock.release()


def _serve(settings, plan, folder_lock, log: logging.Logger) -> int:
    """The service, once the start's checks have passed and the output folder is held: load, then serve."""
    import uvicorn

    from h3serve import startup
    from h3serve.service.app import create_app
    from h3serve.service.http import head_deadline_protocol
    from h3serve.service.page import WebPage

    if plan.budget is not None:
        log.info("memory budget before load:\n%s", plan.budget.table())
    for adapter in plan.adapters:
        log.info("adapter: %s", adapter.describe())
    page = WebPage.load()  # the page's packaged files, read before any weight loads: an install without them stops here
    start = time.perf_counter()
    with refusals():
        engine = startup.launch(plan)
    try:
        gpus = f" on {engine.num_gpus} GPUs" if engine.num_gpus > 1 else ""
        log.info("model %s loaded%s in %.1f s", settings.model_id, gpus, time.perf_counter() - start)
        if plan.adapters:
            log.info(
                "adapters merged in %.2f s; default sampler: %s",
                engine.merge_seconds,
                engine.admission.sampler.describe(),
            )
        log.info("memory held after load:\n%s", engine.memory_budget().table())
        app = create_app(settings, engine, page, folder_lock=folder_lock)
        uvicorn.run(
            app,
            host=settings.bind_host,
            port=settings.api_port,
            log_level="info",
            timeout_graceful_shutdown=30,
            # A request's head must arrive within H3_BODY_TIMEOUT too: uvicorn has no such deadline (service/http.py).
            http=head_deadline_protocol(settings.body_timeout),
        )
    finally:
        engine.close()
    return 0


def _serve_node(settings, log: logging.Logger) -> int:
    """Node K > 0 of several hosts: its ranks only, no HTTP service (node 0 serves). The same checks before any weight
    loads (settings, the model folder, the profile, the memory for its share); then it joins node 0, runs its ranks
    for every start of the group and joins again whenever node 0 is lost, until SIGTERM or Ctrl-C."""
    import threading

    from h3serve import startup
    from h3serve.cli.signals import sigterm_raises

    log.info("node %d of %d: this node runs ranks only; the service settings (port, key, output folder) are node 0's",
             settings.node_rank, settings.nnodes)  # fmt: skip
    stopping = threading.Event()
    with refusals():
        plan = startup.plan(settings, settings.task_type)
        plan = startup.preflight(plan, say=log.info)
        with sigterm_raises():
            try:
                startup.join(plan, stopping)
            finally:
                stopping.set()
    return 0
