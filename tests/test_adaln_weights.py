"""Where the AdaLN weights live (`H3_ADALN_WEIGHTS`): mapped weights are never read at load, stay views of the
checkpoint's file mapping, and give tables, and so renders, bitwise those of the weights loaded on the device and of
the per-step computation, with and without an adapter that changes them; the settings around them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3serve.accel.adaln import AdalnTables
from h3serve.accel.profile import Profile
from h3serve.checkpoint.adapters.read import is_block_adaln
from h3serve.pipeline.layout import MediaGeometry, build_layout
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.sampling import step_timesteps
from h3serve.pipeline.schedule import DualSchedule
from h3serve.settings import SettingsError, load_settings


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from oracle import oracle

    oracle("diffusers")
    from e2e_fixtures import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("release") / "FL2VA")


def _steps(points: int = 5):
    layout = build_layout([1] * 9, MediaGeometry.from_pixels(128, 224, 22), ("first",))
    return step_timesteps(layout, DualSchedule.build(points, 12.0, 3.0))


@pytest.fixture(scope="module")
def engines(checkpoint):
    """engines(adaln_weights, dtype="float32"): one engine per profile for the module, loaded once."""
    from h3serve.pipeline.engine import Engine

    made = {}

    def get(adaln_weights: str, dtype: str = "float32"):
        if (adaln_weights, dtype) not in made:
            made[adaln_weights, dtype] = Engine.load(checkpoint, Profile(adaln_weights=adaln_weights, dtype=dtype))
        return made[adaln_weights, dtype]

    return get


def _engine(checkpoint, adaln_weights: str, adapters=()):
    from h3serve.pipeline.engine import Engine

    return Engine.load(checkpoint, Profile(adaln_weights=adaln_weights), adapters=adapters)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


def test_mapped_weights_stay_views_of_the_checkpoint_and_everything_else_is_owned(checkpoint, engines):
    from loading_fixtures import mapped_ranges, not_owned

    engine = engines("mapped")
    dit = engine.components.dit
    files = sorted((checkpoint / "transformer").glob("*.safetensors"))
    found = not_owned(dit, files)
    adaln = [n for n, _ in dit.named_parameters() if is_block_adaln(n)]
    assert adaln and sorted(f.split(":")[0] for f in found) == sorted(adaln)
    assert all("a view into the mapped checkpoint file" in f for f in found)
    ranges = mapped_ranges(files)
    for name in adaln:  # stored dtype, not the float32 the profile computes in: nothing was converted or copied
        p = dit.get_parameter(name)
        assert p.dtype == torch.bfloat16 and any(lo <= p.data_ptr() < hi for lo, hi in ranges), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mapped_tables_are_bitwise_the_device_tables_and_the_forward_computation(engines, dtype):
    mapped, device = engines("mapped", dtype), engines("device", dtype)
    steps = _steps()
    ours = mapped.tables["fl2va"].for_steps(steps)
    theirs = device.tables["fl2va"].for_steps(steps)
    assert len(ours) == 4 and _equal(ours, theirs)
    dit = device.components.dit
    for step, timesteps in enumerate(steps):  # what each block computes inside a forward
        temb = dit.time_embedder(timesteps)
        for b, block in enumerate(dit.blocks):
            assert torch.equal(ours[step][b], block.modulation(temb, dit.compute_dtype)), (step, b)


def test_a_render_over_mapped_weights_is_bitwise_the_render_over_loaded_ones(engines):
    mapped, device = engines("mapped"), engines("device")
    small = {"width": 224, "height": 128, "num_frames": 22, "steps": 3, "seed": 7}
    one = mapped.render(mapped.validate(RequestFields("a fox in snow", **small)))
    two = device.render(device.validate(RequestFields("a fox in snow", **small)))
    np.testing.assert_array_equal(one.frames, two.frames)
    np.testing.assert_array_equal(one.audio, two.audio)
    assert "tables" in one.timings


def test_an_adapter_changing_adaln_is_merged_as_the_mapped_weights_stream_in(checkpoint, engines, tmp_path):
    from adapter_fixtures import write_adapter
    from h3serve.checkpoint.adapters import read_adapter
    from h3serve.model.tiny import TINY_DIT

    adapter = read_adapter(write_adapter(tmp_path, "native", TINY_DIT, rank=4), config=TINY_DIT)
    assert adapter.touches_adaln
    mapped = _engine(checkpoint, "mapped", adapters=[adapter])
    device = _engine(checkpoint, "device", adapters=[adapter])  # merged as the weights loaded
    plain = engines("device")
    steps = _steps()
    ours = mapped.tables["fl2va"].for_steps(steps)
    assert _equal(ours, device.tables["fl2va"].for_steps(steps))
    assert not _equal(ours, plain.tables["fl2va"].for_steps(steps))  # the adapter did change them
    # The mapped weights themselves are the file's, unmerged: the merge lives only in the tables made from them.
    name = "blocks.0.adaln_proj.linear.weight"
    assert torch.equal(mapped.components.dit.get_parameter(name).float(), plain.components.dit.get_parameter(name))


def test_the_loaded_budget_counts_mapped_weights_as_page_cache(engines):
    mapped, device = engines("mapped"), engines("device")
    ours, theirs = mapped.memory_budget(), device.memory_budget()
    adaln = sum(p.numel() for n, p in device.components.dit.named_parameters() if is_block_adaln(n))
    assert ours.mapped["adaln_weights (mapped)"] * 2**30 == pytest.approx(adaln * 2)  # bf16 as stored
    assert theirs.mapped == {}
    assert theirs.device["dit"] * 2**30 - ours.device["dit"] * 2**30 == pytest.approx(adaln * 4)  # float32 loaded
    assert "page cache, evictable, not counted: adaln_weights (mapped)" in ours.table()


def test_kept_schedules_are_counted_in_default_schedules_steps_least_recently_used_first(engines):
    """cache_size=1 keeps 49 steps (one default schedule): short schedules share it, a longer one is not kept."""
    engine = engines("mapped")
    tables = AdalnTables(engine.components.dit, weights="mapped", cache_size=1, mapped_load=True)
    first = tables.for_steps(_steps(30))  # 29 steps
    assert tables.for_steps(_steps(30)) is first
    short = tables.for_steps(_steps(5))  # 4 more: 33 of 49, both kept
    assert tables.for_steps(_steps(30)) is first and tables.for_steps(_steps(5)) is short
    tables.for_steps(_steps(25))  # 24 more would be 57: the least recently used (the 29 steps) goes
    assert len(tables._cache) == 2 and tables.for_steps(_steps(5)) is short
    assert tables.for_steps(_steps(30)) is not first
    long = tables.for_steps(_steps(60))  # 59 steps, more than is kept: made for its render, nothing kept beside it
    assert len(long) == 59 and len(tables._cache) == 0


def test_mapped_weights_need_a_mapped_load(engines):
    """Mapped tables stream the file's weights (merging adapters as they come in): a DiT whose AdaLN weights were
    loaded or built in memory (possibly merged already) is refused rather than streamed and merged again."""
    from h3serve.model.tiny import tiny_components
    from h3serve.pipeline.engine import Engine

    assert engines("mapped").components.adaln_mapped and not engines("device").components.adaln_mapped
    with pytest.raises(ValueError, match="AdaLN weights were not loaded mapped"):
        AdalnTables(engines("device").components.dit, weights="mapped")
    with pytest.raises(ValueError, match="AdaLN weights were not loaded mapped"):
        Engine(tiny_components(), Profile(adaln_weights="mapped"))


# ---- the settings ------------------------------------------------------------------------------------------------


def _refusal(env: dict[str, str]) -> str:
    with pytest.raises(SettingsError) as err:
        load_settings(env=env, check_profile=False)
    return str(err.value)


def test_the_settings_of_the_adaln_weights(checkpoint, tmp_path):
    out = {"H3_OUTPUT_DIR": str(tmp_path)}
    message = _refusal(out | {"H3_ADALN_RESIDENT": "true"})
    assert message.startswith("H3_ADALN_RESIDENT: was replaced by H3_ADALN_WEIGHTS")
    message = _refusal(out | {"H3_ADALN_WEIGHTS": "mapped"})  # the tiny model: no file to map
    assert "H3_ADALN_WEIGHTS (--adaln-weights): mapped reads the AdaLN weights from the checkpoint's files" in message
    message = _refusal(out | {"H3_ADALN_WEIGHTS": "pinned", "H3_DEVICE": "cpu"})
    assert "H3_ADALN_WEIGHTS (--adaln-weights): adaln_weights pinned needs a CUDA device" in message
    message = _refusal(out | {"H3_ADALN_WEIGHTS": "page-cache"})
    assert "H3_ADALN_WEIGHTS (--adaln-weights): Input should be 'device', 'mapped' or 'pinned'" in message
    message = _refusal(out | {"H3_ADALN_TABLES_KEPT": "0"})
    assert "H3_ADALN_TABLES_KEPT (--adaln-tables-kept): Input should be greater than or equal to 1" in message
    model = out | {"H3_MODEL": str(checkpoint), "H3_DEVICE": "cpu"}
    assert load_settings(env=model | {"H3_ADALN_WEIGHTS": "mapped"}).profile().adaln_weights == "mapped"
    kept = load_settings(env=model | {"H3_ADALN_TABLES_KEPT": "2"}).profile()
    assert (kept.adaln_weights, kept.adaln_tables_kept) == ("device", 2)
    # The device defaults: a discrete GPU keeps a page-locked copy and 4 schedules; an integrated one maps the file
    # and keeps two; the tiny model on CUDA is never mapped (settings.profile() asks CUDA which GPU it is).
    discrete, integrated = Profile.for_device("cuda"), Profile.for_device("cuda", integrated=True)
    assert (discrete.adaln_weights, discrete.adaln_tables_kept) == ("pinned", 4)
    assert (integrated.adaln_weights, integrated.adaln_tables_kept) == ("mapped", 2)
    tiny = load_settings(env=out | {"H3_DEVICE": "cuda"}, check_profile=False)
    assert tiny._profile_values("cuda")["adaln_weights"] == "pinned"
