"""A released checkpoint on disk: where each component lives, whether they fit together, and loading them.

Two folder layouts are published, and a third is accepted:

    original  FL2VA/ (or its parent): transformer/, text_encoder/, tokenizer/, processor/, video_vae/, audio_vae/
    diffusers the same names, except vae/ for the video VAE
    either one with the transformer as a single safetensors file (its QKV order: `qkv_layout`, see checkpoint/dit.py)

The Ref2VA DiT (same architecture, its own weights) sits beside FL2VA/ as Ref2VA/transformer/ in the original layout
and as transformer_ref/ in the diffusers layout; it is found, and its configuration checked, with the rest, and its
weights are read only when a Ref2VA DiT is loaded (`load_ref_dit`).

Everything here happens before the pipeline: it receives loaded `Components` (`model.components`) and knows no
folder names.
"""

from __future__ import annotations

import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from h3serve.checkpoint.dit import load_dit, resolve_dit_layout
from h3serve.checkpoint.safetensors import LoadHook, open_checkpoint
from h3serve.checkpoint.text_encoder import load_text_encoder
from h3serve.checkpoint.vae import load_audio_vae, load_video_vae, read_audio_vae_config, read_video_vae_config
from h3serve.config import DiTConfig
from h3serve.errors import shown_path
from h3serve.files import KINDS
from h3serve.model.audio_vae import AudioVAEConfig
from h3serve.model.components import Components, check_compatible
from h3serve.model.dit import H3DiT
from h3serve.model.text_encoder import TEXT_ENCODER_LAYER
from h3serve.model.video_vae import VideoVAEConfig
from h3serve.vocab import TASK_TYPES, DiTKind, TaskType

# Component folders both layouts share; the video VAE's differs (see `_video_vae_dir`).
_SHARED = ("transformer", "text_encoder", "tokenizer", "processor", "audio_vae")

# Which DiTs a process loads: `vocab.TaskType` and `vocab.TASK_TYPES` (the FL2VA DiT serves t2va, i2va, l2va and
# fl2va; the Ref2VA DiT serves ref2va).


@dataclass(frozen=True)
class ModelFolder:
    """A released checkpoint's component folders and configurations, read and cross-checked before any weight."""

    root: Path
    transformer: Path
    text_encoder: Path
    tokenizer: Path
    processor: Path
    video_vae: Path
    audio_vae: Path
    dit: DiTConfig
    dit_qkv_layout: str | None  # resolved: "interleaved" / "stacked" for original names, None for diffusers names
    video_vae_config: VideoVAEConfig
    audio_vae_config: AudioVAEConfig
    text_hidden_size: int
    ref_transformer: Path | None = None  # the Ref2VA DiT's folder, when the release has one
    ref_qkv_layout: str | None = None  # resolved like dit_qkv_layout, for the Ref2VA DiT's own files

    def check_task_type(self, task_type: str) -> None:
        """Whether this folder holds the DiTs `task_type` loads. ValueError naming what is missing otherwise."""
        if task_type not in TASK_TYPES:
            raise ValueError(f"task type must be one of {', '.join(TASK_TYPES)}, got {task_type!r}")
        if DiTKind.REF2VA in TASK_TYPES[task_type] and self.ref_transformer is None:
            raise ValueError(
                f"task type {task_type} loads the Ref2VA DiT, but model folder {self.root} has none (looked for "
                f"{self.root / 'transformer_ref'} and {self.root.parent / 'Ref2VA' / 'transformer'}); use task type "
                "fl2va, or a release with the Ref2VA weights"
            )


def resolve_model_folder(path: str | Path, *, qkv_layout: str | None = None) -> ModelFolder:
    """Find the components of a released checkpoint and read every configuration and weight-file header, so that a
    missing folder, a broken config, a truncated file or components that do not fit together stop the start before
    any weight loads. `qkv_layout`: a single-file DiT's QKV row order (see `resolve_dit_layout`).

    Raises FileNotFoundError or ValueError naming the file.
    """
    root = _component_root(Path(path))
    video = _video_vae_dir(root)
    dit_config = root / "transformer" / "config.json"
    if not dit_config.is_file():
        raise FileNotFoundError(f"{dit_config} is missing")
    text_layers, text_hidden = _text_encoder_shape(root / "text_encoder")
    if text_layers <= TEXT_ENCODER_LAYER:
        raise ValueError(
            f"{root / 'text_encoder' / 'config.json'}: the text encoder has {text_layers} layers; H3 reads the "
            f"output of layer {TEXT_ENCODER_LAYER}, so it needs more than {TEXT_ENCODER_LAYER}"
        )
    video_config, video_weights = read_video_vae_config(video)
    audio_config, audio_weights = read_audio_vae_config(root / "audio_vae")
    dit = DiTConfig.from_json(dit_config)
    check_compatible(dit, video_config, audio_config, text_hidden)
    ref = _ref_dit_dir(root)
    if ref is not None and DiTConfig.from_json(ref / "config.json") != dit:
        raise ValueError(
            f"{ref / 'config.json'}: the Ref2VA DiT's configuration differs from {dit_config}'s (H3 ships one "
            "architecture with two sets of weights)"
        )
    # Every weight file's header too (indexes, shards, key lists; no tensor data): a missing or truncated file
    # stops the start now, not after the components before it have loaded.
    dit_layout = resolve_dit_layout(open_checkpoint(root / "transformer"), qkv_layout)
    ref_layout = None if ref is None else resolve_dit_layout(open_checkpoint(ref), qkv_layout)
    for weights in (root / "text_encoder", video_weights, audio_weights):
        open_checkpoint(weights)
    return ModelFolder(
        root=root,
        transformer=root / "transformer",
        text_encoder=root / "text_encoder",
        tokenizer=root / "tokenizer",
        processor=root / "processor",
        video_vae=video,
        audio_vae=root / "audio_vae",
        dit=dit,
        dit_qkv_layout=dit_layout.qkv,
        video_vae_config=video_config,
        audio_vae_config=audio_config,
        text_hidden_size=text_hidden,
        ref_transformer=ref,
        ref_qkv_layout=None if ref_layout is None else ref_layout.qkv,
    )


