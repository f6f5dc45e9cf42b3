"""Weights streamed from host memory (`accel.offload`) where the memory plan places them (`pipeline.placement`):
the streamer's ring on a stack of small modules, tiny-model renders bitwise equal to resident ones (the DiT's blocks,
the text encoder's layers, the visiting video VAE; from the built-in model and from a checkpoint folder's load), the
placement of the released model for given device budgets (its configs on the meta device), the start's refusals and
the admission's refusal of a request larger than the device memory holds, through the CLI and the service."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from h3serve.accel.offload import Streamer
from h3serve.accel.profile import Profile
from h3serve.pipeline.budget import OVERHEAD_GIB, tiny_budget
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.placement import Placement, PlacementError, place, spread
from h3serve.pipeline.request import RequestFields
from h3serve.pipeline.rules import RELEASED_RULES, RequestError

sys.path.insert(0, str(Path(__file__).parent))
from service_fixtures import free_port
from test_budget import cuda_profile, released_configs

CPU = Profile.for_device("cpu")


# ---- the streamer's ring --------------------------------------------------------------------------------------------
def _stack(n: int = 5) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(n)).requires_grad_(False)


def _run(stack, x, order=None, streamer=None):
    for i in order or range(len(stack)):
        if streamer is not None:
            streamer.before(i)
        x = stack[i](x)
        if streamer is not None:
            streamer.after(i)
    return x


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_streamed_stack_computes_the_resident_stacks_bits_through_any_ring(slots):
    resident, streamed = _stack(), _stack()
    x = torch.randn(4, 8)
    expected = [_run(resident, x) for _ in range(2)]
    streamer = Streamer(list(streamed), torch.device("cpu"), slots)
    got = [_run(streamed, x, streamer=streamer) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    # Every module shares its slot's tensors: the device holds `slots` modules' weights, not five.
    assert len({streamed[i][0].weight.data_ptr() for i in range(5)}) == min(slots, 5)
    assert streamer.host_bytes >= 5 * streamer.bytes_per_module


def test_modules_skipped_between_others_are_copied_when_they_run():
    """A step cache skips the middle blocks: what was prefetched for them is not used, and the block after the skip
    still gets its own weights."""
    resident, streamed = _stack(), _stack()
    x = torch.randn(4, 8)
    order = [0, 3, 4, 1]
    streamer = Streamer(list(streamed), torch.device("cpu"), 2)
    assert torch.equal(_run(resident, x, order), _run(streamed, x, order, streamer))


def test_the_streamer_refuses_modules_of_another_structure_and_views():
    mixed = [nn.Linear(8, 8), nn.Linear(8, 4)]
    with pytest.raises(ValueError, match="differs in structure"):
        Streamer(mixed, torch.device("cpu"))
    odd = nn.Linear(8, 8)
    odd.weight = nn.Parameter(torch.randn(8, 8).t(), requires_grad=False)
    with pytest.raises(ValueError, match="only contiguous tensors stream"):
        Streamer([odd], torch.device("cpu"))


def test_spread_spaces_the_streamed_blocks_evenly():
    assert spread(0, 50) == ()
    assert spread(50, 50) == tuple(range(50))
    assert spread(5, 50) == (5, 15, 25, 35, 45)
    assert len(spread(27, 50)) == 27


# ---- renders ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resident():
    engine = Engine.load(None, CPU, task_type="both")
    return engine


def _render(engine, **fields):
    request = engine.validate(RequestFields("a lighthouse at dusk, waves", steps=3, seed=7, **fields))
    return engine.render(request)


@pytest.mark.parametrize(
    "placement",
    [
        Placement(dit_streamed=(0, 1), dit_blocks=2, slots=1, text_streamed=True, video_vae_visits=True),
        Placement(dit_streamed=(1,), dit_blocks=2, slots=2),
        Placement(text_streamed=True),
    ],
    ids=["everything, one slot", "one block", "text alone"],
)
def test_streamed_renders_are_bitwise_the_resident_renders(resident, placement):

    engine = Engine.load(None, CPU, task_type="both", placement=placement)
    for fields in ({}, {"task": "i2va", "keyframes": [_keyframe()]}):
        a, b = _render(resident, **fields), _render(engine, **fields)
        assert np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio), fields
    if placement.dit_streamed:
        assert set(engine.offloaded.dits) == {"fl2va", "ref2va"}
        assert engine.offloaded.dits["fl2va"].copies > 0
    if placement.video_vae_visits:
        assert engine.offloaded.video.visits == 3  # the T2VA decode; the I2VA encode and decode
        host = engine.offloaded.video.host.tensor
        start = host.data_ptr()
        for p in engine.components.video_vae.parameters():  # back in its host buffer after each visit
            assert start <= p.data_ptr() < start + host.numel()


def _keyframe():
    import io

    from PIL import Image

    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 255, (128, 224, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_checkpoint_load_streams_as_it_reads_and_renders_the_same_bits(tmp_path_factory):
    from oracle import oracle

    oracle("diffusers")
    from e2e_fixtures import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("release") / "FL2VA")
    everything = Placement(dit_streamed=(0, 1), dit_blocks=2, slots=2, text_streamed=True, video_vae_visits=True)
    a = _render(Engine.load(folder, CPU))
    engine = Engine.load(folder, CPU, placement=everything)
    b = _render(engine)
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio)
    assert engine.memory_budget().host["streamed weights (page-locked)"] > 0
    # The AdaLN weights left as the checkpoint's mapping stay so (they never stream): the same bits again.
    mapped = Profile.for_device("cpu", adaln_weights="mapped")
    c = _render(Engine.load(folder, mapped, placement=everything))
    assert np.array_equal(a.frames, c.frames) and np.array_equal(a.audio, c.audio)


# ---- the placement of the released model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_budget():
    from h3serve.pipeline.budget import plan_budget

    return plan_budget(released_configs(), cuda_profile("CUTLASS", "CUTLASS"), RELEASED_RULES)


def test_the_released_model_is_placed_for_each_gpu_size(fp8_budget):
    budget = fp8_budget
    st = budget.streamable
    assert st.dit_blocks == 50 and st.text_layers == 50
    assert 0.3 < st.dit_block < 0.4  # one FP8 block: ~0.35 GB, as the figures say
    placements = {gib: place(budget, gib) for gib in (24, 32, 48, 80, 140)}
    # Resident where everything fits; the text encoder's layers first, then the VAE, then blocks, as memory shrinks.
    assert not placements[80].streams and not placements[140].streams
    assert placements[48].text_streamed and not placements[48].dit_streamed
    assert placements[32].text_streamed and placements[32].video_vae_visits and len(placements[32].dit_streamed) > 0
    assert placements[24].dit_streamed == tuple(range(50))
    streamed = [len(placements[g].dit_streamed) for g in (24, 32, 48, 80)]
    assert streamed == sorted(streamed, reverse=True)
    for gib, p in placements.items():
        assert p.device_gib <= gib
    # 24 GiB cannot hold the largest request: it admits what fits, the default request among it.
    p24 = placements[24]
    assert budget.default_rows < p24.max_rows < budget.largest_rows
    # By hand: the resident weights are everything less 48 of 50 blocks, 48 of 50 text layers and the video VAE.
    resident = budget.device_weights - 48 * st.dit_block - 48 * st.text_layer - st.video_vae
    assert p24.max_rows == int((24 - resident - OVERHEAD_GIB) / st.activation_per_row)
    assert p24.pinned_gib == pytest.approx(50 * st.dit_block + 50 * st.text_layer + st.video_vae)


def test_bf16_on_48_gib_streams_part_of_the_dit(fp8_budget):
    from h3serve.pipeline.budget import plan_budget

    budget = plan_budget(released_configs(), cuda_profile("BF16", "BF16"), RELEASED_RULES)
    p = place(budget, 48)
    assert p.max_rows is None and 0 < len(p.dit_streamed) < 50 and p.device_gib <= 48


def test_too_little_device_memory_is_refused_with_what_the_default_request_needs(fp8_budget):
    with pytest.raises(PlacementError, match=r"needs \d+\.\d GiB on the device for the default request"):
        place(fp8_budget, 8)


def test_one_memory_pool_streams_nothing(fp8_budget):
    import dataclasses

    shared = dataclasses.replace(fp8_budget, shared=True)
    assert not place(shared, 24).streams
    with pytest.raises(PlacementError, match="one pool"):
        place(shared, 24, "all")
    assert not place(fp8_budget, 24, "none").streams


# ---- the start and the admission ------------------------------------------------------------------------------------
def test_the_start_refuses_a_plan_above_the_free_memory_and_too_little_host_memory(tmp_path):
    from h3serve.errors import SettingError
    from h3serve.settings import load_settings
    from h3serve.startup import StartupError, check_memory

    env = {"H3_OUTPUT_DIR": str(tmp_path), "H3_DEVICE": "cuda", "H3_DEVICE_MEMORY_GIB": "24"}
    settings = load_settings(env=env, check_profile=False)
    with pytest.raises(SettingError) as err:
        check_memory(settings, None, free=(16.0, 64.0, False))
    assert err.value.setting == "device_memory_gib" and "16.0 GiB free" in str(err.value)
    settings = load_settings(env={**env, "H3_OFFLOAD": "all"}, check_profile=False)
    _, placement = check_memory(settings, None, free=(80.0, 64.0, False))
    assert placement.streams and placement.budget_gib == 24
    with pytest.raises(StartupError, match="page-locked host memory"):
        check_memory(settings, None, free=(80.0, 1e-6, False))


def _admitting(rows_beyond_default: int) -> tuple[Placement, float]:
    """The tiny model's placement with every part streamed, within a budget that holds the default request and
    `rows_beyond_default` more packed rows."""
    budget = tiny_budget(CPU)
    full = place(budget, 1e6, "all")
    weights = full.device_gib - OVERHEAD_GIB - budget.largest_rows * budget.streamable.activation_per_row
    gib = (
        weights
        + OVERHEAD_GIB
        + (budget.default_rows + rows_beyond_default + 0.5) * budget.streamable.activation_per_row
    )
    return place(budget, gib, "all"), gib


def test_a_request_larger_than_the_device_memory_holds_is_refused_naming_what_fits():
    placement, _ = _admitting(200)
    assert placement.max_rows is not None
    engine = Engine.load(None, CPU, placement=placement)
    engine.validate(RequestFields("a cat"))  # the default request fits
    with pytest.raises(RequestError) as err:
        engine.validate(RequestFields("a cat", num_frames=90))
    assert err.value.field == "num_frames"
    message = str(err.value)
    assert "this server's device memory admits" in message and "frames fit" in message


def test_the_service_refuses_it_with_a_400_and_shows_the_placement(tmp_path):
    from service_fixtures import live_server, settings

    placement, _ = _admitting(200)
    engine = Engine.load(None, CPU, placement=placement)
    with live_server(settings(tmp_path), engine) as server, server.client() as client:
        health = client.get("/health").json()
        assert health["placement"]["dit_blocks_streamed"] == 2 and health["placement"]["max_rows"] == placement.max_rows
        big = client.post("/v1/videos", json={"prompt": "a cat", "num_frames": 90})
        assert big.status_code == 400, big.text
        assert "device memory admits" in big.text and "num_frames" in big.text
        ok = client.post("/v1/videos", json={"prompt": "a cat", "num_inference_steps": 2})
        assert ok.status_code in (200, 202), ok.text


def test_render_refuses_it_before_any_weight_loads(tmp_path, capsys):
    from h3serve.cli import main

    _, gib = _admitting(200)
    out = tmp_path / "o.mp4"
    code = main(["render", "a cat", "--frames", "90", "--offload", "all", "--device-memory-gib", f"{gib!r}",
                 "--output", str(out), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "device memory admits" in err and not out.exists()


def test_one_pool_admits_the_largest_request_that_fits_instead_of_refusing_the_start():
    """BF16 on a 128 GB DGX Spark: the default request fits the pool, the largest the rules allow does not."""
    import dataclasses

    from h3serve.pipeline.budget import plan_budget

    spark = cuda_profile("BF16", "BF16", integrated=True)
    budget = dataclasses.replace(plan_budget(released_configs(), spark, RELEASED_RULES), shared=True)
    assert budget.pool_need(budget.activations_default) < 118 < budget.pool_need()
    p = place(budget, 118)
    assert not p.streams and budget.default_rows < p.max_rows < budget.largest_rows and p.device_gib <= 118


class _Scaled(nn.Module):
    """A linear with an FP8-style (1, N) scale whose strides are (1, 1), as `accel.linear.quantize_weight` makes it."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(8, 8, generator=g), requires_grad=False)
        self.register_buffer("scale", torch.rand(8, 1, generator=g).t().contiguous())

    def forward(self, x):
        return (x @ self.weight.t()) * self.scale


