"""Ref2VA reference inputs: decoding, resampling, refusals, and parity with diffusers' ref2va setup step.

Parity: diffusers decodes the same files (`MiniMaxH3*Reference.from_file`) and normalizes them with
`MiniMaxH3Ref2VASetupStep`; images, video frames and 32 kHz soundtracks must come out bit-identical, and the frame-grid
and canvas arithmetic exactly equal. Resampling from other rates goes through torchaudio in diffusers, which has no
wheel for torch 2.13: instead the resampler is checked against `windowed_sinc`, the definition of torchaudio's default
resampling (`sinc_interp_hann`) evaluated directly per output sample in float64, to float32 rounding (1e-6), and
against the analytic signal of a sine (1e-3).
"""

from __future__ import annotations

import io
import math
import wave
from types import SimpleNamespace

import av
import numpy as np
import pytest
from PIL import Image

from h3serve.media.mp4 import encode_mp4
from h3serve.pipeline.references import (
    AUDIO,
    IMAGE,
    VIDEO,
    decode_references,
    frame_slots,
    reference_descriptors,
    reference_image_size,
    resample_audio,
    resample_frames,
)
from h3serve.pipeline.rules import CanvasRule, RequestError, resolve_canvas
from oracle import oracle

RNG = np.random.default_rng(0)


