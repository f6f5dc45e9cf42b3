"""The released Qwen3-VL text encoder (`text_encoder/`, with `tokenizer/` and `processor/`), read as far as H3 uses
it: decoder layers 0..layer-1 and the vision tower, into `model.text_encoder.TextEncoder`. Imports transformers."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import Qwen3VLConfig, Qwen3VLModel

from h3serve.checkpoint.safetensors import LoadHook, Source, assign_from_checkpoint, open_checkpoint
from h3serve.model.text_encoder import (
    TEXT_ENCODER_LAYER,
    TextEncoder,
    load_image_processor,
    load_tokenizer,
    materialize_buffers,
    truncated_qwen3vl,
)

log = logging.getLogger(__name__)


def checkpoint_key_map(key: str, layer: int, vision: bool) -> str | None:
    """Map a `Qwen3VLForConditionalGeneration` key to our `Qwen3VLModel` key, or None to skip it."""
    if not key.startswith("model."):
        return None  # lm_head
    key = key.removeprefix("model.")
    if key.startswith("visual."):
        return key if vision else None
    if key.startswith("language_model.layers."):
        return key if int(key.split(".")[2]) < layer else None
    if key == "language_model.norm.weight":
        return None
    return key


def load_qwen3vl_prefix(
    folder: str | Path,
    *,
    layer: int = TEXT_ENCODER_LAYER,
    vision: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    hook: LoadHook | None = None,
) -> Qwen3VLModel:
    """Load decoder layers 0..layer-1 (and the vision tower if `vision`) of a released Qwen3-VL folder.

    Strict like the other loaders: every tensor the prefix needs must be there, in the dtype the folder's config
    declares (bfloat16 in the release), with the right shape; keys past the prefix (later layers, the final norm,
    the LM head, the vision tower when not wanted) must be the ones `checkpoint_key_map` skips, and are never read.
    Each tensor is read (`assign_from_checkpoint`) and placed at `device` and `dtype` once; `hook` may transform it
    on the way (the FP8 text encoder quantizes the decoder layers' linears as they are read). The load's bytes and
    seconds are logged at INFO ("text encoder: X.X GB in Y.Y s (Z.ZZ GB/s)").
    """
    folder = Path(folder)
    config = Qwen3VLConfig.from_pretrained(str(folder), local_files_only=True)
    stored = config.dtype or config.text_config.dtype or torch.bfloat16
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    model = truncated_qwen3vl(config, layer, vision)
    ckpt = open_checkpoint(folder)
    plan = {name: Source((f"model.{name}",)) for name in model.state_dict()}
    skipped = frozenset(k for k in ckpt if checkpoint_key_map(k, layer, vision) is None)
    stats = assign_from_checkpoint(
        model,
        ckpt,
        plan,
        device=device,
        dtype_of=lambda _: dtype,
        ckpt_dtype_of=lambda _: stored,
        unused=skipped,
        hook=hook,
    )
    log.info("text encoder: %s", stats)
    materialize_buffers(model)
    return model.to(device)


def load_text_encoder(
    text_encoder_dir: str | Path,
    tokenizer_dir: str | Path,
    processor_dir: str | Path | None = None,
    *,
    layer: int = TEXT_ENCODER_LAYER,
    vision: bool = True,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    hook: LoadHook | None = None,
) -> TextEncoder:
    """The released `text_encoder/`, `tokenizer/` and `processor/` folders (processor needed only with vision)."""
    if vision and processor_dir is None:
        raise ValueError("vision=True needs processor_dir (the released processor/ folder)")
    model = load_qwen3vl_prefix(text_encoder_dir, layer=layer, vision=vision, device=device, dtype=dtype, hook=hook)
    processor = load_image_processor(processor_dir) if vision else None
    return TextEncoder(model, load_tokenizer(tokenizer_dir), processor)
