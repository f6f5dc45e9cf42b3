"""The video decoder's float16 weights made as they are read (the CUDA profile's float16 autocast): the loaded VAE is
bitwise the float32 load converted afterwards (`accel.vae.decoder_weights_to`), every tensor owned, and no float32
decoder in between."""

from __future__ import annotations

import pytest
import torch

from h3serve.accel.apply import load_plan
from h3serve.accel.profile import Profile
from h3serve.accel.vae import decoder_cast_names, decoder_weights_to


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from oracle import oracle

    oracle("diffusers")
    from e2e_fixtures import write_tiny_checkpoint
    from h3serve.checkpoint.folder import resolve_model_folder

    return resolve_model_folder(write_tiny_checkpoint(tmp_path_factory.mktemp("release") / "FL2VA"))


def test_the_decoder_is_converted_as_read_bitwise_as_after_the_load(folder):
    from h3serve.checkpoint.vae import load_video_vae
    from loading_fixtures import not_owned

    cuda = Profile.for_device("cuda")  # float16 autocast: a value, built on any machine
    hooks = load_plan(cuda).hooks(folder)
    assert "video_dtype_of" in hooks and "video_dtype_of" not in load_plan(Profile()).hooks(folder)
    read = load_video_vae(folder.video_vae, config=folder.video_vae_config, dtype_of=hooks["video_dtype_of"])
    after = load_video_vae(folder.video_vae, config=folder.video_vae_config)
    assert decoder_weights_to(after, torch.float16) > 0  # the former way: float32 first, converted afterwards
    assert decoder_weights_to(read, torch.float16) == 0  # nothing left to convert
    ours, theirs = read.state_dict(), after.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    names = decoder_cast_names(read)
    assert names and all(ours[n].dtype == torch.float16 for n in names)
    assert all(t.dtype != torch.float16 for n, t in ours.items() if n not in names)  # norms, encoder: float32
    files = sorted(folder.video_vae.glob("*.safetensors")) or sorted(folder.video_vae.rglob("*.safetensors"))
    assert not_owned(read, files) == []
