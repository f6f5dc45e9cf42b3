"""The DiT loader: every published layout gives the same model; every corruption stops the load naming the file
and key; a single file's QKV order is the caller's to say."""

import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dit_fixtures import packed_inputs, tiny_dit_pair
from folder_fixtures import DIT_INDEX, write_sharded
from h3serve.checkpoint.dit import load_dit, resolve_dit_layout
from h3serve.checkpoint.reader import CheckpointError
from h3serve.checkpoint.safetensors import open_checkpoint
from loading_fixtures import not_owned

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # lib.export: our DiT as checkpoints hold it
from lib.export import export_state_dict

REFERENCE = Path(__file__).parent / "data" / "reference"


@pytest.fixture(scope="module")
def tiny():
    _, ours = tiny_dit_pair(torch.float32)
    return ours


def write_layout(root: Path, model, layout: str) -> Path:
    """ "original" / "diffusers": a sharded folder with config.json; "stacked" / "interleaved": one file, no config."""
    if layout in ("stacked", "interleaved"):
        path = root / f"minimax_h3_fl2va_{layout}_bf16.safetensors"
        root.mkdir(parents=True, exist_ok=True)
        save_file(export_state_dict(model, layout), path)
        return path
    state = export_state_dict(model, "interleaved" if layout == "original" else layout)
    folder = write_sharded(root / layout, state, layout)
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    return folder


def reference_keys(index: Path, num_layers: int) -> set[str]:
    keys = json.loads(index.read_text())["weight_map"]
    return {k for k in keys if (m := re.search(r"blocks\.(\d+)\.", k)) is None or int(m.group(1)) < num_layers}


def run(model):
    with torch.no_grad():
        return packed_inputs().run_ours(model)


@pytest.mark.parametrize("layout", ["original", "diffusers"])
def test_written_keys_match_released_index(tiny, layout, tmp_path):
    folder = write_layout(tmp_path, tiny, layout)
    index_name = DIT_INDEX[layout][0]
    sub = "FL2VA/transformer" if layout == "original" else "transformer"
    written = set(json.loads((folder / index_name).read_text())["weight_map"])
    # the tiny token refiner has 2 blocks like the real one; main blocks are cut to the tiny depth
    assert written == reference_keys(REFERENCE / sub / index_name, tiny.config.num_layers)


def test_every_layout_loads_to_identical_outputs(tiny, tmp_path):
    expected = run(tiny)
    for layout, qkv, found in [
        ("original", None, "original names, interleaved QKV"),
        ("diffusers", None, "diffusers"),
        ("stacked", None, "original names, stacked QKV"),
        ("stacked", "stacked", "original names, stacked QKV"),
        ("interleaved", "interleaved", "original names, interleaved QKV"),
    ]:
        path = write_layout(tmp_path / layout, tiny, layout)
        assert str(resolve_dit_layout(open_checkpoint(path), qkv)) == found
        video, audio = run(load_dit(path, dtype=torch.float32, config=tiny.config, qkv_layout=qkv))
        assert torch.equal(video, expected[0]) and torch.equal(audio, expected[1]), (layout, qkv)


