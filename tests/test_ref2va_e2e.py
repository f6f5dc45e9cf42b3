"""Ref2VA end to end against diffusers: one tiny checkpoint folder (diffusers layout, with `transformer_ref/`), the same
reference files, rendered by our `Engine` and by diffusers' modular pipeline (its `ref2va` workflow, picked by
`references=[...]`), gives the same frames and the same audio samples (CPU, float32).

Three requests, as the Ref2VA issue asks: two images of different aspect ratios; one video with its soundtrack (30 fps
H.264 with 44.1 kHz AAC, so both the frame grid and the audio resampler run); an image with an audio clip (a 22.05
kHz mono WAV). Each side reads the same files its own way: ours as bytes through `Engine.validate`, diffusers through
the reference classes' `from_file`, as its users do. Everything after that is each side's own: normalization onto the
model's grids, presentation and text encoding, reference encoding, layout, noise, schedule, loop, decoders.

The geometry is shrunk on both sides alike, to keep the CPU run short: our `RequestRules` and diffusers' pipeline
config (`canvas_short_edge`, `canvas_max_pixels`, `reference_image_short_edge`) get the same small values.

Two stand-ins for what this machine lacks, both confined to the oracle's side and both code of the libraries
themselves: Qwen3-VL's video processor with its three torchvision calls replaced by plain torch (from
test_ref2va_presentation.py, checked there to be a no-op resize at these sizes), and, where torchaudio is not
installed, `torchaudio.transforms.Resample` transcribed from torchaudio 2.11 (`_get_sinc_resample_kernel` with the
Hann window and `_apply_sinc_resample_kernel`, verbatim but for the unused branches), which diffusers imports to put a
reference soundtrack on 32 kHz.
"""

from __future__ import annotations

import importlib.util
import io
import math
import sys
import types
import wave
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.accel.profile import Profile
from h3serve.checkpoint.folder import load_components, resolve_model_folder
from h3serve.media.mp4 import encode_mp4
from h3serve.model.text_encoder import load_image_processor
from h3serve.pipeline.conditioning import VideoProcessing, encode_text
from h3serve.pipeline.engine import Engine, RenderResult
from h3serve.pipeline.layout import MediaGeometry, build_ref2va_layout
from h3serve.pipeline.references import reference_descriptors
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import CanvasRule, FrameRule, RequestRules
from oracle import oracle

oracle("diffusers")
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Transformer3DModel,
    ModularPipeline,
)
from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)

from e2e_fixtures import write_tiny_checkpoint
from test_e2e_parity import load_diffusers_model
from test_ref2va_presentation import PilQwen3VLProcessor, TorchOnlyVideoProcessor

PROMPT = "[Shot 1] <Picture 1> walks along a snowy ridge at dawn while <Audio 1> plays; the camera follows."
WIDTH, HEIGHT = 128, 64
NUM_FRAMES = 124  # diffusers' shortest (5 s): 37 latent frames, 207 audio latents per channel
STEPS = 4
SEED = 7
# Small on both sides: reference images at a 64 px short edge, reference videos on a 64 px short edge canvas.
SHORT_EDGE, MAX_PIXELS, IMAGE_SHORT_EDGE = 64, 64 * 128, 64
RULES = RequestRules(
    canvas=CanvasRule(max_pixels=MAX_PIXELS, default_short_edge=SHORT_EDGE),
    frames=FrameRule(),
    warmup_size=None,
    warmup_frames=None,
    reference_short_edge=IMAGE_SHORT_EDGE,
)
VIDEO_FPS, VIDEO_FRAMES, VIDEO_RATE = 30, 33, 44100  # 33 frames at 30 fps: 26 on the 24 fps grid, a 22-frame prefix
WAV_RATE = 22050
CASES = {
    "two_images": ("wide.png", "tall.jpg"),
    "video_with_sound": ("clip.mp4",),
    "image_and_audio": ("tall.jpg", "voice.wav"),
}
LOADERS = {
    ".png": MiniMaxH3ImageReference,
    ".jpg": MiniMaxH3ImageReference,
    ".mp4": MiniMaxH3VideoReference,
    ".wav": MiniMaxH3AudioReference,
}


# ---------------------------------------------------------------- the files


