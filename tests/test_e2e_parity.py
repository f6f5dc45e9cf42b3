"""End to end against diffusers: one tiny checkpoint folder in the diffusers layout, rendered by our `Engine` and by
diffusers' MiniMax-H3 modular pipeline, gives the same frames and the same audio samples (CPU, float32).

Everything between the folder and the outputs is each side's own: loading, tokenization and vision preprocessing,
text conditioning, keyframe fitting and encoding, layout, noise, schedule, denoise loop, both decoders. Only the
loading of diffusers' three H3 models and of the processor is done by hand here, for the reasons given where it
happens; the pipeline itself runs as shipped, through `__call__`, which picks the T2VA or FL2VA blocks from its inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.accel.profile import Profile
from h3serve.model.text_encoder import load_image_processor
from h3serve.pipeline.engine import Engine, RenderResult
from h3serve.pipeline.request import RequestFields
from oracle import oracle

oracle("diffusers")
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Transformer3DModel,
    ModularPipeline,
)
from safetensors.torch import load_file
from transformers import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from e2e_fixtures import write_tiny_checkpoint

PROMPT = "A red fox trots through fresh snow at dawn, breath steaming. (S1) says: <d>[English] Look at that.</d>"
WIDTH, HEIGHT = 128, 64  # 2:1, so a transposed axis shows
# diffusers' layout step refuses anything under 5 s (MiniMaxH3ModularPipeline.min_duration), so the shortest length
# both accept is 124 frames: 37 latent frames, 207 audio latents per channel.
NUM_FRAMES = 124
STEPS = 4  # grid points: three DiT forwards on both sides
SEED = 7
TASKS = ("t2va", "fl2va")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("h3-tiny-diffusers"))


@pytest.fixture(scope="module")
def keyframes() -> list[Image.Image]:
    """A first keyframe of another aspect (stretched onto the canvas) and a square last one (cover-cropped)."""
    rng = np.random.default_rng(5)
    first = Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8))
    last = Image.fromarray(rng.integers(0, 256, (72, 72, 3), dtype=np.uint8))
    return [first, last]


class PilQwen3VLProcessor(Qwen3VLProcessor):
    """The released processor with the PIL image backend (as in test_text_encoder.py). Without torchvision the video
    processor class is a placeholder that fails the type check; H3 keyframes never reach it."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor":
            return super().check_argument_for_proper_class(argument_name, argument)


def load_diffusers_model(cls, folder: Path):
    """What `cls.from_pretrained(folder, dtype=torch.float32)` does on the CPU: build from the folder's config, load
    every tensor (strictly), upcast the bfloat16 ones.

    Test-only: all three H3 models declare `_keep_in_fp32_modules`, and diffusers' `from_pretrained` then requires
    `low_cpu_mem_usage=True`, which needs `accelerate`, not a test dependency. Without it `load_components` refuses
    them ("`low_cpu_mem_usage` cannot be False when `keep_in_fp32_modules` is True").
    """
    model = cls.from_config(cls.load_config(folder))
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.float().eval()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """diffusers' pipeline from the folder's own `modular_model_index.json` (the released index; diffusers loads the
    components present in a local copy from the copy)."""
    pipe = ModularPipeline.from_pretrained(str(checkpoint), local_files_only=True)
    pipe.load_components(names=["text_encoder", "tokenizer", "scheduler", "audio_scheduler"], dtype=torch.float32)
    # Test-only: `Qwen3VLProcessor.from_pretrained(processor/)` looks for tokenizer files in processor/, where the
    # release has none, and without torchvision its video processor fails a type check; it is built from the same
    # files instead, with the tokenizer the pipeline loaded from tokenizer/.
    processor = PilQwen3VLProcessor(
        image_processor=load_image_processor(checkpoint / "processor"),
        tokenizer=pipe.tokenizer,
        video_processor=Qwen3VLVideoProcessor.from_pretrained(checkpoint / "processor"),
    )
    pipe.update_components(
        processor=processor,
        transformer=load_diffusers_model(MiniMaxH3Transformer3DModel, checkpoint / "transformer"),
        vae=load_diffusers_model(AutoencoderKLMiniMaxH3, checkpoint / "vae"),
        audio_vae=load_diffusers_model(AutoencoderKLMiniMaxH3Audio, checkpoint / "audio_vae"),
    )
    return pipe


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    profile = Profile.for_device("cpu")
    assert (profile.dtype, profile.vae_autocast) == ("float32", "none")  # the reference decodes without autocast too
    return Engine.load(checkpoint, profile)


