"""The Ref2VA DiT in a release folder: found beside the FL2VA components in both published layouts, its configuration
checked with the rest, its weights loaded as strictly as the FL2VA DiT's (issue 12's loading step)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from h3serve.checkpoint.dit import load_dit
from h3serve.checkpoint.folder import load_ref_dit, resolve_model_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # lib.export: our DiT as checkpoints hold it


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A tiny diffusers-layout checkpoint with a transformer_ref/ of its own (other random weights)."""
    from oracle import oracle

    oracle("diffusers")
    from diffusers import MiniMaxH3Transformer3DModel

    from e2e_fixtures import SEED, TINY_DIT_DIFFUSERS, is_ref_fp32, write_tiny_checkpoint
    from h3serve.model.tiny import randomize

    root = write_tiny_checkpoint(tmp_path_factory.mktemp("release") / "FL2VA")
    ref = randomize(MiniMaxH3Transformer3DModel(**TINY_DIT_DIFFUSERS), SEED + 10)
    for name, p in ref.named_parameters():
        if not is_ref_fp32(name):
            p.data = p.data.to(torch.bfloat16)
    ref.save_pretrained(root / "transformer_ref")
    return root


def test_diffusers_layout_finds_transformer_ref_and_loads_its_own_weights(release):
    folder = resolve_model_folder(release)
    assert folder.ref_transformer == release / "transformer_ref"
    ref = load_ref_dit(folder, device="cpu", dtype=torch.bfloat16)
    again = load_dit(release / "transformer_ref", dtype=torch.bfloat16)
    fl2va = load_dit(release / "transformer", dtype=torch.bfloat16)
    ref_state, again_state, fl2va_state = ref.state_dict(), again.state_dict(), fl2va.state_dict()
    assert ref_state.keys() == fl2va_state.keys()
    assert all(torch.equal(ref_state[k], again_state[k]) for k in ref_state)
    differs = [k for k in ref_state if k != "rope.inv_freq" and not torch.equal(ref_state[k], fl2va_state[k])]
    assert len(differs) == len(ref_state) - 1  # every weight is the Ref2VA DiT's own


def test_original_layout_finds_ref2va_beside_fl2va(release, tmp_path):
    parent = tmp_path / "MiniMax-H3"
    shutil.copytree(release, parent / "FL2VA", ignore=shutil.ignore_patterns("transformer_ref"))
    shutil.copytree(release / "transformer_ref", parent / "Ref2VA" / "transformer")
    for path in (parent, parent / "FL2VA"):  # the release root or FL2VA/ itself
        assert resolve_model_folder(path).ref_transformer == parent / "Ref2VA" / "transformer"


def test_a_release_without_ref2va_resolves_and_says_where_it_looked(release, tmp_path):
    plain = tmp_path / "FL2VA"
    shutil.copytree(release, plain, ignore=shutil.ignore_patterns("transformer_ref"))
    folder = resolve_model_folder(plain)
    assert folder.ref_transformer is None
    with pytest.raises(
        ValueError,
        match=r"loads the Ref2VA DiT, but model folder .* has none \(looked for .*transformer_ref.*Ref2VA/transformer",
    ):
        load_ref_dit(folder, device="cpu", dtype=torch.bfloat16)


def test_a_ref2va_config_that_differs_is_refused_naming_both_files(release, tmp_path):
    broken = tmp_path / "FL2VA"
    shutil.copytree(release, broken)
    config = broken / "transformer_ref" / "config.json"
    values = json.loads(config.read_text())
    values["num_layers"] += 1
    config.write_text(json.dumps(values))
    with pytest.raises(ValueError, match=r"transformer_ref/config\.json: the Ref2VA DiT.s configuration differs"):
        resolve_model_folder(broken)


def test_community_single_file_ref2va_loads_the_same_weights(release, tmp_path):
    """The third layout: the Ref2VA DiT as one original-names file (`minimax_h3_ref2va_bf16.safetensors`, QKV rows
    stacked as every published single file holds them) beside its config, in transformer_ref/."""
    from lib.export import export_state_dict
    from safetensors.torch import save_file

    root = tmp_path / "FL2VA"
    shutil.copytree(release, root, ignore=shutil.ignore_patterns("transformer_ref"))
    (root / "transformer_ref").mkdir()
    shutil.copyfile(release / "transformer_ref" / "config.json", root / "transformer_ref" / "config.json")
    expected = load_dit(release / "transformer_ref", dtype=torch.bfloat16)
    single = root / "transformer_ref" / "minimax_h3_ref2va_bf16.safetensors"
    save_file(export_state_dict(expected, "stacked"), single)
    folder = resolve_model_folder(root)
    assert folder.ref_transformer == root / "transformer_ref" and folder.ref_qkv_layout == "stacked"
    loaded = load_ref_dit(folder, device="cpu", dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.state_dict().items())
    # Strict, as the FL2VA DiT: a key missing from the file is named.
    from safetensors.torch import load_file

    state = load_file(single)
    missing = next(k for k in state if k.startswith("blocks.1."))
    del state[missing]
    save_file(state, single)
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load_ref_dit(resolve_model_folder(root), device="cpu", dtype=torch.bfloat16)
