"""Keyframe encoding and posterior sampling, noise order and the denoise loop against diffusers' H3 modular blocks."""

from __future__ import annotations

import pytest
import torch

from h3serve.checkpoint.vae import load_video_vae
from h3serve.model.latents import LatentStats
from h3serve.pipeline.conditioning import encode_keyframes, sample_keyframe_latents
from h3serve.pipeline.layout import TASK_ANCHORS, MediaGeometry, audio_rows_to_latents, build_layout, unpatchify_video
from h3serve.pipeline.sampling import (
    InitialNoise,
    bind_model,
    denoise,
    draw_layout_noise,
    draw_noise,
    initial_rows,
    request_generator,
)
from h3serve.pipeline.schedule import DualSchedule
from oracle import oracle

oracle("diffusers")
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import before_denoise as ref_bd
from diffusers.modular_pipelines.minimax_h3 import encoders as ref_enc
from diffusers.modular_pipelines.minimax_h3 import modular_blocks_minimax_h3 as ref_blocks

TASKS = sorted(TASK_ANCHORS)


def run_blocks(blocks, components, state: PipelineState | None = None, **inputs) -> PipelineState:
    """Run diffusers blocks on `components` the way `ModularPipeline.__call__` does: inputs, else defaults."""
    state = state or PipelineState()
    for block in blocks:
        for param in block.inputs:
            if param.name is None:
                continue
            if param.name in inputs:
                state.set(param.name, inputs[param.name], param.kwargs_type)
            elif param.name not in state.values:
                state.set(param.name, param.default, param.kwargs_type)
        with torch.no_grad():
            _, state = block(components, state)
    return state


def tiny_video_vae(latent_channels: int = 4) -> AutoencoderKLMiniMaxH3:
    """The released VAE geometry (16x spatial, 17 -> 5 temporal) with a few channels, so the pipeline's channel
    counts follow the tiny DiT."""
    torch.manual_seed(0)
    return AutoencoderKLMiniMaxH3(
        latent_channels=latent_channels,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 2, 2, 1),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=1,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        latents_mean=tuple(0.1 * i for i in range(latent_channels)),
        latents_std=tuple(0.5 + 0.25 * i for i in range(latent_channels)),
    ).eval()


def tiny_audio_vae(latent_channels: int) -> AutoencoderKLMiniMaxH3Audio:
    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=2,
        encoder_rates=(2, 2),
        latent_dim=2 * latent_channels,
        latent_channels=latent_channels,
        num_attention_heads=2,
        decoder_dim=4,
        decoder_rates=(2, 2),
        decoder_kernel_sizes=(4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
    ).eval()


def text_tags(num_keyframes: int) -> torch.Tensor:
    tags = []
    for _ in range(num_keyframes):
        tags += [1, 1, 1] + [0] * 4
    return torch.tensor([*tags, 1, 1, 1, 1, 1])


# --- initial noise -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_initial_rows_match_reference(task):
    """Released channel counts (24 video, 32 audio): the pipeline's own draws, one generator, same seed."""
    anchors, seed = TASK_ANCHORS[task], 1234
    height, width, num_frames = 64, 96, 124
    geometry = MediaGeometry.from_pixels(height, width, num_frames)
    tags = text_tags(len(anchors))
    g = torch.Generator().manual_seed(99)
    cond = [torch.randn(1, 24, 1, geometry.latent_height, geometry.latent_width, generator=g) for _ in anchors]

    pipe = ref_blocks.MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(scheduler=MiniMaxH3Scheduler(shift=12.0))
    steps = [ref_bd.MiniMaxH3PrepareLayoutStep()]
    if anchors:
        steps += [ref_bd.MiniMaxH3PrepareConditionLatentsStep()]
    steps += [ref_bd.MiniMaxH3PrepareLatentsStep()]
    if anchors:
        steps += [ref_bd.MiniMaxH3FL2VAPrepareLatentsStep()]
    state = run_blocks(
        steps,
        pipe,
        text_token_tags=tags,
        height=height,
        width=width,
        num_frames=num_frames,
        keyframe_anchors=anchors,
        condition_latents=cond,
        generator=torch.Generator().manual_seed(seed),
    )

    layout = build_layout(tags, geometry, anchors)
    video_shape = (1, 24, geometry.latent_frames, geometry.latent_height, geometry.latent_width)
    noise = draw_noise(request_generator(seed), [c.shape for c in cond], video_shape, (layout.num_audio_rows, 32))
    video, audio = initial_rows(layout, noise, cond)
    assert torch.equal(video, state.get("latents"))
    assert torch.equal(audio, state.get("audio_latents"))
    # Keyframe rows are the 0.999-noised latents, held apart from the fresh video noise.
    assert video.shape[0] == layout.video_indices.numel()


