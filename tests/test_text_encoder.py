"""Text encoder: the real H3 tokenizer, the presentation, and hidden_states[layer] of a tiny random Qwen3-VL.

The oracle for the hidden state is transformers' own full model with `output_hidden_states=True`; the oracle for
the presentation is diffusers' H3 text-encoder blocks, run on the same tiny model with the real tokenizer files.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from h3serve.checkpoint.text_encoder import load_text_encoder
from h3serve.model.text_encoder import (
    TEXT_ENCODER_LAYER,
    load_image_processor,
    load_tokenizer,
)
from h3serve.model.tiny import randomize, tiny_text_encoder, tiny_text_encoder_config
from h3serve.pipeline.conditioning import encode_text, tokenize_prompt
from oracle import oracle

REFERENCE = Path(__file__).parent / "data" / "reference"
TOKENIZER = REFERENCE / "FL2VA" / "tokenizer"
PROCESSOR = REFERENCE / "FL2VA" / "processor"
GUIDE = REFERENCE / "skills" / "h3-prompt-writing" / "references" / "base-en.txt"


def example_prompts() -> dict[str, str]:
    """The official example prompts (T2VA, I2VA, FL2VA, L2VA cases) from the prompt-writing guide."""
    text = GUIDE.read_text()
    cases = re.findall(r"### Case \d+: (\w+)\n.*?```text\n(.*?)```", text, flags=re.S)
    return {name: body.rstrip("\n") for name, body in cases}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def image_processor():
    return load_image_processor(PROCESSOR)


def keyframe(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


# --- tokenizer and presentation with the real files -------------------------------------------------------------


def test_prompt_is_tokenized_verbatim(tokenizer):
    prompts = example_prompts()
    assert set(prompts) == {"T2VA", "I2VA", "FL2VA", "L2VA"}
    # The whole guide too: ~3.5k tokens, far past any default max length, to show nothing truncates.
    for prompt in [*prompts.values(), GUIDE.read_text()]:
        p = tokenize_prompt(tokenizer, prompt)
        assert tokenizer.decode(list(p.token_ids)) == prompt  # nothing added, nothing dropped
        assert set(p.token_tags) == {1}
        assert p.pixel_values is None
    ids = tokenize_prompt(tokenizer, prompts["T2VA"]).token_ids
    assert ids[0] not in tokenizer.all_special_ids and ids[-1] not in tokenizer.all_special_ids  # no BOS/EOS
    assert len(tokenize_prompt(tokenizer, GUIDE.read_text()).token_ids) > 3000


def test_h3_special_tokens(tokenizer):
    """H3's added tokens (`<d>`, `</d>`, ...) are single tokens when they appear in the prompt."""
    p = tokenize_prompt(tokenizer, "(S1) says: <d>[English] Hi.</d>")
    d_open, d_close = tokenizer.convert_tokens_to_ids(["<d>", "</d>"])
    assert d_open != tokenizer.unk_token_id and d_close != tokenizer.unk_token_id
    assert p.token_ids.count(d_open) == 1 and p.token_ids.count(d_close) == 1


