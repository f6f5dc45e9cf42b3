"""Request validation: every rule, every error, and the canvas/keyframe arithmetic against diffusers."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from h3serve.pipeline.conditioning import fit_keyframes
from h3serve.pipeline.request import RequestFields, decode_keyframe, validate_request
from h3serve.pipeline.rules import (
    MAX_SEED,
    RELEASED_RULES,
    CanvasRule,
    FrameRule,
    RequestError,
    RequestRules,
    resolve_canvas,
)
from h3serve.pipeline.schedule import DualSchedule
from h3serve.vocab import Task
from oracle import oracle


def image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)
    return Image.fromarray((rng.random((height, width, channels)) * 255).astype(np.uint8), mode)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def request(**overrides):
    args = dict(prompt="a fox runs", task="t2va", width=768, height=448, num_frames=124, steps=30, seed=7)
    args.update(overrides)
    rules = args.pop("rules", RELEASED_RULES)
    return validate_request(RequestFields(**args), rules)


# --- accepted requests -----------------------------------------------------------------------------------------


def test_warmup_request_is_valid_with_a_notice():
    r = request(width=768, height=448, num_frames=56, steps=50)
    assert (r.width, r.height, r.num_frames, r.steps) == (768, 448, 56, 50)
    assert len(r.notices) == 1 and "trained" in r.notices[0]
    assert r.video_shift == 12.0 and r.audio_shift == 3.0 and r.anchors == ()


def test_frames_snap_up_to_the_grid_with_a_notice():
    r = request(num_frames=120)  # 5 s asked, 124 is the next 17n+5
    assert r.num_frames == 124 and r.num_frames % 17 == 5
    assert any("snapped up to 124" in n for n in r.notices)
    for asked in range(1, 363):
        snapped = request(num_frames=asked).num_frames
        assert snapped >= asked and snapped % 17 == 5 and (snapped - asked < 17 or snapped == 22)
    assert request(num_frames=5).num_frames == 22  # below the shortest clip: snapped up to it, as 6..21 are
    assert request(num_frames=124).notices == ()
    assert request(num_frames=362).num_frames == 362


def test_default_canvas_is_resolved_and_said():
    r = request(width=None, height=None)
    assert (r.width, r.height) == (1344, 768)
    assert any("16:9" in n for n in r.notices)
    r = request(task="i2va", width=None, height=None, keyframes=[png(image(300, 400))])
    assert (r.width, r.height) == resolve_canvas(300, 400)
    assert any("keyframe" in n for n in r.notices)


def test_keyframes_decode_in_packed_order():
    first, last = image(96, 64, 1), image(64, 64, 2, "RGBA")
    r = request(task="fl2va", keyframes=[png(first), last])
    assert r.anchors == ("first", "last")
    assert [k.mode for k in r.keyframes] == ["RGB", "RGB"]
    assert np.array_equal(np.asarray(r.keyframes[0]), np.asarray(first))
    assert r.keyframes[1].size == (64, 64)
    assert request(task="l2va", keyframes=[png(first)]).anchors == ("last",)


def test_rules_are_data():
    tiny = RequestRules(canvas=CanvasRule(max_pixels=64 * 64, default_short_edge=64), frames=FrameRule(max_frames=124))
    r = request(width=64, height=64, num_frames=22, rules=tiny)
    assert (r.width, r.height) == (64, 64)
    default = request(width=None, height=None, num_frames=22, rules=tiny)
    assert (default.width, default.height) == (96, 64)
    with pytest.raises(ValueError, match="area cap"):
        request(rules=tiny)
    with pytest.raises(ValueError, match="num_frames"):
        request(width=64, height=64, num_frames=200, rules=tiny)


# --- every error -------------------------------------------------------------------------------------------------

ERRORS = [
    (dict(task="ref2va"), "task ref2va needs at least one reference file"),
    (dict(task="v2va"), "task must be one of t2va, i2va, l2va, fl2va, ref2va"),
    (dict(task="T2VA"), "task"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="   \n"), "prompt"),
    (dict(prompt=None), "prompt"),
    (dict(width=770), "width must be a positive multiple of 32"),
    (dict(height=450), "height must be a positive multiple of 32"),
    (dict(width=0), "width"),
    (dict(height=-32), "height"),
    (dict(width=768.0), "width must be an integer"),
    (dict(width=None), "width and height must be given together"),
    (dict(height=None), "width and height must be given together"),
    (dict(width=4096, height=512), "aspect ratio"),
    (dict(width=32, height=256), "aspect ratio"),
    (dict(width=2048, height=1024), "area cap"),
    (dict(width=1344, height=1344), "area cap"),
    (dict(num_frames=363), r"num_frames must be 22\.\.362"),
    (dict(num_frames=1000), "num_frames"),
    (dict(num_frames=0), "num_frames"),
    (dict(num_frames=-3), "num_frames"),
    (dict(num_frames=56.0), "num_frames must be an integer"),
    (dict(num_frames=True), "num_frames"),
    (dict(steps=1), r"steps must be 2\.\.1000"),
    (dict(steps=0), "steps"),
    (dict(steps=1001), "steps"),
    (dict(steps="30"), "steps must be an integer"),
    (dict(seed=-1), "seed must be 0"),
    (dict(seed=MAX_SEED + 1), "seed"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(video_shift=0), "video_shift must be a finite number > 0"),
    (dict(video_shift=-12.0), "video_shift"),
    (dict(video_shift=math.inf), "video_shift"),
    (dict(audio_shift=math.nan), "audio_shift"),
    (dict(audio_shift="3"), "audio_shift must be a number"),
    (dict(task="i2va"), r"keyframes: task i2va takes 1 keyframe\(s\) \(first\), got 0"),
    (dict(task="l2va", keyframes=[b"x", b"y"]), r"keyframes: task l2va takes 1 keyframe\(s\) \(last\), got 2"),
    (dict(task="fl2va", keyframes=[png(image(8, 8))]), "keyframes: task fl2va takes 2"),
    (dict(task="t2va", keyframes=[png(image(8, 8))]), r"keyframes: task t2va takes 0 keyframe\(s\) \(none\)"),
    (dict(task="i2va", keyframes=[b"not an image"]), r"keyframes\[0\] could not be decoded"),
    (dict(task="fl2va", keyframes=[png(image(8, 8)), png(image(8, 8))[:40]]), r"keyframes\[1\] could not be decoded"),
    (dict(task="i2va", keyframes=["/etc/passwd"]), r"keyframes\[0\] must be image bytes or a PIL image"),
    (dict(task="i2va", width=None, height=None, keyframes=[png(image(500, 100))]), r"keyframes\[0\].*aspect"),
]


@pytest.mark.parametrize("overrides,message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        request(**overrides)


@pytest.mark.parametrize(
    "overrides,field,index",
    [
        (dict(steps=1), "steps", None),
        (dict(width=770), "width", None),
        (dict(task="i2va", keyframes=[b"not an image"]), "keyframes", 0),
        (dict(task="fl2va", keyframes=[png(image(8, 8)), png(image(8, 8))[:40]]), "keyframes", 1),
        (dict(task="i2va", width=None, height=None, keyframes=[png(image(500, 100))]), "keyframes", 0),
        (dict(task="t2va", references=[b"x"]), "references", None),
    ],
)
def test_errors_carry_their_field_and_index(overrides, field, index):
    """What was refused is data: a front end reads `field` and `index`, never the message."""
    with pytest.raises(RequestError) as excinfo:
        request(**overrides)
    err = excinfo.value
    assert (err.field, err.index) == (field, index), str(err)
    if index is None:
        assert err.describe({field: "renamed"}) == str(err) == err.message  # a whole-field message as it is
    else:
        assert str(err).startswith(f"keyframes[{index}] ") and not err.message.startswith("keyframes")
        assert err.describe({"keyframes": "input_reference"}).startswith(f"input_reference[{index}] ")


@pytest.mark.parametrize(
    "module,not_loaded",
    [
        (
            "h3serve.pipeline.rules",
            (
                "h3serve.pipeline.request",
                "h3serve.pipeline.references",
                "h3serve.pipeline.layout",
            ),
        ),
        ("h3serve.pipeline.references", ("h3serve.pipeline.request",)),
        ("h3serve.pipeline.layout", ("h3serve.pipeline.request", "h3serve.pipeline.references")),
    ],
)
def test_the_import_graph_follows_the_data_flow(module, not_loaded):
    """rules <- layout <- references <- request: nothing imports the module that builds on it, so there is no cycle."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('h3serve')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert not [m for m in not_loaded if f"'{m}'" in loaded], loaded