def png(width: int = 70, height: int = 50, orientation: int | None = None, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    buf = io.BytesIO()
    if orientation is None:
        image.save(buf, format="PNG")
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        image.save(buf, format="JPEG", exif=exif.tobytes(), quality=95)
    return buf.getvalue()


def wav(seconds: float = 0.5, rate: int = 44100, channels: int = 1, freq: float = 440.0, frames: int | None = None):
    n = round(seconds * rate) if frames is None else frames
    t = np.arange(n) / rate
    sig = 0.5 * np.sin(2 * np.pi * freq * t)
    pcm = np.repeat(sig[:, None], channels, axis=1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((pcm * 32767).round().astype("<i2").tobytes())
    return buf.getvalue()


def mp4(num_frames: int = 48, fps: int = 24, width: int = 64, height: int = 36, sound: bool = True) -> bytes:
    t = np.arange(num_frames)[:, None, None, None]
    y, x = np.mgrid[0:height, 0:width]
    frames = ((x[None, :, :, None] * 4 + t * 10 + y[None, :, :, None] * 2 + np.arange(3) * 60) % 256).astype(np.uint8)
    n = round(num_frames / fps * 32000)
    audio = np.stack([np.sin(np.arange(n) / 32000 * 2 * np.pi * f) * 0.3 for f in (300, 500)]).astype(np.float32)
    buf = io.BytesIO()
    encode_mp4(buf, frames, audio, fps=fps, sample_rate=32000)
    data = buf.getvalue()
    if sound:
        return data
    # The same video without its audio stream: remux the video packets alone.
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(out, "w", format="mp4") as dst:
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                dst.mux(packet)
    return out.getvalue()


# ---------------------------------------------------------------- decoding


def test_kinds_and_shapes_in_request_order():
    refs = decode_references([("a.png", png()), mp4(), ("v.wav", wav())], num_frames=124)
    assert [r.kind for r in refs] == [IMAGE, VIDEO, AUDIO]
    assert [r.index for r in refs] == [0, 1, 2]
    image, video, audio = refs
    assert image.pixels.shape == (2048, 2880, 3) and image.pixels.dtype == np.uint8 and image.source_size == (70, 50)
    # 64x36 is 16:9: the canvas is 1344x768; 48 frames at 24 fps stay 48 (shorter than 124).
    assert video.pixels.shape == (48, 768, 1344, 3) and video.source_fps == 24.0
    assert video.audio.shape[0] == 2 and video.audio.dtype == np.float32 and video.source_sample_rate == 32000
    assert abs(video.audio.shape[1] - 64000) <= 1024  # AAC pads its last frame
    assert video.vae_frames == 39
    assert audio.audio.shape == (2, math.ceil(22050 * 32000 / 44100)) and audio.source_channels == 1
    assert np.array_equal(audio.audio[0], audio.audio[1])
    assert image.name == "a.png" and video.name is None


def test_exif_orientation_is_applied():
    plain = decode_references([png(60, 40, orientation=1), mp4()])[0]
    rotated = decode_references([png(60, 40, orientation=6), mp4()])[0]  # 6: display rotated 90 degrees clockwise
    assert plain.source_size == (60, 40) and rotated.source_size == (40, 60)
    assert plain.pixels.shape == (2048, 3072, 3) and rotated.pixels.shape == (3072, 2048, 3)


def test_video_truncated_to_target_and_resampled_from_30fps():
    refs = decode_references([mp4(num_frames=60, fps=30)], num_frames=22)
    (video,) = refs
    assert video.pixels.shape[0] == 22 and video.source_fps == 30.0
    # Decoding stopped once the 22 target frames were covered: 30/24 * 22 frames plus one.
    assert video.source_frames < 60
    assert video.audio.shape[1] == int(22 / 24 * 32000)  # soundtrack truncated to the generated duration


def test_mute_drops_a_video_soundtrack_and_silent_video_has_none():
    muted, silent = decode_references([mp4(), mp4(sound=False)], mute={0})
    assert muted.audio is None and silent.audio is None and silent.kind == VIDEO
    assert reference_descriptors([muted])[0].audio_latents == 0


def test_sine_resampled_to_32k_matches_the_analytic_signal():
    (_, audio) = decode_references([png(), wav(seconds=0.5, rate=48000, freq=1000.0)])
    t = np.arange(audio.audio.shape[1]) / 32000
    expected = 0.5 * np.sin(2 * np.pi * 1000.0 * t)
    middle = slice(500, -500)  # away from the zero-padded edges
    assert np.abs(audio.audio[0, middle] - expected[middle]).max() < 1e-3
    # The check can fail: a 1 % rate error is far outside the tolerance.
    off = 0.5 * np.sin(2 * np.pi * 1010.0 * t)
    assert np.abs(audio.audio[0, middle] - off[middle]).max() > 1e-2
    assert np.array_equal(resample_audio(audio.audio, 32000), audio.audio)  # 32 kHz passes through


# torchaudio.transforms.Resample's defaults, which diffusers' setup step resamples with: a Hann-windowed sinc of 6 zero
# crossings each side, its cutoff at 0.99 of the lower rate's Nyquist frequency. Written here, not imported from
# h3serve, so that the oracle shares no code or constant with what it checks.
ZERO_CROSSINGS, ROLLOFF = 6, 0.99


def windowed_sinc(x: np.ndarray, rate: int, target: int, rolloff: float = ROLLOFF, exact: bool = False) -> np.ndarray:
    """The oracle: (C, N) at `rate` -> (C, ceil(N * target / rate)) at `target`, float64, each output sample from the
    definition of band-limited interpolation (J. O. Smith, "Digital Audio Resampling"), without polyphase tables.

    Output sample j sits at j / target seconds: y[j] = sum_i x[i] h(i / rate - j / target), over the input samples
    (zero outside the signal), h(t) = (fc / rate) sinc(fc t) cos^2(pi fc t / 2W) for |fc t| <= W zero crossings and 0
    beyond, fc = rolloff * min(rate, target) Hz: the low-pass's zeros are 1 / fc apart and its gain is 1.

    With the rates reduced by their gcd to orig / new, output j = b * new + p is p / new of an input block past input
    b * orig; torchaudio rounds that phase to float32 (its `arange` is float32) before the float64 arithmetic, which
    moves its numbers by up to 3e-5 at 44.1 kHz. `exact` keeps the phase exact (the definition alone); without it the
    phase is rounded as torchaudio's, so that the oracle is torchaudio's numbers to float32 rounding.
    """
    n = x.shape[1]
    m = -(-n * target // rate)
    g = math.gcd(rate, target)
    orig, new = rate // g, target // g
    reach = math.ceil(ZERO_CROSSINGS / rolloff * orig / min(orig, new)) + 1  # inputs each side of an output's time
    block, phase = np.divmod(np.arange(m)[:, None], new)
    phase = phase / new if exact else (phase / new).astype(np.float32).astype(np.float64)
    i = block * orig + (phase * orig).astype(np.int64) + np.arange(-reach, reach + 1)[None, :]  # (M, taps)
    t = rolloff * min(orig, new) * ((i - block * orig) / orig - phase)  # fc * (i / rate - j / target)
    h = rolloff * min(orig, new) / orig * np.sinc(t) * np.cos(np.pi * t / (2 * ZERO_CROSSINGS)) ** 2
    h = np.where((np.abs(t) <= ZERO_CROSSINGS) & (i >= 0) & (i < n), h, 0.0)
    return np.einsum("mt,cmt->cm", h, x.astype(np.float64)[:, np.clip(i, 0, n - 1)])


def noise(channels: int, n: int, seed: int = 0) -> np.ndarray:
    """White noise: energy up to Nyquist, so that the filter's pass band, transition and stop band all count."""
    return np.random.default_rng(seed).uniform(-1, 1, (channels, n)).astype(np.float32)


@pytest.mark.parametrize("rate", [44100, 48000, 22050, 16000, 8000, 96000, 11025, 37800])
def test_resampling_is_the_windowed_sinc(rate):
    x = noise(2, round(0.3 * rate))
    ours = resample_audio(x, rate)
    want = windowed_sinc(x, rate, 32000)
    assert ours.shape == want.shape and ours.dtype == np.float32
    # float32 taps and sums against float64: a few units of float32's last place on samples of up to 1 (measured: at
    # most 3.3e-7).
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-6)
    # The definition itself, the phases exact: within the float32 phases' shift (measured: at most 2.7e-5, 22.05 kHz).
    np.testing.assert_allclose(ours, windowed_sinc(x, rate, 32000, exact=True), rtol=0, atol=5e-5)
    # The check can fail: the same filter with its cutoff at 0.98 of Nyquist instead of 0.99 is 1.9e-2 away or more.
    assert np.abs(ours - windowed_sinc(x, rate, 32000, rolloff=0.98)).max() > 1e-2


def test_reference_soundtracks_are_truncated_upmixed_and_resampled_as_diffusers_does():
    """diffusers' `_normalize_audio_condition`: truncated to the generated duration at the source rate, a mono channel
    repeated, then one resampling pass (torchaudio's, here its definition)."""
    for rate, channels in ((44100, 1), (48000, 2), (22050, 2), (16000, 1)):
        data = wav(seconds=1.2, rate=rate, channels=channels)  # longer than the 22 frames' 0.92 s: truncated
        ours = decode_references([png(), data], num_frames=22)[1].audio
        with wave.open(io.BytesIO(data)) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, channels).T / 32768.0
        pcm = np.repeat(pcm, 2 // channels, axis=0)[:, : int(22 / 24 * rate)].astype(np.float32)
        want = windowed_sinc(pcm, rate, 32000)
        assert ours.shape == want.shape == (2, -(-int(22 / 24 * rate) * 32000 // rate))
        np.testing.assert_allclose(ours, want, rtol=0, atol=1e-6)


def test_descriptors():
    image, video, audio = decode_references([png(), mp4(num_frames=48), wav(seconds=0.5)])
    blocks = reference_descriptors([image, video, audio])
    assert blocks[0].kind == "image" and (blocks[0].latent_height, blocks[0].latent_width) == (128, 180)
    assert blocks[1].kind == "video" and blocks[1].latent_frames == 12  # 48 -> 39 = 17*2+5 -> 5*2+2
    assert (blocks[1].latent_height, blocks[1].latent_width) == (48, 84)
    assert blocks[1].audio_latents == math.ceil(video.audio.shape[1] / 800)
    assert blocks[2].audio_latents == math.ceil(audio.audio.shape[1] / 800) == 20


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "items,index,words",
    [
        (lambda: [png(), b"not a media file"], 1, "could not be decoded"),
        (lambda: [png(), b""], 1, "empty"),
        (lambda: [png(), "x.png"], 1, "bytes"),
        (lambda: [], None, "at least one"),
        (lambda: [png()] * 10, 9, "at most 9 image"),
        (lambda: [mp4()] * 4, 3, "at most 3 video"),
        (lambda: [png()] + [wav()] * 4, 4, "at most 3 audio"),
        (lambda: [png()] * 9 + [mp4()] * 3 + [wav()], 12, "at most 12"),
        (lambda: [wav(), wav()], 0, "only reference"),
        (lambda: [png(), png(500, 100)], 1, "aspect ratio"),
        (lambda: [mp4(num_frames=10)], 0, "too short"),
        (lambda: [mp4(width=320, height=32)], 0, "aspect ratio"),
        (lambda: [png(), wav(channels=3)], 1, "3 channels"),
        (lambda: [png(), wav(frames=0)], 1, "no decodable samples"),
    ],
)
def test_refusals_name_the_reference(items, index, words):
    """The field and the reference's position are attributes, and the message starts with the reference it names."""
    with pytest.raises(RequestError) as excinfo:
        decode_references(items())
    err = excinfo.value
    assert (err.field, err.index) == ("references", index), str(err)
    if index is not None:
        assert str(err).startswith(f"references[{index}] "), str(err)
    assert words in str(excinfo.value)


def test_mute_must_name_a_video():
    with pytest.raises(RequestError, match=r"^mute_references: references\[0\] is not a video") as excinfo:
        decode_references([png(), mp4()], mute={0})
    err = excinfo.value
    assert (err.field, err.index, err.of) == ("mute_references", 0, "references")
    # A front end names both fields its own way from the attributes, without touching the text.
    names = {"mute_references": "--mute-ref", "references": "--ref"}
    assert err.describe(names) == "--mute-ref: --ref[0] is not a video reference"


def test_named_reference_appears_in_the_message():
    with pytest.raises(RequestError, match=r"^references\[0\] \(face\.png\) could not be decoded") as excinfo:
        decode_references([("face.png", b"garbage")])
    err = excinfo.value
    assert (err.field, err.index, err.name) == ("references", 0, "face.png")
    assert err.describe({"references": "input_references"}).startswith("input_references[0] (face.png) could not")
    # The reason alone, without the label, for a front end that lays the label out itself.
    assert err.message.startswith("could not be decoded as an image, a video or an audio file")


# ---------------------------------------------------------------- parity with diffusers


@pytest.fixture(scope="module")
def diffusers_setup():
    be = oracle("diffusers.modular_pipelines.minimax_h3.before_encoder")
    refs = oracle("diffusers.modular_pipelines.minimax_h3.references")
    mp = oracle("diffusers.modular_pipelines.minimax_h3.modular_pipeline")
    processor = oracle("diffusers.image_processor").VaeImageProcessor(vae_scale_factor=16)
    pipe_state = oracle("diffusers.modular_pipelines").PipelineState
    components = SimpleNamespace(
        canvas_multiple=32,
        config=SimpleNamespace(canvas_short_edge=768, canvas_max_pixels=768 * 1344, reference_image_short_edge=2048),
        image_processor=processor,
        fps=24,
        audio_sampling_rate=32000,
        vae_frames_per_chunk=17,
        vae_latents_per_chunk=5,
        min_duration=5.0,
        max_duration=15.0,
    )

    def normalize(references, num_frames):
        state = pipe_state()
        state.set("references", references)
        state.set("num_frames", num_frames)
        _, state = be.MiniMaxH3Ref2VASetupStep()(components, state)
        return state.get("normalized_references")

    return SimpleNamespace(be=be, refs=refs, mp=mp, normalize=normalize)


def test_files_match_diffusers_decode_and_setup(diffusers_setup, tmp_path):
    d = diffusers_setup
    files = {"a.jpg": png(90, 50, orientation=8), "b.png": png(33, 61, seed=3), "c.mp4": mp4(num_frames=60, fps=30)}
    loaders = {"a.jpg": d.refs.MiniMaxH3ImageReference, "b.png": d.refs.MiniMaxH3ImageReference}
    loaders["c.mp4"] = d.refs.MiniMaxH3VideoReference
    theirs_in = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        theirs_in.append(loaders[name].from_file(tmp_path / name))
    theirs = d.normalize(theirs_in, 124)
    ours = decode_references(list(files.items()), num_frames=124)
    for mine, ref in zip(ours[:2], theirs[:2], strict=True):
        assert np.array_equal(mine.pixels, np.asarray(ref.image))
    assert np.array_equal(ours[2].pixels, ref_frames := theirs[2].frames), (ours[2].pixels.shape, ref_frames.shape)
    assert np.array_equal(ours[2].audio, theirs[2].audio.numpy())  # 32 kHz soundtrack: no resampling, exact
    # The encoder's snap-down and latent count, exact.
    f = ours[2].pixels.shape[0]
    snapped = max(1, (f - 5) // 17) * 17 + 5
    assert ours[2].vae_frames == snapped
    assert reference_descriptors(ours)[2].latent_frames == d.mp.video_latent_num_frames(snapped, 17, 5)


@pytest.mark.parametrize("fps", [24.0, 30.0, 25.0, 60.0, 23.976, 12.0, 29.97, 15.0])
@pytest.mark.parametrize("count", [1, 7, 40, 100])
@pytest.mark.parametrize("num_frames", [22, 124, 362])
def test_frame_grid_matches_diffusers(diffusers_setup, fps, count, num_frames):
    # A 32x64 canvas rule keeps the frames at their size, so only the frame selection is compared.
    frames = np.zeros((count, 32, 64, 3), np.uint8)
    frames[:, 0, 0, 0] = np.arange(count) % 256
    frames[:, 0, 0, 1] = np.arange(count) // 256
    theirs = diffusers_setup.be.MiniMaxH3Ref2VASetupStep._normalize_video_condition(
        frames, fps, num_frames, 32, 32, 32 * 64, 24.0
    )
    ours = resample_frames(frames, fps, num_frames)
    assert np.array_equal(ours, theirs), (ours.shape, theirs.shape)
    assert frame_slots(count, fps).sum() == math.floor(count * 24 / fps + 0.5)


@pytest.mark.parametrize("size", [(70, 50), (50, 70), (1920, 1080), (4000, 1000), (33, 61), (2048, 2048), (17, 9)])
def test_image_size_and_video_canvas_match_diffusers(diffusers_setup, size):
    d = diffusers_setup
    width, height = size
    image = Image.fromarray(RNG.integers(0, 256, (height, width, 3), dtype=np.uint8))
    theirs = d.normalize([d.refs.MiniMaxH3ImageReference(image=image)], 124)[0].image
    assert reference_image_size(width, height) == theirs.size
    h, w = d.mp.resolve_canvas_size(width, height, 32, 768, 768 * 1344)
    assert resolve_canvas(width, height, CanvasRule()) == (w, h)