def render_ours(engine: Engine, task: str, keyframes: list[Image.Image]) -> RenderResult:
    request = engine.validate(
        RequestFields(
            PROMPT,
            task=task,
            width=WIDTH,
            height=HEIGHT,
            num_frames=NUM_FRAMES,
            steps=STEPS,
            seed=SEED,
            keyframes=keyframes if task == "fl2va" else [],
        ),
    )
    return engine.render(request)


def render_reference(pipe, task: str, keyframes: list[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
    """(frames (F, H, W, 3) uint8, audio (2, N) float32) from diffusers, its [0, 1] video rounded as ours is."""
    images = dict(image=keyframes[0], last_image=keyframes[1]) if task == "fl2va" else {}
    state = pipe(
        prompt=PROMPT,
        height=HEIGHT,
        width=WIDTH,
        num_frames=NUM_FRAMES,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(SEED),
        output_type="np",
        **images,
    )
    anchors = ("first", "last") if task == "fl2va" else ()
    assert tuple(state.get("keyframe_anchors")) == anchors  # the pipeline ran the blocks of this task
    video = torch.from_numpy(state.get("videos")[0])  # (F, H, W, 3) float32 in [0, 1]
    frames = (video * 255).round().to(torch.uint8).numpy()
    return frames, state.get("audio")[0].numpy()


@pytest.fixture(scope="module")
def renders(engine, reference, keyframes):
    """task -> (ours, diffusers' frames, diffusers' audio); each rendered once, on first use."""
    cache = {}

    def get(task: str):
        if task not in cache:
            cache[task] = (render_ours(engine, task, keyframes), *render_reference(reference, task, keyframes))
        return cache[task]

    return get


@pytest.mark.parametrize("task", TASKS)
def test_frames_match_diffusers(renders, task):
    ours, ref_frames, _ = renders(task)
    assert ours.frames.shape == ref_frames.shape == (NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert ours.frames.dtype == np.uint8
    # Not a trivial agreement: the frames are neither flat nor pinned to the clamp.
    assert ours.frames.std() > 20 and np.isin(ours.frames, (0, 255)).mean() < 0.5
    diff = np.abs(ours.frames.astype(np.int16) - ref_frames.astype(np.int16))
    # float32 on both sides: identical, or one level off where a value sits on a .5 rounding boundary (observed: 0).
    assert diff.max() <= 1 and (diff > 0).mean() <= 1e-4, f"max {diff.max()}, {(diff > 0).mean():.2e} of values differ"


@pytest.mark.parametrize("task", TASKS)
def test_audio_matches_diffusers(renders, task):
    ours, _, ref_audio = renders(task)
    assert ours.sample_rate == 32000
    assert ours.audio.shape == ref_audio.shape == (2, 207 * 800)
    assert ours.audio.dtype == np.float32
    assert ours.audio.std() > 0.05 and (np.abs(ours.audio) >= 1).mean() < 0.05  # a waveform, not the clamp
    err = np.linalg.norm(ours.audio - ref_audio) / np.linalg.norm(ref_audio)
    assert err <= 1e-5, f"relative error {err:.2e}, max abs {np.abs(ours.audio - ref_audio).max():.2e}"


def test_keyframes_change_the_render(renders):
    """The FL2VA comparison is not the T2VA one again: the keyframes reach the result on both sides."""
    t2va, fl2va = renders("t2va")[0], renders("fl2va")[0]
    assert np.abs(t2va.frames.astype(np.int16) - fl2va.frames.astype(np.int16)).mean() > 1
    assert np.abs(t2va.audio - fl2va.audio).mean() > 1e-3
