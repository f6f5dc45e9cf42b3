"""The decode stage alone, against diffusers' after-denoise, video-decode and audio-decode blocks on the same VAEs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3serve.checkpoint.vae import load_audio_vae, load_video_vae
from h3serve.pipeline.decode import check_finite, decode_audio, decode_video
from h3serve.pipeline.layout import MediaGeometry, build_layout, patchify_video
from oracle import oracle

oracle("diffusers")
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import decoders
from diffusers.modular_pipelines.minimax_h3 import modular_blocks_minimax_h3 as ref_blocks

HEIGHT, WIDTH, FRAMES = 64, 96, 22
ANCHORS = ("first",)  # one keyframe's rows lead the video rows and must be dropped


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    video = AutoencoderKLMiniMaxH3(
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 2, 2, 1),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=16,  # 12 of 16 dims rotate
        decoder_num_register_tokens=1,
        latents_mean=(0.1, -0.2, 0.3, 0.0),
        latents_std=(0.5, 0.75, 1.0, 1.25),
    ).eval()
    audio = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=2,
        encoder_rates=(2, 4, 4, 5, 5),
        latent_dim=12,
        latent_channels=6,
        num_attention_heads=2,
        decoder_dim=128,  # halved once per rate: 7 times
        decoder_rates=(5, 5, 2, 2, 2, 2, 2),
        decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
        latents_mean=tuple(0.05 * i for i in range(6)),
        latents_std=tuple(0.5 + 0.1 * i for i in range(6)),
    ).eval()
    root = tmp_path_factory.mktemp("vaes")
    video.save_pretrained(root / "vae")
    audio.save_pretrained(root / "audio_vae")
    pipe = ref_blocks.MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(vae=video, audio_vae=audio)
    return pipe, load_video_vae(root / "vae"), load_audio_vae(root / "audio_vae")


def test_decode_matches_reference_blocks(setup):
    pipe, video_vae, audio_vae = setup
    geometry = MediaGeometry.from_pixels(HEIGHT, WIDTH, FRAMES)
    layout = build_layout(torch.ones(5, dtype=torch.long), geometry, ANCHORS)
    g = torch.Generator().manual_seed(1)
    frame = (1, 4, 1, geometry.latent_height, geometry.latent_width)
    target = (1, 4, geometry.latent_frames, geometry.latent_height, geometry.latent_width)
    video_rows = torch.cat(
        [patchify_video(torch.randn(frame, generator=g)), patchify_video(torch.randn(target, generator=g))]
    )
    audio_rows = torch.randn(layout.num_audio_rows, 6, generator=g)

    state = PipelineState()
    for name, value in dict(
        latents=video_rows,
        audio_latents=audio_rows,
        num_condition_video_rows=layout.num_condition_video_rows,
        num_condition_audio_rows=0,
        num_latent_frames=geometry.latent_frames,
        latent_height=geometry.latent_height,
        latent_width=geometry.latent_width,
        num_audio_latents=geometry.audio_latents,
        output_type="pt",
    ).items():
        state.set(name, value)
    with torch.no_grad():
        for step in (decoders.MiniMaxH3AfterDenoiseStep(), decoders.MiniMaxH3VideoDecodeStep()):
            _, state = step(pipe, state)
        reference_frames = state.get("videos")[0]  # (F, 3, H, W) in [0, 1]
        _, state = decoders.MiniMaxH3AudioDecodeStep()(pipe, state)

    frames = decode_video(video_vae, video_rows, layout)
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and frames.dtype == np.uint8
    expected = (reference_frames.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()
    assert np.array_equal(frames, expected)  # observed: every value equal (float32, same weights)
    assert frames.std() > 1.0  # not a constant image

    wave = decode_audio(audio_vae, audio_rows, layout)
    reference_wave = state.get("audio")
    reference_wave = reference_wave if isinstance(reference_wave, torch.Tensor) else torch.as_tensor(reference_wave)
    reference_wave = reference_wave.reshape(2, -1).float()
    assert wave.shape == (2, geometry.audio_latents * 800) and wave.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(wave), reference_wave, rtol=1e-5, atol=1e-6)
    assert not np.allclose(wave[0], wave[1])  # L and R are different rows, not one channel twice


def test_non_finite_latents_are_refused_before_decoding():
    rows = torch.zeros(4, 3)
    check_finite(rows, rows)
    bad = rows.clone()
    bad[2, 1] = float("nan")
    for video, audio in ((bad, rows), (rows, bad), (rows, rows / 0 * 0 + float("inf"))):
        with pytest.raises(RuntimeError, match="not finite"):
            check_finite(video, audio)