def test_streamed_tensors_keep_their_strides_so_a_compiled_block_does_not_recompile():
    """Resident and streamed blocks run one compiled code: a slot tensor with canonical strides in place of a (1, N)
    scale's (1, 1) failed a guard (one recompile, measured on the H200 at the reference shape before this)."""
    from h3serve.accel.compile import GraphCounter

    blocks = [_Scaled(i) for i in range(4)]
    assert blocks[0].scale.stride() == (1, 1)
    x = torch.randn(3, 8)
    expected = [b(x) for b in blocks]
    streamer = Streamer([blocks[1], blocks[3]], torch.device("cpu"), 2)
    assert blocks[1].scale.stride() == (1, 1)
    counter = GraphCounter("eager")
    run = torch.compile(lambda block, x: block(x), backend=counter, dynamic=False)
    for _ in range(2):
        for i, block in enumerate(blocks):
            if i % 2:
                streamer.before(i // 2)
            assert torch.equal(run(block, x), expected[i])
            if i % 2:
                streamer.after(i // 2)
    assert counter.recompiles == 0


# ---- with the step cache, adapters, and the split ------------------------------------------------------------------
EVERYTHING = Placement(dit_streamed=(0, 1), dit_blocks=2, slots=2, text_streamed=True, video_vae_visits=True)


def test_with_a_step_cache_the_skipped_blocks_are_not_streamed_and_the_bits_are_the_same():
    from test_stepcache_engine import CACHING

    one_slot = Placement(dit_streamed=(0, 1), dit_blocks=2, slots=1)
    plain = Engine.load(None, CPU, step_cache=CACHING)
    engine = Engine.load(None, CPU, step_cache=CACHING, placement=one_slot)
    a, b = (e.render(e.validate(RequestFields("a red fox in snow", steps=10, seed=1))) for e in (plain, engine))
    assert a.step_cache.cached == b.step_cache.cached and b.step_cache.num_cached > 0
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio)
    # One slot: a whole forward copies both blocks in turn; a cached one runs block 0 alone, so fewer copies than two a
    # forward, and at least one.
    copies, forwards = engine.offloaded.dits["fl2va"].copies, b.step_cache.forwards
    assert forwards <= copies < 2 * forwards


def test_adapters_are_merged_before_the_host_copy_is_made(tmp_path):
    from adapter_fixtures import write_adapter
    from h3serve.checkpoint.adapters import read_adapter
    from h3serve.model.tiny import TINY_DIT

    adapter = read_adapter(write_adapter(tmp_path, "lightx2v-diffusers", TINY_DIT, rank=4), config=TINY_DIT)
    a = _render(Engine.load(None, CPU, adapters=[adapter]))
    b = _render(Engine.load(None, CPU, adapters=[adapter], placement=EVERYTHING))
    plain = _render(Engine.load(None, CPU))
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio)
    assert not np.array_equal(a.frames, plain.frames)  # the adapter changed something