def _component_root(root: Path) -> Path:
    try:
        mode = root.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"model folder {shown_path(root)} does not exist") from None
    except OSError as err:  # a folder above it unreadable, a loop of links: the OS's words
        raise FileNotFoundError(f"model folder {shown_path(root)}: {err.strerror or type(err).__name__}") from None
    if not stat.S_ISDIR(mode):
        kind = next((name for test, name in KINDS if test(mode)), "a file")
        raise NotADirectoryError(f"{shown_path(root)} is {kind}, not a model folder")
    if (root / "FL2VA" / "transformer").is_dir() and not (root / "transformer").is_dir():
        root = root / "FL2VA"
    for name in _SHARED:
        if not (root / name).is_dir():
            raise FileNotFoundError(
                f"model folder {shown_path(root)} has no {name}/ (expected the released FL2VA/ layout or the "
                "diffusers layout)"
            )
    return root


def _ref_dit_dir(root: Path) -> Path | None:
    """transformer_ref/ (diffusers layout) or ../Ref2VA/transformer/ (original layout), if it has a config."""
    for candidate in (root / "transformer_ref", root.parent / "Ref2VA" / "transformer"):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _video_vae_dir(root: Path) -> Path:
    for name in ("video_vae", "vae"):  # original, diffusers
        if (root / name).is_dir():
            return root / name
    raise FileNotFoundError(
        f"model folder {shown_path(root)} has no video_vae/ (original layout) or vae/ (diffusers layout)"
    )


def _text_encoder_shape(folder: Path) -> tuple[int, int]:
    """(num_hidden_layers, hidden_size) of the Qwen3-VL text model, from its config alone."""
    from transformers import Qwen3VLConfig

    try:
        text = Qwen3VLConfig.from_pretrained(str(folder), local_files_only=True).text_config
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder / 'config.json'}: not a readable Qwen3-VL config ({err})") from err
    return text.num_hidden_layers, text.hidden_size


def load_ref_dit(
    folder: ModelFolder,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    hook: LoadHook | None = None,
    mapped: Callable[[str], bool] | None = None,
) -> H3DiT:
    """The Ref2VA DiT of a resolved folder, loaded as strictly as the FL2VA one (`load_dit`)."""
    folder.check_task_type(TaskType.REF2VA)
    return load_dit(
        folder.ref_transformer,
        device=device,
        dtype=dtype,
        config=folder.dit,
        qkv_layout=folder.ref_qkv_layout,
        hook=hook,
        mapped=mapped,
    )


def load_components(
    folder: ModelFolder,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    task_type: str = TaskType.FL2VA,
    dit_hook: LoadHook | None = None,
    text_hook: LoadHook | None = None,
    dit_mapped: Callable[[str], bool] | None = None,
    video_dtype_of: Callable[[str], torch.dtype] | None = None,
    video_vae_device: torch.device | str | None = None,
) -> Components:
    """Load every component of a resolved folder. `dtype`: the DiT block stack and the text encoder (the DiT's fp32
    islands and both VAEs stay float32). `task_type`: which DiTs (`TASK_TYPES`), checked before anything loads.
    `dit_hook`, `text_hook`: per-tensor transforms for the DiTs' and the text encoder's weights as they load.
    `dit_mapped`: the DiT tensors left as their file's mapping, unread (`safetensors.assign_from_checkpoint`).
    `video_dtype_of`: the video VAE's tensors' dtypes as read (float32 unless told). `video_vae_device`: where the video
    VAE loads (None: `device`; host memory when it only visits the device: `pipeline.placement`)."""
    folder.check_task_type(task_type)
    kinds = TASK_TYPES[task_type]
    dit = ref_dit = None
    if DiTKind.FL2VA in kinds:
        dit = load_dit(
            folder.transformer,
            device=device,
            dtype=dtype,
            config=folder.dit,
            qkv_layout=folder.dit_qkv_layout,
            hook=dit_hook,
            mapped=dit_mapped,
        )
    if DiTKind.REF2VA in kinds:
        ref_dit = load_ref_dit(folder, device=device, dtype=dtype, hook=dit_hook, mapped=dit_mapped)
    return Components(
        dit=dit,
        text_encoder=load_text_encoder(
            folder.text_encoder, folder.tokenizer, folder.processor, device=device, dtype=dtype, hook=text_hook
        ),
        video_vae=load_video_vae(
            folder.video_vae,
            device=device if video_vae_device is None else video_vae_device,
            config=folder.video_vae_config,
            dtype_of=video_dtype_of,
        ),
        audio_vae=load_audio_vae(folder.audio_vae, device=device, config=folder.audio_vae_config),
        name=str(folder.root),
        ref_dit=ref_dit,
        adaln_mapped=dit_mapped is not None,
    )
