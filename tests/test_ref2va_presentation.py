"""Ref2VA text-encoder presentation against diffusers' ref2va text-encoder step (real tokenizer and processor files,
tiny random Qwen3-VL).

torchvision is not installed here, so Qwen3-VL's video processor cannot run as shipped; the oracle gets it with its
three torchvision calls replaced by plain torch (RGB conversion of 3-channel frames is the identity, the resize is
checked to be a no-op at these sizes, normalisation is (x - mean) / std). Everything else — frame sampling,
timestamps, labels, padding and patchify — is the oracle's own code.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from h3serve.checkpoint.text_encoder import load_text_encoder
from h3serve.model.text_encoder import TEXT_ENCODER_LAYER, load_image_processor, load_tokenizer
from h3serve.model.tiny import randomize, tiny_text_encoder, tiny_text_encoder_config
from h3serve.pipeline.conditioning import (
    RELEASED_VIDEO_PROCESSING,
    VideoProcessing,
    encode_text,
    sample_reference_video,
    tokenize_prompt,
    tokenize_reference_prompt,
)
from h3serve.pipeline.references import DecodedReference
from oracle import oracle

REFERENCE = Path(__file__).parent / "data" / "reference"
TOKENIZER = REFERENCE / "FL2VA" / "tokenizer"
PROCESSOR = REFERENCE / "FL2VA" / "processor"
# The module itself, not transformers' lazy stand-in that refuses to load without torchvision.
qvp = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
PROMPT = "[Shot 1] <Picture 1> walks into the room while <Audio 1> plays; the camera follows."


class TorchOnlyVideoProcessor(qvp.Qwen3VLVideoProcessor):
    def convert_to_rgb(self, video):
        assert video.shape[-3] == 3
        return video

    def normalize(self, image, mean, std, **kwargs):
        return (image - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1)

    def resize(self, videos, size, resample, factor, temporal_factor, cap_pixels_per_frame=None, **kwargs):
        assert not cap_pixels_per_frame
        h, w = qvp.smart_resize(
            videos.shape[1],
            *videos.shape[-2:],
            temporal_factor=temporal_factor,
            factor=factor,
            min_pixels=size.shortest_edge,
            max_pixels=size.longest_edge,
        )
        assert (h, w) == tuple(videos.shape[-2:]), "a resize the stand-in cannot do"
        return videos


class PilQwen3VLProcessor(Qwen3VLProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor":
            return super().check_argument_for_proper_class(argument_name, argument)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def image_processor():
    return load_image_processor(PROCESSOR)


def pixels(shape, seed):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def image_ref(index, height, width, seed):
    return DecodedReference(index=index, kind="image", pixels=pixels((height, width, 3), seed))


def video_ref(index, frames, height, width, seed, sound):
    audio = np.random.default_rng(seed).standard_normal((2, 32000)).astype(np.float32) if sound else None
    return DecodedReference(index=index, kind="video", pixels=pixels((frames, height, width, 3), seed), audio=audio)


def audio_ref(index, seed):
    return DecodedReference(index=index, kind="audio", audio=np.zeros((2, 16000), np.float32))


CASES = {
    "two_images": lambda: [image_ref(0, 64, 96, 1), image_ref(1, 96, 64, 2)],
    "video_with_sound": lambda: [video_ref(0, 53, 64, 96, 3, sound=True)],  # 5 samples: the last pair is padded
    "image_and_audio": lambda: [image_ref(0, 64, 64, 4), audio_ref(1, 5)],
    "silent_video_and_image": lambda: [video_ref(0, 48, 96, 64, 6, sound=False), image_ref(1, 64, 96, 7)],
}


def diffusers_references(references):
    refs = oracle("diffusers.modular_pipelines.minimax_h3.references")
    out = []
    for r in references:
        if r.kind == "image":
            out.append(refs.MiniMaxH3ImageReference(image=Image.fromarray(r.pixels)))
        elif r.kind == "video":
            audio = None if r.audio is None else torch.from_numpy(r.audio)
            out.append(refs.MiniMaxH3VideoReference(frames=r.pixels, fps=24.0, audio=audio, sample_rate=32000))
        else:
            out.append(refs.MiniMaxH3AudioReference(audio=torch.from_numpy(r.audio), sample_rate=32000))
    return out


def oracle_processor(tokenizer, image_processor):
    return PilQwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=TorchOnlyVideoProcessor.from_pretrained(PROCESSOR, cap_pixels_per_frame=False),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_presentation_matches_diffusers(tokenizer, image_processor, case):
    encoders = oracle("diffusers.modular_pipelines.minimax_h3.encoders")
    references = CASES[case]()
    step = encoders.MiniMaxH3Ref2VATextEncoderStep()
    theirs = diffusers_references(references)
    vision, image_counts, video_counts, video_times = step._gather_vision_features(
        oracle_processor(tokenizer, image_processor), theirs, 24.0
    )
    ids, tags = step._build_presentation(tokenizer, PROMPT, theirs, image_counts, video_counts, video_times)

    p = tokenize_reference_prompt(
        tokenizer, PROMPT, references, image_processor, VideoProcessing.from_folder(PROCESSOR)
    )
    assert tokenizer.decode(list(p.token_ids)) == tokenizer.decode(ids)  # readable diff on failure
    assert list(p.token_ids) == ids
    assert list(p.token_tags) == tags
    for ours, name in [
        (p.pixel_values, "pixel_values"),
        (p.image_grid_thw, "image_grid_thw"),
        (p.pixel_values_videos, "pixel_values_videos"),
        (p.video_grid_thw, "video_grid_thw"),
    ]:
        if name in vision:
            assert torch.equal(ours, vision[name]), name
        else:
            assert ours is None, name


def test_presentation_text(tokenizer, image_processor):
    """The labels by themselves (docs/model.md §3): per-kind numbering, a sounding video's audio label first."""
    references = [
        video_ref(0, 48, 64, 64, 1, sound=True),
        image_ref(1, 64, 64, 2),
        audio_ref(2, 3),
        video_ref(3, 30, 64, 64, 4, sound=False),
        image_ref(4, 64, 64, 5),
    ]
    p = tokenize_reference_prompt(tokenizer, "go", references, image_processor)
    text = tokenizer.decode([i for i, t in zip(p.token_ids, p.token_tags, strict=True) if t == 1])
    assert text == (
        "<Audio 1>: <Video 1>: <0.2 seconds><1.2 seconds><Picture 1>: <Audio 2>: "
        "<Video 2>: <0.2 seconds><1.0 seconds><Picture 2>: go"
    )
    start, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    assert p.token_ids.count(start) == p.token_ids.count(end) == 6  # 2 + 2 video blocks, 2 image blocks
    assert p.video_grid_thw.tolist() == [[2, 4, 4], [2, 4, 4]]
    assert sample_reference_video(48) == ([0, 12, 24, 36], [0.25, 1.25])
    assert sample_reference_video(25) == ([0, 12, 24], [0.25, 1.0])
    with pytest.raises(ValueError, match="frames"):
        sample_reference_video(12)