def test_a_split_render_with_every_rank_streaming_is_the_one_process_render():
    from h3serve.parallel.workers import ParallelEngine, WorkerSpec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs: a CPU GEMM over threads can round a row otherwise (test_parallel)
    try:
        one = _render(Engine.load(None, CPU))
    finally:
        torch.set_num_threads(threads)
    spec = WorkerSpec(None, CPU, 2, cpu_threads=1, placement=EVERYTHING)
    engine = ParallelEngine(spec, engine_factory=_text_on_rank_0_only)
    try:
        assert engine.placement == EVERYTHING
        split = _render(engine)
    finally:
        engine.close()
    assert np.array_equal(one.frames, split.frames) and np.array_equal(one.audio, split.audio)


def _text_on_rank_0_only(spec, place):
    """A rank's engine factory: only rank 0 encodes prompts, so only it keeps the text encoder's streamed layers (and
    their host memory); a worker that breaks this fails its start, and the test with it."""
    from h3serve.parallel.workers import load_rank_engine

    engine = load_rank_engine(spec, place)
    if (engine.offloaded.text is not None) != (place.rank == 0):
        raise RuntimeError(f"rank {place.rank}: text streamer {'kept' if engine.offloaded.text else 'dropped'}")
    return engine


def test_check_preflight_prints_the_placement(tmp_path, capsys):
    from h3serve.cli import main

    out_dir, port = str(tmp_path / "out"), str(free_port())
    code = main(["check", "--preflight", "--offload", "all", "--output-dir", out_dir, "--api-port", port])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "placement: DiT 2 of 2 blocks streamed (2 slots), text encoder layers streamed, video VAE visits" in out.out


