"""`h3serve render`: a prompt (and optional keyframes or references) to an MP4 with sound, checked whole before any
weight loads, written under a temporary name and renamed when complete."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from h3serve.cli.common import CliError, decimal_arg, read_settings, refusals, whole_arg
from h3serve.cli.signals import import_held, sigterm_raises
from h3serve.config import AUDIO_SHIFT, DEFAULT_STEPS, FPS, VIDEO_SHIFT
from h3serve.errors import flag_name
from h3serve.vocab import Task, dit_kind, seconds_to_frames, snap_up


def add_parser(sub: argparse._SubParsersAction) -> None:
    from h3serve.settings import EngineSettings, add_flags

    p = sub.add_parser(
        "render",
        allow_abbrev=False,
        help="render a prompt (and optional first/last keyframes) to an MP4 with stereo sound",
        description="Render one video with sound. Without --model, the built-in tiny model runs (its output is "
        "noise; it exists to try the pipeline without downloading weights). The engine's settings are `serve`'s: "
        "the same flags and H3_* variables (flags win over the environment, which wins over --config).",
        not_flags={
            "--prompt": "the prompt is render's first argument: h3serve render {value} -o OUT.mp4 (or --prompt-file)"
        },
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
        type=whole_arg,
        action="append",
        default=[],
        metavar="N",
        help="leave out the soundtrack of the video given as the N-th --ref (0-based); repeatable",
    )
    p.add_argument("--width", type=whole_arg, help="canvas width, a multiple of 32 (default: from the aspect ratio)")
    p.add_argument("--height", type=whole_arg, help="canvas height, a multiple of 32 (default: from the aspect ratio)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--frames", type=whole_arg, help="frame count, snapped up to 17n+5 (default: 124, tiny: 22)")
    length.add_argument("--seconds", type=decimal_arg, help=f"duration at {FPS} fps, snapped up to 17n+5 frames")
    trained = "; with --lora, the adapter's trained value"
    p.add_argument(
        "--steps",
        type=whole_arg,
        help=f"schedule grid points; N points run N-1 forwards ({DEFAULT_STEPS}{trained})",
    )
    p.add_argument("--video-shift", type=decimal_arg, help=f"video schedule shift ({VIDEO_SHIFT:g}{trained})")
    p.add_argument("--audio-shift", type=decimal_arg, help=f"audio schedule shift ({AUDIO_SHIFT:g}{trained})")
    p.add_argument("--seed", type=whole_arg, default=0, help="request seed: same seed, same render (0)")
    p.add_argument(
        "--apply",
        action="append",
        default=[],
        metavar="NAME[:SCALE]",
        help="apply a declared adapter (--adapters NAME=PATH) at run time, at SCALE or its declared one; repeat for "
        "several",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--preview-dir",
        type=Path,
        help="write previews here as the render runs: the clean estimate's first 9 frames, a PNG strip, after half "
        "of --preview-every forwards, then every --preview-every (preview-FFF-of-NNN.png; the render's bits are the "
        "same with or without)",
    )
    p.add_argument(
        "--preview-every", type=whole_arg, help=f"forwards between previews (with --preview-dir; {PREVIEW_EVERY})"
    )
    # The engine's settings: the same flags and H3_* variables as `serve` (`settings.EngineSettings`).
    add_flags(p, EngineSettings, old_names=True)
    p.set_defaults(func=cmd_render)


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


def _check_previews(args: argparse.Namespace) -> int | None:
    """--preview-dir: a folder that can be created and written (before any weight loads); the preview interval, or
    None without previews."""
    if args.preview_dir is None:
        if args.preview_every is not None:
            raise CliError(f"--preview-every {args.preview_every}: needs --preview-dir, where the previews go")
        return None
    try:
        args.preview_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CliError(f"--preview-dir {args.preview_dir}: cannot create it ({err.strerror})") from err
    if not os.access(args.preview_dir, os.W_OK | os.X_OK):
        raise CliError(f"--preview-dir {args.preview_dir}: not writable")
    return PREVIEW_EVERY if args.preview_every is None else args.preview_every


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
    """The frame count asked for by --frames or --seconds, snapped up to the 17n+5 grid here, with a note naming the
    flag the user typed; None for the model's default."""
    if args.seconds is not None:
        if not (math.isfinite(args.seconds) and args.seconds > 0):
            raise CliError(f"--seconds must be a finite number > 0, got {args.seconds}")
        frames = seconds_to_frames(args.seconds)
        given = f"--seconds {args.seconds:g} is {frames} frames at {FPS} fps,"
    elif args.frames is not None:
        frames, given = args.frames, f"--frames {args.frames}"
    else:
        return None
    if frames < 1:
        return frames  # refused with the allowed range by the request's rules
    snapped = snap_up(frames)
    if snapped != frames:
        print(f"note: {given} snapped up to {snapped} (17n+5)", file=sys.stderr)
    return snapped


