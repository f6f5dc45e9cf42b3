"""The one schema for every setting, and the fail-closed rules between them.

`EngineSettings` holds what every command that builds an engine shares (the model, the profile, the step cache, the
kernel caches, the encoder): `render`, `serve` and `check` take the same flags and `H3_*` variables for them.
`Settings` (serve, check, ready) adds the service's. Each setting is a field with a description and bounds. It is
filled, in rising priority, from its default, an optional config file (JSON or TOML, keys are the field names), its
`H3_<FIELD>` environment variable and its generated CLI flag (`--field-name`). The names and values of the seed's
operator contract are kept: H3_DIFFUSION_ATTENTION_BACKEND, H3_EXECUTION_MODE, H3_LINEAR_BACKEND, H3_CACHE_BACKEND,
H3_CACHE_CONFIG, H3_STARTUP_WARMUP, H3_BIND_HOST, H3_API_PORT, H3_ALLOW_REMOTE_API, H3_API_KEY,
H3_VIDEO_SYNC_TIMEOUT. The profile's names, defaults and rules are `accel.profile`'s.

`load_settings` collects every violation (a bad value, an unknown key or H3_ variable, a forbidden combination)
and raises one SettingsError listing them all, each naming the environment variable and flag and what is allowed.
Nothing here loads weights, so `h3serve check` is quick.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import SplitResult, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from h3serve.accel.profile import (
    MAX_TABLES_KEPT,
    AdalnWeights,
    Attention,
    DType,
    Execution,
    Fp8Scaling,
    Linear,
    Offload,
    Profile,
    ProfileError,
    TextLinear,
    VaeAutocast,
    check,
    check_step_cache,
    is_integrated,
)
from h3serve.config import ENCODER_PRESET, ENCODER_SEGMENT_FRAMES, ENCODER_THREADS, MAX_ENCODER_THREADS, X264_PRESETS
from h3serve.errors import (
    ECHO_CHARS,
    ENV_PREFIX,
    NO_FLAG,
    SettingError,
    decimal_number,
    did_you_mean,
    env_name,
    flag_name,
    label,
    shown,
    shown_path,
    whole_number,
)
from h3serve.files import FileRefused, open_regular, read_regular, read_setting_file
from h3serve.media.encoding import MAX_SEGMENT_FRAMES, NVENC_PRESET, Encoding, EncodingError
from h3serve.vocab import TINY_MODEL_NAME, TaskType

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
HOST_PATTERN = re.compile(r"^[A-Za-z0-9.:-]+$")
KEY_PATTERN = re.compile(r"^[A-Za-z0-9._~-]{32,}$")
REDACTED = "<redacted>"
# The most bytes read of a file a setting names: a key is 32-some characters, a settings file a few hundred bytes.
# Anything near the cap is not the file the setting means (a 200 MiB key file, /dev/zero), and is never read whole.
KEY_FILE_CAP = 4 << 10
CONFIG_FILE_CAP = 1 << 20
SERVED_NAME_CHARS = 256
# Settings that were renamed: the old H3_ variable or config key is refused with what replaces it.
RENAMED = {"adaln_resident": "H3_ADALN_WEIGHTS (device: on the GPU; pinned: the former default)"}
# The profile's field for each setting that feeds it (`accel.profile.Profile`); a ProfileError names the former.
PROFILE_FIELDS = {
    "device": "device",
    "dtype": "dtype",
    "vae_autocast": "vae_autocast",
    "diffusion_attention_backend": "attention",
    "execution_mode": "execution",
    "linear_backend": "linear",
    "text_encoder_linear": "text_linear",
    "adaln_weights": "adaln_weights",
    "adaln_tables_kept": "adaln_tables_kept",
    "fp8_scaling": "fp8_scaling",
}
SETTING_OF = {profile: setting for setting, profile in PROFILE_FIELDS.items()}
# `h3serve render`'s flag names before it took the shared schema, accepted for one release (0.2 drops them).
OLD_RENDER_FLAGS = {
    "diffusion_attention_backend": "--attention",
    "execution_mode": "--execution",
    "linear_backend": "--linear",
    "encoder_threads": "--threads",
}


class EngineSettings(BaseModel):
    """The settings every engine-building command shares (`render`, `serve`, `check`). Field names are the
    config-file keys; `H3_` + the upper-cased name is the environment variable; `--` + the name with dashes is the
    flag."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), use_enum_values=False)

    # The model -------------------------------------------------------------------------------------------------
    # A string, not a Path: /v1/models lists it exactly as given (the seed's identity gate compares it verbatim).
    model: str | None = Field(
        None,
        min_length=1,
        description="released checkpoint folder (FL2VA/ or diffusers layout; the transformer may be one safetensors "
        "file); unset: the built-in tiny model",
    )
    qkv_layout: Literal["stacked", "interleaved"] | None = Field(
        None,
        description="QKV row order of a single-file DiT with original key names, which the file cannot tell: stacked "
        "or interleaved; refused where it cannot apply; unset: stacked, with a warning",
    )
    # The profile -----------------------------------------------------------------------------------------------
    device: str | None = Field(None, description="cpu or cuda[:N]; unset: cuda when available, else cpu")
    dtype: DType | None = Field(
        None,
        description="DiT and text-encoder precision, bfloat16 or float32 (the fp32 islands and both VAEs stay "
        "float32); unset: bfloat16 on cuda, float32 on cpu",
    )
    vae_autocast: VaeAutocast | None = Field(
        None,
        description="video-decode autocast, float16 (the released recipe, cuda only) or none; unset: float16 on "
        "cuda, none on cpu",
    )
    diffusion_attention_backend: Attention | None = Field(
        None,
        description="attention kernel: auto, FA4 (the DiT's attention in FlashAttention-4, exact: sm90+, the fa4 "
        "extra), CUDNN_ATTN, TORCH_SDPA or CUDNN_FP8 (the DiT's attention in FP8, lossy: Hopper+, one GPU, the "
        "fp8-attention extra); unset or auto: on cuda under compile FA4 where it is installed and passes its start-up "
        "self-test on sm90/sm100, else CUDNN_ATTN; under eager CUDNN_ATTN; on cpu TORCH_SDPA",
    )
    execution_mode: Execution | None = Field(
        None,
        description="eager, or compile (regional torch.compile of the DiT block); unset: the device's default profile",
    )
    linear_backend: Linear | None = Field(
        None,
        description="DiT block linears: BF16 (unquantized), CUTLASS (FP8) or HUMMING (FP8, batch-invariant; eager, no "
        "step cache, the humming extra); unset: the device's default profile",
    )
    text_encoder_linear: TextLinear | None = Field(
        None,
        description="text-encoder decoder-layer linears: BF16 (exact) or CUTLASS (FP8: 22.7 GiB less, lossy); unset: "
        "BF16",
    )
    adaln_weights: AdalnWeights | None = Field(
        None,
        description="where the DiT's AdaLN weights (13 B parameters) live: device (on the GPU), pinned (a page-locked "
        "host copy) or mapped (read from the checkpoint file, as page cache, when a schedule's tables are made); "
        "unset: mapped on an integrated GPU, pinned on a discrete one, device on cpu",
    )
    adaln_tables_kept: int | None = Field(
        None,
        ge=1,
        le=MAX_TABLES_KEPT,
        description="schedules whose AdaLN tables are kept (about 2.4 GiB each at 50 grid points, page-locked); "
        "unset: 2 on an integrated GPU, else 4",
    )
    fp8_scaling: Fp8Scaling | None = Field(
        None,
        description="how the CUTLASS FP8 GEMM applies its scales: ROWWISE (in the GEMM) or EPILOGUE (after a "
        "per-tensor GEMM, for GPUs whose cuBLAS refuses rowwise scales), self-tested at start; unset (auto): the "
        "first that passes the self-test on this GPU",
    )
    cache_backend: Literal["none", "cache_dit"] = Field(
        "none", description="step caching (lossy): none, or cache_dit with H3_CACHE_CONFIG"
    )
    cache_config: str | None = Field(
        None,
        description="cache-dit DBCache settings as a JSON object (cache-dit's key names, checked key by key); required "
        "with cache_dit, refused without it",
    )
    cache_dir: Path | None = Field(
        None, description="folder for persistent kernel caches (Inductor, Triton, Humming, FA4) reused across restarts"
    )
    lora: str | None = Field(
        None,
        min_length=1,
        description="few-step adapters merged into the DiT at load: PATH[:SCALE] of a readable regular file, "
        "comma-separated for several; the first adapter's trained sampler (grid points, shifts) is the default of "
        "requests that do not set them",
    )
    adapters: str | None = Field(
        None,
        min_length=1,
        description="adapters a request may apply at run time, by name: NAME=PATH[:SCALE], comma-separated; each "
        "file read and checked against the DiT at start, SCALE the default of a request that names no scale; a "
        "request names them (`lora`, `lora_name`), never a file",
    )
    adapter_cache_gib: float = Field(
        8.0,
        gt=0,
        description="host memory (GiB) the declared adapters' factors may take; past it the least recently used is "
        "given up and read again on its next use",
    )
    adapter_max_active: int = Field(
        2,
        ge=1,
        le=8,
        description="adapters one request may apply at once: the device buffers are sized for this many",
    )
    # The MP4 (media.h264: which of these are part of the file's bytes) -------------------------------------------
    encoder: Literal["x264", "nvenc"] = Field(
        "x264",
        description="H.264 encoder: x264 on the host's cores, or nvenc on the GPU's video engine (opt-in; RTX cards "
        "and the DGX Spark's GB10 have one, the H100/H200/GB200 do not; its bytes are not promised repeatable)",
    )
    encoder_preset: str | None = Field(
        None,
        description=f"the encoder's speed/size preset: x264's {', '.join(X264_PRESETS)}, or nvenc's p1..p7; unset: "
        f"{ENCODER_PRESET} (x264), {NVENC_PRESET} (nvenc)",
    )
    encoder_threads: int = Field(
        ENCODER_THREADS,
        ge=1,
        le=MAX_ENCODER_THREADS,
        description="x264 frame threads of each segment's encoder, pinned so that the same input gives the same bytes",
    )
    encoder_segment_frames: int | None = Field(
        None,
        ge=0,
        le=MAX_SEGMENT_FRAMES,
        description="x264 encodes the video in segments of this many frames (closed groups of pictures, several at "
        "once on the host's cores, joined into one stream; the bytes do not depend on the host); 0: one stream; "
        f"unset: {ENCODER_SEGMENT_FRAMES} (x264), 0 (nvenc, which encodes one stream)",
    )
    encoder_workers: int = Field(
        0,
        ge=0,
        le=256,
        description="segments encoded at once (not part of the bytes); 0: the cores this process may use // "
        "encoder_threads",
    )
    num_gpus: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs one render is split over (sequence parallel, one worker process per GPU; gloo processes on "
        "cpu); the DiT's attention heads must divide by it (the released DiT's 56: 1, 2, 4, 7, 8)",
    )
    # Several hosts (SGLang's names: --nnodes, --node-rank, --dist-init-addr) ------------------------------------------
    nnodes: int = Field(
        1,
        ge=1,
        le=64,
        description="hosts one render is split over: node 0 runs the service (or the render) and its ranks, every "
        "other node runs only its ranks (`h3serve serve --node-rank K`); the ranks are nnodes x H3_NUM_GPUS",
    )
    node_rank: int = Field(
        0,
        ge=0,
        le=63,
        description="this host's node: 0 runs the service and holds ranks 0..H3_NUM_GPUS-1; K > 0 runs ranks "
        "K x H3_NUM_GPUS onward and no HTTP service",
    )
    dist_init_addr: str | None = Field(
        None,
        description="HOST:PORT of node 0's rendezvous (an IPv4 address or a host name): node 0 listens there only "
        "(and on PORT+1 for the process group's store), the other nodes connect to it; required with H3_NNODES > 1; "
        "a non-loopback HOST needs H3_ALLOW_REMOTE_NODES",
    )
    allow_remote_nodes: bool = Field(
        False,
        description="allow a non-loopback H3_DIST_INIT_ADDR (a private link between the nodes: the ranks' tensors "
        "cross it unencrypted)",
    )
    node_key: SecretStr | None = Field(
        None,
        description="the key every node proves to the others before anything else moves (HMAC challenge-response), 32+ "
        "characters of [A-Za-z0-9._~-] (environment or config file only, never a flag); required with H3_NNODES > 1",
    )
    node_key_file: Path | None = Field(
        None,
        description=f"read the nodes' key from this file: a regular file of at most {KEY_FILE_CAP >> 10} KiB, readable "
        "by its owner only (instead of H3_NODE_KEY)",
    )
    node_timeout: int = Field(
        300,
        ge=1,
        le=3600,
        description="seconds node 0 waits at start for every other node to join (then the start ends naming the "
        "missing node and the address), and a joining node waits for node 0",
    )
    node_grace: int = Field(
        10,
        ge=1,
        le=600,
        description="seconds without a heartbeat from a node before it counts as lost: its render fails, /health turns "
        "not ready naming it, and the group is rebuilt when it joins again",
    )

    offload: Offload = Field(
        Offload.AUTO,
        description="what waits in page-locked host memory and streams to the GPU when it runs: auto (only what the "
        "device memory cannot hold: the text encoder's layers, then the video VAE, then DiT blocks, until the largest "
        "request fits; where none does, the largest that fits is served), all (every DiT block, the text encoder's "
        "layers and the video VAE; the least device memory) or none (everything resident); one memory pool (an "
        "integrated GPU) streams nothing",
    )
    device_memory_gib: float | None = Field(
        None,
        gt=0,
        le=4096,
        description="device memory (GiB) the memory plan places the model within, at most what is free (to leave "
        "room for other processes, or to plan as a smaller GPU would); unset: the device's free memory at start",
    )

    @field_validator("*", mode="before")
    @classmethod
    def _ascii_number(cls, value: Any, info: ValidationInfo) -> Any:
        """A number given as text (a flag, an H3_ variable) is read by the one rule (`errors.whole_number`,
        `decimal_number`: ASCII digits only). Left to pydantic, "2_0" would be 20 and "٢" refused in its words."""
        kind = _number_kind(cls.model_fields[info.field_name].annotation) if info.field_name else None
        if kind is None or not isinstance(value, str):
            return value
        try:
            return whole_number(value) if kind is int else decimal_number(value)
        except ValueError as err:
            raise PydanticCustomError("ascii_number", str(err)) from None

    def profile(self, *, ask_hardware: bool = True) -> Profile:
        """The engine profile these settings select (ProfileError naming what cannot be combined). What the hardware
        can run is not asked here (`accel.profile.check`); which GPU it is is (an integrated one has other defaults),
        unless `ask_hardware=False` (then a discrete GPU's defaults)."""
        device = self.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        integrated = ask_hardware and is_integrated(device)
        return Profile.for_device(device, integrated=integrated, **self._profile_values(device))

    def _profile_values(self, device: str) -> dict[str, Any]:
        values = {PROFILE_FIELDS[name]: getattr(self, name) for name in PROFILE_FIELDS if name != "device"}
        if self.model is None and values["adaln_weights"] is None and device.startswith("cuda"):
            values["adaln_weights"] = AdalnWeights.PINNED  # not mapped on an integrated GPU: the tiny model has no file
        return values

    def device_profiles(self) -> dict[str, Profile | ProfileError]:
        """The profile on each device these settings may start on, without asking the hardware (so without torch):
        the device set, or with none set cuda and cpu (a start takes cuda when available; the defaults shown are a
        discrete GPU's). A ProfileError where the profile's own rules refuse; what this machine can run is
        `accel.profile.check`'s (`check --preflight`)."""
        out: dict[str, Profile | ProfileError] = {}
        for device in (self.device,) if self.device is not None else ("cuda", "cpu"):
            try:
                out[device] = Profile.for_device(device, **self._profile_values(device))
            except ProfileError as err:
                out[device] = err
        return out

    @property
    def encoding(self) -> Encoding:
        """The MP4's video encode these settings select (checked by `_encoder_rules`)."""
        return Encoding.of(self.encoder, self.encoder_preset, threads=self.encoder_threads,
                           segment=self.encoder_segment_frames, workers=self.encoder_workers)  # fmt: skip

    @property
    def ranks(self) -> int:
        """Ranks one render is split over: the GPUs (or gloo processes) of every node."""
        return self.nnodes * self.num_gpus

    @property
    def node_secret(self) -> bytes | None:
        """The nodes' shared key (from node_key or node_key_file), or None. Valid once load_settings returned; the
        file is read again at each call (SettingError naming node_key_file if it has gone bad since)."""
        if self.node_key is not None:
            return self.node_key.get_secret_value().encode()
        if self.node_key_file is not None:
            return _read_key_file(self.node_key_file, "node_key_file").encode()
        return None

    def adapter_files(self) -> list[tuple[Path, float]]:
        """The adapter files and their scales from `lora`, in order (valid once load_settings returned)."""
        if self.lora is None:
            return []
        return [parse_lora_setting(item.strip()) for item in self.lora.split(",")]

    def adapter_declaration(self):
        """What `adapters` declares (`checkpoint.adapters.library.Declaration`), or None. Valid once load_settings
        returned."""
        if self.adapters is None:
            return None
        from h3serve.checkpoint.adapters.library import Declaration

        declared = tuple(parse_adapter_setting(item.strip()) for item in self.adapters.split(","))
        return Declaration(declared, int(self.adapter_cache_gib * 2**30), self.adapter_max_active)

    def step_cache(self):
        """The step-cache profile these settings select (`accel.stepcache.StepCacheConfig`), or None without one.
        Valid once load_settings returned (the config was parsed there)."""
        if self.cache_backend != "cache_dit":
            return None
        from h3serve.accel.stepcache import parse_cache_config

        return parse_cache_config(self.cache_config)


