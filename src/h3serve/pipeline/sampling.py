"""Initial noise and the denoise loop.

The request's one CPU generator draws, in this order: one tensor per visual condition (a keyframe, or a Ref2VA image
or video reference, in packed order; each shaped like its latent), the video noise as a latent `(1, C, F, H, W)`,
then the audio noise directly as channel-major rows. (VAE posteriors are sampled with their own generator, in the
conditioning stage; reference audio is never noised.) Changing any of this changes every render of a seed.

The loop is a stateless function over a model callable: the text rows, RoPE table, tags and scatter indices of
a request are bound once (`bind_model`) and the loop only passes rows and timesteps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from h3serve.pipeline.layout import CONDITION_TIMESTEP, PackedLayout, patchify_video
from h3serve.pipeline.schedule import DualSchedule, clean_estimate, euler_step

# (video rows, audio rows, timesteps (M,), timestep indices (S,), step index) -> (video velocity, audio velocity),
# row for row.
ModelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
StepCallback = Callable[[int, int], None]
# After forward `done` of `total`: a function giving the clean video estimate (every video row), made only if called.
EstimateCallback = Callable[[int, int, Callable[[], torch.Tensor]], None]


@dataclass(frozen=True)
class InitialNoise:
    """float32 CPU noise of one request, in draw order."""

    condition: tuple[torch.Tensor, ...]  # one per keyframe / visual reference, shaped like its latent (1, C, F, H, W)
    video: torch.Tensor  # (1, C, F, H, W)
    audio: torch.Tensor  # (channels * Na, C_audio), channel-major rows


def draw_noise(
    generator: torch.Generator,
    condition_shapes: Sequence[Sequence[int]],
    video_shape: Sequence[int],
    audio_rows_shape: Sequence[int],
) -> InitialNoise:
    """Draw a request's noise from its generator in the released order (conditions, video, audio).

    The generator must be a CPU generator: the noise of a seed is then the same on every device.
    """
    if generator.device.type != "cpu":
        raise ValueError(f"the request generator must be a CPU generator, got device {generator.device}")

    def randn(shape: Sequence[int]) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=generator, dtype=torch.float32)

    condition = tuple(randn(shape) for shape in condition_shapes)
    return InitialNoise(condition=condition, video=randn(video_shape), audio=randn(audio_rows_shape))


def draw_layout_noise(
    generator: torch.Generator, layout: PackedLayout, video_channels: int, audio_channels: int
) -> InitialNoise:
    """`draw_noise` with the shapes a layout implies: one latent frame per keyframe (or each visual reference's
    latent), the target video latent, and the channel-major audio rows. video_channels / audio_channels: the DiT's
    latents_dim / audio_latents_dim."""
    g = layout.geometry
    frame = (1, video_channels, 1, g.latent_height, g.latent_width)
    conditions = [frame] * len(layout.anchors) + [
        (1, video_channels, ref.latent_frames, ref.latent_height, ref.latent_width)
        for ref in layout.references
        if ref.has_video
    ]
    video = (1, video_channels, g.latent_frames, g.latent_height, g.latent_width)
    return draw_noise(generator, conditions, video, (layout.num_audio_rows, audio_channels))


def request_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def noise_condition(latents: torch.Tensor, noise: torch.Tensor, level: float = CONDITION_TIMESTEP) -> torch.Tensor:
    """x_t = t*x0 + (1 - t)*noise at t = `level`, in float32: keyframes are held just short of clean."""
    t = torch.tensor(level, dtype=torch.float32)
    return t * latents.float() + (1.0 - t) * noise


def initial_rows(
    layout: PackedLayout,
    noise: InitialNoise,
    condition_latents: Sequence[torch.Tensor] = (),
    condition_audio: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed video rows (conditioning rows first) and audio rows (reference audio rows first) the loop starts
    from, float32.

    condition_latents: the normalised latent of each keyframe or visual reference, in packed order, noised here to
    the conditioning level. condition_audio: Ref2VA's clean reference audio rows, one (2 * Na_i, C_a) tensor per
    audio-bearing reference in packed order.
    """
    expected = len(layout.anchors) + sum(ref.has_video for ref in layout.references)
    if len(condition_latents) != expected or len(noise.condition) != expected:
        raise ValueError(
            f"the layout packs {expected} visual condition(s) but got {len(condition_latents)} latent(s) "
            f"and {len(noise.condition)} noise tensor(s)"
        )
    rows = [
        patchify_video(noise_condition(z, n), layout.patch_size)
        for z, n in zip(condition_latents, noise.condition, strict=True)
    ]
    rows.append(patchify_video(noise.video, layout.patch_size))
    video = torch.cat(rows)
    if video.shape[0] != layout.num_condition_video_rows + layout.num_video_rows:
        raise ValueError(f"{video.shape[0]} video rows do not fit the layout's {layout.video_indices.numel()}")
    if noise.audio.shape[0] != layout.num_audio_rows:
        raise ValueError(f"{noise.audio.shape[0]} audio rows do not fit the layout's {layout.num_audio_rows}")
    audio = torch.cat([*(a.float().cpu() for a in condition_audio), noise.audio])
    if audio.shape[0] != layout.num_condition_audio_rows + layout.num_audio_rows:
        raise ValueError(
            f"{audio.shape[0] - noise.audio.shape[0]} reference audio rows do not fit the layout's "
            f"{layout.num_condition_audio_rows}"
        )
    return video, audio