# Request fields whose `render` flag is the field's own name (`errors.flag_name`); the prompt is an argument.
FLAGGED_FIELDS = ("steps", "video_shift", "audio_shift", "seed", "preview_every")
PREVIEW_EVERY = 5  # --preview-every's default


def _applied(values: list[str]) -> list[tuple[str, float | None]]:
    """`--apply NAME[:SCALE]` values as the request's adapters (the engine checks the names and scales)."""
    out: list[tuple[str, float | None]] = []
    for value in values:
        name, colon, scale = value.partition(":")
        if not colon:
            out.append((name, None))
            continue
        try:
            out.append((name, decimal_arg(scale)))
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise CliError(f"--apply {value}: SCALE must be a number ({err})") from err
    return out


def _request_error(err: ValueError, args: argparse.Namespace) -> str:
    """A request error in the command's terms: the flag the user typed and its value, and the file the user gave
    for a reference."""
    field, index = getattr(err, "field", None), getattr(err, "index", None)
    if field == "references" and index is not None:  # name the file the user gave, not our list position
        return f"--ref {args.ref[index]}: {err}"
    if field == "mute_references":
        return err.describe({"mute_references": "--mute-ref"})
    if field == "adapters":
        return f"--apply {args.apply[index]}: {err.message}" if index is not None else f"--apply: {err.message}"
    if field in ("width", "height"):
        given = " ".join(f"--{name} {getattr(args, name)}" for name in ("width", "height") if getattr(args, name))
        return f"{given}: {err}" if given else str(err)
    if field == "num_frames":
        flag = f"--seconds {args.seconds:g}" if args.seconds is not None else f"--frames {args.frames}"
        return f"{flag}: {err}"
    if field == "preview_every":
        default = " (the default)" if args.preview_every is None else ""
        return f"--preview-every {PREVIEW_EVERY if args.preview_every is None else args.preview_every}{default}: {err}"
    if field in FLAGGED_FIELDS and getattr(args, field, None) is not None:
        return f"{flag_name(field)} {getattr(args, field)}: {err}"
    return str(err)


def _render(engine, request, progress: bool, preview_dir: Path | None = None, frames_to=None):
    from h3serve.pipeline.context import RenderContext

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=request.forwards, desc="denoise", unit="forward", file=sys.stderr, leave=False)

    def on_step(done: int, total: int) -> None:
        if bar is not None:
            bar.update(done - bar.n)

    def on_preview(preview) -> None:
        assert preview_dir is not None
        path = preview_dir / f"preview-{preview.forward:03d}-of-{preview.forwards:03d}.png"
        partial = path.with_name(f".{path.name}.partial")
        partial.write_bytes(preview.png)
        partial.replace(path)  # whole, or not there
        line = f"preview after forward {preview.forward}/{preview.forwards}: {path} ({preview.seconds:.2f} s)"
        if bar is not None:
            bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    ctx = RenderContext(on_preview=on_preview if preview_dir is not None else None, frames_to=frames_to)
    try:
        return engine.render(request, ctx, on_step=on_step)
    finally:
        if bar is not None:
            bar.close()


def cmd_render(args: argparse.Namespace) -> int:
    # From the first import on: a SIGTERM anywhere in the render unwinds like Ctrl-C, through the MP4 writer's cleanup.
    with sigterm_raises():
        return _run_render(args)


def _run_render(args: argparse.Namespace) -> int:
    import_held("h3serve.pipeline.engine", "h3serve.media.mp4")
    settings, plan, request = _admitted(args)
    _announce(settings, plan, request)
    result, writer, load_s, encode_s = _load_render_encode(args, settings, plan, request)
    _report(args, request, result, writer, load_s, encode_s)
    return 0


def _admitted(args: argparse.Namespace):
    """1. Everything the user gave, checked before any weight loads: the settings, the inputs, the start (the same
    checks as `serve`'s, for the DiT the task runs on), then the request under the engine's own admission. Returns
    the settings, the preflighted start-up plan and the request."""
    from h3serve import startup
    from h3serve.pipeline.request import RequestFields

    settings = read_settings(args, engine_only=True)  # the profile, checked against this machine
    prompt = _read_prompt(args)
    references = _read_references(args)
    task, keyframes = (Task.REF2VA, []) if references else _read_keyframes(args)
    _check_output(args.output)
    preview_every = _check_previews(args)
    if settings.node_rank > 0:
        raise CliError(f"--node-rank {settings.node_rank}: render runs on node 0; node {settings.node_rank} runs "
                       f"`h3serve serve --node-rank {settings.node_rank}` (its ranks only)")  # fmt: skip
    with refusals():
        plan = startup.plan(settings, dit_kind(task))
    try:
        fields = RequestFields(
            prompt,
            task=task,
            width=args.width,
            height=args.height,
            num_frames=_num_frames(args),
            steps=args.steps,
            seed=args.seed,
            video_shift=args.video_shift,
            audio_shift=args.audio_shift,
            keyframes=keyframes,
            references=references,
            mute_references=args.mute_ref,
            preview_every=preview_every,
            adapters=_applied(args.apply),
        )
        request = plan.admission.validate(fields)
    except ValueError as err:
        raise CliError(_request_error(err, args)) from err
    with refusals():
        plan = startup.preflight(plan, say=lambda line: print(f"h3serve: {line}", file=sys.stderr))
    try:  # what the device memory admits is known now (`pipeline.placement`), still before any weight loads
        plan.admission.check_memory(request)
        plan.admission.check_rows(request)
    except ValueError as err:
        raise CliError(_request_error(err, args)) from err
    return settings, plan, request