class Settings(EngineSettings):
    """Every setting of `h3serve serve` (and `check`, `ready`): the engine's and the service's."""

    served_model_name: str | None = Field(
        None,
        min_length=1,
        max_length=SERVED_NAME_CHARS,
        description=f"model id in /v1/models: 1 to {SERVED_NAME_CHARS} printable characters, no leading or trailing "
        "space (no newline, tab or other control character); unset: the model path as given",
    )
    task_type: TaskType = Field(
        TaskType.FL2VA,
        description="which DiTs to load: fl2va (t2va, i2va, l2va, fl2va), ref2va (Ref2VA), or both (twice the DiT "
        "memory)",
    )
    startup_warmup: bool = Field(
        True, description="render a 2-point clip at the production shape before reporting ready"
    )
    # The network -----------------------------------------------------------------------------------------------
    bind_host: str = Field(
        "127.0.0.1", description="address to listen on; a non-loopback one needs H3_ALLOW_REMOTE_API and a key"
    )
    api_port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on")
    allow_remote_api: bool = Field(False, description="allow a non-loopback H3_BIND_HOST (requires an API key)")
    api_key: SecretStr | None = Field(
        None,
        description="bearer key, 32+ characters of [A-Za-z0-9._~-], e.g. `openssl rand -hex 32` (environment or "
        "config file only, never a flag); with a key, /ready and the API need it, /health stays open",
    )
    api_key_file: Path | None = Field(
        None,
        description=f"read the bearer key from this file: a regular file of at most {KEY_FILE_CAP >> 10} KiB, "
        "readable by its owner only (instead of H3_API_KEY)",
    )
    video_sync_timeout: int = Field(
        7200, ge=600, le=14400, description="seconds a /v1/videos/sync render may take before it is cancelled (504)"
    )
    # Jobs and limits -------------------------------------------------------------------------------------------
    output_dir: Path = Field(Path("output"), description="folder for the job database and the async jobs' MP4s")
    output_url: str | None = Field(
        None,
        description="where the async jobs' MP4s are kept: unset, videos/ in the output folder; s3://BUCKET[/PREFIX], "
        "that bucket on S3 or an S3-compatible server (H3_S3_ENDPOINT), through boto3 (pip install 'h3serve[fleet]'), "
        "with the credentials and region of the standard AWS_* variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_REGION), AWS_PROFILE or an instance role; checked at start: the bucket must answer and take an upload",
    )
    s3_endpoint: str | None = Field(
        None,
        description="with H3_OUTPUT_URL: the S3-compatible server's URL, http(s)://HOST[:PORT] (path-style requests); "
        "unset: AWS's own endpoint (or AWS_ENDPOINT_URL)",
    )
    s3_presign: int = Field(
        0,
        ge=0,
        le=3600,
        description="with H3_OUTPUT_URL: GET /v1/videos/{id}/content answers 307 to the object's URL signed for this "
        "many seconds (at most 3600) instead of streaming it through the server; 0: streamed",
    )
    store: str | None = Field(
        None,
        description="where the job records are: unset, SQLite in the output folder (jobs.sqlite3); a postgresql:// URL "
        "(postgresql://USER@HOST:PORT/DATABASE), PostgreSQL, through psycopg (pip install 'h3serve[fleet]'); a "
        "password is best left to PGPASSWORD or ~/.pgpass, never a command line; messages show the URL without it",
    )
    server_id: str | None = Field(
        None,
        description="this server's name in a fleet that shares one H3_STORE database: the claims and leases of the "
        "jobs it renders carry it, and /health shows it; 1 to 64 of [A-Za-z0-9._-]; two running servers may not "
        "share one; unset: a new one at each start (host name and random digits), so a restarted server's claims wait "
        "for their leases to run out instead of being taken back at once",
    )
    lease_s: float | None = Field(
        None,
        ge=2,
        le=3600,
        description="with a postgresql:// H3_STORE: seconds a server's claim on a job lasts without a heartbeat; a "
        "job whose server stopped renewing it is claimed again by another server after this; unset: 30",
    )
    heartbeat_s: float | None = Field(
        None,
        ge=0.2,
        le=1800,
        description="with a postgresql:// H3_STORE: seconds between a server's renewals of its leases (at most half "
        "of H3_LEASE_S, so one late renewal loses nothing); unset: a third of H3_LEASE_S",
    )
    max_queue: int = Field(
        8,
        ge=1,
        le=1024,
        description="renders that may wait (with a postgresql:// H3_STORE, the fleet's); more are answered 429",
    )
    max_prompt_chars: int = Field(7000, ge=1, le=100_000, description="longest prompt accepted, in characters")
    preview_every: int = Field(
        0,
        ge=0,
        le=1000,
        description="previews of an async job's render (GET /v1/videos/{id}/events and /preview) after every this many "
        "DiT forwards, for requests that leave preview_every out and run enough forwards; 0: none unless asked for",
    )
    preview_min_every: int = Field(
        5,
        ge=1,
        le=1000,
        description="the smallest preview_every a request may ask for (each preview decodes the first 3 "
        "latents, 9 frames, as one window: under a tenth of the decode)",
    )
    max_upload_mb: int = Field(
        20, ge=1, le=512, description="largest upload (a keyframe or a reference file) accepted, in MiB"
    )
    body_timeout: int = Field(
        120,
        ge=1,
        le=3600,
        description="seconds a client has to send a request's headers (slower: the connection is closed) and its "
        "whole body (slower: 408)",
    )
    api_schema: bool = Field(
        True, description="serve the OpenAPI schema at /openapi.json (behind the key like every API route)"
    )

    # ---------------------------------------------------------------------------------------------------------
    @property
    def key(self) -> str | None:
        """The bearer key in effect (from api_key or api_key_file), or None. Valid once load_settings returned; the
        file is read again at each call (SettingError naming api_key_file if it has gone bad since)."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is not None:
            return _read_key_file(self.api_key_file, "api_key_file")
        return None

    @property
    def lease(self) -> float:
        """Seconds a claim lasts without a heartbeat (H3_LEASE_S, or its default)."""
        return self.lease_s if self.lease_s is not None else DEFAULT_LEASE_S

    @property
    def heartbeat(self) -> float:
        """Seconds between lease renewals (H3_HEARTBEAT_S, or a third of the lease)."""
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease / 3

    @property
    def model_id(self) -> str:
        """The id /v1/models lists: the served name, else the model path exactly as given, else the tiny model's."""
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model is not None else TINY_MODEL_NAME

    def resolved(self, *, resolve_device: bool = True) -> dict[str, Any]:
        """Every setting with the key redacted, plus the profile it resolves to: what `check` prints and `serve`
        logs at start. `resolve_device=False` leaves an unset device unresolved (resolving it asks torch for CUDA)
        and shows the profile on each device it may resolve to (`device_profiles`)."""
        values = self.model_dump(mode="json")
        for secret in ("api_key", "node_key"):
            if values[secret] is not None:
                values[secret] = REDACTED
        if self.store is not None:
            values["store"] = shown_url(self.store)
        values["api_auth"] = self.api_key is not None or self.api_key_file is not None
        values["model_id"] = self.model_id
        if not resolve_device and self.device is None:
            candidates = self.device_profiles().items()
            values["profile"] = {d: p.as_dict() if isinstance(p, Profile) else f"invalid: {p}" for d, p in candidates}
            return values
        try:
            values["profile"] = self.profile(ask_hardware=resolve_device).as_dict()
        except ValueError as err:
            values["profile"] = f"invalid: {err}"
        return values


