"""A whole render through the engine with full-size random weights, per profile: by default T2VA 768x448, 56 frames,
20 grid points (19 forwards), seed 42, the prompt guide's T2VA case prompt; `--shape default` is the released default
request (1344x768, 124 frames) at 50 points unless `--steps` says otherwise. For each profile one render to warm up
(compile happens there), then one timed: per-stage times, total, peak GPU memory.

    PYTHONPATH=src python bench/render.py --out bench/results/render.json
    PYTHONPATH=src python bench/render.py --num-gpus 8 --shape default --profiles compile,compile+CUTLASS \
        --warmup-steps 2 --out bench/results/render_8gpu.json

Profiles in order: eager BF16, compile BF16, then compile with CUTLASS FP8 block linears (the BF16 block weights are
dropped as they are quantized, so it runs after the BF16 ones), then the same with the text encoder's decoder layers in
FP8 too (quantized in place, so last). `--profiles` picks some by name.

The attention backend is a profile field too: `--attention` (default CUDNN_ATTN, what every profile ran before it
was a flag) sets it for every profile named without one, and a name may end in its own, `+ATTENTION`
(`compile+CUTLASS+FA4`), so one run can time the same profile under two backends on the same weights. ATTENTION is
any value of `accel.profile.Attention`. `auto` is resolved as the engine's start resolves it
(`accel.attention.resolve`: FA4 where it runs and passes its self-test, else CUDNN_ATTN; under eager CUDNN_ATTN), and
an explicit FA4 is self-tested there too: a failure is that profile's recorded error, and the self-test's time is in
`engine_start_s`, as it is in a start's. A profile's key in the JSON is its name, `+ATTENTION` added unless that is
CUDNN_ATTN; its entry records the attention that ran (`attention`), the whole profile, and the start's line about
the choice (`attention_choice`). What this machine cannot run (`accel.profile.check`: FA4 without its package or below
sm90, CUDNN_FP8 without cuDNN's frontend) stops the script before any weight is built. Compiled CUTLASS with FA4 at
the released default request, 9 points (8 forwards) and 50:

    PYTHONPATH=src python bench/render.py --shape default --steps 9 --profiles compile+CUTLASS,compile+CUTLASS+FA4 \
        --out bench/results/render_fa4_default_9.json
    PYTHONPATH=src python bench/render.py --shape default --steps 50 --warmup-steps 2 \
        --profiles compile+CUTLASS,compile+CUTLASS+FA4 --out bench/results/render_fa4_default_50.json

(`compile+CUTLASS` is the same profile under cuDNN's attention, in the same run; drop it for FA4 alone.)

`--preview-every N` takes previews (`pipeline.preview`) in the timed render: each one's time and arrival, their share
of the render and the first one's latency; the warmup (the same request) renders without them, so
`identical_to_first` says whether previews changed a bit. The default request at 50 points, a preview every 5:

    PYTHONPATH=src python bench/render.py --shape default --steps 50 --profiles compile+CUTLASS --preview-every 5 \
        --out bench/results/render_previews.json

With `--num-gpus N` (N > 1) each profile's renders run split over N spawned workers (`ParallelEngine`, every worker
drawing the same weights from seed 0, `lib.models.seeded_rank_engine`). Every engine makes the default schedule's
AdaLN tables first, as the service does at start, so a default-schedule render is timed without making them.
`--warmup-steps K` warms up with a K-point render of the same shape instead of a whole one (the compile is the same;
the timed render is then compared with nothing). `--split` takes the workers' path on one GPU too (what a split
costs, and a check of the script on a one-GPU machine).
"""

from __future__ import annotations

import argparse
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from lib.models import build, released_dit_config, seeded_rank_engine, t2va_prompt
from lib.timing import run_header