def test_draw_order_is_conditions_video_audio():
    shapes = [(1, 2, 1, 2, 2)] * 2
    noise = draw_noise(request_generator(5), shapes, (1, 2, 3, 2, 2), (6, 4))
    g = torch.Generator().manual_seed(5)
    expected = [torch.randn(s, generator=g) for s in [*shapes, (1, 2, 3, 2, 2), (6, 4)]]
    got = [*noise.condition, noise.video, noise.audio]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_keyframe_posterior_matches_reference():
    vae = tiny_video_vae()
    pixels = torch.randint(0, 256, (1, 3, 1, 64, 96), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    with torch.no_grad():
        expected = ref_enc.encode_vae_condition(vae, pixels, mean, std, 42)
        x = (pixels.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1, 1)
        posterior = vae.encode(x).latent_dist
    stats = LatentStats(vae.config.latents_mean, vae.config.latents_std)
    ours = sample_keyframe_latents(posterior.mean, posterior.logvar, stats)
    assert ours.shape == (1, 4, 1, 4, 6)
    assert torch.equal(ours, expected)
    # Another seed is another anchor: the seed is really used.
    other = sample_keyframe_latents(posterior.mean, posterior.logvar, stats, 7)
    assert not torch.equal(other, expected)


def test_keyframe_encode_stage_matches_reference(tmp_path):
    """The whole stage: uint8 keyframe -> the VAE's pixel convention -> encode -> seeded posterior -> normalised."""
    from PIL import Image

    vae = tiny_video_vae()
    vae.save_pretrained(tmp_path)
    ours = load_video_vae(tmp_path)
    g = torch.Generator().manual_seed(4)
    images = [torch.randint(0, 256, (64, 96, 3), generator=g, dtype=torch.uint8) for _ in range(2)]
    latents = encode_keyframes(ours, [Image.fromarray(i.numpy()) for i in images])
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    for got, pixels in zip(latents, images, strict=True):
        with torch.no_grad():
            expected = ref_enc.encode_vae_condition(vae, pixels.permute(2, 0, 1)[None, :, None], mean, std, 42)
        assert got.shape == (1, 4, 1, 4, 6) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.equal(latents[0], latents[1])


# --- denoise loop ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dit_pair():
    from dit_fixtures import tiny_dit_pair

    return tiny_dit_pair(torch.float32)


@pytest.mark.parametrize("task", TASKS)
def test_denoise_matches_reference_loop(task, dit_pair):
    """Several steps of the tiny DiT through diffusers' whole core-denoise block vs. our layout, noise and loop."""
    ref_dit, our_dit = dit_pair
    cfg = ref_dit.config
    channels, audio_channels = cfg.in_channels, cfg.audio_in_channels
    anchors, seed, num_points = TASK_ANCHORS[task], 2024, 5
    height, width, num_frames = 32, 64, 124  # diffusers' layout step refuses < 5 s
    geometry = MediaGeometry.from_pixels(height, width, num_frames)
    tags = text_tags(len(anchors))
    g = torch.Generator().manual_seed(11)
    text_states = torch.randn(len(tags), cfg.text_dim, generator=g)
    cond = [torch.randn(1, channels, 1, geometry.latent_height, geometry.latent_width, generator=g) for _ in anchors]

    pipe = ref_blocks.MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(
        transformer=ref_dit,
        vae=tiny_video_vae(channels),
        audio_vae=tiny_audio_vae(audio_channels),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    core = ref_blocks.MiniMaxH3FL2VACoreDenoiseStep() if anchors else ref_blocks.MiniMaxH3CoreDenoiseStep()
    inputs = dict(
        prompt_embeds=text_states[None],
        text_token_tags=tags,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=num_points,
        generator=torch.Generator().manual_seed(seed),
    )
    if anchors:
        inputs.update(condition_latents=cond, keyframe_anchors=anchors)
    state = run_blocks([core], pipe, **inputs)

    layout = build_layout(tags, geometry, anchors)
    noise = draw_layout_noise(request_generator(seed), layout, channels, audio_channels)
    video0, audio0 = initial_rows(layout, noise, cond)
    calls = []
    video, audio = denoise(
        bind_model(our_dit, layout, text_states),
        video0,
        audio0,
        layout,
        DualSchedule.build(num_points),
        on_step=lambda i, n: calls.append((i, n)),
    )
    assert calls == [(i, num_points - 1) for i in range(1, num_points)]
    n_cond = layout.num_condition_video_rows
    assert torch.equal(video[:n_cond], video0[:n_cond])  # keyframe rows are never written
    final_video = unpatchify_video(video[n_cond:], geometry)
    final_audio = audio_rows_to_latents(audio)
    ref_video, ref_audio = state.get("latents"), state.get("audio_latents")
    assert final_video.shape == ref_video.shape and final_audio.shape == ref_audio.shape
    # The loop moved the latents far from the noise, so agreement is not trivial.
    assert (final_video - noise.video).abs().max() > 0.1
    torch.testing.assert_close(final_video, ref_video, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final_audio, ref_audio, atol=1e-5, rtol=1e-5)


def test_denoise_lands_on_the_data_with_an_exact_velocity():
    """A model whose data-ward velocity points exactly at x0 makes every step's x0 estimate exact, so the loop
    ends on x0 whatever the schedule; keyframe rows pass through untouched. Independent of any reference."""
    geometry = MediaGeometry(latent_frames=7, latent_height=4, latent_width=4, audio_latents=9)
    layout = build_layout([1, 1, 0, 0, 1], geometry, ("first", "last"))
    g = torch.Generator().manual_seed(0)
    x0_video = torch.randn(layout.num_video_rows, 16, generator=g)
    x0_audio = torch.randn(layout.num_audio_rows, 8, generator=g)
    video0 = torch.randn(layout.num_condition_video_rows + layout.num_video_rows, 16, generator=g)
    audio0 = torch.randn(layout.num_audio_rows, 8, generator=g)
    n_cond = layout.num_condition_video_rows
    schedule = DualSchedule.build(6, video_shift=12.0, audio_shift=3.0)
    seen = []

    def model(video, audio, timesteps, timestep_indices, step):
        # Recover each row's own t from the plan, as the DiT does, and return (x0 - x_t) / sigma.
        t_rows = timesteps[timestep_indices]
        t_video, t_audio = t_rows[layout.video_indices], t_rows[layout.audio_indices]
        seen.append((timesteps.clone(), t_video[:n_cond].unique()))
        v_video = torch.zeros_like(video)
        v_video[n_cond:] = (x0_video - video[n_cond:]) / (1 - t_video[n_cond:, None])
        return v_video, (x0_audio - audio) / (1 - t_audio[:, None])

    video, audio = denoise(model, video0, audio0, layout, schedule)
    torch.testing.assert_close(video[n_cond:], x0_video, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(audio, x0_audio, atol=1e-5, rtol=1e-5)
    assert torch.equal(video[:n_cond], video0[:n_cond])
    assert len(seen) == schedule.num_steps == 5
    for timesteps, cond_t in seen:  # keyframe rows sit at max(t, 0.999)
        assert timesteps.is_contiguous() and len(cond_t) == 1 and cond_t.item() >= torch.tensor(0.999).item()


def test_initial_rows_rejects_mismatches():
    geometry = MediaGeometry(latent_frames=2, latent_height=2, latent_width=2, audio_latents=3)
    layout = build_layout([1], geometry, ("first",))
    noise = InitialNoise(condition=(), video=torch.zeros(1, 4, 2, 2, 2), audio=torch.zeros(6, 4))
    with pytest.raises(ValueError, match="visual condition"):
        initial_rows(layout, noise, [])
