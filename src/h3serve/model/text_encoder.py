"""H3's text encoder: the first 50 decoder layers of Qwen3-VL-32B, read before the final norm.

The conditioning is `hidden_states[50]` of the released `Qwen3VLForConditionalGeneration`: the output of
decoder layers 0..49. Layers 50..63, the final norm and the LM head never run, so they are never loaded; the
vision tower is loaded unless `vision=False` (only the keyframe modes use it).

How a prompt and its keyframes are presented to it (H3's prompt format) is the conditioning stage's business
(`h3serve.pipeline.conditioning`); this module holds the truncated model and its tokenizer and image processor.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

TEXT_ENCODER_LAYER = 50


def load_tokenizer(path: str | Path):
    """The H3 tokenizer folder (Qwen2 BPE plus H3's extra special tokens such as `<d>`). Local files only."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_image_processor(path: str | Path) -> Qwen2VLImageProcessorPil:
    """The released `processor/` folder, on the PIL backend.

    The PIL backend is chosen on purpose, not as a fallback: it needs no torchvision. Keyframes reach it already
    on the canvas (multiples of 32, which the processor keeps), so no resampling happens; the torchvision backend
    (what the config names) could differ only in the float rounding of the 0.5/0.5 normalisation.
    """
    return Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)


def truncated_qwen3vl(config: Qwen3VLConfig, layer: int, vision: bool) -> Qwen3VLModel:
    """A Qwen3VLModel on the meta device with only decoder layers 0..layer-1 and no final norm.

    With the norm an identity, the model's last hidden state is `hidden_states[layer]` of the full model.
    """
    num_layers = config.text_config.num_hidden_layers
    if not 0 < layer < num_layers:
        # hidden_states[num_layers] of the full model is post-norm, which is not what H3 was trained on.
        raise ValueError(f"layer must be in 1..{num_layers - 1} for a {num_layers}-layer Qwen3-VL, got {layer}")
    num_deepstack = len(config.vision_config.deepstack_visual_indexes)
    if layer <= num_deepstack:
        # transformers records hidden_states[i] before the deepstack addition after layer i-1; ours would be after.
        raise ValueError(f"layer must exceed the {num_deepstack} deepstack layers, got {layer}")
    config = Qwen3VLConfig.from_dict(config.to_dict())
    config.text_config.num_hidden_layers = layer
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    model.language_model.norm = nn.Identity()
    if not vision:
        model.visual = None
    return model.eval().requires_grad_(False)


def materialize_buffers(model: nn.Module) -> None:
    """Rebuild, on the CPU, every module that owns non-persistent buffers.

    Those are the rotary tables: no checkpoint holds them, so after a meta-device build they are either still on
    meta or (after `to_empty`) garbage. Both rotary classes rebuild from their own config; any other such module is
    an error, not something to guess at.
    """
    for name, module in list(model.named_modules()):
        if not module._non_persistent_buffers_set:
            continue
        if not hasattr(module, "config"):
            raise RuntimeError(f"cannot rebuild the buffers of {name} ({type(module).__name__})")
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, type(module)(module.config))


class TextEncoder(nn.Module):
    """The truncated Qwen3-VL with its tokenizer and image processor: token ids (+ vision inputs) -> (L, hidden)."""

    def __init__(self, model: Qwen3VLModel, tokenizer, image_processor=None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        cfg = model.config
        self.image_token_id, self.video_token_id = cfg.image_token_id, cfg.video_token_id

    @property
    def has_vision(self) -> bool:
        return self.model.visual is not None and self.image_processor is not None

    @torch.no_grad()
    def forward(
        self,
        token_ids: Sequence[int],
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (L,) and the vision inputs (keyframes and reference images; reference videos) -> (L, hidden):
        the output of the last loaded decoder layer, before any norm."""
        device = self.model.language_model.embed_tokens.weight.device
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)  # (1, L)
        # Qwen's own modality ids (0 text, 1 image, 2 video) drive its MRoPE; they are not H3's row tags.
        mm_types = (ids == self.image_token_id).long() + 2 * (ids == self.video_token_id).long()
        vision = {}
        for values, grid, names in (
            (pixel_values, image_grid_thw, ("pixel_values", "image_grid_thw")),
            (pixel_values_videos, video_grid_thw, ("pixel_values_videos", "video_grid_thw")),
        ):
            if values is None:
                continue
            if self.model.visual is None:
                raise ValueError("this text encoder was loaded without the vision tower; images cannot be encoded")
            vision[names[0]] = values.to(device, self.model.visual.dtype)
            vision[names[1]] = grid.to(device)
        out = self.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=mm_types,
            use_cache=False,
            **vision,
        )
        return out.last_hidden_state[0]
