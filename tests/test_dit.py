"""Our DiT against diffusers' MiniMaxH3Transformer3DModel on the same weights and packed inputs."""

import pytest
import torch

from dit_fixtures import packed_inputs, rel_err, tiny_dit_pair
from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT, is_fp32_name, timestep_sinusoid

CASES = [(0.3, 0.7), (0.05, 0.95), (0.999, 0.5)]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_forward_matches_reference(dtype, tol):
    ref, ours = tiny_dit_pair(dtype)
    for t_video, t_audio in CASES:
        inputs = packed_inputs(t_video, t_audio)
        assert len(inputs.timesteps) >= 2 and set(inputs.token_tags.tolist()) == {0, 1, 2}
        with torch.no_grad():
            ref_video, ref_audio = ref(**inputs.reference_kwargs(), return_dict=False)
            video, audio = inputs.run_ours(ours)
        assert video.dtype == audio.dtype == torch.float32  # the heads are fp32 islands
        assert video.shape == ref_video[0].shape and audio.shape == ref_audio[0].shape
        assert rel_err(video, ref_video[0]) < tol, (t_video, t_audio)
        assert rel_err(audio, ref_audio[0]) < tol, (t_video, t_audio)


def test_outputs_depend_on_timestep_and_tags():
    """Guards the parity test against degenerate inputs: t and tags must change the output."""
    _, ours = tiny_dit_pair(torch.float32)
    base = packed_inputs(0.3, 0.7)
    with torch.no_grad():
        v0, _ = base.run_ours(ours)
        other_t = packed_inputs(0.6, 0.7)
        v1, _ = other_t.run_ours(ours)
        base.token_tags = torch.where(base.token_tags == 1, 2, base.token_tags)
        v2, _ = base.run_ours(ours)
    assert rel_err(v1, v0) > 1e-3
    assert rel_err(v2, v0) > 1e-3


def test_fp32_islands_stay_fp32_in_bf16_model():
    _, ours = tiny_dit_pair(torch.bfloat16)
    for name, tensor in ours.state_dict().items():
        expected = torch.float32 if is_fp32_name(name) else torch.bfloat16
        assert tensor.dtype == expected, name
    assert {n for n, _ in ours.state_dict().items() if is_fp32_name(n)} >= {
        "video_patch_proj.weight",
        "audio_patch_proj.bias",
        "time_embedder.proj_in.weight",
        "time_embedder.proj_out.bias",
        "final_layer.video_out.weight",
        "final_layer.audio_out.bias",
        "rope.inv_freq",
    }


def test_timestep_sinusoid_by_hand():
    # dim 4: freqs exp(-ln(1e4) * k / 2) = (1, 0.01); [cos(t f), sin(t f)]
    emb = timestep_sinusoid(torch.tensor([0.5]), 4)
    expected = torch.tensor(
        [
            [
                torch.cos(torch.tensor(0.5)),
                torch.cos(torch.tensor(0.005)),
                torch.sin(torch.tensor(0.5)),
                torch.sin(torch.tensor(0.005)),
            ]
        ]
    )
    torch.testing.assert_close(emb, expected)


def test_released_config_builds_on_meta_with_index_parameter_count():
    """33,122,992,896 parameters; with the released dtypes, bytes equal each index's total_size."""
    import json
    from pathlib import Path

    ref_dir = Path(__file__).parent / "data" / "reference"
    cfg = DiTConfig.from_json(ref_dir / "FL2VA" / "transformer" / "config.json")
    assert cfg == DiTConfig.from_json(ref_dir / "transformer" / "config.json") == DiTConfig()
    with torch.device("meta"):
        model = H3DiT(cfg)
    assert sum(p.numel() for p in model.parameters()) == 33_122_992_896
    nbytes = sum(t.numel() * (4 if is_fp32_name(n) else 2) for n, t in model.named_parameters())
    diffusers_total = json.loads(
        (ref_dir / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text()
    )
    original_total = json.loads((ref_dir / "FL2VA" / "transformer" / "model.safetensors.index.json").read_text())
    assert nbytes == diffusers_total["metadata"]["total_size"]
    assert nbytes + model.rope.inv_freq.numel() * 4 == original_total["metadata"]["total_size"]


def test_bf16_forward_is_bitwise_equal_to_reference():
    """Same kernels, same op order: in bf16 on the CPU the outputs are the reference's to the bit."""
    ref, ours = tiny_dit_pair(torch.bfloat16)
    inputs = packed_inputs(0.3, 0.7)
    with torch.no_grad():
        ref_video, ref_audio = ref(**inputs.reference_kwargs(), return_dict=False)
        video, audio = inputs.run_ours(ours)
    assert torch.equal(video, ref_video[0]) and torch.equal(audio, ref_audio[0])