def _number_kind(annotation: Any) -> type | None:
    """int or float for a numeric setting (`int`, `float | None`), else None (bool is no number here)."""
    for arg in (annotation, *getattr(annotation, "__args__", ())):
        if arg is int or arg is float:
            return arg
    return None


class Violation(str):
    """One refusal: the line shown, and the setting it concerns as data (`setting`: a field name; None for a config
    file or a variable that is no setting)."""

    setting: str | None

    def __new__(cls, text: str, setting: str | None = None) -> Violation:
        line = super().__new__(cls, text)
        line.setting = setting
        return line


class SettingsError(ValueError):
    """Every violation found, one per line; `settings`: the setting of each, in order."""

    def __init__(self, violations: list[str]):
        super().__init__("\n".join(violations))
        self.violations = violations

    @property
    def settings(self) -> list[str | None]:
        return [getattr(v, "setting", None) for v in self.violations]


def refusal(field: str, message: str) -> Violation:
    """A violation of `field`, shown under its environment name and flag."""
    return Violation(f"{label(field)}: {message}", field)


CLI_FIELDS = tuple(f for f in Settings.model_fields if f not in NO_FLAG)
ENGINE_FIELDS = tuple(EngineSettings.model_fields)


def _choices(annotation: Any) -> str | None:
    """'A|B|C' for an enum or Literal setting (the --help text's allowed values)."""
    for arg in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return "|".join(str(m.value) for m in arg)
        if getattr(arg, "__origin__", None) is Literal:
            return "|".join(map(str, arg.__args__))
    return None