def step_timesteps(layout: PackedLayout, schedule: DualSchedule) -> list[torch.Tensor]:
    """Each step's distinct timesteps, as the denoise loop will hand them to the DiT ((M_i,) float32)."""
    sv, sa = schedule.video, schedule.audio
    return [layout.timestep_plan(sv.timesteps[i], sa.timesteps[i])[0] for i in range(schedule.num_steps)]


def request_rows(dit: torch.nn.Module, layout: PackedLayout, text_states: torch.Tensor):
    """A request's refined text rows (L, hidden) and whole RoPE table on the DiT's device, and that device: what
    every forward of the request shares (the token refiner runs here, once per request)."""
    if text_states.shape[0] != layout.num_text:
        raise ValueError(f"{text_states.shape[0]} text rows do not match the layout's {layout.num_text}")
    device = next(dit.parameters()).device
    with torch.no_grad():
        text = dit.refine_text(text_states.to(device))
        rope = dit.rope(layout.rope_positions().to(device))
    return text, rope, device


def bind_model(
    dit: torch.nn.Module,
    layout: PackedLayout,
    text_states: torch.Tensor,
    tables: Sequence[Sequence[torch.Tensor]] | None = None,
) -> ModelFn:
    """Fix a request's text rows, RoPE table, tags and indices on an H3DiT; return the per-step callable.

    text_states: (L, text_dim) text-encoder output. The token refiner runs here, once per request.
    tables: every block's modulation table per step, made ahead of time (`h3serve.accel.adaln`), or None.
    """
    text, rope, device = request_rows(dit, layout, text_states)
    tags = layout.token_tags.to(device)
    video_indices = layout.video_indices.to(device)
    audio_indices = layout.audio_indices.to(device)
    text_indices = layout.text_indices.to(device)

    def model(video, audio, timesteps, timestep_indices, step):
        return dit(
            video, audio, text, timesteps, timestep_indices, tags, rope, video_indices, audio_indices, text_indices,
            None if tables is None else tables[step],
        )  # fmt: skip

    return model


@torch.no_grad()
def _estimate(cond: torch.Tensor, video: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Every video row with the generated ones at their clean estimate (a preview's input)."""
    return torch.cat([cond.float(), clean_estimate(video, velocity, t)])


def denoise(
    model: ModelFn,
    video_rows: torch.Tensor,
    audio_rows: torch.Tensor,
    layout: PackedLayout,
    schedule: DualSchedule,
    on_step: StepCallback | None = None,
    on_estimate: EstimateCallback | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the schedule's forwards; return the final (video rows, audio rows), conditioning rows included and
    unchanged.

    Only generated rows are stepped: the keyframe or reference video rows, and Ref2VA's reference audio rows, ride
    through every step as they came in. Video and audio advance by the same index i; each forward sees every row at
    its own timestep (`layout.timestep_plan`). Inputs are not modified. `on_estimate`: a preview's look at the clean
    video estimate after each forward (`pipeline.preview`); it reads the state only.
    """
    device = video_rows.device
    n_cond, n_cond_audio = layout.num_condition_video_rows, layout.num_condition_audio_rows
    cond, cond_audio = video_rows[:n_cond], audio_rows[:n_cond_audio]
    video = video_rows[n_cond:].float()
    audio = audio_rows[n_cond_audio:].float()
    sv, sa = schedule.video, schedule.audio
    num_steps = schedule.num_steps
    for i in range(num_steps):
        timesteps, timestep_indices = layout.timestep_plan(sv.timesteps[i], sa.timesteps[i])
        v_video, v_audio = model(
            torch.cat([cond, video]),
            torch.cat([cond_audio, audio]),
            timesteps.to(device),
            timestep_indices.to(device),
            i,
        )
        # A preview's view of this forward's clean estimate (made only if asked for), offered after the step is
        # reported: it holds the state before the step, which the step replaces and never modifies.
        estimate = None
        if on_estimate is not None:
            estimate = functools.partial(_estimate, cond, video, v_video[n_cond:], sv.timesteps[i])
        video = euler_step(video, v_video[n_cond:], sv.timesteps[i], sv.sigmas[i], sv.sigmas[i + 1])
        audio = euler_step(audio, v_audio[n_cond_audio:], sa.timesteps[i], sa.sigmas[i], sa.sigmas[i + 1])
        if on_step is not None:
            on_step(i + 1, num_steps)
        if on_estimate is not None:
            on_estimate(i + 1, num_steps, estimate)
    return torch.cat([cond, video]), torch.cat([cond_audio, audio])