def _announce(settings, plan, request) -> None:
    """The request as it will run: its notices, the adapters, and one line of shape, model, profile and placement."""
    for notice in request.notices:
        print(f"note: {notice}", file=sys.stderr)
    model_name = settings.model if plan.folder else "built-in tiny model (random weights: the output is noise)"
    for adapter in plan.adapters:
        print(f"adapter: {adapter.describe()}", file=sys.stderr)
    for name, scale in request.adapters:
        entry = plan.library.catalog.entries[name]
        print(f"adapter at run time: {name} at scale {scale:g} ({entry.adapter.describe()})", file=sys.stderr)
    shifts = f"shifts {request.video_shift:g}/{request.audio_shift:g}"
    print(
        f"h3serve: {request.task} {request.width}x{request.height} {request.num_frames} frames, {request.grid}, "
        f"{shifts}, seed {request.seed} | {model_name} | "
        f"{plan.profile.describe()}{f' | {settings.ranks} GPUs' if settings.ranks > 1 else ''}"
        f"{f' | {plan.placement.describe()}' if plan.placement is not None and plan.placement.streams else ''}",
        file=sys.stderr,
    )


def _load_render_encode(args: argparse.Namespace, settings, plan, request):
    """2. Load and render, each decode window's frames encoded as they come (atomically: a temporary name renamed
    when complete, removed on any failure); 3. what the encoder had left once the decode ended. Returns the result,
    the writer, and the load's and the encode's seconds."""
    from h3serve import startup
    from h3serve.media.mp4 import Mp4Writer

    try:
        writer = Mp4Writer(args.output, encoding=settings.encoding)
    except (ValueError, OSError) as err:
        raise CliError(f"--output {args.output}: {err}") from err
    start = time.perf_counter()
    with refusals():
        engine = startup.launch(plan)
    load_s = time.perf_counter() - start
    if plan.adapters:
        print(f"adapters merged in {engine.merge_seconds:.2f}s (part of the load)", file=sys.stderr)
    try:
        result = _render(engine, request, progress=not args.no_progress, preview_dir=args.preview_dir,
                         frames_to=writer)  # fmt: skip
    except BaseException as err:
        writer.abort(err)
        raise
    finally:
        engine.close()
    encode_start = time.perf_counter()
    try:
        writer.finish()
    except (ValueError, OSError) as err:
        raise CliError(f"--output {args.output}: {err}") from err
    except BaseException as err:  # Ctrl-C or SIGTERM while the encoder finishes: stop it, it removes its file
        writer.abort(err)
        raise
    return result, writer, load_s, time.perf_counter() - encode_start


def _report(args: argparse.Namespace, request, result, writer, load_s: float, encode_s: float) -> None:
    """The closing line: the file, its shape, each stage's seconds, and what the step cache skipped."""
    from h3serve.pipeline.engine import STAGES

    stages = " ".join(f"{name} {result.timings[name]:.2f}s" for name in STAGES)
    if "previews" in result.timings:
        stages += f" (previews {result.timings['previews']:.2f}s of the denoise)"
    if result.request.adapters:
        applied = ", ".join(f"{name}:{scale:g}" for name, scale in result.request.adapters)
        stages += f" (adapters {applied} applied in {result.timings['adapters']:.2f}s of the tables)"
    cache_note = ""
    if result.step_cache is not None and result.step_cache.enabled:
        cached = result.step_cache.cached
        cache_note = (
            f" | step cache (lossy): {len(cached)} of {result.step_cache.forwards} forwards cached {list(cached)}"
        )
    print(
        f"wrote {args.output}: {writer.frames} frames {request.width}x{request.height} at {result.fps} fps, "
        f"{result.audio.shape[1] / result.sample_rate:.2f} s stereo {result.sample_rate} Hz | load {load_s:.2f}s "
        f"{stages} encode {encode_s:.2f}s (after the decode; {writer.encoding.describe()}) "
        f"total {load_s + result.timings['total'] + encode_s:.2f}s{cache_note}",
        file=sys.stderr,
    )