class _StoreNamingFlag(argparse.Action):
    """Store the value, and under `given_as(dest)` the flag it came as (a setting's old name or its own), so that a
    refusal names the flag the user typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, given_as(self.dest), option_string)


def given_as(field: str) -> str:
    """The namespace attribute holding the flag a setting was given as (set only for settings with old names)."""
    return f"{field}_given_as"


def add_flags(parser: argparse.ArgumentParser, schema: type[EngineSettings] = Settings, *, old_names: bool = False):
    """One flag per setting of `schema`, generated from it (values are parsed and checked by `load_settings`).
    `old_names`: also accept `render`'s former flag names (`OLD_RENDER_FLAGS`) for the same settings."""
    parser.add_argument("--config", type=Path, help="settings file (JSON or TOML; keys are the setting names)")
    for name in schema.model_fields:
        if name not in CLI_FIELDS:
            continue
        info = schema.model_fields[name]
        default = "unset" if info.default is None else info.default
        default = default.value if isinstance(default, enum.Enum) else default
        help_text = f"{info.description} (env {env_name(name)}; default {default})"
        flags, action = [flag_name(name)], None
        if old_names and name in OLD_RENDER_FLAGS:
            action = _StoreNamingFlag
            flags.append(OLD_RENDER_FLAGS[name])
            help_text += f"; {OLD_RENDER_FLAGS[name]} is its former render name, kept for one release"
        if info.annotation is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            metavar = _choices(info.annotation) or name.upper()
            parser.add_argument(*flags, dest=name, default=None, metavar=metavar, help=help_text, action=action)


