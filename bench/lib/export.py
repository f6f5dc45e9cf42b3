"""Our DiT in the layouts the published checkpoints use, the inverse of what the loader reads: the weights
(`export_state_dict`: original names with QKV stacked or interleaved per head, or diffusers' names through diffusers'
own converter) and the configuration under diffusers' `transformer/config.json` keys (`diffusers_config`). For the
tests and benchmarks that hand our weights to diffusers' model, or write a checkpoint for the loader to read (the
"diffusers" layout imports diffusers, a test dependency: only they ask for it). Here, not in the package: the service
never writes a checkpoint."""

from __future__ import annotations

import torch

from h3serve.checkpoint.rows import interleave_qkv
from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT, is_fp32_name

# diffusers module name prefixes that the released checkpoint stores in float32.
DIFFUSERS_FP32 = ("proj_in.", "audio_proj_in.", "time_embedder.", "proj_out.", "audio_proj_out.")


def is_diffusers_fp32(name: str) -> bool:
    """Whether the released diffusers checkpoint stores the tensor of this (diffusers) name in float32."""
    return name.startswith(DIFFUSERS_FP32)


def diffusers_config(cfg: DiTConfig) -> dict:
    """`cfg` under the diffusers `transformer/config.json` keys (the AdaLN widths are derived there, not stored)."""
    return dict(
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_refiner_layers=cfg.token_refiner_num_layers,
        ffn_dim=cfg.ffn_hidden_size,
        in_channels=cfg.latents_dim,
        audio_in_channels=cfg.audio_latents_dim,
        patch_size=cfg.patch_size,
        text_dim=cfg.text_dim,
        freq_dim=cfg.timestep_input_dim,
        time_embed_hidden_dim=cfg.time_embed_hidden_size,
        time_embed_dim=cfg.time_embed_dim,
        rope_freq_dim=cfg.rope_inv_freq_len,
        rope_theta=cfg.rope_theta,
        norm_eps=cfg.norm_eps,
        qk_norm_eps=cfg.qk_norm_eps,
        final_norm_eps=cfg.final_norm_eps,
    )


def export_state_dict(model: H3DiT, layout: str) -> dict[str, torch.Tensor]:
    """Our model's weights as a published checkpoint stores them (bf16 with fp32 islands):

    "stacked": original key names, QKV `[q; k; v]` (the community single files);
    "interleaved": original key names, QKV per head (the `FL2VA/transformer` shards);
    "diffusers": converted from "stacked" by diffusers' own single-file converter.
    """
    heads = model.config.num_attention_heads
    stacked = {
        k: (v.float() if is_fp32_name(k) else v.to(torch.bfloat16)).detach().cpu().contiguous()
        for k, v in model.state_dict().items()
    }
    if layout == "stacked":
        return stacked
    if layout == "interleaved":
        return {
            k: interleave_qkv(v, heads).contiguous() if k.endswith("attn.qkv_proj.weight") else v
            for k, v in stacked.items()
        }
    if layout == "diffusers":
        from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

        config = {"num_attention_heads": heads, "attention_head_dim": model.config.attention_head_dim}
        converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(stacked, config, qkv_layout="stacked")
        return {k: v.contiguous() for k, v in converted.items()}
    raise ValueError(f"unknown layout {layout!r}")