def test_an_engine_refuses_to_stream_humming_weights():
    from h3serve.accel.profile import ProfileError
    from h3serve.model.tiny import tiny_components

    humming = Profile.for_device("cuda", linear="HUMMING", execution="eager")
    with pytest.raises(ProfileError, match="HUMMING's FP8 layout does not stream") as err:
        Engine(tiny_components(), humming, placement=Placement(text_streamed=True))
    assert err.value.setting == "linear"


def test_a_load_sends_exactly_the_streamed_tensors_to_host_memory_by_the_names_it_reads():
    """The load hooks' predicates against the names the loaders pass them: the DiT's own and the Qwen3-VL model's
    (`checkpoint.text_encoder` loads the model the text encoder wraps)."""
    from h3serve.checkpoint.adapters.read import is_block_adaln
    from h3serve.model.tiny import tiny_components

    components = tiny_components()
    placement = Placement(dit_streamed=(1,), dit_blocks=2, text_streamed=True)
    dit_names = [n for n, _ in components.dit.named_parameters()] + [n for n, _ in components.dit.named_buffers()]
    host = placement.dit_host_names()
    assert (
        {n for n in dit_names if host(n)}
        == {n for n in dit_names if n.startswith("blocks.1.") and not is_block_adaln(n)}
        != set()
    )
    text_names = [n for n, _ in components.text_encoder.model.named_parameters()]
    host = placement.text_host_names()
    assert {n for n in text_names if host(n)} == {n for n in text_names if n.startswith("language_model.layers.")}
    assert any(host(n) for n in text_names) and not all(host(n) for n in text_names)
    assert not any(Placement().text_host_names()(n) for n in text_names)