def load_settings(
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
    *,
    check_profile: bool = True,
    schema: type[EngineSettings] = Settings,
) -> EngineSettings:
    """Merge defaults < config file < environment < flags into `schema`; validate every value and rule; raise
    SettingsError. An `H3_*` variable or file key that is no h3serve setting is refused; one that is a setting of
    another command (a service setting when `schema` is `EngineSettings`, for `render`) is left to that command.
    `check_profile=False` skips asking the machine whether it can run the profile (which imports torch and
    initialises CUDA), for `h3serve ready` (a healthcheck that only needs the address and the key) and `h3serve check`
    without --preflight; the profile's own rules are checked all the same (`EngineSettings.device_profiles`)."""
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    source: dict[str, str] = {}
    violations: list[str] = []
    fields = schema.model_fields

    config_file = config_file or (getattr(args, "config", None) if args is not None else None)
    if config_file is not None:
        where = f"--config {shown_path(config_file)}"
        for key, value in _read_config(config_file, violations).items():
            if key in RENAMED:
                violations.append(Violation(f"{where}: {shown(key)} was replaced by {RENAMED[key]}", key))
            elif key not in Settings.model_fields:
                violations.append(f"{where}: unknown setting {shown(key)}; {_config_key_hint(str(key))}")
            elif key in fields:
                raw[key], source[key] = value, f"{where}, key {key}"
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name in RENAMED:
            violations.append(Violation(f"{var}: was replaced by {RENAMED[name]}", name))
            continue
        if name not in Settings.model_fields:
            named = var if len(var) <= ECHO_CHARS and var.isprintable() else shown(var)
            violations.append(f"{named}: not an h3serve setting; {_nearest(var, map(env_name, Settings.model_fields))}")
            continue
        if value == "" or name not in fields:  # compose passes unset variables as empty strings
            continue
        raw[name], source[name] = value, var
    if args is not None:
        for name in CLI_FIELDS:
            value = getattr(args, name, None)
            if value is not None and name in fields:
                raw[name], source[name] = value, getattr(args, given_as(name), None) or flag_name(name)

    failed: set[str] = set()
    try:
        schema.model_validate(raw)
    except ValidationError as err:
        for e in err.errors():
            field = str(e["loc"][0]) if e["loc"] else ""
            failed.add(field)
            got = raw.get(field)
            echo = REDACTED if field in ("api_key", "node_key", "store") else shown(got)
            violations.append(refusal(field, f"{e['msg']}, got {echo} (from {source.get(field, 'default')})"))
    settings = schema.model_validate({k: v for k, v in raw.items() if k not in failed})
    violations += _engine_rules(settings, failed, env, check_profile)
    if isinstance(settings, Settings):
        violations += _service_rules(settings, failed)
    if violations:
        raise SettingsError(violations)
    return settings


def _nearest(name: str, names: Any) -> str:
    """`did you mean X?` for a misspelt setting name, or the allowed names where none is close."""
    names = list(names)
    close = did_you_mean(name, names)
    return f"did you mean {close}?" if close is not None else f"allowed: {', '.join(names)}"


def _config_key_hint(key: str) -> str:
    """What to write instead of an unknown config-file key: the setting's own name where the key is its environment
    variable (`H3_API_PORT`: the file's keys drop the prefix), else the nearest name."""
    if key.upper().startswith(ENV_PREFIX) and key[len(ENV_PREFIX) :].lower() in Settings.model_fields:
        return f"a file's keys are the setting names without {ENV_PREFIX}: write {key[len(ENV_PREFIX) :].lower()}"
    return _nearest(key, Settings.model_fields)


def _read_config(path: Path, violations: list[str]) -> dict[str, Any]:
    """The settings file's table, checked (a regular file of at most CONFIG_FILE_CAP, UTF-8, JSON or TOML, an
    object); a violation naming --config and the file otherwise, and an empty table."""
    kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
    try:
        text = read_regular(path, CONFIG_FILE_CAP).decode("utf-8")
    except FileRefused as err:
        violations.append(f"--config {err}")
        return {}
    except UnicodeDecodeError as err:
        violations.append(f"--config {shown_path(path)}: not UTF-8 text ({err.reason} at byte {err.start})")
        return {}
    try:
        data = tomllib.loads(text) if kind == "TOML" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        violations.append(f"--config {shown_path(path)}: not valid {kind} ({err})")
        return {}
    except RecursionError:
        violations.append(f"--config {shown_path(path)}: not valid {kind} (nested too deeply to parse)")
        return {}
    if not isinstance(data, dict):
        violations.append(
            f"--config {shown_path(path)}: must hold a table/object of settings, got {type(data).__name__}"
        )
        return {}
    return data


def _engine_rules(s: EngineSettings, failed: set[str], env: Mapping[str, str], check_profile: bool = True) -> list[str]:
    """The rules between the engine's settings (each only when the settings it reads are themselves valid). A rule
    about one value is that value's predicate (`Linear.streams`, `accel.profile.check_step_cache`, the split's
    `parallel.plan.split_refusals`), called here and by the start-up and the engine alike; its error names the
    setting."""
    ok = lambda *names: not failed.intersection(names)  # noqa: E731
    out = _cache_rules(s, ok) + _file_rules(s, ok, env) + _node_rules(s, failed) + _split_rules(s, ok, check_profile)
    streams = s.linear_backend is None or Linear(s.linear_backend).streams  # unset: the device's default, which does
    if ok("offload", "linear_backend") and s.offload == Offload.ALL and not streams:
        out.append(refusal("offload", "all: HUMMING's FP8 layout does not stream; use auto or none with HUMMING, or "
                                      "another H3_LINEAR_BACKEND"))  # fmt: skip
    return out + _profile_rules(s, ok, check_profile) + _encoder_rules(s, ok, check_profile)


# Encoding's fields -> their settings.
ENCODER_SETTINGS = {
    "encoder": "encoder",
    "preset": "encoder_preset",
    "threads": "encoder_threads",
    "segment": "encoder_segment_frames",
    "workers": "encoder_workers",
}


def _encoder_rules(s: EngineSettings, ok: Callable[..., bool], check_profile: bool) -> list[str]:
    """The encoder's settings together (`media.encoding.Encoding.check`), then, where the machine is asked, whether it
    can open the encoder (nvenc needs a GPU with the engine and its driver)."""
    if not ok(*ENCODER_SETTINGS.values()):
        return []
    try:
        s.encoding.check()
        if check_profile:
            from h3serve.media.h264 import check_available

            check_available(s.encoding)
    except EncodingError as err:
        return [refusal(ENCODER_SETTINGS.get(err.field, "encoder"), str(err))]
    return []


def _cache_rules(s: EngineSettings, ok: Callable[..., bool]) -> list[str]:
    """Step caching: an explicit, tested config or nothing. The config is cache-dit's DBCache options, checked key by
    key (accel/stepcache.py): an unknown key, a wrong type, a value out of range or a field not built is refused."""
    out: list[str] = []
    if ok("cache_backend", "cache_config"):
        if s.cache_config is not None:
            from h3serve.accel.stepcache import parse_cache_config

            try:
                parse_cache_config(s.cache_config)
            except ValueError as err:
                out.append(refusal("cache_config", f"{err}"))
            if s.cache_backend == "none":
                out.append(refusal("cache_config", "given, but H3_CACHE_BACKEND is none; set cache_dit or remove it"))
        if s.cache_backend == "cache_dit" and s.cache_config is None:
            out.append(refusal("cache_backend", "cache_dit requires an explicit, tested H3_CACHE_CONFIG"))
    if ok("linear_backend", "cache_backend") and s.cache_backend != "none":
        try:
            check_step_cache(s.linear_backend)
        except ProfileError as err:
            out.append(refusal(SETTING_OF[err.setting], f"{err} (H3_CACHE_BACKEND is {s.cache_backend})"))
    return out