def test_task_is_the_vocabulary_enum():
    r = request(task="fl2va", keyframes=[png(image(8, 8)), png(image(8, 8))])
    assert r.task is Task.FL2VA and r.task == "fl2va" and f"{r.task}" == "fl2va"


def test_forwards_come_from_the_schedule():
    assert request(steps=50).forwards == 49 == DualSchedule.build(50, 12.0, 3.0).num_steps
    assert request(steps=2).forwards == 1
    # Shifts this large push the top of the float32 grid into collisions that the schedule collapses: 39 distinct
    # timesteps of the 49 that 50 grid points would give, and the request runs exactly those.
    r = request(steps=50, video_shift=1e6, audio_shift=1e6)
    assert r.forwards == len(r.schedule.video.timesteps) == len(r.schedule.audio.timesteps) == 39


# --- canvas and keyframe arithmetic against diffusers ------------------------------------------------------------

ASPECTS = [(16, 9), (9, 16), (1, 1), (4, 3), (21, 9), (2.35, 1), (1, 4), (4, 1), (1920, 1080), (300, 400), (1000, 999)]


@pytest.mark.parametrize("aw,ah", ASPECTS)
def test_resolve_canvas_matches_reference(aw, ah):
    ref = oracle("diffusers.modular_pipelines.minimax_h3.modular_pipeline")
    height, width = ref.resolve_canvas_size(aw, ah, 32, 768, 768 * 1344)
    assert resolve_canvas(aw, ah) == (width, height)
    # Whatever the resolver picks is a valid explicit canvas too.
    RELEASED_RULES.canvas.check(width, height)


