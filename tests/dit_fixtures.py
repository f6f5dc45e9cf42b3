"""A tiny diffusers reference DiT and our H3DiT holding identical random weights, plus packed inputs for both."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3serve.checkpoint.dit import load_dit
from h3serve.model.dit import H3DiT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # lib.export: our DiT as checkpoints hold it
from lib.export import is_diffusers_fp32 as is_ref_fp32

# Attention width (2 x 16 = 32) differs from the hidden size (24), and RoPE rotates 2 x 3 x 2 = 12 of 16 head dims,
# so every path of the full model (inner != hidden, partial rotary) runs. Widths are all distinct to catch
# transposed weights.
TINY_DIFFUSERS_CONFIG = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    hidden_size=24,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=40,
    in_channels=4,
    audio_in_channels=6,
    patch_size=(1, 2, 2),
    text_dim=8,
    freq_dim=10,
    time_embed_hidden_dim=28,
    time_embed_dim=20,
    rope_freq_dim=2,
)


def reference_dit(seed: int = 0):
    """diffusers' MiniMaxH3Transformer3DModel with random weights rounded to bf16 where the checkpoint is bf16.

    Norm weights are randomised too (they start at ones), so that a swapped or ignored norm shows up.
    """
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    ref = MiniMaxH3Transformer3DModel(**TINY_DIFFUSERS_CONFIG).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.ndim > 1 else 0.5) + (1.0 if "norm" in name else 0.0))
            if not is_ref_fp32(name):
                p.copy_(p.to(torch.bfloat16).float())
    return ref


def reference_state_dict(ref) -> dict[str, torch.Tensor]:
    """The reference's weights as the released diffusers checkpoint stores them (bf16 + fp32 islands)."""
    return {
        k: (v.float() if is_ref_fp32(k) else v.to(torch.bfloat16)).contiguous()
        for k, v in ref.state_dict().items()
        if k != "rope.inv_freq"
    }


def cast_reference(ref, dtype: torch.dtype):
    """The reference in `dtype` with the float32 islands (and the rope buffer) kept, as `from_pretrained` does."""
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if not is_ref_fp32(name):
                p.data = p.data.to(dtype)
    return ref


def tiny_dit_pair(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[object, H3DiT]:
    """(diffusers reference, our H3DiT) with identical weights, ours loaded through the diffusers-layout loader."""
    ref = reference_dit(seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_file(reference_state_dict(ref), folder / "diffusion_pytorch_model.safetensors")
        (folder / "config.json").write_text(__import__("json").dumps(dict(ref.config)))
        ours = load_dit(folder, dtype=dtype)
    return cast_reference(ref, dtype), ours


@dataclass
class PackedInputs:
    """One packed request: text | conditioning video rows | audio L, R | target video, with three distinct t."""

    video: torch.Tensor
    audio: torch.Tensor
    text_states: torch.Tensor
    timesteps: torch.Tensor
    timestep_indices: torch.Tensor
    token_tags: torch.Tensor
    position_ids: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor

    def reference_kwargs(self) -> dict[str, torch.Tensor]:
        return dict(
            hidden_states=self.video[None],
            audio_hidden_states=self.audio[None],
            encoder_hidden_states=self.text_states[None],
            timestep=self.timesteps,
            timestep_indices=self.timestep_indices,
            token_tags=self.token_tags,
            position_ids=self.position_ids,
            video_indices=self.video_indices,
            audio_indices=self.audio_indices,
            text_indices=self.text_indices,
        )

    def run_ours(self, model: H3DiT) -> tuple[torch.Tensor, torch.Tensor]:
        text = model.refine_text(self.text_states)
        rope = model.rope(self.position_ids)
        return model(
            self.video,
            self.audio,
            text,
            self.timesteps,
            self.timestep_indices,
            self.token_tags,
            rope,
            self.video_indices,
            self.audio_indices,
            self.text_indices,
        )


def packed_inputs(t_video: float = 0.3, t_audio: float = 0.7, seed: int = 1, cfg=TINY_DIFFUSERS_CONFIG) -> PackedInputs:
    """Inputs for a DiT of diffusers config `cfg` (its in_channels, audio_in_channels and text_dim)."""
    g = torch.Generator().manual_seed(seed)
    n_text, n_cond, n_audio, n_video = 7, 4, 6, 8
    tags = [1] * n_text + [0] * n_cond + [2] * n_audio + [0] * n_video
    tags[2:4] = [0, 0]  # a vision block inside the text rows is tagged video
    t_cond = max(t_video, 0.999)
    row_t = [t_video] * n_text + [t_cond] * n_cond + [t_audio] * n_audio + [t_video] * n_video
    timesteps, inverse = torch.unique(torch.tensor(row_t, dtype=torch.float32), sorted=True, return_inverse=True)
    s = len(tags)
    positions = torch.stack(
        [
            torch.arange(s, dtype=torch.float32) * 5 / 3,
            torch.rand(s, generator=g) * 8,
            torch.rand(s, generator=g) * 8 - 2,
        ],
        dim=-1,
    )
    video_dim = cfg["in_channels"] * 4
    return PackedInputs(
        video=torch.randn(n_cond + n_video, video_dim, generator=g),
        audio=torch.randn(n_audio, cfg["audio_in_channels"], generator=g),
        text_states=torch.randn(n_text, cfg["text_dim"], generator=g),
        timesteps=timesteps,
        timestep_indices=inverse,
        token_tags=torch.tensor(tags),
        position_ids=positions,
        video_indices=torch.cat([torch.arange(n_text, n_text + n_cond), torch.arange(s - n_video, s)]),
        audio_indices=torch.arange(n_text + n_cond, n_text + n_cond + n_audio),
        text_indices=torch.arange(n_text),
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