from h3serve.accel import attention
from h3serve.accel.compile import uncompile_repeated_blocks
from h3serve.accel.profile import Attention, Profile, ProfileError, check
from h3serve.media.encoding import Encoding
from h3serve.media.mp4 import Mp4Writer, encode_mp4
from h3serve.parallel.workers import ParallelEngine, WorkerSpec
from h3serve.pipeline.context import RenderContext
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

# (execution, linear, text_linear), in the order they run (quantization is in place: BF16 first).
PROFILES = {
    "eager": ("eager", "BF16", "BF16"),
    "compile": ("compile", "BF16", "BF16"),
    "compile+CUTLASS": ("compile", "CUTLASS", "BF16"),
    "compile+CUTLASS+text CUTLASS": ("compile", "CUTLASS", "CUTLASS"),
}
ATTENTION = Attention.CUDNN_ATTN  # what a name without its own attention runs unless --attention says otherwise
SHAPES = {"reference": (dict(width=768, height=448, num_frames=56), 20), "default": ({}, 50)}  # shape, steps


@dataclass(frozen=True)
class Run:
    """One profile of the run: its key in the JSON, its name in `PROFILES` and its attention backend (as asked:
    `auto` is resolved at its start)."""

    key: str
    base: str
    attention: Attention

    @property
    def profile(self) -> Profile:
        """The engine's profile (checked for its rules, not against this machine: `accel.profile.check`)."""
        execution, linear, text_linear = PROFILES[self.base]
        return Profile(device="cuda", dtype="bfloat16", vae_autocast="float16", attention=self.attention,
                       execution=execution, linear=linear, text_linear=text_linear)  # fmt: skip


def runs(names: list[str], default: Attention | str = ATTENTION) -> list[Run]:
    """The runs `--profiles` names (each a name of `PROFILES`, alone or ending in `+ATTENTION`; `default`: the
    attention of a name without one), in `PROFILES`' order, each once. ValueError naming what is unknown."""
    allowed = ", ".join(Attention)
    out: dict[str, Run] = {}
    for name in names:
        base, attn = name, str(default)
        if name not in PROFILES:
            base, _, attn = name.rpartition("+")
            if base not in PROFILES:
                raise ValueError(f"unknown profile {name!r} (allowed: {', '.join(PROFILES)}, each optionally "
                                 f"+ATTENTION, one of {allowed})")  # fmt: skip
        if attn not in tuple(Attention):
            raise ValueError(f"profile {name!r}: unknown attention {attn!r} (allowed: {allowed})")
        run = Run(base if attn == ATTENTION else f"{base}+{attn}", base, Attention(attn))
        out.setdefault(run.key, run)
    order = list(PROFILES)
    return sorted(out.values(), key=lambda r: order.index(r.base))


def encoding_of(name: str) -> Encoding:
    """`default`, or PRESET/THREADS/SEGMENT."""
    if name == "default":
        return Encoding()
    preset, threads, segment = name.split("/")
    return Encoding(preset=preset, threads=int(threads), segment=int(segment))


