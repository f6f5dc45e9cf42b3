"""The peer: diffusers' MiniMaxH3Transformer3DModel holding our DiT's weights (exported by diffusers' own converter,
`lib.export`), and one forward of it on packed inputs named as our scripts name them."""

from __future__ import annotations

import torch

from lib.export import diffusers_config, export_state_dict


def peer_weights(dit) -> dict:
    """What `peer` needs of our DiT, on the host (so that ours can be freed first): its weights in diffusers' layout,
    its configuration and its rotary frequencies (the one non-persistent buffer)."""
    return {"state": export_state_dict(dit, "diffusers"), "config": diffusers_config(dit.config),
            "inv_freq": dit.rope.inv_freq.cpu()}  # fmt: skip


def peer(weights: dict, device) -> torch.nn.Module:
    """diffusers' model over `peer_weights` (taken from the dict as they are placed), on `device`, eval."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**weights["config"])
    model.load_state_dict(weights.pop("state"), strict=True, assign=True)
    model.rope.inv_freq = weights["inv_freq"]  # left on meta by the meta build
    return model.to(device).eval().requires_grad_(False)


def call_peer(peer, x: dict):
    """One forward of diffusers' MiniMaxH3Transformer3DModel on packed inputs named as our scripts name them."""
    return peer(
        hidden_states=x["video"][None],
        audio_hidden_states=x["audio"][None],
        encoder_hidden_states=x["text_states"][None],
        timestep=x["timesteps"],
        timestep_indices=x["timestep_indices"],
        token_tags=x["token_tags"],
        position_ids=x["position_ids"],
        video_indices=x["video_indices"],
        audio_indices=x["audio_indices"],
        text_indices=x["text_indices"],
        return_dict=False,
    )