def _file_rules(s: EngineSettings, ok: Callable[..., bool], env: Mapping[str, str]) -> list[str]:
    """What the settings name on disk: mapped AdaLN weights need a checkpoint, each adapter a readable file, the kernel
    caches a writable folder."""
    out: list[str] = []
    if ok("adaln_weights", "model") and s.adaln_weights == AdalnWeights.MAPPED and s.model is None:
        message = "mapped reads the AdaLN weights from the checkpoint's files; the built-in tiny model has none: set "
        out.append(refusal("adaln_weights", message + "H3_MODEL, or device or pinned"))
    # Adapters: each PATH[:SCALE] parses and names a readable file (what the file is, is read before weights load).
    if ok("lora") and s.lora is not None:
        for item in s.lora.split(","):
            try:
                path, scale = parse_lora_setting(item.strip())
            except ValueError as err:
                out.append(refusal("lora", f"{err} (in {shown(s.lora)}; entries are comma-separated)"))
                continue
            if scale == 0:
                message = f"{shown(item.strip())}: a scale of 0 merges nothing; leave the adapter out"
                out.append(refusal("lora", message))
                continue
            try:  # a regular file that opens (no cap: adapters are large; what it holds is read before weights load)
                with open_regular(path):
                    pass
            except FileRefused as err:
                out.append(refusal("lora", str(err)))
    # Run-time adapters: NAME=PATH[:SCALE], each name once, each file readable; the companions need them.
    if ok("adapters") and s.adapters is not None:
        names: set[str] = set()
        for item in s.adapters.split(","):
            try:
                name, path, _ = parse_adapter_setting(item.strip())
            except ValueError as err:
                out.append(refusal("adapters", f"{err} (in {shown(s.adapters)}; entries are comma-separated)"))
                continue
            if name in names:
                out.append(refusal("adapters", f"{shown(name)} is declared twice; each name once"))
            names.add(name)
            try:
                with open_regular(path):
                    pass
            except FileRefused as err:
                out.append(refusal("adapters", f"{name}: {err}"))
    for companion in ("adapter_cache_gib", "adapter_max_active"):  # set to other than its default, for nothing
        default = type(s).model_fields[companion].default
        if ok("adapters", companion) and s.adapters is None and getattr(s, companion) != default:
            out.append(refusal(companion, "given, but H3_ADAPTERS declares no adapters; declare some or remove it"))
    # The kernel caches: a folder that can be created and written, and no conflicting cache variable.
    if ok("cache_dir") and s.cache_dir is not None:
        try:
            from h3serve.accel.caches import use_cache_dir

            use_cache_dir(s.cache_dir, environ=dict(env))  # a dry run on a copy of the environment
            if not os.access(s.cache_dir, os.W_OK | os.X_OK):
                out.append(refusal("cache_dir", f"{shown_path(s.cache_dir)} is not writable"))
        except OSError as err:  # its own text repeats the path, uncapped
            out.append(refusal("cache_dir", f"{shown_path(s.cache_dir)}: {err.strerror or type(err).__name__}"))
        except ValueError as err:
            out.append(refusal("cache_dir", f"{err}"))
    return out


def _split_rules(s: EngineSettings, ok: Callable[..., bool], check_profile: bool) -> list[str]:
    """A render split over several ranks: what the split runs (`parallel.plan.split_refusals`), and this node's GPUs
    visible (asked of the machine only with `check_profile`)."""
    if not ok("num_gpus", "nnodes", "linear_backend", "device", "diffusion_attention_backend") or s.ranks == 1:
        return []
    from h3serve.parallel.plan import ranks_text, split_refusals, split_setting

    refused = split_refusals(s.linear_backend, s.device, s.ranks, s.diffusion_attention_backend)
    setting, ranks = split_setting(s.num_gpus, s.nnodes), ranks_text(s.num_gpus, s.nnodes)
    out = [refusal(setting, f"{ranks}: {message}") for message in refused]
    local = s.num_gpus > 1 and not (s.device or "").startswith("cuda:")  # this node's GPUs, each one rank
    if local and check_profile and s.device != "cpu":  # cpu: gloo processes
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (s.device is not None or visible) and s.num_gpus > visible:  # unset without CUDA: the cpu
            out.append(refusal("num_gpus", f"{s.num_gpus} GPUs: only {visible} CUDA device(s) are visible (gloo "
                                           "processes on the CPU: H3_DEVICE=cpu)"))  # fmt: skip
    return out


def _profile_rules(s: EngineSettings, ok: Callable[..., bool], check_profile: bool) -> list[str]:
    """The profile: its own rules, then what this machine can run. `check_profile=False` (the healthcheck, `check`
    without --preflight) does not ask the machine: an unset device resolves by asking torch for CUDA, which costs
    seconds and a call every 30 s must not do. The rules still hold; with the device unset, a profile that no device
    can run is refused."""
    if not ok(*PROFILE_FIELDS):
        return []
    if check_profile:
        try:
            check(s.profile())
        except ProfileError as err:
            return [refusal(SETTING_OF.get(err.setting, "device"), str(err))]
        return []
    errors = list(s.device_profiles().values())
    if all(isinstance(e, ProfileError) for e in errors):
        first, *others = (str(e) for e in errors)
        message = first + "".join(f"; without CUDA: {o}" for o in others if o != first)
        return [refusal(SETTING_OF.get(errors[0].setting, "device"), message)]
    return []


# The settings that only apply to several nodes: refused with one node, where they would be ignored.
NODE_SETTINGS = ("dist_init_addr", "node_key", "node_key_file", "node_timeout", "node_grace", "allow_remote_nodes")