def test_single_file_qkv_order_is_assumed_stacked_with_a_warning_that_says_how_to_change_it(tiny, tmp_path, caplog):
    path = write_layout(tmp_path, tiny, "interleaved")
    with caplog.at_level(logging.WARNING, logger="h3serve.checkpoint.dit"):
        wrong = load_dit(path, dtype=torch.float32, config=tiny.config)
    assert "assuming stacked" in caplog.text and "--qkv-layout interleaved" in caplog.text
    # The file really is interleaved: read as stacked, the model differs; said so, it loads right.
    assert not torch.equal(run(wrong)[0], run(tiny)[0])
    right = load_dit(path, dtype=torch.float32, config=tiny.config, qkv_layout="interleaved")
    assert torch.equal(run(right)[0], run(tiny)[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="h3serve.checkpoint.dit"):
        load_dit(path, dtype=torch.float32, config=tiny.config, qkv_layout="stacked")
    assert "assuming" not in caplog.text  # an explicit choice is not warned about


@pytest.mark.parametrize(
    ("layout", "qkv", "message"),
    [
        ("original", "stacked", "interleaves QKV per head"),
        ("diffusers", "stacked", "diffusers names"),
        ("diffusers", "interleaved", "diffusers names"),
        ("stacked", "per-head", "qkv_layout must be one of stacked, interleaved"),
    ],
)
def test_qkv_layout_that_cannot_apply_is_refused(tiny, tmp_path, layout, qkv, message):
    path = write_layout(tmp_path, tiny, layout)
    with pytest.raises(ValueError, match=message):
        load_dit(path, dtype=torch.float32, config=tiny.config, qkv_layout=qkv)


def test_bf16_load_places_tensors_once_in_target_dtypes(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "original")
    model = load_dit(folder, dtype=torch.bfloat16)
    assert model.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.video_patch_proj.weight.dtype == torch.float32
    assert not any(t.is_meta for t in model.state_dict().values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["original", "diffusers", "stacked", "interleaved"])
def test_every_layout_loads_into_owned_aligned_tensors(tiny, tmp_path, layout, dtype):
    """No tensor is a view into the file's mmap: the views sit at the file's offsets (8-byte aligned), which differ
    from layout to layout, and CPU GEMMs round by alignment, so the same model rendered other frames from another
    layout (issue 22). Whichever tensors need no conversion (the fp32 islands; in bf16, every block weight too) are
    the ones a zero-copy load would have left in the file."""
    path = write_layout(tmp_path, tiny, layout)
    qkv = layout if layout in ("stacked", "interleaved") else None
    model = load_dit(path, dtype=dtype, config=tiny.config, qkv_layout=qkv)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    assert not_owned(model, files) == []


# ----------------------------------------------------------------------------------------------- corruption


def shard_of(folder: Path, key: str) -> Path:
    index = next(folder.glob("*.index.json"))
    return folder / json.loads(index.read_text())["weight_map"][key]


def rewrite_shard(file: Path, edit) -> None:
    from safetensors.torch import load_file

    state = load_file(file)
    edit(state)
    save_file(state, file)


def expect_error(path, *needles: str, config=None) -> None:
    with pytest.raises(CheckpointError) as err:
        load_dit(path, dtype=torch.float32, config=config)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


KEY = "blocks.1.mlp.fc2.weight"


def test_missing_shard(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "original")
    shard = shard_of(folder, KEY)
    shard.unlink()
    expect_error(folder, str(shard), "missing")


def test_missing_key(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "original")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = shard_of(folder, KEY)
    del data["weight_map"][KEY]
    index.write_text(json.dumps(data))
    rewrite_shard(shard, lambda s: s.pop(KEY))
    expect_error(folder, str(index), KEY, "missing key")


def test_key_listed_in_index_but_absent_from_shard(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "original")
    shard = shard_of(folder, KEY)
    rewrite_shard(shard, lambda s: s.pop(KEY))
    expect_error(folder, str(shard), KEY)


def test_unexpected_key(tiny, tmp_path):
    path = write_layout(tmp_path, tiny, "stacked")
    rewrite_shard(path, lambda s: s.update({"blocks.7.extra.weight": torch.zeros(2, dtype=torch.bfloat16)}))
    expect_error(path, str(path), "blocks.7.extra.weight", "unexpected", config=tiny.config)


def test_wrong_shape(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "diffusers")
    key = "transformer_blocks.0.attn.to_k.weight"
    shard = shard_of(folder, key)
    rewrite_shard(shard, lambda s: s.update({key: s[key][:-1].clone()}))
    expect_error(folder, str(shard), key, "shape")


def test_wrong_shape_that_breaks_the_reorder(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "original")
    key = "blocks.0.attn.qkv_proj.weight"
    shard = shard_of(folder, key)
    rewrite_shard(shard, lambda s: s.update({key: s[key][:-1].clone()}))
    expect_error(folder, str(shard), key, "shape")


def test_wrong_dtype(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "original")
    for key, want in (("blocks.0.norm1.weight", "bfloat16"), ("video_patch_proj.weight", "float32")):
        shard = shard_of(folder, key)
        original = shard.read_bytes()
        rewrite_shard(shard, lambda s, key=key: s.update({key: s[key].to(torch.float16)}))
        expect_error(folder, str(shard), key, "float16", want)
        shard.write_bytes(original)


def test_truncated_file(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "original")
    shard = shard_of(folder, KEY)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    expect_error(folder, str(shard))


def test_not_a_dit_checkpoint(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"foo": torch.zeros(1)}, path)
    expect_error(path, "not an H3 DiT checkpoint")


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    expect_error(tmp_path, str(tmp_path), "*.safetensors")


def test_folder_without_config(tiny, tmp_path):
    folder = write_layout(tmp_path, tiny, "original")
    (folder / "config.json").unlink()
    expect_error(folder, str(folder), "config.json is missing")
