"""How one render's work is spread over devices: the engine's stages call these five points and nothing else knows
whether one process runs the render or several (`h3serve.parallel`: one rank per GPU, Ulysses sequence
parallelism).

    share         a stage computed once (text encoding, keyframe encoding) and handed to every process
    bind          the per-step DiT callable of a request (`sampling.bind_model`, or one rank's rows of it)
    decode_video  the video decode (or this rank's share of its windows)
    decode_audio  the audio decode (where the result is returned; a rank other than 0 returns None)

`ONE_DEVICE` is the plain render: everything here, in this process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

from h3serve.model.audio_vae import AudioVAE
from h3serve.model.video_vae import VideoVAE
from h3serve.pipeline.decode import decode_audio, decode_video
from h3serve.pipeline.layout import PackedLayout
from h3serve.pipeline.sampling import ModelFn, bind_model

T = TypeVar("T")
WindowCallback = Callable[[int, int], None]


class Spread(Protocol):
    @property
    def ranks(self) -> int:
        """Processes one render runs on (`pipeline.admission.Admission.ranks`: what a split render cannot do)."""
        ...

    def share(self, compute: Callable[[], T]) -> T:
        """`compute()` run once (on the lead) and its result on every process."""
        ...

    def bind(
        self,
        dit: torch.nn.Module,
        layout: PackedLayout,
        text_states: torch.Tensor,
        tables: Sequence[Sequence[torch.Tensor]] | None,
    ) -> ModelFn: ...

    def decode_video(
        self,
        vae: VideoVAE,
        video_rows: torch.Tensor,
        layout: PackedLayout,
        autocast: torch.dtype | None,
        on_window: WindowCallback,
        on_frames: Callable[[np.ndarray], None] | None = None,
    ) -> np.ndarray | None: ...

    def decode_audio(self, vae: AudioVAE, audio_rows: torch.Tensor, layout: PackedLayout) -> np.ndarray | None: ...


@dataclass(frozen=True)
class OneDevice:
    """Every stage in this process, on the profile's one device."""

    ranks = 1

    def share(self, compute: Callable[[], T]) -> T:
        return compute()

    def bind(self, dit, layout, text_states, tables) -> ModelFn:
        return bind_model(dit, layout, text_states, tables)

    def decode_video(self, vae, video_rows, layout, autocast, on_window, on_frames=None) -> np.ndarray | None:
        return decode_video(vae, video_rows, layout, autocast, on_window, on_frames=on_frames)

    def decode_audio(self, vae, audio_rows, layout) -> np.ndarray:
        return decode_audio(vae, audio_rows, layout)


ONE_DEVICE = OneDevice()
