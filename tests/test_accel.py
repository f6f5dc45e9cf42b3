"""Acceleration seams on the CPU: the attention-kernel registry, the fixed-shape modulation table, and regional
compilation with no recompiles across steps and requests (counted, not assumed)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from h3serve.accel import attention
from h3serve.accel.compile import compile_repeated_blocks
from h3serve.accel.profile import Profile
from h3serve.config import MAX_TIMESTEPS, NUM_MODALITIES
from h3serve.model import ops
from h3serve.model.dit import TABLE_ROWS
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields


@pytest.fixture
def engine() -> Engine:
    return Engine.load(None, Profile())


def _requests(engine: Engine):
    """Requests that differ in everything a compiled block could specialise on: prompt length, task, keyframe
    count, canvas and frame count (so the row count S), and the number of distinct timesteps per step."""
    key = Image.new("RGB", (64, 48), (200, 40, 10))
    return [
        engine.validate(RequestFields("a fox", steps=4, seed=1)),
        engine.validate(
            RequestFields(
                "a much longer prompt: a red fox runs through fresh snow under a low winter moon, wind in the pines",
                task="i2va",
                keyframes=[key],
                width=256,
                height=128,
                num_frames=39,
                steps=3,
                seed=2,
            ),
        ),
        engine.validate(
            RequestFields("first and last", task="fl2va", keyframes=[key, key], width=160, height=96, steps=3, seed=3)
        ),
    ]


def test_regional_compile_compiles_two_graphs_and_never_recompiles(engine):
    """aot_eager runs Dynamo's tracing and guards (where recompiles come from) without Inductor's code generation,
    which takes most of a minute per graph on this CPU; GPU runs use Inductor (bench/dit_step.py counts there)."""
    requests = _requests(engine)
    eager = [engine.render(r) for r in requests]
    counter = compile_repeated_blocks(engine.components.dit, backend="aot_eager")
    compiled = [engine.render(r) for r in requests]
    assert counter.graphs == 2, counter.compiles  # Block and RefinerBlock, compiled once each
    assert counter.recompiles == 0, counter.compiles
    for a, b in zip(eager, compiled, strict=True):
        np.testing.assert_array_equal(a.frames, b.frames)
        np.testing.assert_array_equal(a.audio, b.audio)


def test_compile_refuses_a_model_without_repeated_blocks():
    with pytest.raises(ValueError, match="no repeated blocks"):
        compile_repeated_blocks(torch.nn.Linear(2, 2))


def test_every_attention_call_goes_through_the_models_own_kernel(engine):
    """The DiT (blocks and refiner), the video decoder and the audio VAE each attend through the kernel their
    attention modules hold, so the kernel `accel.apply` sets is the one that runs everywhere, for this model only."""
    calls: list[tuple[int, ...]] = []

    def counting(q, k, v, causal):
        calls.append(tuple(q.shape))
        return ops.sdpa(q, k, v, causal)

    other = Engine.load(None, Profile())
    request = engine.validate(RequestFields("a fox", steps=3, seed=1))
    reference = engine.render(request)
    modules = [m for c in (engine.components.dit, engine.components.video_vae, engine.components.audio_vae)
               for m in c.modules() if isinstance(m, attention.MODULES)]  # fmt: skip
    for module in modules:
        module.kernel = counting
    result = engine.render(request)
    dit = engine.components.dit
    assert len(calls) >= len(dit.token_refiner.blocks) + request.forwards * len(dit.blocks) + 1  # + the decoders'
    np.testing.assert_array_equal(result.frames, reference.frames)
    seen = len(calls)
    other.render(other.validate(RequestFields("a fox", steps=3, seed=1)))
    assert len(calls) == seen  # the other engine's models kept their own kernel


def test_attention_registry_has_a_kernel_for_every_backend_name_and_sets_it_per_model(engine):
    from h3serve.accel.profile import Attention

    assert set(attention.KERNELS) == set(Attention) - {Attention.AUTO}  # auto is resolved at start, never run
    video_vae = engine.components.video_vae
    assert attention.set_kernel(video_vae, Attention.CUDNN_ATTN) > 0
    assert all(m.kernel is attention.cudnn_sdpa for m in video_vae.modules() if isinstance(m, attention.MODULES))
    assert all(m.kernel is ops.sdpa for m in engine.components.dit.modules() if isinstance(m, attention.MODULES))
    with pytest.raises(ValueError, match="FLASH4"):
        attention.set_kernel(video_vae, "FLASH4")


def test_modulation_table_has_a_fixed_shape_and_zero_padding(engine):
    dit = engine.components.dit
    block = dit.blocks[0]
    tables = []
    for m in range(1, MAX_TIMESTEPS + 1):
        temb = dit.time_embedder(torch.linspace(0.1, 0.9, m))
        table = block.modulation(temb, dit.compute_dtype)
        assert table.shape == (TABLE_ROWS, 6 * dit.config.hidden_size)
        assert torch.all(table[m * NUM_MODALITIES :] == 0)
        tables.append(table)
    # The first timestep's rows do not depend on which other timesteps share the forward.
    torch.testing.assert_close(tables[0][:NUM_MODALITIES], tables[2][:NUM_MODALITIES], rtol=0, atol=1e-6)


def test_compute_dtype_is_the_norms_not_a_linear_weights(engine):
    dit = engine.components.dit
    assert dit.compute_dtype == torch.float32
    with torch.no_grad():
        dit.blocks[0].attn.qkv_proj.weight.data = dit.blocks[0].attn.qkv_proj.weight.data.to(torch.float64)
    assert dit.compute_dtype == torch.float32  # a linear layer's storage does not decide the activations' dtype


# ---- FP8 block linears (CUTLASS) ----------------------------------------------------------------------------------


def test_fp8_linear_matches_its_dequantized_reference_and_stays_close_to_bf16():
    from h3serve.accel.linear import FP8, Fp8Linear, quantize_weight

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 64, bias=False)
    fp8 = Fp8Linear.from_linear(linear)
    q, _ = quantize_weight(linear.weight)
    assert fp8.weight.dtype == FP8 and fp8.scale.shape == (1, 64)
    # One scale per output channel: each row's largest magnitude lands on e4m3's largest value.
    assert torch.all(q.float().abs().amax(dim=1) == 448.0)
    x = torch.randn(7, 3, 96)
    reference = fp8.reference(x)
    error = ((reference - linear(x)).norm() / linear(x).norm()).item()
    assert 1e-3 < error < 5e-2, error  # FP8 rounding: visible, small
    try:
        out = fp8(x)
    except (RuntimeError, NotImplementedError) as err:  # the CPU build may lack a scaled-mm kernel
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {err}")
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


def test_the_load_hook_quantizes_block_linears_as_they_are_read(tmp_path):
    """Loading with Fp8LoadHook gives, for every block linear, exactly the FP8 weight and scales that quantizing the
    plainly loaded BF16 weight gives, and every other tensor unchanged."""
    import json

    from oracle import oracle

    oracle("diffusers")
    from safetensors.torch import save_file

    from dit_fixtures import reference_dit, reference_state_dict
    from h3serve.accel.linear import Fp8Linear, Fp8LoadHook, quantize_weight
    from h3serve.checkpoint.dit import load_dit

    ref = reference_dit(0)
    save_file(reference_state_dict(ref), tmp_path / "diffusion_pytorch_model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(dict(ref.config)))
    plain = load_dit(tmp_path, dtype=torch.bfloat16)
    hooked = load_dit(tmp_path, dtype=torch.bfloat16, hook=Fp8LoadHook())

    quantized = {n for n, m in hooked.named_modules() if isinstance(m, Fp8Linear)}
    expected = {
        f"{prefix}.{i}.{path}"
        for prefix, blocks in (("blocks", plain.blocks), ("token_refiner.blocks", plain.token_refiner.blocks))
        for i in range(len(blocks))
        for path in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
    }
    assert quantized == expected
    plain_state, hooked_state = plain.state_dict(), hooked.state_dict()
    for name in expected:
        q, scale = quantize_weight(plain_state[f"{name}.weight"])
        assert torch.equal(hooked_state[f"{name}.weight"].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(hooked_state[f"{name}.scale"], scale), name
    others = {k for k in plain_state if k.removesuffix(".weight") not in expected}
    assert others == {k for k in hooked_state if k.rsplit(".", 1)[0] not in expected}
    for k in others:
        assert torch.equal(plain_state[k], hooked_state[k]), k


def test_quantize_blocks_quantizes_every_block_linear_once(engine):
    from h3serve.accel.linear import Fp8Linear, is_quantized, quantize_blocks

    dit = engine.components.dit
    assert not is_quantized(dit)
    assert quantize_blocks(dit) == 4 * (len(dit.blocks) + len(dit.token_refiner.blocks))
    assert is_quantized(dit) and isinstance(dit.blocks[0].mlp.fc2, Fp8Linear)
    assert quantize_blocks(dit) == 0  # already FP8: nothing left to do


def test_cutlass_is_refused_on_the_cpu():
    with pytest.raises(ValueError, match="linear CUTLASS needs a CUDA device"):
        Profile(linear="CUTLASS")


# ---- persistent kernel caches -----------------------------------------------------------------------------------


def test_cache_dir_points_inductor_and_triton_at_one_folder(tmp_path, monkeypatch):
    from torch._inductor.runtime.runtime_utils import cache_dir

    from h3serve.accel.caches import CACHES, SWITCHES, use_cache_dir

    for var in (*CACHES, *SWITCHES):
        monkeypatch.delenv(var, raising=False)
    chosen = use_cache_dir(tmp_path / "kernels")
    folders = {var: str((tmp_path / "kernels" / sub).resolve()) for var, sub in CACHES.items()}
    assert chosen == {**folders, "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}  # FA4 persists only when switched on
    assert all(Path(p).is_dir() for p in folders.values())
    assert cache_dir() == chosen["TORCHINDUCTOR_CACHE_DIR"]  # what Inductor itself will use
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str((tmp_path / "kernels" / "fa4").resolve())
    assert use_cache_dir(tmp_path / "kernels") == chosen  # idempotent


def test_fa4_persistence_switched_off_by_the_operator_is_a_conflict(tmp_path):
    from h3serve.accel.caches import use_cache_dir

    env = {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0"}
    with pytest.raises(ValueError, match="FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1, but it is set to '0'"):
        use_cache_dir(tmp_path / "kernels", environ=env)
    assert env == {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0"}  # nothing set on a refusal


def test_a_conflicting_cache_variable_is_refused(tmp_path):
    from h3serve.accel.caches import use_cache_dir
    from h3serve.settings import SettingsError, load_settings

    env = {"TRITON_CACHE_DIR": str(tmp_path / "elsewhere")}
    with pytest.raises(ValueError, match="TRITON_CACHE_DIR is already set"):
        use_cache_dir(tmp_path / "kernels", environ=env)
    with pytest.raises(SettingsError, match="H3_CACHE_DIR"):
        load_settings(env={**env, "H3_CACHE_DIR": str(tmp_path / "kernels")})
    assert load_settings(env={"H3_CACHE_DIR": str(tmp_path / "kernels")}).cache_dir == tmp_path / "kernels"


def test_inductors_own_default_in_the_environment_is_no_conflict(tmp_path):
    """Importing torch's compiler modules writes Inductor's default folder into the environment; that is replaced,
    an operator's other folder is refused, and `h3serve render` starts with H3_CACHE_DIR set (it once refused to)."""
    import subprocess
    import sys

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from h3serve.accel.caches import use_cache_dir

    env = {"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}
    chosen = use_cache_dir(tmp_path / "kernels", environ=env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == chosen["TORCHINDUCTOR_CACHE_DIR"] != default_cache_dir()
    with pytest.raises(ValueError, match="TORCHINDUCTOR_CACHE_DIR is already set"):
        use_cache_dir(tmp_path / "kernels", environ={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")})
    from h3serve.accel.caches import CACHES

    child = {k: v for k, v in os.environ.items() if not k.startswith("H3_") and k not in CACHES}
    child["H3_CACHE_DIR"] = str(tmp_path / "kernels")
    out = tmp_path / "fox.mp4"
    run = subprocess.run(
        [sys.executable, "-m", "h3serve.cli", "render", "a fox", "--steps", "2", "--no-progress", "-o", str(out)],
        env=child, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0 and out.stat().st_size > 0, run.stderr[-2000:]


def test_text_encoder_fp8_quantizes_the_decoder_layers_only_and_stays_close(engine):
    from h3serve.accel.linear import Fp8Linear, quantize_text_encoder
    from h3serve.pipeline.conditioning import encode_text

    te = engine.components.text_encoder
    before = encode_text(te, "a red fox runs through fresh snow", ()).states
    count = quantize_text_encoder(te)
    layers = te.model.language_model.layers
    assert count == 7 * len(layers)
    in_layers = [m for n, m in te.named_modules() if n.startswith("model.language_model.layers.")]
    assert sum(isinstance(m, Fp8Linear) for m in in_layers) == count
    assert not any(isinstance(m, torch.nn.Linear) for m in in_layers)
    assert not any(isinstance(m, Fp8Linear) for n, m in te.named_modules() if n.startswith("model.visual"))
    try:
        after = encode_text(te, "a red fox runs through fresh snow", ()).states
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {err}")
    # FP8 rounding through every decoder layer of random weights: visible, bounded. (Each Fp8Linear is checked
    # against its exact dequantized reference above; the full-size effect is measured on the GPU.)
    error = ((after - before).norm() / before.norm()).item()
    assert 0 < error < 0.2, error


# ---- AdaLN tables -------------------------------------------------------------------------------------------------


def test_adaln_tables_equal_what_each_forward_computes_and_are_cached(engine):
    """A table made ahead of time is bitwise the one the block makes inside a forward (same projection on the same
    rows); a render through tables equals the render without them; a second request of the schedule reuses them."""
    from h3serve.accel.adaln import AdalnTables
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.sampling import step_timesteps
    from h3serve.pipeline.schedule import DualSchedule

    dit = engine.components.dit
    layout = build_layout([1] * 9, MediaGeometry.from_pixels(128, 224, 22), ("first",))
    schedule = DualSchedule.build(5, 12.0, 3.0)
    steps = step_timesteps(layout, schedule)
    maker = AdalnTables(dit, weights="device")
    tables = maker.for_steps(steps)
    assert len(tables) == 4 and all(len(t) == len(dit.blocks) for t in tables)
    for step, timesteps in enumerate(steps):
        temb = dit.time_embedder(timesteps)
        for b, block in enumerate(dit.blocks):
            assert torch.equal(tables[step][b], block.modulation(temb, dit.compute_dtype)), (step, b)
    assert maker.for_steps(steps) is tables  # cached
    # The off-device path (weights copied in per block, the module's own forward on the copies) gives the same.
    offloaded = AdalnTables(dit, weights="pinned")  # on the CPU both sides are the CPU; copies are made all the same
    offloaded.offloaded = True  # and the tables copied out as on a GPU (into pageable memory here)
    again_tables = offloaded.for_steps(steps)
    assert all(
        torch.equal(a, b) for sa, sb in zip(tables, again_tables, strict=True) for a, b in zip(sa, sb, strict=True)
    )

    request = engine.validate(RequestFields("a fox", steps=5, seed=4))
    with_tables = engine.render(request)
    engine.tables["fl2va"] = AdalnTables(dit, cache_size=0)  # nothing kept: made again every time
    again = engine.render(request)
    np.testing.assert_array_equal(with_tables.frames, again.frames)
    np.testing.assert_array_equal(with_tables.audio, again.audio)
    assert "tables" in with_tables.timings


def test_a_forward_with_tables_is_bitwise_the_forward_without(engine):
    from h3serve.accel.adaln import AdalnTables
    from h3serve.pipeline.sampling import bind_model, step_timesteps

    c = engine.components
    request = engine.validate(RequestFields("a fox", steps=3, seed=5))
    from h3serve.pipeline.conditioning import encode_text
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.schedule import DualSchedule

    text = encode_text(c.text_encoder, request.prompt)
    layout = build_layout(text.token_tags, MediaGeometry.from_pixels(request.height, request.width, 22), ())
    schedule = DualSchedule.build(3, 12.0, 3.0)
    tables = AdalnTables(c.dit, weights="device").for_steps(step_timesteps(layout, schedule))
    g = torch.Generator().manual_seed(0)
    video = torch.randn(layout.num_video_rows, c.dit.config.video_patch_dim, generator=g)
    audio = torch.randn(layout.num_audio_rows, c.dit.config.audio_latents_dim, generator=g)
    ts, idx = layout.timestep_plan(schedule.video.timesteps[1], schedule.audio.timesteps[1])
    plain = bind_model(c.dit, layout, text.states)(video, audio, ts, idx, 1)
    tabled = bind_model(c.dit, layout, text.states, tables)(video, audio, ts, idx, 1)
    assert torch.equal(plain[0], tabled[0]) and torch.equal(plain[1], tabled[1])


def test_memory_budget_counts_the_weights_and_sizes_the_largest_request(engine):
    from h3serve.pipeline.budget import largest_request_rows

    budget = engine.memory_budget()
    c = engine.components
    weights = {name: sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers())) / 2**30
               for name, m in (("dit", c.dit), ("text_encoder", c.text_encoder), ("video_vae", c.video_vae),
                               ("audio_vae", c.audio_vae))}  # fmt: skip
    assert {k: budget.device[k] for k in weights} == pytest.approx(weights, rel=1e-9)
    assert "adaln_weights" not in budget.host  # a CPU engine: nothing is moved off the device
    # The largest request the tiny rules allow: FL2VA (two keyframes), the 16:9 canvas at the area cap, 362 frames.
    assert budget.largest_rows == largest_request_rows(c.dit_config, engine.rules)
    assert budget.largest_rows > largest_request_rows(c.dit_config, engine.rules, text_rows=10)
    assert budget.activations_largest > 0 and budget.device_need > budget.device_weights


def test_decoder_weights_in_the_autocast_dtype_decode_bitwise_the_same_and_leave_the_encoder_alone():
    from h3serve.accel.vae import decoder_weights_to
    from h3serve.model.tiny import TINY_SEED, TINY_VIDEO_VAE, randomize
    from h3serve.model.video_vae import VideoVAE
    from h3serve.pipeline.video_decode import decode

    vae = randomize(VideoVAE(TINY_VIDEO_VAE), TINY_SEED + 1)
    z = torch.randn(1, TINY_VIDEO_VAE.latent_channels, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    # CPU autocast computes linears and convolutions in float16 as CUDA's does; the engine's profile only allows
    # float16 autocast on CUDA, so this calls the pieces directly.
    expected = decode(vae, z, autocast_dtype=torch.float16)
    encoder = {n: p.clone() for n, p in vae.encoder.named_parameters()}
    before = sum(p.numel() * p.element_size() for p in vae.parameters())
    saved = decoder_weights_to(vae, torch.float16)
    assert saved == before - sum(p.numel() * p.element_size() for p in vae.parameters()) > 0
    assert vae.decoder.proj_out.weight.dtype == vae.post_quant_conv.bias.dtype == torch.float16
    # What autocast keeps in float32 stays float32: the norms, the residual scales, the encoder.
    assert vae.decoder.norm_out.weight.dtype == vae.decoder.transformer_blocks[0].scale1.dtype == torch.float32
    assert all(torch.equal(p, encoder[n]) and p.dtype == torch.float32 for n, p in vae.encoder.named_parameters())
    assert torch.equal(decode(vae, z, autocast_dtype=torch.float16), expected)
    with pytest.raises(ValueError, match=r"decode under autocast_dtype=torch\.float16"):
        decode(vae, z)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        decoder_weights_to(vae, torch.float32)


def test_default_schedule_tables_are_made_at_start_for_every_task(engine, monkeypatch):
    from h3serve.accel.adaln import AdalnTables
    from h3serve.config import DEFAULT_STEPS
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.sampling import step_timesteps
    from h3serve.pipeline.schedule import DualSchedule

    monkeypatch.setattr(engine, "tables", {"fl2va": AdalnTables(engine.components.dit, weights="device")})
    assert engine.prepare_tables() > 0
    assert len(engine.tables["fl2va"]._cache) == 2  # no keyframe rows, and keyframe rows (one clock more)
    made = dict(engine.tables["fl2va"]._cache)
    schedule = DualSchedule.build(DEFAULT_STEPS, 12.0, 3.0)
    for anchors, canvas in (((), (128, 224, 22)), (("first", "last"), (224, 128, 39))):  # another shape and prompt
        layout = build_layout([1] * 17, MediaGeometry.from_pixels(*canvas), anchors)
        assert any(engine.tables["fl2va"].for_steps(step_timesteps(layout, schedule)) is t for t in made.values())
    assert len(engine.tables["fl2va"]._cache) == 2  # nothing new was made


def test_eager_precision_keeps_the_bf16_roundings_eager_makes_between_fused_ops():
    """Inductor (on this CPU as on the GPU) fuses a block's pointwise ops and by default skips the bf16 rounding
    between them; `eager_precision` keeps it, so the compiled bf16 forward lands much closer to eager's."""
    from h3serve.accel.compile import uncompile_repeated_blocks
    from h3serve.model.tiny import tiny_components
    from h3serve.pipeline.layout import MediaGeometry, build_layout
    from h3serve.pipeline.sampling import bind_model

    dit = tiny_components(dtype=torch.bfloat16).dit
    layout = build_layout([1] * 20, MediaGeometry.from_pixels(128, 224, 22), ())
    g = torch.Generator().manual_seed(0)
    text = torch.randn(20, dit.config.text_dim, generator=g).to(torch.bfloat16)
    video = torch.randn(layout.num_video_rows, dit.config.video_patch_dim, generator=g)
    audio = torch.randn(layout.num_audio_rows, dit.config.audio_latents_dim, generator=g)
    ts, idx = layout.timestep_plan(0.6, 0.3)

    def forward():
        return bind_model(dit, layout, text)(video, audio, ts, idx, 0)[0].double()

    eager = forward()
    errors = {}
    for keep in (False, True):
        uncompile_repeated_blocks(dit)
        torch._dynamo.reset()
        compile_repeated_blocks(dit, eager_precision=keep)
        errors[keep] = ((forward() - eager).norm() / eager.norm()).item()
    uncompile_repeated_blocks(dit)
    assert errors[True] < errors[False] / 2, errors  # measured: 2.0e-3 against 5.0e-3
    assert not torch._inductor.config.emulate_precision_casts  # scoped to these compiles, not left set


def test_load_hooks_quantize_the_text_encoder_and_dit_as_they_load_exactly_as_after_a_plain_load(tmp_path):
    """The FP8 text encoder made while it loads (`TextFp8LoadHook`) is bitwise the one `quantize_text_encoder` makes
    from a plain load; chained with the AdaLN host hook, the DiT's FP8 block linears are too, and nothing else moves
    (on this CPU the AdaLN weights are already in host memory, so that hook leaves them as they are)."""
    from oracle import oracle

    oracle("diffusers")
    from e2e_fixtures import write_tiny_checkpoint
    from h3serve.accel.adaln import AdalnHostHook
    from h3serve.accel.linear import (
        Fp8Linear,
        Fp8LoadHook,
        TextFp8LoadHook,
        is_text_quantized,
        quantize_blocks,
        quantize_text_encoder,
    )
    from h3serve.checkpoint.folder import load_components, resolve_model_folder
    from h3serve.checkpoint.safetensors import chain

    folder = resolve_model_folder(write_tiny_checkpoint(tmp_path / "FL2VA"))
    plain = load_components(folder, device="cpu", dtype=torch.bfloat16)
    hooked = load_components(
        folder,
        device="cpu",
        dtype=torch.bfloat16,
        dit_hook=chain(Fp8LoadHook(), AdalnHostHook()),
        text_hook=TextFp8LoadHook(),
    )
    count = quantize_text_encoder(plain.text_encoder)
    quantize_blocks(plain.dit)
    assert is_text_quantized(hooked.text_encoder)
    assert count == sum(isinstance(m, Fp8Linear) for m in hooked.text_encoder.modules()) > 0
    for part in ("text_encoder", "dit"):
        a, b = getattr(plain, part).state_dict(), getattr(hooked, part).state_dict()
        assert a.keys() == b.keys(), part
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