def _node_rules(s: EngineSettings, failed: set[str]) -> list[str]:
    """Several hosts: an address to meet at (a loopback one unless remote nodes are allowed), a strong shared key given
    one way, a node rank among the nodes; and none of these given for one host, where they would be ignored."""
    from h3serve.parallel.plan import split_address

    out: list[str] = []
    ok = lambda *names: not failed.intersection(names)  # noqa: E731
    if not ok("nnodes", "node_rank", *NODE_SETTINGS):
        return out
    # Given: set (a file key, a variable, a flag) to a value other than its default, which with one node would do
    # nothing. Its default is no choice (deploy/.env.example writes each default, and loads uncommented).
    given = [
        name
        for name in NODE_SETTINGS
        if getattr(s, name) is not None
        and name in s.model_fields_set
        and getattr(s, name) != type(s).model_fields[name].default
    ]
    if s.nnodes == 1:
        if s.node_rank != 0:
            out.append(refusal("node_rank", f"{s.node_rank}: H3_NNODES is 1, whose only node is 0"))
        for name in given:
            out.append(refusal(name, "applies to several nodes; H3_NNODES is 1 (set it, or remove this setting)"))
        return out
    if s.node_rank >= s.nnodes:
        out.append(refusal("node_rank", f"{s.node_rank}: the nodes of H3_NNODES={s.nnodes} are 0 to {s.nnodes - 1}"))
    if s.dist_init_addr is None:
        out.append(refusal("dist_init_addr", f"required with H3_NNODES={s.nnodes}: node 0's HOST:PORT"))
    else:
        try:
            host, _ = split_address(s.dist_init_addr)
        except ValueError as err:
            out.append(refusal("dist_init_addr", str(err)))
        else:
            if host not in LOOPBACK_HOSTS and ok("allow_remote_nodes") and not s.allow_remote_nodes:
                out.append(
                    refusal(
                        "dist_init_addr",
                        f"{shown(host)} is not loopback ({', '.join(sorted(LOOPBACK_HOSTS))}); nodes on other hosts "
                        "require H3_ALLOW_REMOTE_NODES=true (and a private link: the ranks' traffic is not encrypted)",
                    )
                )
    if s.node_key is not None and s.node_key_file is not None:
        out.append(Violation(f"{env_name('node_key')} and {label('node_key_file')}: give the key one way, not both",
                             "node_key_file"))  # fmt: skip
    else:
        try:
            key = s.node_secret
        except SettingError as err:
            out.append(refusal(err.setting, err.message))
        else:
            if key is None:
                out.append(
                    refusal(
                        "node_key",
                        f"required with H3_NNODES={s.nnodes} (or {label('node_key_file')}): every node proves it "
                        "before anything else moves; e.g. `openssl rand -hex 32`, the same on every node",
                    )
                )
            elif not KEY_PATTERN.fullmatch(key.decode("utf-8", "replace")):
                field = "node_key" if s.node_key is not None else "node_key_file"
                out.append(refusal(field, f"the key must be 32 or more characters of [A-Za-z0-9._~-] (got {len(key)} "
                                          "characters; e.g. `openssl rand -hex 32`)"))  # fmt: skip
    return out


def parse_lora_setting(value: str) -> tuple[Path, float]:
    """`PATH[:SCALE]` -> (path, scale). The text after the last ':' is the scale unless it holds a '/' (then the
    whole value is a path); a path holding ':' itself takes an explicit scale (`a:b.safetensors:1`)."""
    if not value or not value.strip():
        raise ValueError("an adapter setting is PATH[:SCALE]; got an empty value")
    head, colon, tail = value.rpartition(":")
    if not colon or "/" in tail:
        return Path(value), 1.0
    if not tail:
        raise ValueError(
            f"adapter setting {shown(value)}: nothing after ':' (write PATH:SCALE, e.g. {shown(head + ':0.8')})"
        )
    try:
        scale = decimal_number(tail)
    except ValueError:
        raise ValueError(
            f"adapter setting {shown(value)}: scale {shown(tail)} is not a number (write PATH:SCALE; a path that "
            "holds ':' needs an explicit :SCALE)"
        ) from None
    if not math.isfinite(scale):
        raise ValueError(f"adapter setting {shown(value)}: scale must be finite, got {shown(tail)}")
    if not head:
        raise ValueError(f"adapter setting {shown(value)}: no path before ':'")
    return Path(head), scale


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def parse_adapter_setting(value: str) -> tuple[str, Path, float]:
    """`NAME=PATH[:SCALE]` -> (name, path, scale): a name of letters, digits, `.`, `_` and `-` (64 at most), the
    path and scale as in H3_LORA (`parse_lora_setting`), the scale nonzero and within the requests' bound."""
    from h3serve.checkpoint.adapters.library import MAX_SCALE

    name, equals, rest = value.partition("=")
    if not equals:
        raise ValueError(f"adapter {shown(value)}: write NAME=PATH[:SCALE], e.g. turbo=/models/turbo.safetensors:1")
    name = name.strip()
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter name {shown(name)}: 1-64 of letters, digits, '.', '_' and '-', starting with a "
                         "letter or digit")  # fmt: skip
    path, scale = parse_lora_setting(rest.strip())
    if not 0 < abs(scale) <= MAX_SCALE:
        raise ValueError(f"adapter {name}: scale {scale:g} must be within -{MAX_SCALE:g} and {MAX_SCALE:g}, and not 0")
    return name, path, scale


def _service_rules(s: Settings, failed: set[str]) -> list[str]:
    """The network: loopback unless remote access is asked for, and then only behind a strong key. Previews: the
    default interval within the minimum."""
    out: list[str] = []
    ok = lambda *names: not failed.intersection(names)  # noqa: E731
    if ok("preview_every", "preview_min_every") and 0 < s.preview_every < s.preview_min_every:
        out.append(refusal("preview_every", f"{s.preview_every} is below {label('preview_min_every')} "
                                            f"({s.preview_min_every}); 0 (none) or at least that"))  # fmt: skip
    key_ok = True
    if ok("api_key", "api_key_file"):
        if s.api_key is not None and s.api_key_file is not None:
            out.append(
                Violation(
                    f"{env_name('api_key')} and {label('api_key_file')}: give the key one way, not both",
                    "api_key_file",
                )
            )
            key_ok = False
        else:
            try:
                key = s.key
            except SettingError as err:
                out.append(refusal(err.setting, err.message))
                key, key_ok = None, False
            if key is not None and not KEY_PATTERN.fullmatch(key):
                field = "api_key" if s.api_key is not None else "api_key_file"
                out.append(
                    refusal(
                        field,
                        "the key must be 32 or more characters of [A-Za-z0-9._~-] "
                        f"(got {len(key)} characters; e.g. `openssl rand -hex 32`)",
                    )
                )
                key_ok = False
    if ok("bind_host"):
        if not HOST_PATTERN.fullmatch(s.bind_host):
            out.append(refusal("bind_host", f"must match [A-Za-z0-9.:-]+, got {shown(s.bind_host)}"))
        elif s.bind_host not in LOOPBACK_HOSTS and ok("allow_remote_api"):
            if not s.allow_remote_api:
                out.append(
                    refusal(
                        "bind_host",
                        f"{shown(s.bind_host)} is not loopback ({', '.join(sorted(LOOPBACK_HOSTS))}); "
                        "a remote bind requires H3_ALLOW_REMOTE_API=true and an API key",
                    )
                )
            elif s.api_key is None and s.api_key_file is None and key_ok:
                out.append(
                    refusal("bind_host", f"a remote bind ({shown(s.bind_host)}) requires H3_API_KEY or H3_API_KEY_FILE")
                )
    if ok("store") and s.store is not None:
        out += _store_rules(s.store)
    out += _fleet_rules(s, ok)
    out += _output_rules(s, ok)
    if ok("served_model_name") and s.served_model_name is not None:
        name = s.served_model_name
        if name != name.strip() or not name.isprintable():  # a blank name is all surrounding space
            out.append(
                refusal(
                    "served_model_name",
                    f"must be 1 to {SERVED_NAME_CHARS} printable characters with no leading or trailing space (no "
                    f"newline, tab or other control character), got {shown(name)}",
                )
            )
    return out


