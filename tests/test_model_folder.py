"""A model folder is read and cross-checked before any weight loads: configs only, no weights, in these tests."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from e2e_fixtures import write_tiny_checkpoint
from folder_fixtures import with_dit_layout, write_config_folder
from h3serve.accel.profile import Profile
from h3serve.checkpoint.folder import load_components, resolve_model_folder
from h3serve.cli import main
from h3serve.model.dit import H3DiT
from h3serve.model.tiny import (
    TINY_AUDIO_VAE,
    TINY_DIT,
    TINY_VIDEO_VAE,
    tiny_components,
)
from h3serve.pipeline.engine import Engine
from loading_fixtures import not_owned


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A complete tiny checkpoint (weights included) in the diffusers layout, under a release-like parent."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("release") / "FL2VA")


def test_complete_folder_resolves_with_its_configs(checkpoint):
    folder = resolve_model_folder(checkpoint)
    assert folder.dit == TINY_DIT and folder.text_hidden_size == TINY_DIT.text_dim
    assert folder.video_vae.name == "vae" and folder.video_vae_config.latent_channels == TINY_DIT.latents_dim
    assert folder.audio_vae_config == TINY_AUDIO_VAE


def test_parent_of_fl2va_resolves_to_it(checkpoint):
    assert resolve_model_folder(checkpoint.parent).root == checkpoint


def test_weights_are_checked_before_anything_loads(checkpoint, tmp_path):
    """Configs that fit but no weight files (or a truncated one): refused by reading headers only."""
    with pytest.raises(ValueError, match=r"transformer: expected one \*\.safetensors\.index\.json"):
        resolve_model_folder(write_config_folder(tmp_path / "configs-only"))
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    audio = next((broken / "audio_vae").glob("*.safetensors"))
    audio.write_bytes(audio.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=re.escape(str(audio))):
        resolve_model_folder(broken)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dit": replace(TINY_DIT, text_dim=16)}, "transformer text_dim is 16 but text encoder hidden_size is 32"),
        (
            {"dit": replace(TINY_DIT, audio_latents_dim=6)},
            "transformer audio_latents_dim is 6 but audio VAE latent_channels is 8",
        ),
        (
            {
                "video": replace(
                    TINY_VIDEO_VAE,
                    block_out_channels=(8, 8, 16),
                    spatial_downsample_factors=(2, 2, 2),
                    temporal_downsample_factors=(1, 2, 2),
                )
            },
            "video VAE spatial ratio is 8 but the pipeline's is 16",
        ),
        ({"text_layers": 50}, "H3 reads the output of layer 50"),
        ({"dit": replace(TINY_DIT, patch_size=(1, 1, 1))}, r"transformer patch_size is \(1, 1, 1\) but the pipeline"),
    ],
)
def test_mismatched_components_are_refused_before_loading(tmp_path, change, message):
    root = write_config_folder(tmp_path / "m", **change)
    with pytest.raises(ValueError, match=message):
        resolve_model_folder(root)


def test_broken_config_names_the_file(tmp_path):
    root = write_config_folder(tmp_path / "m")
    (root / "audio_vae" / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=re.escape(str(root / "audio_vae" / "config.json"))):
        resolve_model_folder(root)
    root = write_config_folder(tmp_path / "n")
    (root / "transformer" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"transformer/config\.json is missing"):
        resolve_model_folder(root)


def test_cli_refuses_a_mismatched_folder_without_loading_weights(tmp_path, capsys):
    """No weight file exists at all: the error can only come from reading the configs."""
    root = write_config_folder(tmp_path / "m", dit=replace(TINY_DIT, latents_dim=4))
    out = tmp_path / "out.mp4"
    code = main(["render", "a fox", "--model", str(root), "-o", str(out), "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "transformer latents_dim is 4 but video VAE latent_channels is 8" in err[-1]
    assert not out.exists()


def test_engine_refuses_components_that_do_not_fit():
    components = tiny_components()
    components.dit = H3DiT(replace(TINY_DIT, text_dim=16))
    with pytest.raises(ValueError, match="transformer text_dim is 16"):
        Engine(components, Profile.for_device("cpu"))


# --- a single-file DiT in a model folder: its QKV order is the caller's to say -------------------------------------


@pytest.fixture(scope="module")
def single_file_checkpoint(checkpoint, tmp_path_factory):
    """The tiny checkpoint with its DiT rewritten as one original-names file whose QKV rows are interleaved per head
    (a file merged from the original shards), which the file itself cannot reveal."""
    return with_dit_layout(checkpoint, tmp_path_factory.mktemp("single") / "FL2VA", "interleaved")


def test_single_file_dit_qkv_layout_is_resolved_before_loading(single_file_checkpoint, checkpoint):
    assert resolve_model_folder(single_file_checkpoint).dit_qkv_layout == "stacked"  # the default, with a warning
    assert resolve_model_folder(single_file_checkpoint, qkv_layout="interleaved").dit_qkv_layout == "interleaved"
    assert resolve_model_folder(checkpoint).dit_qkv_layout is None  # diffusers names: q, k, v stored apart
    with pytest.raises(ValueError, match="diffusers names"):
        resolve_model_folder(checkpoint, qkv_layout="stacked")


def test_cli_qkv_layout_decides_how_a_single_file_dit_reads(single_file_checkpoint, checkpoint, tmp_path):
    from h3serve.media.mp4 import decode_frames

    def render(model, name, *extra):
        out = tmp_path / f"{name}.mp4"
        code = main(["render", "a fox", "--model", str(model), "--width", "64", "--height", "64", "--frames", "22",
                     "--steps", "3", "--no-progress", "-o", str(out), *extra])  # fmt: skip
        return code, out

    code, reference = render(checkpoint, "reference")
    assert code == 0
    code, right = render(single_file_checkpoint, "interleaved", "--qkv-layout", "interleaved")
    assert code == 0
    code, wrong = render(single_file_checkpoint, "assumed-stacked")
    assert code == 0
    frames = decode_frames(reference)
    assert (decode_frames(right) == frames).all()  # told the truth: the same model as the diffusers folder
    assert not (decode_frames(wrong) == frames).all()  # the default order on an interleaved file: another model


# --- the same model from every released DiT layout: the same bytes -------------------------------------------------


@pytest.fixture(scope="module")
def released_layouts(checkpoint, tmp_path_factory):
    """The tiny checkpoint with the same DiT weights in each published layout: the original `FL2VA/transformer`
    shards, the diffusers `transformer/` shards and a community single file (stacked QKV, read by default)."""
    return {
        "original": with_dit_layout(checkpoint, tmp_path_factory.mktemp("original") / "FL2VA", "original"),
        "diffusers": checkpoint,
        "single file": with_dit_layout(checkpoint, tmp_path_factory.mktemp("community") / "FL2VA", "stacked"),
    }


def test_every_dit_layout_renders_the_same_mp4_bytes(released_layouts, tmp_path):
    """Each layout puts the fp32 islands at other file offsets; loaded as views, they computed otherwise on AMD EPYC
    CPUs (issue 22). Owned, aligned copies make the layout invisible to the render."""
    renders = {}
    for layout, model in released_layouts.items():
        out = tmp_path / f"{layout.replace(' ', '-')}.mp4"
        code = main(["render", "a fox", "--model", str(model), "--width", "64", "--height", "64", "--frames", "22",
                     "--steps", "3", "--device", "cpu", "--no-progress", "-o", str(out)])  # fmt: skip
        assert code == 0, layout
        renders[layout] = out.read_bytes()
    assert renders["original"] == renders["diffusers"] == renders["single file"]


def test_every_component_loads_into_owned_aligned_tensors(released_layouts):
    """No loaded tensor of any component (either DiT layout's, the text encoder's, both VAEs') is a view into the
    files it was read from; see `loading_fixtures.not_owned`."""
    for layout in ("original", "single file"):
        folder = resolve_model_folder(released_layouts[layout])
        components = load_components(folder, device="cpu", dtype=torch.bfloat16)
        for name, module, files in [
            ("transformer", components.dit, folder.transformer.glob("*.safetensors")),
            ("text encoder", components.text_encoder.model, folder.text_encoder.glob("*.safetensors")),
            ("video VAE", components.video_vae, folder.video_vae.rglob("*.safetensors")),
            ("audio VAE", components.audio_vae, folder.audio_vae.glob("*.safetensors")),
        ]:
            assert not_owned(module, files) == [], (layout, name)


def test_cli_refuses_a_qkv_layout_that_cannot_apply(checkpoint, tmp_path, capsys):
    out = tmp_path / "x.mp4"
    assert main(["render", "p", "--model", str(checkpoint), "--qkv-layout", "stacked", "-o", str(out)]) == 1
    assert "diffusers names" in capsys.readouterr().err and not out.exists()
    assert main(["render", "p", "--qkv-layout", "interleaved", "-o", str(out)]) == 1
    assert "built-in tiny model" in capsys.readouterr().err and not out.exists()
