"""`h3serve` command line. `render`: a prompt (and optional keyframes) to an MP4 with sound.

Everything the user gives is checked before any weight loads: the prompt, the keyframe files, the output path, the
profile and the request against the model's rules. Any failure prints one line and exits non-zero, and no partial
output file is left behind (the MP4 is written under a temporary name and renamed when complete). Ctrl-C exits 130
and, during `render`, SIGTERM exits 143, each with one line and by the same unwinding, so neither leaves one either.

The parsers and the quick commands (`--help`, `check` without --preflight, `ready`) import neither torch nor av:
each command imports what it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from h3serve import __version__
from h3serve.config import AUDIO_SHIFT, DEFAULT_STEPS, FPS, SAMPLE_RATE, VIDEO_SHIFT
from h3serve.vocab import SMOKE_REQUEST, Task, dit_kind, seconds_to_frames

if TYPE_CHECKING:
    from h3serve.accel.profile import Profile
    from h3serve.checkpoint.folder import ModelFolder
    from h3serve.pipeline.request import RenderRequest
    from h3serve.settings import EngineSettings

EXIT_ERROR = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, a shell's status for a command ended by Ctrl-C
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143


class CliError(Exception):
    """A user-facing error: printed as one line, exit status EXIT_ERROR."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread while `render` runs (`_sigterm_raises`), so that it unwinds as Ctrl-C's
    KeyboardInterrupt does and the same cleanup removes the partial output. A BaseException like KeyboardInterrupt:
    no `except Exception` on the way may take it for a failure."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """For the duration of a command, SIGTERM raises Terminated; then the previous handler is back. It raises once:
    a repeat while unwinding is ignored, so it cannot cut the cleanup short. Left alone where the process ignores
    SIGTERM (as Python leaves an ignored SIGINT) and off the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield
        return

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:  # None: a handler not set from Python, which cannot be put back; the default is the closest
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held for the body (noted, not acted on), then delivered to their own handlers as it ends.
    For the import of a native module that calls back into Python while it initialises: Triton's does, and a
    KeyboardInterrupt raised inside that callback aborts the process (exit -6, a C++ terminate) instead of
    unwinding. A signal mask would not do: torch's threads, which do not share it, take the signal. Off the main
    thread, where no handler can be set, the body runs as it is; a signal ignored or not handled from Python is left
    alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) not in (signal.SIG_IGN, None)]
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):  # Ctrl-C raises KeyboardInterrupt here, on the way out
            signal.raise_signal(sig)


def _import_held(*modules: str) -> None:
    """Import `modules` with signals held (`_signals_held`): a command's heavy imports (torch, Triton, transformers,
    PyAV) in one go, so that a Ctrl-C in their seconds ends the command after them, as one line. Landing inside
    third-party import code, a KeyboardInterrupt can abort the process (Triton's native init) or be swallowed
    and leave a half-imported module that fails later (transformers' lazy import of accelerate)."""
    import importlib

    with _signals_held():
        for name in modules:
            importlib.import_module(name)