def timed(engine, request, warmup_steps: int | None, mp4: Path | None = None,
          encodings: tuple[str, ...] = ("default",)) -> dict:  # fmt: skip
    """A warmup render (the same request, or `warmup_steps` points of it), then a timed one: its stage times, per
    forward, rank 0's peak, whether it is byte-identical to the warmup; an error instead, as text. With `mp4` the timed
    render streams its frames into an MP4 there as `h3serve render` does (`media.mp4.Mp4Writer`), once per encoding
    (`encoding_of`), and each one's end to end includes the encoder's finish: `mp4[name].tail_s` is what the file
    took after the render returned."""
    entry: dict = {"steps": request.steps, "forwards": request.forwards}
    try:
        entry["default_tables_s"] = round(engine.prepare_tables(), 2)  # as the service does at start
        warm = request if warmup_steps is None else engine.validate(RequestFields(request.prompt, width=request.width,
                                                                    height=request.height,
                                                                    num_frames=request.num_frames,
                                                                    steps=warmup_steps, seed=request.seed))  # fmt: skip
        start = time.perf_counter()
        first = engine.render(warm)
        entry["warmup_render_s"] = round(time.perf_counter() - start, 2)
        entry["warmup_steps"] = warm.steps
        for name in encodings if mp4 is not None else (None,):
            previews: list = []
            start = time.perf_counter()
            # Previews (`--preview-every`): taken in the timed render only, so `identical_to_first` compares a render
            # with previews against one without.
            keep = lambda p, previews=previews, start=start: previews.append((time.perf_counter() - start, p))  # noqa: E731
            encoding = None if name is None else encoding_of(name)
            writer = None if name is None else Mp4Writer(mp4 / f"{name.replace('/', '-')}.mp4", encoding=encoding)
            ctx = RenderContext(on_preview=keep if request.preview_every else None, frames_to=writer)
            second = engine.render(request, ctx)
            if writer is not None:
                returned = time.perf_counter() - start
                writer.finish()
                end = time.perf_counter() - start
                entry.setdefault("mp4", {})[name] = {
                    "encoding": encoding.describe(), "render_returned_s": round(returned, 3),
                    "end_to_end_s": round(end, 3), "tail_s": round(end - returned, 3),
                    "bytes": writer.path.stat().st_size,
                }  # fmt: skip
                if warm is request and first.frames is not None:  # streamed bytes against the warmup's frames, whole
                    whole = io.BytesIO()
                    encode_mp4(whole, first.frames, first.audio, encoding=encoding)
                    same = whole.getvalue() == writer.path.read_bytes()
                    entry["mp4"][name]["identical_to_first"] = same
                    entry["identical_to_first"] = entry.get("identical_to_first", True) and same
            entry["end_to_end_s"] = round(time.perf_counter() - start, 3)
        if request.preview_every:
            entry["previews"] = [{"forward": p.forward, "seconds": round(p.seconds, 4), "at_s": round(at, 3),
                                  "width": p.width, "height": p.height} for at, p in previews]  # fmt: skip
            spent = sum(p.seconds for _, p in previews)
            entry["previews_s"] = round(spent, 3)
            entry["previews_share"] = round(spent / entry["end_to_end_s"], 4)
            entry["first_preview_at_s"] = round(previews[0][0], 3) if previews else None
        entry["timings_s"] = {k: round(v, 3) for k, v in second.timings.items()}
        entry["per_forward_s"] = round(second.timings["denoise"] / request.forwards, 4)
        entry["peak_gib"] = round(second.peak_memory_mb / 1024, 2)
        if warm is request and second.frames is not None:
            entry["identical_to_first"] = bool((first.frames == second.frames).all() and
                                               (first.audio == second.audio).all())  # fmt: skip
        compiled = getattr(engine, "compiled", None)  # a split engine's compile is in its workers: not seen here
        if compiled is not None:
            entry["graphs"], entry["recompiles"] = compiled.graphs, compiled.recompiles
        if second.split:
            entry["rows_per_gpu"] = list(second.split)
    except Exception as err:  # recorded, so that the other runs of the script still run
        entry["error"] = f"{type(err).__name__}: {err}"[:2000]
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=SHAPES, default="reference")
    parser.add_argument("--steps", type=int, help="grid points (default 20 at the reference shape, 50 at default)")
    parser.add_argument("--num-gpus", type=int, default=1, help="split each render over this many GPUs (workers)")
    parser.add_argument("--profiles", type=lambda v: v.split(","), default=list(PROFILES),
                        help=f"comma-separated, from {', '.join(PROFILES)}; each may end in +ATTENTION "
                        "(compile+CUTLASS+FA4)")  # fmt: skip
    parser.add_argument("--attention", choices=[str(a) for a in Attention], default=str(ATTENTION),
                        help="the attention backend of every profile named without one (auto: chosen at start, as "
                        "the engine's start chooses it)")  # fmt: skip
    parser.add_argument("--warmup-steps", type=int, help="warm up with a render of this many points")
    parser.add_argument("--split", action="store_true", help="the split path (workers) even for one GPU")
    parser.add_argument(
        "--blocks",
        type=int,
        help="DiT main blocks of the one-GPU run (default: the released 50); fewer for a smoke run",
    )
    parser.add_argument("--mp4", type=Path, help="stream the timed render's frames into an MP4 in this folder")
    parser.add_argument("--mp4-encodings", type=lambda v: tuple(v.split(",")), default=("default",),
                        help="with --mp4, one timed render per encoding: `default` (the settings' defaults) or "
                        "PRESET/THREADS/SEGMENT (medium/4/0: the writer before issue 55's settings)")  # fmt: skip
    parser.add_argument("--preview-every", type=int, default=0,
                        help="previews in the timed render after every N forwards: their time, share and the first's "
                        "latency (the warmup renders without, so identical_to_first compares the two)")  # fmt: skip
    args = parser.parse_args()
    try:
        chosen = runs(args.profiles, args.attention)
    except ValueError as err:
        parser.error(f"--profiles: {err}")
    for run in chosen:  # every refusal before minutes of building weights
        try:
            check(run.profile)
        except ProfileError as err:  # it names the setting and what is allowed
            parser.error(f"profile {run.key}: {err}")
    shape, steps = SHAPES[args.shape]
    steps = args.steps or steps
    split = args.num_gpus > 1 or args.split
    if split and args.blocks is not None:
        parser.error("--blocks: the one-GPU run only (a split's workers build the released DiT)")
    components = None if split else build(torch.device("cuda"), args.blocks)
    record: dict = {**run_header(), "num_gpus": args.num_gpus, "shape": args.shape, "attention": args.attention,
                    "runs": {}}  # fmt: skip
    if components is not None:
        record["weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    head_dim = released_dit_config().attention_head_dim
    for run in chosen:
        start = time.perf_counter()
        entry: dict = {}
        engine = None
        try:
            # FA4 is self-tested and `auto` chosen here, as at the engine's start (`startup.preflight`); the split's
            # workers then run what was chosen.
            profile, line = attention.resolve(run.profile, head_dim)
            if line is not None:
                entry["attention_choice"] = line
            if split:
                engine = ParallelEngine(WorkerSpec(None, profile, args.num_gpus), engine_factory=seeded_rank_engine,
                                        dit_config=released_dit_config())  # fmt: skip
            else:
                uncompile_repeated_blocks(components.dit)
                torch._dynamo.reset()
                # CUTLASS: the engine quantizes the loaded block linears one by one, dropping each BF16 weight (a
                # checkpoint load quantizes them as they are read instead); FP8 is what stays resident.
                engine = Engine(components, profile)
                torch.cuda.empty_cache()
            entry["attention"] = str(engine.profile.attention)
            entry["profile"] = engine.profile.as_dict()
            entry["engine_start_s"] = round(time.perf_counter() - start, 1)
            request = engine.validate(
                RequestFields(t2va_prompt(), **shape, steps=steps, seed=42, preview_every=args.preview_every)
            )
            if not split:
                entry["resident_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            entry["budget_gib"] = engine.memory_budget()
            mp4 = None if args.mp4 is None else args.mp4 / run.key.replace("+", "_")
            if mp4 is not None:
                mp4.mkdir(parents=True, exist_ok=True)
            entry |= timed(engine, request, args.warmup_steps, mp4, args.mp4_encodings)
        except Exception as err:  # a split's workers that failed to start: recorded, the next profile still runs
            entry["error"] = f"{type(err).__name__}: {err}"[:2000]
        finally:
            if split and engine is not None:
                engine.close()
        record["runs"][run.key] = entry
        args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(run.key, entry, flush=True)


if __name__ == "__main__":
    main()