def image_file(width: int, height: int, seed: int, fmt: str) -> bytes:
    """A smooth pattern with some noise, so that neither the resize nor the VAE sees a flat or a white-noise image."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    noise = np.random.default_rng(seed).normal(0, 20, base.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(buf, format=fmt, quality=90)
    return buf.getvalue()


def video_file() -> bytes:
    """H.264 at 30 fps, 80x48 (5:3: its own canvas is not the target's), stereo AAC at 44.1 kHz."""
    t = np.arange(VIDEO_FRAMES)[:, None, None, None]
    y, x = np.mgrid[0:48, 0:80]
    frames = ((x[None, :, :, None] * 3 + t * 9 + y[None, :, :, None] * 2 + np.arange(3) * 70) % 256).astype(np.uint8)
    n = round(VIDEO_FRAMES / VIDEO_FPS * VIDEO_RATE)
    s = np.arange(n) / VIDEO_RATE
    audio = np.stack([0.4 * np.sin(2 * np.pi * 330 * s), 0.3 * np.sin(2 * np.pi * 550 * s + 1.0)]).astype(np.float32)
    buf = io.BytesIO()
    encode_mp4(buf, frames, audio, fps=VIDEO_FPS, sample_rate=VIDEO_RATE)
    return buf.getvalue()


def wav_file(seconds: float = 1.5) -> bytes:
    """Mono 16-bit PCM at 22.05 kHz: a gliding tone with a little noise."""
    n = round(seconds * WAV_RATE)
    s = np.arange(n) / WAV_RATE
    sig = 0.5 * np.sin(2 * np.pi * (200 * s + 150 * s**2)) + 0.05 * np.random.default_rng(9).standard_normal(n)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(WAV_RATE)
        w.writeframes((np.clip(sig, -1, 1) * 32767).round().astype("<i2").tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ref2va-references")
    data = {
        "wide.png": image_file(90, 54, 1, "PNG"),  # 5:3
        "tall.jpg": image_file(48, 64, 2, "JPEG"),  # 3:4
        "clip.mp4": video_file(),
        "voice.wav": wav_file(),
    }
    for name, content in data.items():
        (folder / name).write_bytes(content)
    return {name: folder / name for name in data}


# ---------------------------------------------------------------- torchaudio's resampler, where it is missing


def _get_sinc_resample_kernel(orig_freq, new_freq, gcd, lowpass_filter_width=6, rolloff=0.99, dtype=None):
    """torchaudio 2.11 `functional._get_sinc_resample_kernel`, `sinc_interp_hann` (its default), on the CPU."""
    orig_freq = int(orig_freq) // gcd
    new_freq = int(new_freq) // gcd
    base_freq = min(orig_freq, new_freq)
    base_freq *= rolloff
    width = math.ceil(lowpass_filter_width * orig_freq / base_freq)
    idx_dtype = dtype if dtype is not None else torch.float64
    idx = torch.arange(-width, width + orig_freq, dtype=idx_dtype)[None, None] / orig_freq
    t = torch.arange(0, -new_freq, -1, dtype=dtype)[:, None, None] / new_freq + idx
    t *= base_freq
    t = t.clamp_(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t *= math.pi
    scale = base_freq / orig_freq
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * scale
    if dtype is None:
        kernels = kernels.to(dtype=torch.float32)
    return kernels, width


def _apply_sinc_resample_kernel(waveform, orig_freq, new_freq, gcd, kernel, width):
    """torchaudio 2.11 `functional._apply_sinc_resample_kernel`."""
    orig_freq = int(orig_freq) // gcd
    new_freq = int(new_freq) // gcd
    shape = waveform.size()
    waveform = waveform.view(-1, shape[-1])
    num_wavs, length = waveform.shape
    waveform = torch.nn.functional.pad(waveform, (width, width + orig_freq))
    resampled = torch.nn.functional.conv1d(waveform[:, None], kernel, stride=orig_freq)
    resampled = resampled.transpose(1, 2).reshape(num_wavs, -1)
    target_length = torch.ceil(torch.as_tensor(new_freq * length / orig_freq)).long()
    resampled = resampled[..., :target_length]
    return resampled.view(shape[:-1] + resampled.shape[-1:])


class _Resample(torch.nn.Module):
    """torchaudio 2.11 `transforms.Resample` with its defaults (Hann window, 6 zero crossings, rolloff 0.99): the
    kernel computed in float64 and cached as float32."""

    def __init__(self, orig_freq: int = 16000, new_freq: int = 16000):
        super().__init__()
        self.orig_freq, self.new_freq = orig_freq, new_freq
        self.gcd = math.gcd(int(orig_freq), int(new_freq))
        if orig_freq != new_freq:
            kernel, self.width = _get_sinc_resample_kernel(orig_freq, new_freq, self.gcd)
            self.register_buffer("kernel", kernel)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        if self.orig_freq == self.new_freq:
            return waveform
        return _apply_sinc_resample_kernel(waveform, self.orig_freq, self.new_freq, self.gcd, self.kernel, self.width)


def torchaudio_modules() -> dict[str, types.ModuleType]:
    """What to put in `sys.modules` while diffusers runs: nothing where torchaudio is installed, else the stand-in."""
    if importlib.util.find_spec("torchaudio") is not None:
        return {}
    package, transforms = types.ModuleType("torchaudio"), types.ModuleType("torchaudio.transforms")
    transforms.Resample = _Resample
    package.transforms = transforms
    return {"torchaudio": package, "torchaudio.transforms": transforms}


# ---------------------------------------------------------------- the two sides


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("h3-tiny-ref2va"), ref2va=True)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """diffusers' pipeline from the folder's own index, loaded as in test_e2e_parity.py, with `transformer_ref` and
    the shrunk geometry set as pipeline config."""
    pipe = ModularPipeline.from_pretrained(str(checkpoint), local_files_only=True)
    pipe.load_components(names=["text_encoder", "tokenizer", "scheduler", "audio_scheduler"], dtype=torch.float32)
    processor = PilQwen3VLProcessor(
        image_processor=load_image_processor(checkpoint / "processor"),
        tokenizer=pipe.tokenizer,
        video_processor=TorchOnlyVideoProcessor.from_pretrained(checkpoint / "processor", cap_pixels_per_frame=False),
    )
    pipe.update_components(
        processor=processor,
        transformer_ref=load_diffusers_model(MiniMaxH3Transformer3DModel, checkpoint / "transformer_ref"),
        vae=load_diffusers_model(AutoencoderKLMiniMaxH3, checkpoint / "vae"),
        audio_vae=load_diffusers_model(AutoencoderKLMiniMaxH3Audio, checkpoint / "audio_vae"),
        canvas_short_edge=SHORT_EDGE,
        canvas_max_pixels=MAX_PIXELS,
        reference_image_short_edge=IMAGE_SHORT_EDGE,
    )
    assert pipe.config.reference_image_short_edge == IMAGE_SHORT_EDGE
    assert pipe.config.canvas_short_edge == SHORT_EDGE and pipe.config.canvas_max_pixels == MAX_PIXELS
    return pipe


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    """Both DiTs from the folder, under the shrunk rules (what `Engine.load` does, with `RULES` for the released
    ones)."""
    profile = Profile.for_device("cpu")
    assert (profile.dtype, profile.vae_autocast) == ("float32", "none")
    folder = resolve_model_folder(checkpoint)
    components = load_components(folder, device="cpu", dtype=profile.torch_dtype, task_type="both")
    return Engine(components, profile, RULES, VideoProcessing.from_folder(folder.processor))


def render_ours(engine: Engine, names: tuple[str, ...], files: dict[str, Path]) -> RenderResult:
    request = engine.validate(
        RequestFields(
            PROMPT,
            task="ref2va",
            width=WIDTH,
            height=HEIGHT,
            num_frames=NUM_FRAMES,
            steps=STEPS,
            seed=SEED,
            references=[(name, files[name].read_bytes()) for name in names],
        ),
    )
    return engine.render(request)


def render_reference(pipe, names: tuple[str, ...], files: dict[str, Path]):
    """diffusers' pipeline state after the call, its references decoded by `from_file`."""
    references = [LOADERS[Path(name).suffix].from_file(files[name]) for name in names]
    with mock.patch.dict(sys.modules, torchaudio_modules()):
        return pipe(
            prompt=PROMPT,
            references=references,
            height=HEIGHT,
            width=WIDTH,
            num_frames=NUM_FRAMES,
            num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(SEED),
            output_type="np",
        )


@pytest.fixture(scope="module")
def renders(engine, reference, files):
    """case -> (ours, diffusers' state); each rendered once, on first use."""
    cache = {}

    def get(case: str):
        if case not in cache:
            names = CASES[case]
            cache[case] = (render_ours(engine, names, files), render_reference(reference, names, files))
        return cache[case]

    return get


def reference_frames(state) -> np.ndarray:
    """diffusers' [0, 1] video as (F, H, W, 3) uint8, rounded as ours is."""
    return (torch.from_numpy(state.get("videos")[0]) * 255).round().to(torch.uint8).numpy()


# ---------------------------------------------------------------- the comparisons


@pytest.mark.parametrize("case", list(CASES))
def test_references_are_normalized_alike(renders, case):
    """The first stage: the same files land on the same grids (images and frames bitwise, soundtracks to float32
    rounding of the resampler)."""
    ours, state = renders(case)
    theirs = state.get("normalized_references")
    mine = ours.request.references
    assert [r.kind for r in mine] == [r.kind for r in theirs]
    for a, b in zip(mine, theirs, strict=True):
        if a.kind == "image":
            assert np.array_equal(a.pixels, np.asarray(b.image)) and min(a.pixels.shape[:2]) == IMAGE_SHORT_EDGE
        elif a.kind == "video":
            assert np.array_equal(a.pixels, b.frames) and min(a.pixels.shape[1:3]) == SHORT_EDGE
        if a.audio is not None or b.has_audio:
            their_audio = b.audio.numpy()
            assert a.audio.shape == their_audio.shape
            assert np.abs(a.audio - their_audio).max() <= 1e-6 * np.abs(their_audio).max()


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_diffusers(renders, engine, case):
    """Text tags and the packed sequence (row counts, tags, RoPE positions, scatter indices) are diffusers'."""
    ours, state = renders(case)
    references = ours.request.references
    text = encode_text(
        engine.components.text_encoder, PROMPT, references=references, video_processing=engine.video_processing
    )
    assert torch.equal(text.token_tags, state.get("text_token_tags").reshape(-1))
    assert torch.equal(text.states, state.get("prompt_embeds")[0])
    layout = build_ref2va_layout(
        text.token_tags,
        reference_descriptors(references),
        MediaGeometry.from_pixels(HEIGHT, WIDTH, NUM_FRAMES),
        patch_size=engine.components.ref_dit.config.patch_size,
    )
    assert layout.num_condition_video_rows == state.get("num_condition_video_rows") > 0
    assert layout.num_condition_audio_rows == state.get("num_condition_audio_rows")
    assert (layout.num_condition_audio_rows > 0) == (case != "two_images")
    assert torch.equal(layout.token_tags, state.get("token_tags").reshape(-1))
    assert torch.equal(layout.position_ids, state.get("position_ids").reshape(-1, 3))
    for name in ("video_indices", "audio_indices", "text_indices"):
        assert torch.equal(getattr(layout, name), state.get(name).reshape(-1)), name


@pytest.mark.parametrize("case", list(CASES))
def test_frames_match_diffusers(renders, case):
    ours, state = renders(case)
    ref_frames = reference_frames(state)
    assert ours.frames.shape == ref_frames.shape == (NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert ours.frames.dtype == np.uint8
    assert ours.frames.std() > 20 and np.isin(ours.frames, (0, 255)).mean() < 0.5
    diff = np.abs(ours.frames.astype(np.int16) - ref_frames.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() <= 1e-4, f"max {diff.max()}, {(diff > 0).mean():.2e} of values differ"


@pytest.mark.parametrize("case", list(CASES))
def test_audio_matches_diffusers(renders, case):
    ours, state = renders(case)
    ref_audio = state.get("audio")[0].numpy()
    assert ours.sample_rate == 32000
    assert ours.audio.shape == ref_audio.shape == (2, 207 * 800)
    assert ours.audio.dtype == np.float32
    assert ours.audio.std() > 0.05 and (np.abs(ours.audio) >= 1).mean() < 0.05
    err = np.linalg.norm(ours.audio - ref_audio) / np.linalg.norm(ref_audio)
    assert err <= 1e-5, f"relative error {err:.2e}, max abs {np.abs(ours.audio - ref_audio).max():.2e}"


def test_references_change_the_render(renders):
    """The cases are not one render again: what each conditions on reaches the frames and the audio."""
    results = [renders(case)[0] for case in CASES]
    for i in range(len(results)):
        for j in range(i + 1, len(results)):
            a, b = results[i], results[j]
            assert np.abs(a.frames.astype(np.int16) - b.frames.astype(np.int16)).mean() > 1
            assert np.abs(a.audio - b.audio).mean() > 1e-3
