"""The DiT's published layouts, told apart by their keys, read into `model.dit.H3DiT`; their quirks fixed once, here.

* ``original`` names (our parameter names): `FL2VA/transformer` (13 shards, `model.safetensors.index.json`) with
  the fused QKV rows interleaved per head `[h0: q k v, h1: q k v, ...]`, and the community single files, whose QKV
  rows are stacked `[q_all; k_all; v_all]`. Keys and shapes are identical, so a single file's QKV order cannot be
  read from the file: it is taken as stacked (what every published single file holds, and diffusers' default)
  unless the caller says `qkv_layout="interleaved"` (a file merged from the original shards by hand).
* ``diffusers`` names: `transformer/` (14 shards): renamed keys, split `to_q/to_k/to_v`, and `fc1` halves swapped
  to `[value; gate]`.

The renames (`diffusers_name`, `diffusers_keys`) serve the adapters' reader too (`checkpoint.adapters`), and the row
reorders are `checkpoint.rows`'. Nothing here imports transformers: a DiT-only load does not need it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from h3serve.checkpoint.reader import DEFAULT_THREADS, CheckpointError
from h3serve.checkpoint.rows import deinterleave_qkv, swap_halves
from h3serve.checkpoint.safetensors import (
    Checkpoint,
    LoadHook,
    LoadStats,
    Source,
    assign_from_checkpoint,
    naming_by_marker,
    open_checkpoint,
)
from h3serve.config import DiTConfig
from h3serve.model.dit import H3DiT, inv_freq, is_fp32_name

log = logging.getLogger(__name__)


DIT_NAMINGS = ("original", "diffusers")
QKV_LAYOUTS = ("stacked", "interleaved")


@dataclass(frozen=True)
class DiTLayout:
    """How a DiT checkpoint stores our tensors: its key naming and, for original names, the fused QKV row order
    (None for diffusers names, which store q, k and v apart)."""

    naming: str
    qkv: str | None

    def __str__(self) -> str:
        return self.naming if self.qkv is None else f"{self.naming} names, {self.qkv} QKV"


def detect_dit_naming(ckpt: Checkpoint) -> str:
    markers = {"original": "blocks.0.attn.qkv_proj.weight", "diffusers": "transformer_blocks.0.attn.to_q.weight"}
    return naming_by_marker(ckpt, "DiT", markers)


def resolve_dit_layout(ckpt: Checkpoint, qkv_layout: str | None = None) -> DiTLayout:
    """The layout of a DiT checkpoint: naming from the keys, QKV order from the release or from `qkv_layout`.

    The original shards are interleaved and diffusers shards split, so `qkv_layout` may only confirm them; for a
    single file with original names it decides (None: stacked, with a warning that says how to change it).
    """
    if qkv_layout is not None and qkv_layout not in QKV_LAYOUTS:
        raise ValueError(f"qkv_layout must be one of {', '.join(QKV_LAYOUTS)}, got {qkv_layout!r}")
    naming = detect_dit_naming(ckpt)
    if naming == "diffusers":
        if qkv_layout is not None:
            raise ValueError(
                f"{ckpt.root}: qkv_layout applies only to a single-file DiT with original key names; this checkpoint "
                f"has diffusers names, which store to_q / to_k / to_v apart"
            )
        return DiTLayout("diffusers", None)
    if ckpt.sharded:
        if qkv_layout not in (None, "interleaved"):
            raise ValueError(
                f"{ckpt.root}: the sharded original DiT (FL2VA/transformer) interleaves QKV per head; "
                f"qkv_layout={qkv_layout!r} applies only to a single-file DiT"
            )
        return DiTLayout("original", "interleaved")
    if qkv_layout is None:
        log.warning(
            "%s: a single-file DiT does not record its QKV row order; assuming stacked [q; k; v], as in every "
            "published single file. For a file merged from the original shards, pass --qkv-layout interleaved",
            ckpt.root,
        )
        qkv_layout = "stacked"
    return DiTLayout("original", qkv_layout)


# Our (original) name prefix -> diffusers name prefix, for the parts that are a pure rename.
_DIFFUSERS_RENAMES = (
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("blocks.", "transformer_blocks."),
    ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
)
_DIFFUSERS_SUFFIXES = (
    ("attn.q_norm.", "attn.norm_q."),
    ("attn.k_norm.", "attn.norm_k."),
    ("attn.out_proj.", "attn.to_out.0."),
    ("mlp.fc1.", "ff.net.0.proj."),
    ("mlp.fc2.", "ff.net.2."),
)


def diffusers_name(name: str) -> str:
    """The diffusers key of our tensor `name` where it is a pure rename (see `diffusers_keys` for the rest)."""
    for ours, theirs in _DIFFUSERS_RENAMES:
        if name.startswith(ours):
            name = theirs + name[len(ours) :]
            break
    for ours, theirs in _DIFFUSERS_SUFFIXES:
        name = name.replace(ours, theirs)
    return name


def diffusers_keys(name: str) -> tuple[tuple[str, ...], bool]:
    """The diffusers keys that store our tensor `name`, in our row order (q, k and v apart for the fused QKV), and
    whether its two row halves are swapped there (fc1's `[value; gate]`)."""
    theirs = diffusers_name(name)
    if name.endswith("attn.qkv_proj.weight"):
        stem = theirs[: -len("qkv_proj.weight")]
        return tuple(f"{stem}to_{p}.weight" for p in "qkv"), False
    return (theirs,), name.endswith("mlp.fc1.weight")


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def _swapped(ts: list[torch.Tensor]) -> torch.Tensor:
    return swap_halves(ts[0])


def dit_plan(model: H3DiT, layout: DiTLayout, ckpt_keys: frozenset[str]) -> dict[str, Source]:
    """Module name -> Source for one DiT layout."""
    cfg = model.config
    plan: dict[str, Source] = {}
    for name in model.state_dict():
        if name == "rope.inv_freq":
            # Recomputable (bit-identical); the original shards store it, diffusers and some single files do not.
            stored = layout.naming == "original" and name in ckpt_keys
            plan[name] = (
                Source((name,)) if stored else Source((), lambda _: inv_freq(cfg.rope_inv_freq_len, cfg.rope_theta))
            )
        elif layout.naming == "diffusers":
            keys, swapped = diffusers_keys(name)
            plan[name] = Source(keys, _cat) if len(keys) > 1 else Source(keys, _swapped) if swapped else Source(keys)
        elif layout.qkv == "interleaved" and name.endswith("attn.qkv_proj.weight"):
            heads = cfg.num_attention_heads
            plan[name] = Source((name,), lambda ts, heads=heads: deinterleave_qkv(ts[0], heads))
        else:
            plan[name] = Source((name,))
    return plan


def _find_dit_config(path: Path) -> Path | None:
    folder = path if path.is_dir() else path.parent
    candidate = folder / "config.json"
    return candidate if candidate.is_file() else None


def load_dit(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    config: DiTConfig | None = None,
    qkv_layout: str | None = None,
    hook: LoadHook | None = None,
    mapped: Callable[[str], bool] | None = None,
    threads: int = DEFAULT_THREADS,
    on_stats: Callable[[LoadStats], None] | None = None,
) -> H3DiT:
    """Load the H3 DiT from any published layout (see the module docstring; `qkv_layout` as in
    `resolve_dit_layout`).

    `dtype` is the compute dtype of the block stack; the fp32 islands stay float32. The checkpoint must store the
    released dtypes: float32 for the islands, bfloat16 for everything else. The config comes from `config`, else the
    `config.json` in the folder (required for a folder), else, for a single community file (they ship none), the
    released H3 configuration, with a warning. `hook`: a per-tensor transform applied as the weights are read (the
    FP8 linear backend quantizes the block linears this way). `mapped`: tensors left as the file's mapping, unread,
    and `threads`: how many read the rest, as in `assign_from_checkpoint`. The load's
    bytes and seconds are logged at INFO ("DiT: X.X GB in Y.Y s (Z.ZZ GB/s)") and given to `on_stats` (for a caller
    that records them: `bench/load.py`).
    """
    path = Path(path)
    if config is None:
        found = _find_dit_config(path)
        if found is not None:
            config = DiTConfig.from_json(found)
        elif path.is_dir():
            # Both released folder layouts ship a config.json; a folder without one is incomplete.
            raise CheckpointError(f"{path}: config.json is missing (the released transformer folders ship one)")
        else:
            log.warning("%s: no config.json beside the weights; using the released H3 DiT configuration", path)
            config = DiTConfig()
    ckpt = open_checkpoint(path)
    layout = resolve_dit_layout(ckpt, qkv_layout)
    with torch.device("meta"):
        model = H3DiT(config)
    plan = dit_plan(model, layout, ckpt.keys())
    island_keys = {key for name, src in plan.items() if is_fp32_name(name) for key in src.keys}
    stats = assign_from_checkpoint(
        model,
        ckpt,
        plan,
        device=device,
        dtype_of=lambda name: torch.float32 if is_fp32_name(name) else dtype,
        ckpt_dtype_of=lambda key: torch.float32 if key in island_keys else torch.bfloat16,
        hook=hook,
        mapped=mapped,
        threads=threads,
    )
    log.info("loaded H3 DiT from %s (%s, %s, %s)", path, layout, dtype, device)
    log.info("DiT: %s", stats)
    if on_stats is not None:
        on_stats(stats)
    return model.eval().requires_grad_(False)