def test_resolved_canvases_always_validate():
    for ratio in np.linspace(0.25, 4.0, 400):
        RELEASED_RULES.canvas.check(*resolve_canvas(float(ratio), 1.0))


@pytest.mark.parametrize(
    "first,last,canvas",
    [((640, 480), (1280, 720), (768, 448)), ((333, 777), (500, 500), None), ((1000, 1000), (37, 91), (64, 96))],
)
def test_fit_keyframes_matches_reference(first, last, canvas):
    oracle("diffusers")
    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks

    a, b = image(*first, seed=1), image(*last, seed=2)
    state = PipelineState()
    state.set("image", a)
    state.set("last_image", b)
    state.set("width", None if canvas is None else canvas[1])
    state.set("height", None if canvas is None else canvas[0])
    _, state = MiniMaxH3ResizeStep()(MiniMaxH3Blocks().init_pipeline(), state)

    r = validate_request(
        RequestFields(
            "p",
            task="fl2va",
            width=None if canvas is None else canvas[1],
            height=None if canvas is None else canvas[0],
            num_frames=124,
            steps=2,
            keyframes=[a, b],
        )
    )
    assert (r.height, r.width) == (state.get("height"), state.get("width"))
    ours = fit_keyframes(r.keyframes, r.width, r.height)
    for mine, theirs in zip(ours, state.get("keyframes"), strict=True):
        assert mine.size == theirs.size
        assert np.array_equal(np.asarray(mine), np.asarray(theirs.convert("RGB")))


def test_keyframe_exif_orientation_is_applied():
    """A camera JPEG stored landscape with an EXIF 'rotate 90' tag is a portrait image, as the reference loads it."""
    import io

    from PIL import Image

    image = Image.new("RGB", (64, 32), (200, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", exif=exif)
    decoded = decode_keyframe(0, buffer.getvalue())
    assert decoded.size == (32, 64)
