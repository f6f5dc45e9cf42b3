"""The words every layer shares: tasks, the DiTs that run them, reference kinds, the 17n+5 frame grid, the stereo
channel count, the smoke request and the built-in tiny model's name.

A leaf: it imports only `config`, so the model folder, the pipeline, the settings, the CLI and the HTTP schemas all
name these without importing each other. The enums are `StrEnum`s, so a member equals (and hashes as) its string:
`Task.T2VA == "t2va"`, and a plain string from a client or a config file looks them up as it is. A member also
reads as its string, repr included, so that messages and logs show 't2va' rather than <Task.T2VA: 't2va'>.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from h3serve.config import CLIP_FRAMES, FPS, LATENTS_PER_CLIP, TOKEN_DROP

# --- tasks and DiTs -----------------------------------------------------------------------------------------------


class _Word(StrEnum):
    def __repr__(self) -> str:
        return repr(self.value)


class Task(_Word):
    """What a request generates from. The four base modes differ only in the keyframes they pack (`TASK_ANCHORS`)
    and run the FL2VA DiT; ref2va takes reference files and runs the Ref2VA DiT (`dit_kind`)."""

    T2VA = "t2va"
    I2VA = "i2va"
    L2VA = "l2va"
    FL2VA = "fl2va"
    REF2VA = "ref2va"


class DiTKind(_Word):
    """The two released DiTs: one architecture, two sets of weights."""

    FL2VA = "fl2va"
    REF2VA = "ref2va"


class TaskType(_Word):
    """Which DiTs a process loads (vLLM-Omni's task type). Each DiT is 33 B parameters, so a process usually holds
    one; `both` holds the two."""

    FL2VA = "fl2va"
    REF2VA = "ref2va"
    BOTH = "both"

    @property
    def kinds(self) -> tuple[DiTKind, ...]:
        """The DiTs this task type loads, FL2VA first."""
        return TASK_TYPES[self]


TASK_TYPES: dict[TaskType, tuple[DiTKind, ...]] = {
    TaskType.FL2VA: (DiTKind.FL2VA,),
    TaskType.REF2VA: (DiTKind.REF2VA,),
    TaskType.BOTH: (DiTKind.FL2VA, DiTKind.REF2VA),
}

# Keyframe anchors per base task, in packed order (first before last). Ref2VA packs reference blocks instead.
ANCHORS = ("first", "last")
TASK_ANCHORS: dict[Task, tuple[str, ...]] = {
    Task.T2VA: (),
    Task.I2VA: ("first",),
    Task.L2VA: ("last",),
    Task.FL2VA: ("first", "last"),
}
BASE_TASKS = tuple(TASK_ANCHORS)  # the tasks the FL2VA DiT serves


def dit_kind(task: str) -> DiTKind:
    """The DiT a task runs on: the Ref2VA DiT for ref2va, the FL2VA DiT for the four base modes. ValueError for a
    string that is not a task."""
    return DiTKind.REF2VA if Task(task) is Task.REF2VA else DiTKind.FL2VA


class ReferenceKind(_Word):
    """What a Ref2VA reference file is, read from its content (`pipeline.references`)."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


# --- the frame grid -----------------------------------------------------------------------------------------------
# The video VAE encodes 17-frame clips of 5 latents each and drops the last 3 latents of a video (config.TOKEN_DROP):
# the frame counts it takes are 17n + 5 with n >= 1 (one whole clip, then whole clips after it), and 17n + 5 frames
# pad to n + 1 clips, 5(n + 1) latents, of which 5n + 2 remain.

MIN_FRAMES = CLIP_FRAMES + LATENTS_PER_CLIP  # 22, the shortest clip on the grid (n = 1)


def seconds_to_frames(seconds: float) -> int:
    """The frame count a duration asks for at the model's frame rate, before snapping to the grid (at least 1)."""
    return max(1, round(seconds * FPS))


def on_grid(num_frames: int) -> bool:
    """Whether the VAE encodes exactly `num_frames` frames: 17n + 5 with n >= 1."""
    return num_frames >= MIN_FRAMES and num_frames % CLIP_FRAMES == LATENTS_PER_CLIP


def snap_up(num_frames: int) -> int:
    """The smallest frame count on the grid that is >= num_frames (22 for anything up to 22)."""
    return max(MIN_FRAMES, num_frames + (LATENTS_PER_CLIP - num_frames) % CLIP_FRAMES)


def snap_down(num_frames: int) -> int:
    """The largest frame count on the grid that is <= num_frames: the prefix of a longer video the VAE encodes.
    ValueError below 22 frames, which hold no whole clip."""
    if num_frames < MIN_FRAMES:
        raise ValueError(
            f"{num_frames} frames hold no {CLIP_FRAMES}n+{LATENTS_PER_CLIP} clip (n >= 1): {MIN_FRAMES} at least"
        )
    return num_frames - (num_frames - LATENTS_PER_CLIP) % CLIP_FRAMES


def latent_frames(num_frames: int) -> int:
    """The latent frames the video VAE encodes `num_frames` (on the grid) to: 5n + 2 for 17n + 5."""
    if not on_grid(num_frames):
        raise ValueError(f"num_frames must be of the form {CLIP_FRAMES}n+{LATENTS_PER_CLIP} (n >= 1), got {num_frames}")
    clips = (num_frames - LATENTS_PER_CLIP) // CLIP_FRAMES + 1  # after padding to whole clips
    return clips * LATENTS_PER_CLIP - TOKEN_DROP


# --- audio ----------------------------------------------------------------------------------------------------------

# The generated soundtrack, and every reference soundtrack the model reads, is stereo: two mono channels that the
# audio VAE codes as a batch of two and the packed layout holds as two blocks of rows (L then R).
AUDIO_CHANNELS = 2


# --- the built-in tiny model -----------------------------------------------------------------------------------------

# The name `model/tiny.py` gives its components, and the id /v1/models lists when no model folder is served. Here, not
# in model/tiny.py, so that the settings name it without importing torch.
TINY_MODEL_NAME = "h3serve-tiny"


# --- the smoke request ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SmokeRequest:
    """The short request the startup warmup and `h3serve accept` render: the production canvas and a 2 s clip.
    Steps and seed are each caller's own (the warmup runs one forward, the acceptance the seed's 20 steps)."""

    prompt: str
    width: int
    height: int
    seconds: float

    @property
    def num_frames(self) -> int:
        """The frame count `seconds` asks for, on the grid (2.0 s: 48 frames, snapped up to 56)."""
        return snap_up(seconds_to_frames(self.seconds))


SMOKE_REQUEST = SmokeRequest(
    prompt="Macro soldering a PCB under warm bench light, soft room tone.", width=768, height=448, seconds=2.0
)
