"""Loading both VAEs from both published layouts, and the errors a broken checkpoint gives.

The same random weights are written by the test in each layout: the diffusers layout by diffusers' own
`save_pretrained` (sharded, with an index), the original layout by the inverse of the conversion script
(`diffusers_to_original` in test_video_vae.py) with original-style config files.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3serve.checkpoint.reader import CheckpointError
from h3serve.checkpoint.vae import load_audio_vae, load_video_vae
from h3serve.pipeline.video_decode import decode
from test_video_vae import REF, diffusers_to_original, rel_err

# The conversion script's MINIMAX_H3_TEST_VIDEO_VAE_CONFIG: the release with the widths cut down and every
# checkpoint-tied knob (24 latent channels, 32 groups, 4 registers, ffn x4) intact, so the original config files,
# which hard-code those knobs, can describe it.
VIDEO_TEST_ARCH = {
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "spatial_downsample_factors": [2, 2],
    "temporal_downsample_factors": [2, 2],
    "decoder_num_layers": 4,
    "decoder_num_attention_heads": 4,
    "decoder_attention_head_dim": 32,
}
# The same architecture for the original audio metadata, which hard-codes 8 heads and the (3, 7, 11) resblocks.
AUDIO_TEST_KWARGS = {
    "attn_proj": True,
    "decoder_dim": 16,
    "decoder_rates": [2, 2],
    "decoder_type": "bigvgan",
    "encoder_dim": 4,
    "encoder_rates": [2, 2],
    "latent_dim": 32,
    "sample_rate": 32000,
    "vae_latent_channels": 8,
}


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def video_dirs(tmp_path_factory):
    from diffusers import AutoencoderKLMiniMaxH3

    root = tmp_path_factory.mktemp("video")
    wrapper = json.loads((REF / "FL2VA/video_vae/config.json").read_text())
    source = json.loads((REF / "FL2VA/video_vae/source/config.json").read_text())
    torch.manual_seed(0)
    ref = AutoencoderKLMiniMaxH3(
        **VIDEO_TEST_ARCH, latents_mean=wrapper["latents_mean"], latents_std=wrapper["latents_std"]
    )
    ref = _perturbed(ref, 1)
    ref.disable_tiling()

    diffusers_dir = root / "vae"
    ref.save_pretrained(diffusers_dir, max_shard_size="300KB")
    assert len(list(diffusers_dir.glob("*.safetensors"))) > 1, "the fixture should be sharded"

    original_dir = root / "FL2VA" / "video_vae"
    (original_dir / "source").mkdir(parents=True)
    (original_dir / "config.json").write_text(json.dumps(wrapper))
    source.update(
        ch=32,
        ch_mult=[1, 2],
        num_res_blocks=1,
        space_down=[2, 2],
        time_down=[2, 2],
        vae_ratio=4,
        vae_ratio_t=4,
    )
    source["vit_decoder_kwargs"].update(num_layers=4, heads=4, dim_head=32)
    (original_dir / "source" / "config.json").write_text(json.dumps(source))
    save_file(diffusers_to_original(ref.state_dict(), 4, 32), original_dir / "source" / "model.safetensors")
    return ref, original_dir, diffusers_dir


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _edit(file: Path, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


# ---------------------------------------------------------------------------------------------------------------
# Video VAE
# ---------------------------------------------------------------------------------------------------------------
def test_video_vae_layouts_load_identically(video_dirs):
    ref, original_dir, diffusers_dir = video_dirs
    a = load_video_vae(original_dir)
    b = load_video_vae(diffusers_dir)
    c = load_video_vae(original_dir / "source")  # the source folder alone finds its wrapper config
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys() == c.state_dict().keys()
    for name, tensor in sd_a.items():
        assert torch.equal(tensor, sd_b[name]), name
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
    assert a.cfg.latents_mean == b.cfg.latents_mean
    assert a.cfg.tile_size == 256 and not a.training

    z = torch.randn(1, 24, 7, 3, 2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, 3, 22, 16, 8, generator=torch.Generator().manual_seed(1))
    out_a, out_b = decode(a, z, autocast_dtype=None), decode(b, z, autocast_dtype=None)
    assert torch.equal(out_a, out_b)
    assert torch.equal(a.encode(x), b.encode(x))
    with torch.no_grad():  # and both equal the reference the weights came from
        assert rel_err(out_a, ref.decode(z).sample) < 1e-5
        assert rel_err(a.encode(x), ref.encode(x).latent_dist.parameters) < 1e-5


def _expect(path: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as info:
        load_video_vae(path)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_video_vae_missing_shard(video_dirs, tmp_path):
    folder = _copy(video_dirs[2], tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.unlink()
    _expect(folder, shard.name, "missing")


def test_video_vae_missing_weights_file(video_dirs, tmp_path):
    folder = _copy(video_dirs[1], tmp_path)
    (folder / "source" / "model.safetensors").unlink()
    _expect(folder, "model.safetensors", "missing")


def test_video_vae_missing_config(video_dirs, tmp_path):
    folder = _copy(video_dirs[2], tmp_path)
    (folder / "config.json").unlink()
    _expect(folder, "config.json", "missing")


@pytest.mark.parametrize("which", ["original", "diffusers"])
def test_video_vae_missing_key(video_dirs, tmp_path, which):
    folder = _copy(video_dirs[1] if which == "original" else video_dirs[2], tmp_path)
    if which == "original":
        file = folder / "source" / "model.safetensors"
        _edit(file, lambda t: t.pop("decoder.register_tokens"))
        _expect(folder, "decoder.register_tokens", "missing", str(folder))
    else:  # drop a key from both the index and its shard
        index_file = folder / "diffusion_pytorch_model.safetensors.index.json"
        index = json.loads(index_file.read_text())
        key = "decoder.transformer_blocks.1.attn.to_k.bias"
        shard = folder / index["weight_map"].pop(key)
        index_file.write_text(json.dumps(index))
        _edit(shard, lambda t: t.pop(key))
        _expect(folder, key, "missing")


def test_video_vae_key_missing_from_listed_shard(video_dirs, tmp_path):
    folder = _copy(video_dirs[2], tmp_path)
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    key = "encoder.conv_in.weight"
    shard = folder / index["weight_map"][key]
    _edit(shard, lambda t: t.pop(key))
    _expect(folder, key, shard.name)


def test_video_vae_unexpected_key(video_dirs, tmp_path):
    folder = _copy(video_dirs[1], tmp_path)
    file = folder / "source" / "model.safetensors"
    _edit(file, lambda t: t.update({"decoder.extra_token": torch.zeros(3)}))
    _expect(folder, "decoder.extra_token", "unexpected", str(file))


@pytest.mark.parametrize(
    ("which", "key"),
    [
        ("original", "decoder.x_embedder.weight"),
        ("original", "decoder.transformer_blocks.0.attn.to_qkv.weight"),
        ("diffusers", "decoder.transformer_blocks.0.attn.to_v.weight"),  # one input of a combined build
    ],
)
def test_video_vae_wrong_shape(video_dirs, tmp_path, which, key):
    folder = _copy(video_dirs[1] if which == "original" else video_dirs[2], tmp_path)
    if which == "original":
        file = folder / "source" / "model.safetensors"
    else:
        index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
        file = folder / index["weight_map"][key]
    _edit(file, lambda t: t.update({key: t[key][:-1].contiguous()}))
    _expect(folder, key, "shape", file.name)


def test_video_vae_wrong_dtype(video_dirs, tmp_path):
    folder = _copy(video_dirs[1], tmp_path)
    file = folder / "source" / "model.safetensors"
    key = "encoder.down.1.block.0.nin_shortcut.weight"
    _edit(file, lambda t: t.update({key: t[key].half()}))
    _expect(folder, key, "float16", str(file))


def test_video_vae_truncated_file(video_dirs, tmp_path):
    folder = _copy(video_dirs[1], tmp_path)
    file = folder / "source" / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    _expect(folder, str(file))


def test_video_vae_foreign_checkpoint(video_dirs, tmp_path):
    folder = _copy(video_dirs[1], tmp_path)
    file = folder / "source" / "model.safetensors"
    save_file({"something.else": torch.zeros(2)}, file)
    _expect(folder, "not an H3 video VAE checkpoint")


# ---------------------------------------------------------------------------------------------------------------
# Audio VAE
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def audio_dirs(tmp_path_factory):
    from diffusers import AutoencoderKLMiniMaxH3Audio

    root = tmp_path_factory.mktemp("audio")
    mean = [0.1 * i for i in range(8)]
    std = [1.0 + 0.2 * i for i in range(8)]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref = AutoencoderKLMiniMaxH3Audio(
            encoder_dim=4,
            encoder_rates=[2, 2],
            latent_dim=32,
            latent_channels=8,
            decoder_dim=16,
            decoder_rates=[2, 2],
            decoder_kernel_sizes=[4, 4],
            latents_mean=mean,
            latents_std=std,
        )
    ref = _perturbed(ref, 2)
    diffusers_dir = root / "audio_vae"
    ref.save_pretrained(diffusers_dir)

    original_dir = root / "FL2VA" / "audio_vae"
    original_dir.mkdir(parents=True)
    wrapper = json.loads((REF / "FL2VA/audio_vae/config.json").read_text())
    wrapper.update(latent_channels=8, latents_mean=mean, latents_std=std)
    (original_dir / "config.json").write_text(json.dumps(wrapper))
    (original_dir / "metadata.json").write_text(json.dumps({"metadata": {"kwargs": AUDIO_TEST_KWARGS}}))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, original_dir / "model.safetensors")
    return ref, original_dir, diffusers_dir


def test_audio_vae_layouts_load_identically(audio_dirs):
    ref, original_dir, diffusers_dir = audio_dirs
    a, b = load_audio_vae(original_dir), load_audio_vae(diffusers_dir)
    assert a.cfg == b.cfg
    sd_b = b.state_dict()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, sd_b[name]), name
    z = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(0))
    out = a.decode(a.cfg.latent_stats.denormalize(z))
    assert torch.equal(out, b.decode(b.cfg.latent_stats.denormalize(z)))
    with torch.no_grad():
        latents = z * torch.tensor(ref.config.latents_std).view(1, -1, 1) + torch.tensor(ref.config.latents_mean).view(
            1, -1, 1
        )
        assert rel_err(out, ref.decode(latents).sample) < 1e-5


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda t: t.pop("decoder.conv_post.weight_g"), ("decoder.conv_post.weight_g", "missing")),
        (lambda t: t.update({"decoder.bogus": torch.zeros(1)}), ("decoder.bogus", "unexpected")),
        (
            lambda t: t.update({"decoder.ups.0.0.filter_x": torch.zeros(1)}),
            ("decoder.ups.0.0.filter_x", "unexpected"),
        ),
        (
            lambda t: t.update({"decoder.activation_post.upsample.filter": torch.zeros(1, 1, 12, dtype=torch.float64)}),
            ("decoder.activation_post.upsample.filter", "float64"),
        ),
        (
            lambda t: t.update({"pre_block.attn.zero_k_bias": torch.zeros(31)}),
            ("pre_block.attn.zero_k_bias", "shape"),
        ),
    ],
)
def test_audio_vae_corruptions(audio_dirs, tmp_path, edit, fragments):
    folder = _copy(audio_dirs[1], tmp_path)
    file = folder / "model.safetensors"
    _edit(file, edit)
    with pytest.raises(CheckpointError) as info:
        load_audio_vae(folder)
    for fragment in (*fragments, "model.safetensors"):
        assert fragment in str(info.value), (fragment, str(info.value))


def test_audio_vae_truncated_and_missing(audio_dirs, tmp_path):
    folder = _copy(audio_dirs[2], tmp_path)
    file = next(folder.glob("*.safetensors"))
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=file.name):
        load_audio_vae(folder)
    file.unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_audio_vae(folder)