def test_audio_only_needs_no_vision_and_vision_is_refused(tokenizer, image_processor):
    encoder = tiny_text_encoder(tokenizer, None, seed=0)
    audio_only = encode_text(encoder, PROMPT, references=[audio_ref(0, 1)])
    # The label and the prompt are tokenized apart (": " keeps its own space token), not as one string.
    ids = [
        *tokenizer("<Audio 1>: ", add_special_tokens=False)["input_ids"],
        *tokenize_prompt(tokenizer, PROMPT).token_ids,
    ]
    assert audio_only.token_tags.tolist() == [1] * len(ids)
    assert torch.equal(audio_only.states, encoder(ids))
    with pytest.raises(ValueError, match="vision"):
        encode_text(encoder, PROMPT, references=[image_ref(0, 64, 64, 1)])
    assert VideoProcessing.from_folder(PROCESSOR) == RELEASED_VIDEO_PROCESSING


@pytest.mark.parametrize("case", list(CASES))
def test_states_match_diffusers_step(tmp_path, tokenizer, image_processor, case):
    """The whole step (tiny 51-layer Qwen3-VL, hidden_states[50]) against encode_text(..., references=...)."""
    blocks = oracle("diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3")
    encoders = oracle("diffusers.modular_pipelines.minimax_h3.encoders")
    from diffusers.modular_pipelines import PipelineState

    full = randomize(Qwen3VLForConditionalGeneration(tiny_text_encoder_config(TEXT_ENCODER_LAYER + 1)).eval(), 3)
    full.save_pretrained(tmp_path)
    ours = load_text_encoder(tmp_path, TOKENIZER, PROCESSOR, dtype=torch.float32)
    pipe = blocks.MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        text_encoder=full, tokenizer=tokenizer, processor=oracle_processor(tokenizer, image_processor)
    )
    references = CASES[case]()
    state = PipelineState()
    state.set("prompt", PROMPT)
    state.set("normalized_references", diffusers_references(references))
    with torch.no_grad():
        _, state = encoders.MiniMaxH3Ref2VATextEncoderStep()(pipe, state)

    cond = encode_text(ours, PROMPT, references=references)
    assert torch.equal(cond.token_tags, state.get("text_token_tags"))
    assert torch.equal(cond.states, state.get("prompt_embeds")[0])
