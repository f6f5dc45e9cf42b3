"""Ref2VA through the engine and `h3serve render --ref` with the built-in tiny model (its tiny Ref2VA DiT): which DiTs
an engine loads and what it then refuses, that the references stay fixed through the loop and reach the result, the
render's determinism, and the CLI's errors. Parity with diffusers is tests/test_ref2va_e2e.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.accel.profile import Profile
from h3serve.cli import main
from h3serve.media.mp4 import probe_mp4
from h3serve.model.tiny import tiny_components
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import RequestError

PROMPT = "A red fox trots through fresh snow at dawn."


def png(seed: int, width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    import wave

    t = np.arange(int(seconds * rate)) / rate
    samples = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(rate)
        f.writeframes(samples.tobytes())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(None, Profile.for_device("cpu"), task_type="both")


def test_task_type_selects_the_dits_and_their_tasks():
    for task_type, dits, tasks in (
        ("fl2va", ("fl2va",), ("t2va", "i2va", "l2va", "fl2va")),
        ("ref2va", ("ref2va",), ("ref2va",)),
        ("both", ("fl2va", "ref2va"), ("t2va", "i2va", "l2va", "fl2va", "ref2va")),
    ):
        components = tiny_components(task_type=task_type)
        assert tuple(components.dits) == dits and components.task_type == task_type
        assert Engine(components, Profile.for_device("cpu")).tasks == tasks
    with pytest.raises(ValueError, match="task type must be one of fl2va, ref2va, both, got 'all'"):
        tiny_components(task_type="all")


def test_the_two_tiny_dits_share_a_shape_not_weights(engine):
    fl2va, ref2va = engine.components.dit, engine.components.ref_dit
    assert fl2va.config == ref2va.config
    assert not torch.equal(fl2va.blocks[0].attn.qkv_proj.weight, ref2va.blocks[0].attn.qkv_proj.weight)


@pytest.mark.parametrize(
    ("task_type", "task", "message"),
    [
        ("fl2va", "ref2va", "task ref2va needs the Ref2VA DiT .* started with task type fl2va .* H3_TASK_TYPE"),
        ("ref2va", "t2va", "task t2va needs the FL2VA DiT .* started with task type ref2va .* H3_TASK_TYPE"),
        ("ref2va", "fl2va", "task fl2va needs the FL2VA DiT"),
    ],
)
def test_a_task_whose_dit_is_not_loaded_is_refused_before_anything_decodes(task_type, task, message):
    engine = Engine.load(None, Profile.for_device("cpu"), task_type=task_type)
    extra = {"references": [b"not even a file"]} if task == "ref2va" else {}
    with pytest.raises(RequestError, match=message) as err:
        engine.validate(RequestFields(PROMPT, task=task, steps=3, **extra))
    assert err.value.field == "task"


@pytest.mark.parametrize(
    ("kwargs", "field", "index", "message"),
    [
        (dict(task="ref2va"), "references", None, "needs at least one reference file"),
        (dict(task="t2va", references=[b"x"]), "references", None, "only task ref2va takes references"),
        (dict(task="ref2va", references=[b"x"], keyframes=[b"x"]), "keyframes", None, "takes 0 keyframe"),
        (dict(task="ref2va", references=[wav()]), "references", 0, "audio cannot be the only reference"),
        (dict(task="ref2va", references=[png(1, 64, 64), b"junk"]), "references", 1, "could not be decoded"),
        (dict(task="ref2va", references=[png(1, 64, 64)], mute_references=[0]), "mute_references", 0, "not a video"),
        (dict(task="ref2va", references=[png(1, 64, 64)] * 10), "references", 9, "at most 9 image references"),
    ],
)
def test_bad_references_are_refused_naming_the_position(engine, kwargs, field, index, message):
    with pytest.raises(RequestError, match=message) as err:
        engine.validate(RequestFields(PROMPT, steps=3, **kwargs))
    assert (err.value.field, err.value.index) == (field, index)


def test_references_ride_through_the_loop_unchanged_and_reach_the_result(engine, monkeypatch):
    """The reference video and audio rows the DiT sees at every forward are the ones the loop started from (the
    video ones noised once to t = 0.999, the audio ones clean), and they change the render."""
    import h3serve.pipeline.engine as engine_module

    seen = []
    denoise = engine_module.denoise

    def spy(model, video_rows, audio_rows, layout, schedule, on_step=None, on_estimate=None):
        def recording(video, audio, *rest):
            seen.append(
                (video[: layout.num_condition_video_rows].clone(), audio[: layout.num_condition_audio_rows].clone())
            )
            return model(video, audio, *rest)

        seen.append((video_rows[: layout.num_condition_video_rows], audio_rows[: layout.num_condition_audio_rows]))
        out = denoise(recording, video_rows, audio_rows, layout, schedule, on_step, on_estimate)
        seen.append((out[0][: layout.num_condition_video_rows], out[1][: layout.num_condition_audio_rows]))
        return out

    monkeypatch.setattr(engine_module, "denoise", spy)
    request = engine.validate(RequestFields(PROMPT, task="ref2va", steps=4, seed=3, references=[png(1, 64, 48), wav()]))
    result = engine.render(request)
    start_video, start_audio = seen[0]
    assert start_video.shape[0] > 0 and start_audio.shape[0] > 0  # an image's rows, the audio's clean rows
    assert len(seen) == 2 + 3  # the start, three forwards, the end
    for video, audio in seen[1:]:
        assert torch.equal(video, start_video) and torch.equal(audio, start_audio)

    monkeypatch.setattr(engine_module, "denoise", denoise)
    again = engine.render(request)
    np.testing.assert_array_equal(result.frames, again.frames)  # deterministic
    np.testing.assert_array_equal(result.audio, again.audio)
    other = engine.render(
        engine.validate(RequestFields(PROMPT, task="ref2va", steps=4, seed=3, references=[png(2, 64, 48), wav()]))
    )
    assert np.abs(other.frames.astype(np.int16) - result.frames.astype(np.int16)).mean() > 0.1  # 0.23 measured
    t2va = engine.render(engine.validate(RequestFields(PROMPT, task="t2va", steps=4, seed=3)))
    assert np.abs(t2va.audio - result.audio).mean() > 1e-4


def test_a_ref2va_only_engine_warms_up_with_a_reference_and_prepares_its_tables():
    engine = Engine.load(None, Profile.for_device("cpu"), task_type="ref2va")
    from h3serve.service.warmup import run_warmup  # the startup warmup is the service's

    warmup = run_warmup(engine)
    assert warmup.passed and warmup.request.startswith("ref2va "), warmup
    made = set(engine.tables["ref2va"]._cache)
    assert len(made) == 3  # the default schedule without and with reference audio, and the warmup's own
    request = engine.validate(RequestFields(PROMPT, task="ref2va", steps=50, seed=0, references=[png(1, 64, 48)]))
    from h3serve.pipeline.layout import MediaGeometry, build_ref2va_layout
    from h3serve.pipeline.references import reference_descriptors
    from h3serve.pipeline.sampling import step_timesteps
    from h3serve.pipeline.schedule import DualSchedule

    layout = build_ref2va_layout(
        [1] * 7, reference_descriptors(request.references), MediaGeometry.from_pixels(128, 224, 22)
    )
    engine.tables["ref2va"].for_steps(step_timesteps(layout, DualSchedule.build(50, 12.0, 3.0)))
    assert set(engine.tables["ref2va"]._cache) == made  # found, not made again


def test_cli_ref_renders_ref2va(tmp_path, capsys):
    image, audio = tmp_path / "look.png", tmp_path / "sound.wav"
    image.write_bytes(png(1, 64, 48))
    audio.write_bytes(wav())
    out = tmp_path / "ref.mp4"
    code = main(["render", PROMPT, "--ref", str(image), "--ref", str(audio), "-o", str(out), "--steps", "3",
                 "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert "h3serve: ref2va 224x128" in capsys.readouterr().err
    info = probe_mp4(out)
    assert (info.width, info.height, info.frame_count, info.channels) == (224, 128, 22, 2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ref", "{img}", "--first", "{img}"], "--ref selects Ref2VA, which takes references instead of keyframes"),
        (["--mute-ref", "0"], "--mute-ref applies to a video given with --ref"),
        (["--ref", "{missing}"], "--ref .*missing.png: cannot read it"),
        (["--ref", "{junk}"], "--ref .*junk.bin: references\\[0\\] \\(junk.bin\\) could not be decoded"),
        (["--ref", "{img}", "--mute-ref", "0"], "not a video reference"),
    ],
)
def test_cli_ref_errors_are_one_line_and_write_nothing(tmp_path, capsys, flags, message):
    img, junk = tmp_path / "img.png", tmp_path / "junk.bin"
    img.write_bytes(png(1, 64, 48))
    junk.write_bytes(b"\x00" * 64)
    paths = {"img": img, "junk": junk, "missing": tmp_path / "missing.png"}
    out = tmp_path / "x.mp4"
    code = main(
        ["render", PROMPT, "-o", str(out), "--steps", "3", "--no-progress", *(f.format(**paths) for f in flags)]
    )
    err = capsys.readouterr().err
    assert code == 1 and not out.exists()
    assert err.startswith("h3serve: error: ") and err.count("\n") == 1, err
    import re

    assert re.search(message, err), err


def test_a_request_larger_than_the_memory_plan_is_refused(engine):
    """The plan covers the largest keyframe request (tiny: 4,258 rows besides the prompt: 362 frames of 224x128 and
    two keyframes); nine 4:1 images (64 rows each at the tiny short edge) beside the longest target (4,202 rows)
    pack 4,778; at 300 frames (311 on the grid: 3,250 rows) they fit."""
    wide = [png(i, 200, 50) for i in range(9)]
    with pytest.raises(
        RequestError, match=r"packs 576 reference rows and 4202 rows .* 4778 in all; .* covers 4258"
    ) as err:
        engine.validate(RequestFields(PROMPT, task="ref2va", steps=3, num_frames=362, references=wide))
    assert err.value.field == "references"
    request = engine.validate(RequestFields(PROMPT, task="ref2va", steps=3, num_frames=300, references=wide))
    assert len(request.references) == 9