@pytest.mark.parametrize("height,width,pads", [(448, 768, 336), (768, 1344, 1008)])
def test_keyframe_presentation(tokenizer, image_processor, height, width, pads):
    """docs/model.md §3: `"<Picture i>: "` + vision block of n = H*W/32^2 pads, tagged video, then the prompt."""
    prompt = example_prompts()["FL2VA"]
    p = tokenize_prompt(tokenizer, prompt, [keyframe(height, width, 0), keyframe(height, width, 1)], image_processor)
    start, pad, end = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    ids, tags = list(p.token_ids), list(p.token_tags)
    assert ids.count(pad) == 2 * pads and ids.count(start) == 2 and ids.count(end) == 2
    label1 = tokenizer("<Picture 1>: ", add_special_tokens=False)["input_ids"]
    label2 = tokenizer("<Picture 2>: ", add_special_tokens=False)["input_ids"]
    block = [start] + [pad] * pads + [end]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids == label1 + block + label2 + block + prompt_ids
    assert tags == [1] * len(label1) + [0] * len(block) + [1] * len(label2) + [0] * len(block) + [1] * len(prompt_ids)
    assert p.image_grid_thw.tolist() == [[1, height // 16, width // 16]] * 2


# --- hidden state against transformers ---------------------------------------------------------------------------


def full_tiny_qwen(num_layers: int, seed: int = 0) -> Qwen3VLForConditionalGeneration:
    model = Qwen3VLForConditionalGeneration(tiny_text_encoder_config(num_layers)).eval()
    return randomize(model, seed)


def reference_hidden_states(model, presentation, layer: int) -> torch.Tensor:
    ids = torch.tensor([presentation.token_ids])
    kwargs = {}
    if presentation.pixel_values is not None:
        kwargs = dict(pixel_values=presentation.pixel_values, image_grid_thw=presentation.image_grid_thw)
    mm = (ids == model.config.image_token_id).long()
    with torch.no_grad():
        out = model.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=mm,
            use_cache=False,
            output_hidden_states=True,
            **kwargs,
        )
    return out.hidden_states


@pytest.mark.parametrize("with_keyframes", [False, True])
def test_layer_equals_transformers_hidden_states(tmp_path, tokenizer, image_processor, with_keyframes):
    """Loading only layers 0..2 of a 5-layer model gives exactly transformers' hidden_states[3]."""
    layer, full = 3, full_tiny_qwen(5)
    full.save_pretrained(tmp_path)
    encoder = load_text_encoder(tmp_path, TOKENIZER, PROCESSOR, layer=layer, vision=with_keyframes, dtype=torch.float32)
    assert len(encoder.model.language_model.layers) == layer
    assert (encoder.model.visual is not None) == with_keyframes
    keyframes = [keyframe(64, 96, 0), keyframe(64, 96, 1)] if with_keyframes else []
    cond = encode_text(encoder, example_prompts()["FL2VA"][:300], keyframes)
    presentation = tokenize_prompt(
        encoder.tokenizer, example_prompts()["FL2VA"][:300], keyframes, encoder.image_processor
    )
    hidden = reference_hidden_states(full, presentation, layer)
    assert torch.equal(cond.states, hidden[layer][0])
    assert not torch.allclose(cond.states, hidden[layer - 1][0])
    assert not torch.allclose(cond.states, hidden[layer + 1][0])
    assert cond.token_tags.tolist() == list(presentation.token_tags)
    if not with_keyframes:
        with pytest.raises(ValueError, match="vision"):
            encode_text(encoder, "a prompt", [keyframe(64, 64, 2)])


def test_loader_rejects_bad_layers(tmp_path):
    full_tiny_qwen(3).save_pretrained(tmp_path)
    for layer in (3, 4, 0):  # 3 = the post-norm final state, 4 = past the end
        with pytest.raises(ValueError, match="layer"):
            load_text_encoder(tmp_path, TOKENIZER, vision=False, layer=layer)
    with pytest.raises(ValueError, match="deepstack"):
        load_text_encoder(tmp_path, TOKENIZER, vision=False, layer=1)  # 1 deepstack layer in the tiny config


def test_released_config_is_supported():
    """The released text_encoder/config.json builds a 50-layer prefix (on meta; no weights needed)."""
    from transformers import Qwen3VLConfig

    from h3serve.model.text_encoder import truncated_qwen3vl

    cfg = Qwen3VLConfig.from_pretrained(REFERENCE / "FL2VA" / "text_encoder")
    model = truncated_qwen3vl(cfg, TEXT_ENCODER_LAYER, vision=False)
    assert len(model.language_model.layers) == 50 and model.visual is None
    assert isinstance(model.language_model.norm, torch.nn.Identity)
    assert model.language_model.embed_tokens.weight.shape == (151936, 5120)


@pytest.mark.parametrize("vision", [False, True])
def test_released_index_covers_exactly_the_prefix(vision):
    """Every tensor the 50-layer prefix needs is in the released index, and nothing past layer 49 is read."""
    import json

    from transformers import Qwen3VLConfig

    from h3serve.checkpoint.text_encoder import checkpoint_key_map
    from h3serve.model.text_encoder import truncated_qwen3vl

    folder = REFERENCE / "FL2VA" / "text_encoder"
    keys = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    mapped = {checkpoint_key_map(k, TEXT_ENCODER_LAYER, vision) for k in keys} - {None}
    model = truncated_qwen3vl(Qwen3VLConfig.from_pretrained(folder), TEXT_ENCODER_LAYER, vision)
    assert mapped == set(model.state_dict())
    layers = {int(k.split(".")[2]) for k in mapped if k.startswith("language_model.layers.")}
    assert layers == set(range(50))
    assert any(k.startswith("visual.") for k in mapped) == vision


def test_tiny_text_encoder_is_deterministic(tokenizer, image_processor):
    kf = [keyframe(64, 64, 3)]
    a = encode_text(tiny_text_encoder(tokenizer, image_processor, seed=0), "a red fox", kf)
    b = encode_text(tiny_text_encoder(tokenizer, image_processor, seed=0), "a red fox", kf)
    c = encode_text(tiny_text_encoder(tokenizer, image_processor, seed=1), "a red fox", kf)
    assert torch.equal(a.states, b.states) and not torch.allclose(a.states, c.states)
    assert torch.isfinite(a.states).all() and a.states.std() > 0.1


# --- presentation and conditioning against diffusers' H3 text-encoder blocks -------------------------------------


class PilQwen3VLProcessor(Qwen3VLProcessor):
    """The released processor with the PIL image backend. Without torchvision the video processor class is a
    placeholder that fails the type check; H3 keyframes never reach it, so only that check is skipped."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor":
            return super().check_argument_for_proper_class(argument_name, argument)


@pytest.mark.parametrize("num_keyframes", [0, 1, 2])
def test_matches_diffusers_text_encoder_step(tmp_path, tokenizer, image_processor, num_keyframes):
    """The diffusers blocks read hidden_states[50], so the tiny model has 51 layers here."""
    blocks = oracle("diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3")
    encoders = oracle("diffusers.modular_pipelines.minimax_h3.encoders")
    from diffusers.modular_pipelines import PipelineState

    full = full_tiny_qwen(TEXT_ENCODER_LAYER + 1, seed=3)
    full.save_pretrained(tmp_path)
    ours = load_text_encoder(tmp_path, TOKENIZER, PROCESSOR, dtype=torch.float32)

    processor = PilQwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor.from_pretrained(PROCESSOR),
    )
    pipe = blocks.MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(text_encoder=full, tokenizer=tokenizer, processor=processor)
    prompt = example_prompts()["FL2VA" if num_keyframes else "T2VA"]
    keyframes = [keyframe(64, 96, 10 + i) for i in range(num_keyframes)]
    if num_keyframes:
        step, inputs = encoders.MiniMaxH3FL2VATextEncoderStep(), dict(prompt=prompt, keyframes=keyframes)
    else:
        step, inputs = encoders.MiniMaxH3TextEncoderStep(), dict(prompt=prompt)
    state = PipelineState()
    for name, value in inputs.items():
        state.set(name, value)
    with torch.no_grad():
        _, state = step(pipe, state)

    cond = encode_text(ours, prompt, keyframes)
    assert torch.equal(cond.token_tags, state.get("text_token_tags"))
    assert torch.equal(cond.states, state.get("prompt_embeds")[0])


# --- loader strictness ------------------------------------------------------------------------------------------


def _rewrite(file, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("model.language_model.layers.1.mlp.up_proj.weight"), "missing key"),
        (lambda s: s.update({"model.extra.weight": torch.zeros(2)}), "unexpected key 'model.extra.weight'"),
        (
            lambda s: s.update({"model.language_model.layers.0.input_layernorm.weight": torch.zeros(3)}),
            "wrong shape",
        ),
        (
            lambda s: s.update(
                {"model.language_model.layers.0.input_layernorm.weight": torch.ones(32, dtype=torch.float16)}
            ),
            "dtype torch.float16, expected torch.float32",
        ),
    ],
)
def test_loader_refuses_corrupt_checkpoints(tmp_path, edit, message):
    """Keys past the prefix (layer 2, the final norm, the LM head) are skipped; anything else wrong is refused."""
    from h3serve.checkpoint.reader import CheckpointError

    full_tiny_qwen(3).save_pretrained(tmp_path)
    _rewrite(tmp_path / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=message):
        load_text_encoder(tmp_path, TOKENIZER, vision=False, layer=2, dtype=torch.float32)


def test_loader_reads_a_clean_prefix_checkpoint(tmp_path):
    full_tiny_qwen(3).save_pretrained(tmp_path)
    encoder = load_text_encoder(tmp_path, TOKENIZER, vision=False, layer=2, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in encoder.model.parameters())
    assert len(encoder.model.language_model.layers) == 2
