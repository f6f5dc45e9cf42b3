"""`h3serve render` end to end with the built-in tiny model: four modes, the MP4 checked by decoding it,
determinism, and every user error (one line, non-zero exit, no partial file)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from folder_fixtures import write_config_folder
from h3serve.accel.profile import Profile
from h3serve.cli import main
from h3serve.media.mp4 import audio_psnr, decode_audio, decode_frames, frame_hashes, probe_mp4
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

STEPS = ["--steps", "3", "--no-progress"]


@pytest.fixture(scope="module")
def keyframes(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("keyframes")
    rng = np.random.default_rng(0)
    first, last = folder / "first.png", folder / "last.jpg"
    Image.fromarray(rng.integers(0, 255, (90, 160, 3), dtype=np.uint8)).save(first)
    Image.fromarray(rng.integers(0, 255, (120, 120, 3), dtype=np.uint8)).save(last)
    return first, last


def render(tmp_path: Path, *extra: str, name: str = "out.mp4") -> tuple[int, Path]:
    out = tmp_path / name
    code = main(["render", "a red fox runs through fresh snow", "-o", str(out), *STEPS, *extra])
    return code, out


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(
    ("mode", "flags", "size", "frames"),
    [
        ("t2va", [], (224, 128), 22),  # the tiny model's default 16:9 canvas and length
        ("i2va", ["--width", "128", "--height", "96", "--frames", "30"], (128, 96), 39),  # 30 snaps up to 39
        ("l2va", ["--width", "160", "--height", "64", "--seconds", "1"], (160, 64), 39),  # 24 frames -> 39
        ("fl2va", ["--width", "96", "--height", "96"], (96, 96), 22),
    ],
)
def test_render_each_mode_writes_a_valid_mp4(tmp_path, keyframes, mode, flags, size, frames, capsys):
    keyframe_flags = {
        "t2va": [],
        "i2va": ["--first", str(keyframes[0])],
        "l2va": ["--last", str(keyframes[1])],
        "fl2va": ["--first", str(keyframes[0]), "--last", str(keyframes[1])],
    }[mode]
    code, out = render(tmp_path, *flags, *keyframe_flags)
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"h3serve: {mode} {size[0]}x{size[1]} {frames} frames" in err
    assert f"wrote {out}" in err and "denoise" in err
    assert "(after the decode; x264 ultrafast crf 18, 8 threads, segments of 62 frames)" in err  # what made the bytes
    info = probe_mp4(out)
    assert (info.video_codec, info.pixel_format, info.width, info.height) == ("h264", "yuv420p", *size)
    assert info.fps == 24.0 and info.frame_count == frames and (frames - 5) % 17 == 0
    assert (info.audio_codec, info.audio_profile, info.channels, info.sample_rate) == ("aac", "LC", 2, 32000)
    # The audio covers the frames to within one AAC frame (1024 samples).
    assert abs(info.audio_duration_s - frames / 24) <= 1024 / 32000
    assert leftovers(tmp_path) == ["out.mp4"]


def test_same_seed_same_render_other_seed_differs(tmp_path, keyframes):
    flags = ["--first", str(keyframes[0]), "--seed", "7"]
    assert render(tmp_path, *flags, name="a.mp4")[0] == 0
    assert render(tmp_path, *flags, name="b.mp4")[0] == 0
    assert render(tmp_path, "--first", str(keyframes[0]), "--seed", "8", name="c.mp4")[0] == 0
    a, b, c = (tmp_path / n for n in ("a.mp4", "b.mp4", "c.mp4"))
    assert frame_hashes(decode_frames(a)) == frame_hashes(decode_frames(b))
    assert np.array_equal(decode_audio(a), decode_audio(b))
    assert audio_psnr(decode_audio(a), decode_audio(b)) == float("inf")
    assert a.read_bytes() == b.read_bytes()  # same versions, pinned encoder threads
    assert frame_hashes(decode_frames(a)) != frame_hashes(decode_frames(c))


def test_engine_render_is_deterministic_before_encoding():
    engine = Engine.load(None, Profile.for_device("cpu"))
    request = engine.validate(RequestFields("waves on a pebble beach", num_frames=22, steps=4, seed=11))
    one, two = engine.render(request), engine.render(request)
    assert np.array_equal(one.frames, two.frames) and np.array_equal(one.audio, two.audio)
    assert one.frames.shape == (22, 128, 224, 3) and one.frames.dtype == np.uint8
    assert one.audio.shape == (2, round(22 / 24 * 40) * 800) and np.abs(one.audio).max() <= 1.0
    # Off the clamp: equal samples are then a real comparison, not two saturated waveforms.
    assert (np.abs(one.audio) >= 0.999).mean() < 0.01 and one.audio.std() > 1e-3
    assert set(one.timings) == {"text", "keyframes", "layout", "tables", "denoise", "video", "audio", "total"}
    other = engine.render(engine.validate(RequestFields("waves on a pebble beach", num_frames=22, steps=4, seed=12)))
    assert not np.array_equal(one.frames, other.frames) and not np.array_equal(one.audio, other.audio)


def test_static_request_work_runs_once_not_per_step():
    """The token refiner and the RoPE table are computed once per request, however many steps run."""
    engine = Engine.load(None, Profile.for_device("cpu"))
    dit = engine.components.dit
    calls = {"refine_text": 0, "rope": 0, "forward": 0}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    dit.refine_text = count("refine_text", dit.refine_text)
    dit.rope.register_forward_hook(lambda *_: calls.__setitem__("rope", calls["rope"] + 1))
    dit.register_forward_hook(lambda *_: calls.__setitem__("forward", calls["forward"] + 1))
    engine.render(engine.validate(RequestFields("rain on a tin roof", num_frames=22, steps=6)))
    assert calls == {"refine_text": 1, "rope": 1, "forward": 5}


def test_console_script_renders_in_a_fresh_process(tmp_path):
    exe = shutil.which("h3serve", path=os.path.dirname(sys.executable))
    assert exe is not None, "the h3serve console script is not installed beside this Python"
    out = tmp_path / "fox.mp4"
    proc = subprocess.run([exe, "render", "a fox", "-o", str(out), *STEPS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert probe_mp4(out).frame_count == 22


# ----------------------------------------------------------------------------------------------- errors


def expect_error(tmp_path, capsys, *flags: str, message: str, prompt: str | None = "a fox") -> None:
    out = tmp_path / "out.mp4"
    args = ["render", *([prompt] if prompt is not None else []), *STEPS, *flags]
    if "-o" not in flags:
        args += ["-o", str(out)]
    before = leftovers(tmp_path)
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    # one line, or a settings refusal: its header and one line per refused setting
    assert err[-1].startswith(("h3serve: error: ", "  - ")) and message in err[-1], err
    assert sum(line.startswith("h3serve: error: ") for line in err) == 1, err
    assert leftovers(tmp_path) == before  # no output, no temporary file


def test_error_missing_model_files(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    expect_error(tmp_path, capsys, "--model", str(model), message="has no transformer/")
    expect_error(tmp_path, capsys, "--model", str(tmp_path / "absent"), message="does not exist")


def test_error_model_with_unreadable_weights_leaves_no_file(tmp_path, capsys):
    """Configs that fit together pass the checks; the corrupt weights then stop the load, naming the file."""
    model = write_config_folder(tmp_path / "model")
    (model / "transformer" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    expect_error(tmp_path, capsys, "--model", str(model), "--device", "cpu", message="model.safetensors")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--width", "100", "--height", "64"], "width must be a positive multiple of 32, got 100"),
        (["--width", "128"], "width and height must be given together"),
        (["--width", "2048", "--height", "2048"], "above the canvas area cap"),
        (["--frames", "5000"], "num_frames must be 22..362"),
        (["--frames", "0"], "num_frames must be >= 22"),
        (["--seconds", "-1"], "--seconds must be a finite number > 0"),
        (["--threads", "0"], "H3_ENCODER_THREADS (--encoder-threads): Input should be greater than or equal to 1"),
        (
            ["--encoder-threads", "65"],
            "H3_ENCODER_THREADS (--encoder-threads): Input should be less than or equal to 64",
        ),
        (["--video-shift", "1e6", "--steps", "50"], "steps=50 with video_shift=1e+06 and audio_shift=3 collapses"),
        (["--steps", "1"], "steps must be 2..1000"),
        (["--video-shift", "0"], "video_shift must be a finite number > 0"),
        (["--seed", "-3"], "seed must be 0..9223372036854775807"),
        (["--device", "tpu"], "device must be 'cpu' or 'cuda[:N]'"),
        (["--device", "cpu", "--vae-autocast", "float16"], "vae_autocast float16 needs a CUDA device"),
    ],
)
def test_error_invalid_request(tmp_path, capsys, flags, message):
    expect_error(tmp_path, capsys, *flags, message=message)


@pytest.mark.parametrize("seconds", ["inf", "nan", "\u0665"])
def test_seconds_not_written_in_ascii_digits_are_a_usage_error_naming_the_flag(tmp_path, capsys, seconds):
    """argparse reads --seconds by the settings' rule (`errors.decimal_number`): a usage error (exit 2) in a line
    that names the flag and what to write, and no file."""
    before = leftovers(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["render", "a fox", *STEPS, "--seconds", seconds, "-o", str(tmp_path / "out.mp4")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert "--seconds" in err[0] and "digits 0-9" in err[0], err
    assert leftovers(tmp_path) == before


def test_error_unreadable_keyframe(tmp_path, capsys):
    expect_error(tmp_path, capsys, "--first", str(tmp_path / "nope.png"), message="--first")
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image")
    expect_error(tmp_path, capsys, "--last", str(garbage), message="--last")


def test_error_unwritable_output(tmp_path, capsys):
    expect_error(tmp_path, capsys, "-o", str(tmp_path / "missing" / "x.mp4"), message="does not exist")
    expect_error(tmp_path, capsys, "-o", str(tmp_path / "x.mov"), message="must end in .mp4")
    folder = tmp_path / "dir.mp4"
    folder.mkdir()
    expect_error(tmp_path, capsys, "-o", str(folder), message="is a folder")


def test_error_prompt(tmp_path, capsys):
    expect_error(tmp_path, capsys, message="a prompt is required", prompt=None)
    expect_error(tmp_path, capsys, "--prompt-file", str(tmp_path / "none.txt"), message="--prompt-file", prompt=None)
    expect_error(tmp_path, capsys, message="prompt must be a non-empty string", prompt="   ")


def test_prompt_file_is_read_verbatim(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("integrated_multimodal_description: [Shot 1] A fox.\n\noverall_soundscape: wind.")
    code = main(["render", "--prompt-file", str(prompt), "-o", str(tmp_path / "p.mp4"), *STEPS])
    assert code == 0, capsys.readouterr().err
    assert probe_mp4(tmp_path / "p.mp4").frame_count == 22


def test_existing_output_survives_a_failed_render(tmp_path, capsys):
    out = tmp_path / "keep.mp4"
    out.write_bytes(b"previous render")
    code = main(["render", "a fox", "-o", str(out), "--frames", "9999", *STEPS])
    assert code == 1 and out.read_bytes() == b"previous render"


def test_render_uses_float32_on_cpu_by_default():
    profile = Profile.for_device("cpu")
    assert (profile.dtype, profile.vae_autocast) == ("float32", "none")
    engine = Engine.load(None, profile)
    assert engine.components.dit.blocks[0].attn.qkv_proj.weight.dtype == torch.float32


def test_internal_failure_is_one_line_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    """A failure inside the render (here: the engine raising as on a CUDA out-of-memory) is reported in one line."""

    def fail(self, request, ctx=None, on_step=None):
        raise RuntimeError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(Engine, "render", fail)
    expect_error(tmp_path, capsys, message="render failed: RuntimeError: CUDA out of memory")


def test_non_finite_latents_are_refused_not_written_as_black(tmp_path):
    engine = Engine.load(None, Profile.for_device("cpu"))
    with torch.no_grad():
        engine.components.dit.final_layer.video_out.bias.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="denoised latents are not finite"):
        engine.render(engine.validate(RequestFields("a fox", num_frames=22, steps=3)))