def _read_key_file(path: Path, setting: str) -> str:
    """The key in the file (stripped): a regular file of at most KEY_FILE_CAP bytes, UTF-8, readable by its owner only;
    SettingError(setting) naming the file otherwise. The key itself is never in a message."""
    data = read_setting_file(setting, path, KEY_FILE_CAP)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SettingError(setting, f"the key file {shown_path(path)} is not UTF-8 text") from None
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise SettingError(setting, f"the key file {shown_path(path)}: {err.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        message = f"the key file {shown_path(path)} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it"
        raise SettingError(setting, message)
    return text.strip()


SERVER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
DEFAULT_LEASE_S = 30.0


def _fleet_rules(s: Settings, ok: Callable[..., bool]) -> list[str]:
    """A server's name and its leases: a plain name; the lease and heartbeat only where there is a fleet to lease in
    (a postgresql:// H3_STORE), and the heartbeat at most half the lease."""
    out: list[str] = []
    if ok("server_id") and s.server_id is not None and not SERVER_ID.fullmatch(s.server_id):
        out.append(refusal("server_id", f"must be 1 to 64 of [A-Za-z0-9._-], got {shown(s.server_id)}"))
    for name in ("lease_s", "heartbeat_s"):
        if ok(name, "store") and getattr(s, name) is not None and s.store is None:
            out.append(
                refusal(name, "given, but there is no fleet to lease in: set a postgresql:// H3_STORE or remove it")
            )
    if ok("lease_s", "heartbeat_s") and s.heartbeat_s is not None and s.heartbeat_s > s.lease / 2:
        out.append(
            refusal(
                "heartbeat_s",
                f"must be at most half of H3_LEASE_S ({s.lease:g} s), so that one late renewal loses no lease; got "
                f"{s.heartbeat_s:g}",
            )
        )
    return out


def _store_rules(url: str) -> list[str]:
    """H3_STORE: a postgresql:// URL (`url_problem`), and psycopg installed to reach it. The URL is never echoed
    with its password."""
    import importlib.util

    problem = url_problem(url)
    if problem is not None:
        return [refusal("store", problem)]
    if importlib.util.find_spec("psycopg") is None:
        return [refusal("store", "a postgresql:// store needs psycopg 3: pip install 'h3serve[fleet]'")]
    return []


# ---- H3_STORE: the job store's URL, what it may be and how a message shows it (never its password) ---------------
STORE_SCHEMES = ("postgresql", "postgres")  # libpq's two spellings
STORE_ALLOWED = "a postgresql:// URL (postgresql://USER@HOST:PORT/DATABASE); unset: SQLite in the output folder"
URL_HIDDEN = "***"


def _split_url(url: str) -> SplitResult | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a port that is no number raises here)
    except ValueError:
        return None
    return parts


def shown_url(url: str) -> str:
    """The URL as a message or the resolved settings show it: the password replaced by ***, and the query (which may
    hold one, `?password=`) by *** too. A URL that does not parse is shown by its scheme alone."""
    parts = _split_url(url)
    if parts is None or not parts.scheme:
        return f"<{len(url)} characters>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    user = parts.username
    login = "" if user is None else f"{user}{':' + URL_HIDDEN if parts.password is not None else ''}@"
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit((parts.scheme, f"{login}{host}{port}", parts.path, URL_HIDDEN if parts.query else "", ""))


def url_problem(url: str) -> str | None:
    """What is wrong with an H3_STORE value (None: nothing), in words that never hold the password."""
    if not url.isprintable() or any(ch.isspace() for ch in url):
        return f"must be {STORE_ALLOWED}, without spaces or control characters"
    parts = _split_url(url)
    if parts is None:
        return f"is not a URL that can be read (a port that is no number?); must be {STORE_ALLOWED}"
    if parts.scheme not in STORE_SCHEMES:
        got = f"a {parts.scheme}:// URL" if parts.scheme else "no URL"
        return f"must be {STORE_ALLOWED}; got {got}"
    if parts.fragment:
        return f"must be {STORE_ALLOWED}, without a #fragment"
    return None


# ---- H3_OUTPUT_URL: where the MP4s are kept (service/store/objects.py) ----------------------------------------------
OUTPUT_ALLOWED = "s3://BUCKET or s3://BUCKET/PREFIX; unset: videos/ in the output folder"
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's rule for a bucket's name


def split_output_url(url: str) -> tuple[str, str]:
    """`s3://BUCKET/PRE/FIX` -> ("BUCKET", "PRE/FIX/") (the prefix "" or ending in "/"); ValueError saying what is
    wrong, in words that name the allowed form."""
    if not url.isprintable() or any(ch.isspace() or ch == "\\" for ch in url):
        raise ValueError(f"must be {OUTPUT_ALLOWED}, without spaces, backslashes or control characters")
    parts = _split_url(url)
    if parts is None or parts.scheme != "s3":
        raise ValueError(
            f"must be {OUTPUT_ALLOWED}; got {f'a {parts.scheme}:// URL' if parts and parts.scheme else 'no URL'}"
        )
    if parts.query or parts.fragment or "@" in parts.netloc or parts.port is not None:
        raise ValueError(
            f"must be {OUTPUT_ALLOWED}: no user, port, ?query or #fragment (the endpoint is H3_S3_ENDPOINT)"
        )
    if not BUCKET_NAME.fullmatch(parts.netloc) or ".." in parts.netloc:
        raise ValueError(f"the bucket {shown(parts.netloc)} is no S3 bucket name (3-63 of a-z, 0-9, '.' and '-')")
    segments = [p for p in parts.path.split("/") if p]
    if any(p in (".", "..") for p in segments) or "//" in parts.path.strip("/"):
        raise ValueError("the prefix may not hold '.', '..' or an empty segment ('//')")
    return parts.netloc, "".join(f"{p}/" for p in segments)


def endpoint_problem(url: str) -> str | None:
    """What is wrong with an H3_S3_ENDPOINT value (None: nothing)."""
    parts = _split_url(url) if url.isprintable() and not any(ch.isspace() for ch in url) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return (
            f"must be an http:// or https:// URL of the S3-compatible server (http(s)://HOST[:PORT]), got {shown(url)}"
        )
    if parts.username is not None or parts.query or parts.fragment:
        return "must be http(s)://HOST[:PORT]: no user, ?query or #fragment (credentials come from the AWS_* variables)"
    return None


def _output_rules(s: Settings, ok: Callable[..., bool]) -> list[str]:
    """H3_OUTPUT_URL: an s3:// URL and boto3 installed; H3_S3_ENDPOINT an http(s) URL; both H3_S3_* only with it.
    Whether the bucket answers is the start's check (`service.store.objects.check_outputs`)."""
    import importlib.util

    out: list[str] = []
    if ok("output_url") and s.output_url is not None:
        try:
            split_output_url(s.output_url)
        except ValueError as err:
            out.append(refusal("output_url", str(err)))
        else:
            if importlib.util.find_spec("boto3") is None:
                out.append(refusal("output_url", "an s3:// output needs boto3: pip install 'h3serve[fleet]'"))
    if ok("s3_endpoint") and s.s3_endpoint is not None and (problem := endpoint_problem(s.s3_endpoint)):
        out.append(refusal("s3_endpoint", problem))
    for name in ("s3_endpoint", "s3_presign"):
        if ok(name, "output_url") and getattr(s, name) and s.output_url is None:
            out.append(refusal(name, f"only with {label('output_url')} (an s3:// output); the output folder's MP4s are "
                                     "served by the server itself"))  # fmt: skip
    return out