def _render_parser(sub: argparse._SubParsersAction) -> None:
    from h3serve.settings import EngineSettings, add_flags

    p = sub.add_parser(
        "render",
        allow_abbrev=False,
        help="render a prompt (and optional first/last keyframes) to an MP4 with stereo sound",
        description="Render one video with sound. Without --model, the built-in tiny model runs (its output is "
        "noise; it exists to try the pipeline without downloading weights). The engine's settings are `serve`'s: "
        "the same flags and H3_* variables (flags win over the environment, which wins over --config).",
    )
    p.add_argument("prompt", nargs="?", help="the shooting-script prompt (or use --prompt-file)")
    p.add_argument("--prompt-file", type=Path, help="read the prompt from this UTF-8 file, verbatim")
    p.add_argument("-o", "--output", type=Path, required=True, help="the MP4 to write")
    p.add_argument("--first", type=Path, help="first keyframe image (I2VA, or FL2VA with --last)")
    p.add_argument("--last", type=Path, help="last keyframe image (L2VA, or FL2VA with --first)")
    p.add_argument(
        "--ref",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a reference image, video (with its sound) or audio file, its kind read from the content; repeat in "
        "request order (<= 9 images, 3 videos, 3 audios, 12 in all; audio never alone). Selects Ref2VA, which runs "
        "the Ref2VA DiT",
    )
    p.add_argument(
        "--mute-ref",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="leave out the soundtrack of the video given as the N-th --ref (0-based); repeatable",
    )
    p.add_argument("--width", type=int, help="canvas width, a multiple of 32 (default: from the aspect ratio)")
    p.add_argument("--height", type=int, help="canvas height, a multiple of 32 (default: from the aspect ratio)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--frames", type=int, help="frame count, snapped up to 17n+5 (default: 124, tiny: 22)")
    length.add_argument("--seconds", type=float, help=f"duration at {FPS} fps, snapped up to 17n+5 frames")
    trained = "; with --lora, the adapter's trained value"
    p.add_argument(
        "--steps",
        type=int,
        help=f"schedule grid points; N points run N-1 forwards ({DEFAULT_STEPS}{trained})",
    )
    p.add_argument("--video-shift", type=float, help=f"video schedule shift ({VIDEO_SHIFT:g}{trained})")
    p.add_argument("--audio-shift", type=float, help=f"audio schedule shift ({AUDIO_SHIFT:g}{trained})")
    p.add_argument("--seed", type=int, default=0, help="request seed: same seed, same render (0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # The engine's settings: the same flags and H3_* variables as `serve` (`settings.EngineSettings`).
    add_flags(p, EngineSettings, old_names=True)
    p.set_defaults(func=cmd_render)


def _serve_parsers(sub: argparse._SubParsersAction) -> None:
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
    r.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (5)")
    r.set_defaults(func=cmd_ready)


def _accept_parser(sub: argparse._SubParsersAction) -> None:
    smoke = SMOKE_REQUEST  # not `accept`'s names: importing it pulls httpx and av into every command's start
    p = sub.add_parser(
        "accept",
        help="two-render acceptance against a running server",
        description="Check health and model identity, render the fixed request twice through /v1/videos/sync, "
        "check each MP4, compare decoded frames byte for byte and audio by PSNR, and write a JSON report. Exit 0 "
        "only if everything holds. The key comes from H3_API_KEY or --api-key-file.",
    )
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--expect-model", help="the exact id /v1/models must list (default: exactly one model)")
    p.add_argument("--api-key-file", type=Path, help="file holding the bearer key (default: $H3_API_KEY)")
    p.add_argument("--out", type=Path, default=Path("accept"), help="folder for the MP4s and the report (accept/)")
    p.add_argument("--prompt", default=smoke.prompt, help="the prompt (the seed's smoke prompt)")
    p.add_argument("--width", type=int, default=smoke.width, help=f"canvas width ({smoke.width})")
    p.add_argument("--height", type=int, default=smoke.height, help=f"canvas height ({smoke.height})")
    p.add_argument(
        "--duration", type=float, default=smoke.seconds, help=f"seconds, as extra_params.duration ({smoke.seconds})"
    )
    p.add_argument("--steps", type=int, default=20, help="num_inference_steps (20)")
    p.add_argument("--seed", type=int, default=42, help="seed (42)")
    p.add_argument("--min-audio-psnr", type=float, default=math.inf, help="audio PSNR bound in dB (inf: identical)")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds to wait for each render (7200)")
    p.add_argument("--wait-ready", type=float, default=0.0, help="seconds to wait for the server to be ready (0)")
    p.set_defaults(func=cmd_accept)


BENCHES = (
    "dit-step", "render", "serve-accept", "warm-restart", "cuda-profile-check", "full-size-smoke", "gpu-check",
    "humming-check", "adaln-tables", "stepcache", "ref2va-smoke", "fused-passes", "text-encoder-fp8",
    "vae-decode-memory", "lora", "split", "one-box", "load", "start", "plot-scaling",
)  # fmt: skip


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a GPU benchmark script from a checkout's bench/ folder",
        description="Run bench/<NAME>.py of the repository checkout (the scripts and their fixtures are not part of "
        "the installed package), with src/ and tests/ importable. Arguments after NAME go to the script, e.g. "
        "`h3serve bench dit-step --out bench/results/dit_step.json`. Results are recorded in bench/results/.",
    )
    p.add_argument("name", choices=BENCHES, help="which benchmark")
    p.add_argument("--repo", type=Path, default=Path("."), help="the repository checkout (default: here)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    script = args.repo / "bench" / f"{args.name.replace('-', '_')}.py"
    if not script.is_file():
        raise CliError(f"{script}: not found; run `h3serve bench` from the repository checkout or give --repo")
    env = dict(os.environ)
    paths = [str((args.repo / "src").resolve()), str((args.repo / "tests").resolve())]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, str(script), *args.script_args], env=env).returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h3serve", description="MiniMax-H3 inference engine")
    parser.add_argument("--version", action="version", version=f"h3serve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _render_parser(sub)
    _serve_parsers(sub)
    _accept_parser(sub)
    _bench_parser(sub)
    return parser


def _load_settings(args: argparse.Namespace, check_profile: bool = True, engine_only: bool = False):
    from h3serve.settings import EngineSettings, Settings, SettingsError, load_settings

    try:
        schema = EngineSettings if engine_only else Settings
        return load_settings(args, check_profile=check_profile, schema=schema)
    except SettingsError as err:
        lines = "\n".join(f"  - {v}" for v in err.violations)
        raise CliError(f"{len(err.violations)} setting(s) refused:\n{lines}") from err


def _read_adapters(settings, folder) -> tuple:
    """The H3_LORA adapter files, each recognised and checked against the DiT's config (headers and factors only;
    nothing merges yet); CliError naming the file, the key and the shapes otherwise."""
    files = settings.adapter_files()
    if not files:
        return ()
    from h3serve.checkpoint.adapters import AdapterError, read_adapter
    from h3serve.model.tiny import TINY_DIT

    config = folder.dit if folder is not None else TINY_DIT
    try:
        return tuple(read_adapter(path, scale, config=config) for path, scale in files)
    except (AdapterError, OSError) as err:
        raise CliError(f"H3_LORA (--lora): {err}") from err


def _preflight(check, *args, **kwargs):
    """A `service.preflight` check, its refusal as one CLI error line."""
    from h3serve.service.preflight import PreflightError

    try:
        return check(*args, **kwargs)
    except PreflightError as err:
        raise CliError(str(err)) from err


def _fp8_profile(profile, say):
    """`profile` with the FP8 GEMM's scaling chosen by its self-test on the device (CUTLASS on CUDA;
    `service.preflight.check_fp8`), before any weight loads; the test's line goes to `say`."""
    from h3serve.service import preflight

    chosen, line = _preflight(preflight.check_fp8, profile)
    if line is not None:
        say(line)
    return chosen


def cmd_check(args: argparse.Namespace) -> int:
    import json

    from h3serve.service import preflight

    # The hardware (which initialises CUDA, and takes seconds to import torch for) only with --preflight.
    settings = _load_settings(args, check_profile=args.preflight)
    folder = _preflight(preflight.check_model, settings)
    print(json.dumps(settings.resolved(resolve_device=args.preflight), indent=2))
    for adapter in _read_adapters(settings, folder):
        print(f"adapter: {adapter.describe()}", file=sys.stderr)
    if folder is not None:  # the heads from the folder's config (the tiny model's: at render and serve)
        from h3serve.parallel.plan import check_heads

        try:
            check_heads(folder.dit, settings.num_gpus)
        except ValueError as err:
            raise CliError(str(err)) from err
    if args.preflight:
        _preflight(preflight.check_output_dir, settings.output_dir)
        _preflight(preflight.check_port, settings.bind_host, settings.api_port)
        profile = _fp8_profile(settings.profile(), print)
        if folder is not None:
            print(_preflight(preflight.check_memory, settings, folder, profile=profile).table())
            if settings.num_gpus > 1:
                print(f"(per GPU: each of the {settings.num_gpus} ranks holds this, checked against each GPU's free "
                      f"memory; the host holds {settings.num_gpus} copies of the host part)")  # fmt: skip
        checked = "settings, profile on this machine, FP8 GEMM, model folder, output folder, port, memory"
        print(f"h3serve: preflight ok ({checked})", file=sys.stderr)
        return 0
    print("h3serve: settings ok (the hardware is checked with --preflight)", file=sys.stderr)
    return 0


def cmd_ready(args: argparse.Namespace) -> int:
    import httpx

    settings = _load_settings(args, check_profile=False)  # a healthcheck every 30 s must not initialise CUDA
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
    import json

    _import_held("uvicorn", "h3serve.service.app")
    import uvicorn

    from h3serve.service import preflight
    from h3serve.service.app import create_app

    logging.getLogger("h3serve").setLevel(logging.INFO)
    log = logging.getLogger("h3serve.serve")
    # Everything is checked before any weight loads: settings, the model folder, the output folder, the port.
    settings = _load_settings(args)
    log.info("settings: %s", json.dumps(settings.resolved(), sort_keys=True))
    folder = _preflight(preflight.check_model, settings)
    if settings.cache_dir is not None:
        from h3serve.accel.caches import use_cache_dir

        log.info("kernel caches: %s", use_cache_dir(settings.cache_dir))
    _preflight(preflight.check_output_dir, settings.output_dir)
    _preflight(preflight.check_port, settings.bind_host, settings.api_port)
    profile = _fp8_profile(settings.profile(), log.info)  # which FP8 GEMM runs: the memory plan counts it
    if folder is not None:  # the seed's free-memory gate, from the configs: a start that cannot fit stops here
        budget = _preflight(preflight.check_memory, settings, folder, profile=profile)
        log.info("memory budget before load:\n%s", budget.table())
    adapters = _read_adapters(settings, folder)
    for adapter in adapters:
        log.info("adapter: %s", adapter.describe())
    from h3serve.service.page import WebPage

    page = WebPage.load()  # the page's packaged files, read before any weight loads: an install without them stops here
    start = time.perf_counter()
    engine = _load_engine(settings, folder, profile, settings.task_type, adapters)
    gpus = f" on {engine.num_gpus} GPUs" if engine.num_gpus > 1 else ""
    log.info("model %s loaded%s in %.1f s", settings.model_id, gpus, time.perf_counter() - start)
    if adapters:
        log.info(
            "adapters merged in %.2f s; default sampler: %s", engine.merge_seconds, engine.admission.sampler.describe()
        )
    log.info("memory held after load:\n%s", engine.memory_budget().table())
    app = create_app(settings, engine, page)
    try:
        uvicorn.run(
            app, host=settings.bind_host, port=settings.api_port, log_level="info", timeout_graceful_shutdown=30
        )
    finally:
        if engine.num_gpus > 1:
            engine.close()
    return 0


def cmd_accept(args: argparse.Namespace) -> int:
    from h3serve.accept import AcceptPlan, run_accept

    key = os.environ.get("H3_API_KEY") or None
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text(encoding="utf-8").strip()
        except OSError as err:
            raise CliError(f"--api-key-file {args.api_key_file}: cannot read it ({err})") from err
    plan = AcceptPlan(
        url=args.url,
        out_dir=args.out,
        key=key,
        expect_model=args.expect_model,
        prompt=args.prompt,
        width=args.width,
        height=args.height,
        duration=args.duration,
        steps=args.steps,
        seed=args.seed,
        min_audio_psnr=args.min_audio_psnr,
        timeout=args.timeout,
        wait_ready=args.wait_ready,
    )
    passed, report = run_accept(plan)
    path = plan.out_dir / "accept-report.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for check in report["checks"]:
        print(f"{'PASS' if check['passed'] else 'FAIL'}  {check['check']}: {check['detail']}", file=sys.stderr)
    for r in report["renders"]:
        print(f"render {r['index']}: HTTP {r['status']}, {r['client_seconds']} s client, engine "
              f"{r['inference_time_s']} s", file=sys.stderr)  # fmt: skip
    print(f"h3serve accept: {'PASSED' if passed else 'FAILED'} (report: {path})", file=sys.stderr)
    return 0 if passed else EXIT_ERROR


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise CliError("give the prompt either as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            return args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CliError(f"--prompt-file {args.prompt_file}: cannot read it as UTF-8 text ({err})") from err
    if args.prompt is None:
        raise CliError("a prompt is required (as an argument or with --prompt-file)")
    return args.prompt


def _read_references(args: argparse.Namespace) -> list[tuple[str, bytes]]:
    """The --ref files, read in the order given (decoded and checked with the request)."""
    if args.ref and (args.first is not None or args.last is not None):
        raise CliError("--ref selects Ref2VA, which takes references instead of keyframes; drop --first/--last")
    if args.mute_ref and not args.ref:
        raise CliError("--mute-ref applies to a video given with --ref; no --ref is given")
    files = []
    for path in args.ref:
        try:
            files.append((path.name, path.read_bytes()))
        except OSError as err:
            raise CliError(f"--ref {path}: cannot read it ({err.strerror or err})") from err
    return files


def _read_keyframes(args: argparse.Namespace) -> tuple[str, list]:
    """The task follows from which keyframes are given; each must read and decode as an image."""
    from h3serve.pipeline.request import decode_keyframe

    task = {(False, False): Task.T2VA, (True, False): Task.I2VA, (False, True): Task.L2VA, (True, True): Task.FL2VA}[
        (args.first is not None, args.last is not None)
    ]
    images = []
    for flag, path in (("--first", args.first), ("--last", args.last)):
        if path is None:
            continue
        try:
            images.append(decode_keyframe(len(images), path.read_bytes()))
        except OSError as err:
            raise CliError(f"{flag} {path}: cannot read the keyframe image ({err.strerror or err})") from err
        except ValueError as err:
            raise CliError(f"{flag} {path}: not a readable image ({err})") from err
    return task, images


def _check_output(path: Path) -> None:
    if path.suffix.lower() != ".mp4":
        raise CliError(f"--output {path}: the file name must end in .mp4")
    if path.is_dir():
        raise CliError(f"--output {path}: is a folder; give a file path")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise CliError(f"--output {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CliError(f"--output {path}: folder {folder} is not writable")


def _num_frames(args: argparse.Namespace) -> int | None:
    """The requested frame count, or None for the model's default."""
    if args.seconds is not None:
        if not (math.isfinite(args.seconds) and args.seconds > 0):
            raise CliError(f"--seconds must be a finite number > 0, got {args.seconds}")
        return seconds_to_frames(args.seconds)
    return args.frames


@dataclass(frozen=True)
class _RenderPlan:
    """Everything `render` was asked to do, checked, before any weight loads."""

    request: RenderRequest
    profile: Profile
    folder: ModelFolder | None  # None: the built-in tiny model
    settings: EngineSettings
    adapters: tuple = ()  # model.adapters.Adapter, read and checked


def _plan_render(args: argparse.Namespace) -> _RenderPlan:
    from h3serve.checkpoint.folder import resolve_model_folder
    from h3serve.media.mp4 import DEFAULT_CRF, check_settings
    from h3serve.model.tiny import TINY_DIT
    from h3serve.pipeline.admission import Admission, Sampler, check_adapter_kinds, trained_tasks
    from h3serve.pipeline.request import validate_request
    from h3serve.pipeline.rules import RELEASED_RULES, TINY_RULES

    settings = _load_settings(args, engine_only=True)  # the profile, checked against this machine
    prompt = _read_prompt(args)
    references = _read_references(args)
    task, keyframes = (Task.REF2VA, []) if references else _read_keyframes(args)
    _check_output(args.output)
    try:
        check_settings(FPS, SAMPLE_RATE, DEFAULT_CRF, settings.encoder_threads)
    except ValueError as err:
        raise CliError(f"H3_ENCODER_THREADS (--encoder-threads): {err}") from err
    tiny = settings.model is None
    if tiny and settings.qkv_layout is not None:
        raise CliError(
            "H3_QKV_LAYOUT (--qkv-layout) applies to a --model whose DiT is a single file; the built-in tiny model "
            "has none"
        )
    try:
        # Every config read and cross-checked, every weight header opened; no weights yet.
        folder = None if tiny else resolve_model_folder(settings.model, qkv_layout=settings.qkv_layout)
        if folder is not None:
            folder.check_task_type(dit_kind(task))
    except (ValueError, FileNotFoundError) as err:
        raise CliError(f"H3_MODEL (--model) {settings.model}: {err}") from err
    adapters = _read_adapters(settings, folder)
    try:
        check_adapter_kinds(adapters, dit_kind(task))
    except ValueError as err:
        raise CliError(str(err)) from err
    admission = Admission(
        tasks=tuple(Task),
        task_type=dit_kind(task),
        rules=TINY_RULES if tiny else RELEASED_RULES,
        dit_config=folder.dit if folder is not None else TINY_DIT,
        step_cache=settings.cache_backend != "none",
        sampler=Sampler.for_adapters(adapters),
        trained_tasks=trained_tasks(adapters),
    )
    try:
        admission.check_trained_task(task)
        fields = {"steps": args.steps, "video_shift": args.video_shift, "audio_shift": args.audio_shift}
        request = validate_request(
            prompt,
            task=task,
            width=args.width,
            height=args.height,
            num_frames=_num_frames(args),
            seed=args.seed,
            keyframes=keyframes,
            references=references,
            mute_references=args.mute_ref,
            rules=admission.rules,
            **admission.sampler.fill(fields),
        )
    except ValueError as err:
        raise CliError(_request_error(err, args)) from err
    return _RenderPlan(request, settings.profile(), folder, settings, adapters)


def _request_error(err: ValueError, args: argparse.Namespace) -> str:
    """A request error in the command's terms: the flag, and the file the user gave for a reference."""
    field, index = getattr(err, "field", None), getattr(err, "index", None)
    if field == "references" and index is not None:  # name the file the user gave, not our list position
        return f"--ref {args.ref[index]}: {err}"
    if field == "mute_references":
        return err.describe({"mute_references": "--mute-ref"})
    return str(err)


def _load_engine(settings, folder, profile, task_type: str, adapters):
    """The engine of these settings: one process, or H3_NUM_GPUS workers (`parallel.workers.load_engine`); what the
    split needs is checked before any weight loads."""
    from h3serve.model.tiny import TINY_DIT
    from h3serve.parallel.plan import check_split
    from h3serve.parallel.workers import WorkerError, check_visible, load_engine

    try:
        check_split(folder.dit if folder is not None else TINY_DIT, profile, settings.num_gpus)
        check_visible(profile, settings.num_gpus)
    except ValueError as err:
        raise CliError(str(err)) from err
    try:
        return load_engine(folder, profile, task_type=task_type, step_cache=settings.step_cache(), adapters=adapters,
                           num_gpus=settings.num_gpus)  # fmt: skip
    except WorkerError as err:  # what a worker could not load is the model's; the rest is the GPUs'
        setting = (
            f"H3_MODEL (--model) {settings.model}"
            if err.input_error
            else f"H3_NUM_GPUS (--num-gpus) {settings.num_gpus}"
        )
        raise CliError(f"{setting}: {err}") from err
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError and names the file and key
        raise CliError(f"H3_MODEL (--model) {settings.model}: {err}") from err


def _render(engine, request, progress: bool):
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=request.forwards, desc="denoise", unit="forward", file=sys.stderr, leave=False)

    def on_step(done: int, total: int) -> None:
        if bar is not None:
            bar.update(done - bar.n)

    try:
        return engine.render(request, on_step=on_step)
    finally:
        if bar is not None:
            bar.close()


def cmd_render(args: argparse.Namespace) -> int:
    # From the first import on: a SIGTERM anywhere in the render unwinds like Ctrl-C, through write_mp4's cleanup.
    with _sigterm_raises():
        return _run_render(args)


def _run_render(args: argparse.Namespace) -> int:
    _import_held("h3serve.pipeline.engine", "h3serve.media.mp4")
    from h3serve.media.mp4 import write_mp4
    from h3serve.pipeline.engine import STAGES

    # 1. Everything the user gave, checked before any weight loads.
    plan = _plan_render(args)
    request, settings = plan.request, plan.settings
    profile = _fp8_profile(plan.profile, lambda line: print(f"h3serve: {line}", file=sys.stderr))
    for notice in request.notices:
        print(f"note: {notice}", file=sys.stderr)
    model_name = settings.model if plan.folder else "built-in tiny model (random weights: the output is noise)"
    for adapter in plan.adapters:
        print(f"adapter: {adapter.describe()}", file=sys.stderr)
    shifts = f"shifts {request.video_shift:g}/{request.audio_shift:g}"
    print(
        f"h3serve: {request.task} {request.width}x{request.height} {request.num_frames} frames, {request.steps} "
        f"grid points ({request.forwards} DiT forwards), {shifts}, seed {request.seed} | {model_name} | "
        f"{profile.describe()}{f' | {settings.num_gpus} GPUs' if settings.num_gpus > 1 else ''}",
        file=sys.stderr,
    )

    # 2. Load and render.
    if settings.cache_dir is not None:
        from h3serve.accel.caches import use_cache_dir

        use_cache_dir(settings.cache_dir)  # checked by the settings' rules
    start = time.perf_counter()
    engine = _load_engine(settings, plan.folder, profile, dit_kind(request.task), plan.adapters)
    load_s = time.perf_counter() - start
    if plan.adapters:
        print(f"adapters merged in {engine.merge_seconds:.2f}s (part of the load)", file=sys.stderr)
    try:
        result = _render(engine, request, progress=not args.no_progress)
    finally:
        if engine.num_gpus > 1:
            engine.close()

    # 3. Encode (atomically: a temporary name renamed when complete).
    encode_start = time.perf_counter()
    try:
        write_mp4(
            args.output,
            result.frames,
            result.audio,
            fps=result.fps,
            sample_rate=result.sample_rate,
            threads=settings.encoder_threads,
        )
    except (ValueError, OSError) as err:
        raise CliError(f"--output {args.output}: {err}") from err
    encode_s = time.perf_counter() - encode_start
    stages = " ".join(f"{name} {result.timings[name]:.2f}s" for name in STAGES)
    cache_note = ""
    if result.step_cache is not None and result.step_cache.enabled:
        cached = result.step_cache.cached
        cache_note = (
            f" | step cache (lossy): {len(cached)} of {result.step_cache.forwards} forwards cached {list(cached)}"
        )
    frames = result.frames
    print(
        f"wrote {args.output}: {frames.shape[0]} frames {frames.shape[2]}x{frames.shape[1]} at {result.fps} fps, "
        f"{result.audio.shape[1] / result.sample_rate:.2f} s stereo {result.sample_rate} Hz | load {load_s:.2f}s "
        f"{stages} encode {encode_s:.2f}s total {load_s + result.timings['total'] + encode_s:.2f}s{cache_note}",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    command, verbose = "h3serve", False
    # The parse is inside: building the parsers imports the settings (pydantic), where a Ctrl-C may land too.
    # argparse's own exits (--help, --version, a usage error) are SystemExit and pass through.
    try:
        args = build_parser().parse_args(argv)
        command, verbose = args.command, args.verbose
        # A server's log needs times; a one-shot command's does not.
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s" if command == "serve" else "%(levelname)s %(message)s"
        logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=fmt)
        return args.func(args)
    except CliError as err:
        print(f"h3serve: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("h3serve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("h3serve: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as err:  # an internal failure (out of memory, a bug): still one line, still no partial file
        if verbose:
            logging.exception("h3serve: %s failed", command)
        hint = "" if verbose else " (run with -v for the traceback)"
        print(f"h3serve: error: {command} failed: {type(err).__name__}: {err}{hint}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
