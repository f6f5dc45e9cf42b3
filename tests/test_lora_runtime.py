"""Adapters applied at run time (`accel.lora.RuntimeAdapters` over `checkpoint.adapters.library.AdapterLibrary`): a
forward with none active is bit for bit the plain DiT's; one active matches diffusers + peft with the adapter fused
(the bound the merge is held to); two at once, and an adapter that changes AdaLN, match them merged; a switch refills
the same buffers; the host cache holds its bound, gives up the least recently used and reads it again from the file
checked at start (a changed file is refused); what cannot run per request is refused at declaration, naming the way
that works (merging). CPU, float32, the real diffusers reference."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from tests.test_adapters import SCALE, diffusers_fused, oracle_setup  # noqa: F401  (a fixture)

from adapter_fixtures import write_adapter
from dit_fixtures import rel_err
from h3serve.accel.lora import ROOM_WARNING, LoraLinear, RuntimeAdapters
from h3serve.checkpoint.adapters import AdapterError, merge_into, read_adapter
from h3serve.checkpoint.adapters.formats import Names
from h3serve.checkpoint.adapters.library import AdapterLibrary, buffer_ranks
from h3serve.checkpoint.dit import load_dit

GIB = 2**30


@pytest.fixture
def model(oracle_setup):  # noqa: F811
    folder, cfg, inputs, _ = oracle_setup
    return load_dit(folder, dtype=torch.float32), cfg, inputs


def forward(dit, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return inputs.run_ours(dit)


def files(tmp_path, cfg, *specs):
    """(name, format, seed) -> name: path, each in its own folder."""
    out = {}
    for name, fmt, seed in specs:
        (tmp_path / name).mkdir()
        out[name] = write_adapter(tmp_path / name, fmt, cfg, seed=seed)
    return out


def library(cfg, paths, max_active=2, cache_bytes=GIB, scales=None):
    declared = [(n, p, (scales or {}).get(n, 1.0)) for n, p in paths.items()]
    return AdapterLibrary(declared, cfg, cache_bytes, max_active)


def test_with_no_adapter_active_the_forward_is_the_plain_dits_bit_for_bit(model, tmp_path):
    dit, cfg, inputs = model
    plain = forward(copy.deepcopy(dit), inputs)
    runtime = RuntimeAdapters(dit, library(cfg, files(tmp_path, cfg, ("turbo", "lightx2v-diffusers", 0))), None,
                              torch.float32, "cpu")  # fmt: skip
    assert runtime.linears and all(isinstance(m, LoraLinear) for m in runtime.linears.values())
    for got, want in zip(forward(dit, inputs), plain, strict=True):
        assert torch.equal(got, want)
    assert runtime.activate([("turbo", 1.0)]).switched
    assert not torch.equal(forward(dit, inputs)[0], plain[0])
    assert not runtime.activate([("turbo", 1.0)]).switched  # the same set: nothing copied
    runtime.activate([])  # back to the plain model
    for got, want in zip(forward(dit, inputs), plain, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["lightx2v-diffusers", "comfyui-fused"])
def test_one_adapter_at_run_time_matches_diffusers_with_it_fused(model, tmp_path, fmt):
    dit, cfg, inputs = model
    paths = files(tmp_path, cfg, ("a", fmt, 0))
    RuntimeAdapters(dit, library(cfg, paths), None, torch.float32, "cpu").activate([("a", SCALE)])
    ref = diffusers_fused(paths["a"], SCALE)
    with torch.no_grad():
        expected = ref(**inputs.reference_kwargs(), return_dict=False)
    video, audio = forward(dit, inputs)
    errors = rel_err(video, expected[0][0]), rel_err(audio, expected[1][0])
    assert max(errors) < 1e-5, errors  # the merge's bound (tests/test_adapters.py)


def test_two_adapters_and_one_that_changes_adaln_match_them_merged_and_a_switch_keeps_the_buffers(model, tmp_path):
    dit, cfg, inputs = model
    paths = files(tmp_path, cfg, ("turbo", "lightx2v-diffusers", 1), ("style", "comfyui-fused", 2),
                  ("larry", "native", 3))  # fmt: skip
    runtime = RuntimeAdapters(dit, library(cfg, paths), None, torch.float32, "cpu")
    assert "larry" in runtime.adaln and runtime.adaln_key([("turbo", 1.0)]) == ()
    assert runtime.adaln_key([("larry", 0.5)]) == (("larry", 0.5),)  # its tables are its own
    pointers = {t: (m.lora_down.data_ptr(), m.lora_up.data_ptr()) for t, m in runtime.linears.items()}
    for chosen in ([("turbo", 0.5), ("style", 1.2)], [("larry", 0.8)], [("style", -0.6), ("larry", 1.5)]):
        runtime.activate(chosen)
        assert {t: (m.lora_down.data_ptr(), m.lora_up.data_ptr()) for t, m in runtime.linears.items()} == pointers
        merged = copy.deepcopy(dit)
        for name, m in list(merged.named_modules()):  # the plain weights under the wrappers, then merged
            if isinstance(m, LoraLinear):
                parent, _, leaf = name.rpartition(".")
                setattr(merged.get_submodule(parent), leaf, m.base)
        merge_into(merged, [read_adapter(paths[n], s, config=cfg) for n, s in chosen])
        got, want = forward(dit, inputs), forward(merged, inputs)
        assert max(rel_err(g, w) for g, w in zip(got, want, strict=True)) < 1e-5, chosen
        assert runtime.chosen == tuple(chosen)
    with pytest.raises(
        ValueError, match=r"declared ones for this DiT, each once: turbo, style, larry; got \['other'\]"
    ):
        runtime.activate([("other", 1.0)])
    with pytest.raises(ValueError, match="at most 2 adapters at once; got 3"):
        runtime.activate([("turbo", 1.0), ("style", 1.0), ("larry", 1.0)])


def test_buffers_hold_the_largest_choice_and_every_block_of_a_role_alike(tmp_path):
    from h3serve.model.tiny import TINY_DIT

    paths = files(tmp_path, TINY_DIT, ("a", "lightx2v-diffusers", 0), ("b", "comfyui-fused", 1))
    lib = library(TINY_DIT, paths, max_active=1)
    a, b = (lib.catalog.entries[n].ranks for n in "ab")
    shapes = Names.of(TINY_DIT).shapes
    ranks = buffer_ranks(lib.catalog, shapes)
    target = "blocks.0.attn.qkv_proj.weight"
    padded = lambda rank: -(-rank // 16) * 16  # noqa: E731  (buffer ranks are padded to 16)
    assert ranks[target] == padded(max(a[target], b[target]))  # one at a time: the larger
    lib2 = library(TINY_DIT, paths, max_active=2)
    assert buffer_ranks(lib2.catalog, shapes)[target] == padded(a[target] + b[target])
    last = f"blocks.{TINY_DIT.num_layers - 1}.attn.qkv_proj.weight"
    assert ranks[last] == ranks[target]


def test_the_host_cache_holds_its_bound_and_reads_a_given_up_adapter_again_from_the_checked_file(tmp_path):
    from h3serve.model.tiny import TINY_DIT

    paths = files(tmp_path, TINY_DIT, ("a", "lightx2v-diffusers", 0), ("b", "lightx2v-diffusers", 1),
                  ("c", "lightx2v-diffusers", 2))  # fmt: skip
    one = library(TINY_DIT, paths).catalog.entries["a"].nbytes
    lib = library(TINY_DIT, paths, cache_bytes=2 * one)  # two of the three fit
    assert lib.held == ("b", "c") and lib.held_bytes <= 2 * one and lib.evictions == 1
    adapter, seconds = lib.get("b")  # held: no read
    assert seconds == 0.0 and lib.held == ("c", "b")
    adapter, seconds = lib.get("a")  # given up at start: read again, and "c" (least recently used) goes
    assert seconds > 0.0 and lib.reads == 1 and lib.held == ("b", "a")
    again = read_adapter(paths["a"], config=TINY_DIT)
    assert all(torch.equal(x.up, y.up) and torch.equal(x.down, y.down)
               for x, y in zip(adapter.deltas, again.deltas, strict=True))  # fmt: skip
    stat = os.stat(paths["c"])
    os.utime(paths["c"], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched since the start
    with pytest.raises(AdapterError, match="changed since the server checked it at start"):
        lib.get("c")
    with pytest.raises(ValueError, match=r"adapter a \(fl2va.safetensors\)|holds .* GiB of factors; the adapter cache"):
        library(TINY_DIT, paths, cache_bytes=one - 1)


def test_a_full_rank_adapter_is_refused_at_declaration_naming_the_merge(tmp_path):
    from h3serve.model.tiny import TINY_DIT

    paths = files(tmp_path, TINY_DIT, ("fast", "fasth3", 0))
    with pytest.raises(AdapterError, match=r"full-rank delta .* merge it at load \(H3_LORA\)"):
        library(TINY_DIT, paths)
    plain = files(tmp_path, TINY_DIT, ("plain", "lightx2v-diffusers", 0))["plain"]
    with pytest.raises(ValueError, match="adapter name 'x' is declared twice"):
        AdapterLibrary([("x", plain, 1.0), ("x", plain, 1.0)], TINY_DIT, GIB, 1)


def test_a_forward_computes_over_the_rank_its_number_of_adapters_needs(tmp_path):
    """One adapter applied in buffers made for two: the width is one adapter's (`buffer_ranks(applied=1)`), the
    output what the full width (the rest zero) gives; two applied: the full width; none: 0."""
    from h3serve.model.tiny import TINY_DIT, tiny_dit

    paths = files(tmp_path, TINY_DIT, ("a", "lightx2v-diffusers", 0), ("b", "comfyui-fused", 1))
    lib = library(TINY_DIT, paths, max_active=2)
    runtime = RuntimeAdapters(tiny_dit(), lib, None, torch.float32, "cpu")
    shapes = Names.of(TINY_DIT).shapes
    one, two = (buffer_ranks(lib.catalog, shapes, applied=k) for k in (1, 2))
    target = "blocks.0.attn.qkv_proj.weight"
    linear = runtime.linears[target]
    assert one[target] < two[target] == linear.lora_down.shape[0] and linear.width == 0
    runtime.activate([("b", 1.0)])
    assert linear.width == one[target]
    x = torch.randn(5, linear.in_features)
    got = linear(x)
    linear.width = two[target]  # the full width: the columns past the applied adapter are zero
    assert torch.allclose(got, linear(x), rtol=1e-6, atol=1e-6)
    runtime.activate([("a", 1.0), ("b", 0.5)])
    assert {m.width for m in runtime.linears.values()} == set(two.values())
    runtime.activate([])
    assert all(m.width == 0 for m in runtime.linears.values())


@pytest.mark.parametrize("size", [0.01, 0.05])
def test_over_an_fp8_base_the_delta_rides_in_the_bases_own_fp8_gemm(size):
    """An Fp8Linear base (CUTLASS's), resident: its weight moves into the wide buffer (the base reads a view of the
    same bytes: without an adapter the same output bit for bit); with an adapter one FP8 GEMM over the rows extended
    by h computes base and delta. Against the exact float32 output it errs as the same adapter merged into FP8
    weights does: a delta 1.6% of the weight's norm (`size` 0.01) as merged; one of 39% (0.05: the up factor's
    columns leave FP8's range at HEADROOM, rows scale down) within 1.3x merged's error. The streamed way (FP8 down,
    addmm up) as merged at both."""
    from h3serve.accel.linear import Fp8Linear, quantize_rows

    torch.manual_seed(0)
    dense = torch.nn.Linear(256, 128, bias=True)
    base = Fp8Linear.from_linear(dense)
    x = torch.randn(64, 256)
    q, scale = quantize_rows(x)
    plain = base.matmul_rows(q, scale, torch.float32)
    linear = LoraLinear(base, [16, 32], torch.bfloat16, torch.device("cpu"), wide=True, keep_factors=True)
    assert linear.use_wide and base.weight.data_ptr() == linear.wide.data_ptr()
    assert torch.equal(linear.matmul_rows(q, scale, torch.float32), plain)  # none applied
    down, up = torch.randn(32, 256) * size, torch.randn(128, 32) * size
    room = float(linear.put(slice(0, 32), slice(0, 128), down, up))
    assert (room == 1.0) if size == 0.01 else (room < ROOM_WARNING)  # the large delta's columns leave FP8's range
    linear.set_applied(2)
    merged = torch.nn.Linear(256, 128)
    with torch.no_grad():
        merged.weight.copy_(dense.weight + up @ down)
        merged.bias.copy_(dense.bias)
        exact = merged(x)
        merged_error = rel_err(Fp8Linear.from_linear(merged)(x), exact)
    wide = linear.matmul_rows(q, scale, torch.float32)
    linear.use_wide = False
    streamed = linear.matmul_rows(q, scale, torch.float32)
    assert torch.isfinite(wide).all() and not torch.equal(wide, streamed)  # the wide GEMM ran
    bound = 1.05 if size == 0.01 else 1.3
    assert rel_err(wide, exact) < bound * merged_error, (rel_err(wide, exact), merged_error)
    assert rel_err(streamed, exact) < 1.05 * merged_error, (rel_err(streamed, exact), merged_error)
    linear.use_wide = True
    linear.clear()
    linear.set_applied(0)  # as `activate([])` leaves it: the base alone again, on the same bytes
    assert torch.equal(linear.matmul_rows(q, scale, torch.float32), plain)
