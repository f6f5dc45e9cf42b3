"""The startup warmup: one short render at the production shape, encoded to MP4 in memory and checked as a client
would check it, before the server reports ready (with run-time adapters declared, once more per number of adapters a
request may apply, with the first ones applied, so that each compiled variant is made now, and once more plain).

It runs on the scheduler's GPU worker before the first request, so it finds what a first request would: a CUDA
context to create, kernels to compile or load, the default schedule's AdaLN tables to make, an encoder to start. A
failure is its result, never an exception: the server then stays up, not ready, and says why in /health.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass

import numpy as np

from h3serve.media.encoding import Encoding
from h3serve.media.mp4 import DEFAULT_ENCODING, encode_mp4, verify_mp4
from h3serve.pipeline.engine import RenderEngine
from h3serve.pipeline.request import RenderRequest, RequestFields
from h3serve.vocab import SMOKE_REQUEST, Task, dit_kind

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # grid points: one forward, as the seed's 2-step warmup


@dataclass(frozen=True)
class WarmupResult:
    """The startup warmup: a short render at the production shape, encoded and checked as the clients will."""

    passed: bool
    seconds: float
    request: str  # what was rendered, e.g. "t2va 768x448 56 frames 1 step(s)"
    error: str | None = None


def warmup_request(engine: RenderEngine, adapters: tuple[tuple[str, None], ...] = ()) -> RenderRequest:
    """The production shape (768x448, 56 frames for the released model; the tiny model's own default): T2VA, or
    with only the Ref2VA DiT loaded, ref2va with one generated image reference; `adapters` applied at run time."""
    size = engine.rules.warmup_size
    task = Task.T2VA if Task.T2VA in engine.tasks else Task.REF2VA
    extra = {"references": [("warmup.png", _reference_png())]} if task == Task.REF2VA else {}
    return engine.validate(
        RequestFields(
            SMOKE_REQUEST.prompt,
            task=task,
            width=size[0] if size else None,
            height=size[1] if size else None,
            num_frames=engine.rules.warmup_frames,
            steps=WARMUP_STEPS,
            seed=0,
            adapters=adapters,
            **extra,
        )
    )


def _compile_times() -> str:
    """torch's per-phase compile times of this process, aggregated, on one line (empty if torch has none)."""
    import torch._dynamo.utils

    try:
        text = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
    except Exception as err:  # a private helper of torch's: its absence costs only this log line
        return f"(no compile times: {type(err).__name__})"
    return " | ".join(line.strip() for line in str(text).splitlines() if line.strip())


def describe(request: RenderRequest) -> str:
    shape = f"{request.task} {request.width}x{request.height} {request.num_frames} frames"
    return f"{shape}, {request.grid}"


def run_warmup(engine: RenderEngine, encoding: Encoding = DEFAULT_ENCODING) -> WarmupResult:
    """Make the default schedule's AdaLN tables, render the warmup request, encode it to MP4 in memory and check the
    file as a client would (codecs, size, frame count, stereo AAC). Never raises: a failure is the result, with its
    reason."""
    start = time.perf_counter()
    shape = "the warmup request"
    try:
        request = warmup_request(engine)
        shape = describe(request)
        log.info("default-schedule AdaLN tables made in %.2f s", engine.prepare_tables())  # under the engine's lock
        result = engine.render(request)
        log.info("warmup render stages (s): %s", ", ".join(f"{k} {v:.2f}" for k, v in result.timings.items()))
        compiled = getattr(engine, "compiled", None)  # a split engine compiles in its workers: nothing to say here
        if compiled is not None:  # where a compiling forward's time went (Dynamo's own per-phase account)
            log.info("warmup compile: %d graph(s); %s", compiled.graphs, _compile_times())
        buffer = io.BytesIO()
        media = {"fps": result.fps, "sample_rate": result.sample_rate, "encoding": encoding}
        encode_mp4(buffer, result.frames, result.audio, **media)
        buffer.seek(0)
        verify_mp4(buffer, width=request.width, height=request.height, num_frames=request.num_frames)
        sets = _adapter_sets(engine, request.task)
        for chosen in sets:  # each number of adapters applied compiles its own variant: now, not in a user's request
            applied = engine.render(warmup_request(engine, chosen))
            log.info("warmup with adapters %s: %.2f s (switch %.3f s)", ", ".join(n for n, _ in chosen),
                     applied.timings["total"], applied.timings.get("adapters", 0.0))  # fmt: skip
        if sets:
            engine.render(request)  # and back to the plain weights, as a request without adapters finds them
    except Exception as err:  # every failure is reported instead of raised: the server stays up and not ready
        log.exception("warmup failed")
        return WarmupResult(False, time.perf_counter() - start, shape, f"{type(err).__name__}: {err}")
    return WarmupResult(True, time.perf_counter() - start, shape)


def _adapter_sets(engine: RenderEngine, task: str) -> list[tuple[tuple[str, None], ...]]:
    """One set of declared run-time adapters per number a request of the warmup's task may apply (1 up to
    H3_ADAPTER_MAX_ACTIVE, as many as are declared for its DiT), the first ones at their declared scales: each
    number computes over its own rank (`accel.lora`), so each is a compiled variant of its own."""
    kind = dit_kind(task)
    catalog = engine.admission.catalog
    names = [name for name, entry in catalog.entries.items() if entry.dit_kind in (None, kind)]
    return [tuple((name, None) for name in names[:k]) for k in range(1, min(catalog.max_active, len(names)) + 1)]


def _reference_png() -> bytes:
    """A square PNG (colour gradients) standing in for a reference image in a Ref2VA-only warmup."""
    from PIL import Image

    ramp = np.linspace(0, 255, 64, dtype=np.float32)
    rgb = np.stack([ramp[None, :].repeat(64, 0), ramp[:, None].repeat(64, 1), 255 - ramp[None, :].repeat(64, 0)], -1)
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()
