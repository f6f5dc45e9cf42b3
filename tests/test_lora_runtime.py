"""Adapters applied at run time (`accel.lora.RuntimeAdapters`, issue 57's engine side): a forward with none active is
bit for bit the plain DiT's; one active matches diffusers + peft with the adapter fused (the same bound the merge is
held to); two at once match both merged; switching refills the same buffers; what cannot be applied at run time is
refused, naming the file and the way that works (merging). CPU, float32, the real diffusers reference."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.test_adapters import SCALE, diffusers_fused, oracle_setup  # noqa: F401  (a fixture)

from adapter_fixtures import write_adapter
from dit_fixtures import rel_err
from h3serve.accel.lora import LoraLinear, RuntimeAdapters
from h3serve.checkpoint.adapters import AdapterError, merge_into, read_adapter
from h3serve.checkpoint.dit import load_dit


@pytest.fixture
def model(oracle_setup):  # noqa: F811
    folder, cfg, inputs, _ = oracle_setup
    return load_dit(folder, dtype=torch.float32), cfg, inputs


def forward(dit, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return inputs.run_ours(dit)


def test_with_no_adapter_active_the_forward_is_the_plain_dits_bit_for_bit(model, tmp_path):
    dit, cfg, inputs = model
    plain = forward(copy.deepcopy(dit), inputs)
    turbo = read_adapter(write_adapter(tmp_path, "lightx2v-diffusers", cfg), config=cfg)
    runtime = RuntimeAdapters(dit, {"turbo": turbo}, torch.float32)
    assert runtime.linears and all(isinstance(m, LoraLinear) for m in runtime.linears.values())
    for got, want in zip(forward(dit, inputs), plain, strict=True):
        assert torch.equal(got, want)
    runtime.activate([("turbo", 1.0)])
    assert not torch.equal(forward(dit, inputs)[0], plain[0])
    runtime.activate([])  # back to the plain model
    for got, want in zip(forward(dit, inputs), plain, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["lightx2v-diffusers", "comfyui-fused"])
def test_one_adapter_at_run_time_matches_diffusers_with_it_fused(model, tmp_path, fmt):
    dit, cfg, inputs = model
    file = write_adapter(tmp_path, fmt, cfg)
    runtime = RuntimeAdapters(dit, {"a": read_adapter(file, config=cfg)}, torch.float32)
    runtime.activate([("a", SCALE)])  # the request's scale on top of the file's alpha / rank
    ref = diffusers_fused(file, SCALE)
    with torch.no_grad():
        expected = ref(**inputs.reference_kwargs(), return_dict=False)
    video, audio = forward(dit, inputs)
    errors = rel_err(video, expected[0][0]), rel_err(audio, expected[1][0])
    assert max(errors) < 1e-5, errors  # the merge's bound (tests/test_adapters.py)


def test_two_adapters_at_once_match_both_merged_and_a_switch_keeps_the_buffers(model, tmp_path):
    dit, cfg, inputs = model
    files = {}
    for name, fmt, seed in (("turbo", "lightx2v-diffusers", 1), ("style", "comfyui-fused", 2)):
        (tmp_path / name).mkdir()
        files[name] = write_adapter(tmp_path / name, fmt, cfg, seed=seed)
    merged = copy.deepcopy(dit)
    merge_into(merged, [read_adapter(files["turbo"], 0.5, config=cfg), read_adapter(files["style"], 1.2, config=cfg)])
    runtime = RuntimeAdapters(dit, {k: read_adapter(f, config=cfg) for k, f in files.items()}, torch.float32)
    pointers = {t: (m.down.data_ptr(), m.up.data_ptr()) for t, m in runtime.linears.items()}
    runtime.activate([("style", 1.0)])
    runtime.activate([("turbo", 0.5), ("style", 1.2)])
    assert {t: (m.down.data_ptr(), m.up.data_ptr()) for t, m in runtime.linears.items()} == pointers
    want = forward(merged, inputs)
    got = forward(dit, inputs)
    assert max(rel_err(g, w) for g, w in zip(got, want, strict=True)) < 1e-5
    assert runtime.chosen == (("turbo", 0.5), ("style", 1.2)) and runtime.buffer_bytes > 0
    with pytest.raises(ValueError, match=r"adapters must be declared ones, each once: turbo, style; got \['other'\]"):
        runtime.activate([("other", 1.0)])


@pytest.mark.parametrize(("fmt", "why"), [("native", "changes an AdaLN projection"), ("fasth3", "full-rank delta")])
def test_what_cannot_run_per_request_is_refused_naming_the_merge(model, tmp_path, fmt, why):
    dit, cfg, _ = model
    adapter = read_adapter(write_adapter(tmp_path, fmt, cfg), config=cfg)
    with pytest.raises(AdapterError, match=rf"{why}.*merge it at load \(H3_LORA\)"):
        RuntimeAdapters(dit, {"x": adapter}, torch.float32)
