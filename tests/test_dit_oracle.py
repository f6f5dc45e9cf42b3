"""The original checkpoint layout against an oracle that is not our code.

Random weights are written straight in the original layout (key names from the released index; the QKV rows of the
file are whatever the random draw put there, so they are "interleaved" by definition). diffusers 0.42.1's own
single-file converter turns the same tensors into its layout with `qkv_layout="interleaved"`, and its model built
from them is the oracle for our load of the original shards. Five heads, and widths that all differ, so that a
reorder in the wrong direction or a transposed weight cannot pass by symmetry (with 2 or 3 heads the per-head
interleave and its inverse can coincide).

The negative cases break our loader on purpose (the QKV reorder reversed, the fc1 halves swapped) and must fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dit_fixtures import packed_inputs, rel_err
from h3serve.checkpoint import dit as dit_loading
from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT, inv_freq, is_fp32_name
from oracle import oracle

diffusers = oracle("diffusers")
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from safetensors.torch import save_file

RELEASED_INDEX = Path(__file__).parent / "data" / "reference" / "FL2VA" / "transformer" / "model.safetensors.index.json"

# diffusers config names. Attention width 5 x 16 = 80 != hidden 40; RoPE rotates 2 x 3 x 2 = 12 of 16 head dims.
ORACLE_CONFIG = dict(
    num_attention_heads=5,
    attention_head_dim=16,
    hidden_size=40,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=56,
    in_channels=4,
    audio_in_channels=6,
    patch_size=(1, 2, 2),
    text_dim=12,
    freq_dim=10,
    time_embed_hidden_dim=28,
    time_embed_dim=20,
    rope_freq_dim=2,
)


def original_keys(num_layers: int) -> list[str]:
    """The released original-layout key names, cut to `num_layers` blocks."""
    keys = json.loads(RELEASED_INDEX.read_text())["weight_map"]
    return sorted(k for k in keys if (m := re.match(r"blocks\.(\d+)\.", k)) is None or int(m.group(1)) < num_layers)


def random_original_checkpoint(cfg: DiTConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the released key names and dtypes (bf16, fp32 islands), norms near 1."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in H3DiT(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key in original_keys(cfg.num_layers):
        if key == "rope.inv_freq":
            state[key] = inv_freq(cfg.rope_inv_freq_len, cfg.rope_theta)
            continue
        t = torch.randn(shapes[key], generator=g) * (0.2 if len(shapes[key]) > 1 else 0.5)
        t = t + (1.0 if "norm" in key else 0.0)
        state[key] = t.float() if is_fp32_name(key) else t.to(torch.bfloat16)
    return state


def write_original_shards(folder: Path, state: dict[str, torch.Tensor], cfg: DiTConfig, shards: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    keys = sorted(state)
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in keys[i::shards]}, folder / name)
        weight_map.update(dict.fromkeys(keys[i::shards], name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    return folder


@pytest.fixture(scope="module")
def oracle_pair(tmp_path_factory):
    """(diffusers model from the converted original checkpoint, the original shards' folder)."""
    cfg = DiTConfig.from_dict(ORACLE_CONFIG)
    state = random_original_checkpoint(cfg)
    folder = write_original_shards(tmp_path_factory.mktemp("original"), state, cfg)
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        {k: v.clone() for k, v in state.items()}, dict(ORACLE_CONFIG), qkv_layout="interleaved"
    )
    reference = diffusers.MiniMaxH3Transformer3DModel(**ORACLE_CONFIG).eval()
    reference.load_state_dict({k: v.float() for k, v in converted.items()}, strict=True)
    return reference, folder


def reversed_reorder(w, heads: int):
    """The wrong direction: treat the stored rows as [q; k; v] and interleave them, instead of de-interleaving."""
    return w.view(3, heads, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape)


def swapped_fc1_plan(original_plan):
    def plan(model, layout, keys):
        out = original_plan(model, layout, keys)
        for name, src in out.items():
            if name.endswith("mlp.fc1.weight"):
                out[name] = dit_loading.Source(src.keys, dit_loading._swapped)
        return out

    return plan


@pytest.mark.parametrize("broken", [None, "qkv reorder reversed", "fc1 halves swapped"])
def test_original_shards_load_like_diffusers_converter(oracle_pair, monkeypatch, broken):
    reference, folder = oracle_pair
    if broken == "qkv reorder reversed":
        monkeypatch.setattr(dit_loading, "deinterleave_qkv", reversed_reorder)
    elif broken == "fc1 halves swapped":
        monkeypatch.setattr(dit_loading, "dit_plan", swapped_fc1_plan(dit_loading.dit_plan))
    ours = dit_loading.load_dit(folder, dtype=torch.float32)
    inputs = packed_inputs(cfg=ORACLE_CONFIG)
    with torch.no_grad():
        expected = reference(**inputs.reference_kwargs(), return_dict=False)
        video, audio = inputs.run_ours(ours)
    errors = rel_err(video, expected[0][0]), rel_err(audio, expected[1][0])
    if broken is None:
        assert max(errors) < 1e-5, errors
    else:
        # The broken loader must be caught: its output is nowhere near the oracle's.
        assert min(errors) > 1e-2, (broken, errors)
