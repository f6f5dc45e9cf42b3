"""DiTConfig: both released config files read into the same dataclass; invalid values are refused."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from h3serve.config import DiTConfig

REFERENCE = Path(__file__).parent / "data" / "reference"


def test_original_and_diffusers_configs_agree():
    original = DiTConfig.from_json(REFERENCE / "FL2VA" / "transformer" / "config.json")
    diffusers = DiTConfig.from_json(REFERENCE / "transformer" / "config.json")
    assert original == diffusers
    assert original.inner_dim == 7168 and original.hidden_size == 5376
    assert original.rotary_dim == 96 and original.video_patch_dim == 96


def test_round_trip_through_original_keys():
    cfg = DiTConfig.from_json(REFERENCE / "FL2VA" / "transformer" / "config.json")
    data = json.loads((REFERENCE / "FL2VA" / "transformer" / "config.json").read_text())
    out = cfg.to_dict()
    assert {k: v for k, v in out.items() if k != "rope_theta"} == {k: v for k, v in data.items() if k[0] != "_"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"adaln_out_features": 100}, "adaln_out_features must be 6 x 3 modalities x hidden_size = 96768"),
        ({"final_adaln_out_features": 1}, "final_adaln_out_features must be 2 x hidden_size = 10752"),
        ({"rope_inv_freq_len": 32}, "must not exceed attention_head_dim"),
        ({"attention_head_dim": 127}, "attention_head_dim must be even"),
        ({"patch_size": (1, 2)}, "patch_size must be three positive ints"),
        ({"patch_size": (1, 0, 2)}, "patch_size must be three positive ints"),
        ({"num_layers": 0}, "num_layers must be a positive number"),
        ({"norm_eps": -1.0}, "norm_eps must be a positive number"),
        ({"hidden_size": 5376.0}, "hidden_size must be an int"),
        ({"timestep_input_dim": 255}, "timestep_input_dim must be even"),
        ({"num_layers": 2.5}, "num_layers must be an int, got 2.5"),
        ({"rope_inv_freq_len": 4.0}, "rope_inv_freq_len must be an int"),
    ],
)
def test_invalid_values_are_refused(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        replace(DiTConfig(), **change)


def test_unknown_and_duplicate_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown DiT config key 'hidden_dim'"):
        DiTConfig.from_dict({"hidden_dim": 3})
    with pytest.raises(ValueError, match="given twice"):
        DiTConfig.from_dict({"ffn_dim": 3, "ffn_hidden_size": 3})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=str(bad)):
        DiTConfig.from_json(bad)
