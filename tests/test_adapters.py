"""Few-step adapters: every published layout is read and merged into our DiT's weights like the reference does it.

Where diffusers 0.42.1 reads a layout (LightX2V's diffusers names, ComfyUI's fused native names, larryvrh's native
names, ai-toolkit, musubi, DiffSynth), its `MiniMaxH3LoraLoaderMixin` converts the same file, peft loads it into
diffusers' H3 transformer holding our weights, and `fuse_lora` fuses it: that model's forward is the oracle for ours.
The mixin's loading steps are classmethods, so no pipeline object is needed. diffusers reads neither FastH3's
full-rank deltas nor FlashGen's `transformer.`-prefixed native file; for those a merge computed here, with its own
row bookkeeping, is the oracle on the 2-block tiny DiT. The broken cases disable our row reorders and must fail.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_fixtures import FASTH3_IDENTITY, FLASHGEN_SCHEDULE, FORMATS, write_adapter
from dit_fixtures import (
    TINY_DIFFUSERS_CONFIG,
    is_ref_fp32,
    packed_inputs,
    reference_state_dict,
    rel_err,
)
from h3serve.checkpoint.adapters import (
    AdapterError,
    AdapterMerge,
    Preset,
    merge_into,
    read_adapter,
)
from h3serve.checkpoint.adapters import read as adapter_reader
from h3serve.checkpoint.dit import load_dit
from h3serve.config import DiTConfig
from h3serve.model.tiny import TINY_DIT, tiny_dit
from h3serve.settings import parse_lora_setting
from oracle import oracle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # lib.export: our DiT as checkpoints hold it
from lib.export import export_state_dict

# diffusers config names. 128-wide heads because diffusers' DiffSynth de-interleave assumes the released head width;
# two heads, so that the per-head interleave is not its own inverse; widths all differ.
ORACLE_CONFIG = {**TINY_DIFFUSERS_CONFIG, "attention_head_dim": 128, "hidden_size": 40, "ffn_dim": 56, "text_dim": 12}
DIFFUSERS_READS = ("lightx2v-diffusers", "comfyui-fused", "native", "ai-toolkit", "musubi", "diffsynth")
SCALE = 0.7


def identity(t, *_):
    return t


# --------------------------------------------------------------------------------- diffusers as the oracle


def reference_model():
    """diffusers' H3 transformer with fixed random weights, bf16-valued outside the fp32 islands."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(0)
    ref = MiniMaxH3Transformer3DModel(**ORACLE_CONFIG).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.ndim > 1 else 0.5) + (1.0 if "norm" in name else 0.0))
            if not is_ref_fp32(name):
                p.copy_(p.to(torch.bfloat16).float())
    return ref


@pytest.fixture(scope="module")
def oracle_setup(tmp_path_factory):
    """(folder of the reference's weights in the diffusers layout, our config, packed inputs, base outputs)."""
    oracle("diffusers")
    oracle("peft")  # diffusers loads LoRAs through peft
    folder = tmp_path_factory.mktemp("reference")
    ref = reference_model()
    save_file(reference_state_dict(ref), folder / "diffusion_pytorch_model.safetensors")
    (folder / "config.json").write_text(json.dumps(dict(ref.config)))
    inputs = packed_inputs(cfg=ORACLE_CONFIG)
    with torch.no_grad():
        base = ref(**inputs.reference_kwargs(), return_dict=False)
    return folder, DiTConfig.from_dict(ORACLE_CONFIG), inputs, (base[0][0], base[1][0])


def diffusers_fused(file: Path, scale: float):
    """The reference with `file` loaded by diffusers' H3 LoRA loader and fused at `scale`."""
    from diffusers.loaders import MiniMaxH3LoraLoaderMixin

    ref = reference_model()
    state_dict, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(str(file), return_lora_metadata=True)
    MiniMaxH3LoraLoaderMixin.load_lora_into_transformer(state_dict, transformer=ref, metadata=metadata)
    ref.fuse_lora(lora_scale=scale)
    return ref


def compare_with_diffusers(oracle_setup, tmp_path, fmt: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(our merged forward's errors against diffusers' fused one, how far the adapter moved diffusers' output)."""
    folder, cfg, inputs, base = oracle_setup
    file = write_adapter(tmp_path, fmt, cfg)
    ours = load_dit(folder, dtype=torch.float32)
    merge_into(ours, [read_adapter(file, SCALE, config=cfg)])
    ref = diffusers_fused(file, SCALE)
    with torch.no_grad():
        expected = ref(**inputs.reference_kwargs(), return_dict=False)
        video, audio = inputs.run_ours(ours)
    errors = rel_err(video, expected[0][0]), rel_err(audio, expected[1][0])
    moved = rel_err(base[0], expected[0][0]), rel_err(base[1], expected[1][0])
    return errors, moved


@pytest.mark.parametrize("fmt", DIFFUSERS_READS)
def test_merge_matches_diffusers_fused_lora(oracle_setup, tmp_path, fmt):
    errors, moved = compare_with_diffusers(oracle_setup, tmp_path, fmt)
    assert min(moved) > 0.05, ("the adapter hardly changes the output, so the comparison would prove little", moved)
    assert max(errors) < 1e-5, errors


@pytest.mark.parametrize(
    ("fmt", "broken"),
    [
        ("lightx2v-diffusers", "swap_halves"),  # ff.net.0.proj B halves left [value; gate]
        ("diffsynth", "deinterleave_qkv"),  # interleaved QKV rows treated as stacked
    ],
)
def test_wrong_row_order_differs_from_diffusers(oracle_setup, tmp_path, monkeypatch, fmt, broken):
    monkeypatch.setattr(adapter_reader, broken, identity)
    errors, _ = compare_with_diffusers(oracle_setup, tmp_path, fmt)
    assert min(errors) > 1e-2, (broken, errors)


# ------------------------------------------------------------------ merges computed here (diffusers reads neither)


def stacked_qkv_rows(b: torch.Tensor, heads: int) -> torch.Tensor:
    """Per-head `[h: q k v]` rows -> `[q_all; k_all; v_all]`, copied block by block."""
    d = b.shape[0] // (3 * heads)
    out = torch.empty_like(b)
    for h in range(heads):
        for s in range(3):
            out[(s * heads + h) * d : (s * heads + h + 1) * d] = b[(h * 3 + s) * d : (h * 3 + s + 1) * d]
    return out


def expected_merge(base: dict, terms: list[tuple[str, int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """base plus each (target, first row, delta), in float64."""
    out = {k: v.double().clone() for k, v in base.items()}
    for target, row, delta in terms:
        out[target][row : row + delta.shape[0]] += delta.double()
    return out


def assert_weights(model, expected: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
    for name, tensor in model.state_dict().items():
        if torch.equal(expected[name], base[name].double()):
            assert torch.equal(tensor, base[name]), f"{name} changed though nothing targets it"
        else:
            torch.testing.assert_close(tensor.double(), expected[name], atol=2e-6, rtol=0, msg=name)


def flashgen_terms(file: Path, cfg: DiTConfig, scale: float) -> list[tuple[str, int, torch.Tensor]]:
    tensors = load_file(file)
    terms = []
    for key in sorted(k for k in tensors if k.endswith(".lora_B.default.weight")):
        module = key.removeprefix("transformer.").removesuffix(".lora_B.default.weight")
        up, down = tensors[key].double(), tensors[key.replace("lora_B", "lora_A")].double()
        if module.endswith("qkv_proj"):
            up = stacked_qkv_rows(up, cfg.num_attention_heads)
        terms.append((f"{module}.weight", 0, scale * (up @ down)))  # lora_alpha == rank
    return terms


def fasth3_terms(file: Path, cfg: DiTConfig, scale: float) -> list[tuple[str, int, torch.Tensor]]:
    """FastH3's diffusers-named factors and deltas placed by hand: q/k/v into their rows, fc1 halves swapped."""
    renames = {
        "transformer_blocks.": "blocks.",
        "token_refiner.refiner_blocks.": "token_refiner.blocks.",
        "proj_in": "video_patch_proj",
        "audio_proj_in": "audio_patch_proj",
        "proj_out": "final_layer.video_out",
        "norm_out.norm": "final_layer.norm",
        "norm_out.linear": "final_layer.adaln_proj.linear",
    }
    inner = cfg.inner_dim
    tensors = load_file(file)
    terms = []
    for key, value in sorted(tensors.items()):
        module, _, role = key.rpartition(".lora_") if ".lora_" in key else key.rpartition(".")
        if role == "A.weight":
            continue
        for theirs, ours in renames.items():
            if module.startswith(theirs):
                module = ours + module[len(theirs) :]
        row = 0
        for i, p in enumerate("qkv"):
            if module.endswith(f"attn.to_{p}"):
                module, row = module.replace(f"attn.to_{p}", "attn.qkv_proj"), i * inner
        module = module.replace("attn.to_out.0", "attn.out_proj").replace("ff.net.0.proj", "mlp.fc1")
        module = module.replace("ff.net.2", "mlp.fc2")
        if role == "B.weight":
            up = value.double()
            if module.endswith("mlp.fc1"):
                half = up.shape[0] // 2
                up = torch.cat((up[half:], up[:half]))
            delta = up @ tensors[key.replace("lora_B", "lora_A")].double()
        else:
            delta = value.double()
        terms.append((f"{module}.{'bias' if role == 'diff_b' else 'weight'}", row, scale * delta))
    return terms


@pytest.mark.parametrize("broken", [None, "deinterleave_qkv"])
def test_flashgen_native_merge_by_hand(tmp_path, monkeypatch, broken):
    file = write_adapter(tmp_path, "flashgen-native", TINY_DIT)
    model = tiny_dit()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    expected = expected_merge(base, flashgen_terms(file, TINY_DIT, 0.6))
    if broken:
        monkeypatch.setattr(adapter_reader, broken, identity)
    merge_into(model, [read_adapter(file, 0.6, config=TINY_DIT)])
    if broken is None:
        assert_weights(model, expected, base)
    else:
        with pytest.raises(AssertionError):
            assert_weights(model, expected, base)


@pytest.mark.parametrize("broken", [None, "swap_halves"])
def test_fasth3_merge_by_hand(tmp_path, monkeypatch, broken):
    file = write_adapter(tmp_path, "fasth3", TINY_DIT)
    model = tiny_dit()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    terms = fasth3_terms(file, TINY_DIT, 0.6)
    assert {t for t, _, d in terms if d.ndim == 1} >= {"blocks.0.norm1.weight", "final_layer.video_out.bias"}
    expected = expected_merge(base, terms)
    if broken:
        monkeypatch.setattr(adapter_reader, broken, identity)
    merge_into(model, [read_adapter(file, 0.6, config=TINY_DIT)])
    if broken is None:
        assert_weights(model, expected, base)
    else:
        with pytest.raises(AssertionError):
            assert_weights(model, expected, base)


# ------------------------------------------------------------------------------------- recognition and presets


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pdd"])
def test_each_format_is_recognised(tmp_path, fmt):
    adapter = read_adapter(write_adapter(tmp_path, fmt, TINY_DIT), config=TINY_DIT)
    assert adapter.format == fmt
    assert adapter.targets > 0 and adapter.ranks
    line = adapter.describe()
    assert "\n" not in line and f"{fmt}.safetensors" in line and fmt in line and "targets" in line


def test_scales_follow_alpha_rules(tmp_path):
    def scales(fmt, **kw):
        return read_adapter(write_adapter(tmp_path, fmt, TINY_DIT, **kw), config=TINY_DIT).alpha_scale

    assert scales("lightx2v-diffusers") == (2.0,)  # metadata alpha 8 / rank 4
    assert scales("lightx2v-diffusers", metadata={"alpha": None}) == (1.0,)  # no alpha: 1
    assert scales("comfyui-fused") == (0.5,)  # rank 12 QKV with alpha 6, rank 4 elsewhere with alpha 2
    assert scales("ai-toolkit") == (2.0,)
    assert scales("musubi") == (0.25,)
    assert scales("native") == (1.0,)
    assert scales("flashgen-native", metadata={"lora_alpha": "2"}) == (0.5,)
    with pytest.raises(AdapterError, match="lora_rank=9"):
        scales("flashgen-native", metadata={"lora_rank": "9"})


@pytest.mark.parametrize(
    ("name", "fmt", "preset"),
    [
        (
            "minimax_h3_fl2v_turbo_8step_v1.0_768p_bf16.safetensors",
            "lightx2v-diffusers",
            Preset(9, 6.0, 3.0, dit_kind="fl2va"),
        ),
        (
            "minimax_h3_fl2v_turbo_8step_v1.0_bf16.safetensors",
            "lightx2v-diffusers",
            Preset(9, 12.0, 3.0, dit_kind="fl2va"),
        ),
        (
            "minimax_h3_ref2v_turbo_8step_v1.0_768p_comfyui_bf16.safetensors",
            "comfyui-fused",
            Preset(9, 6.0, 3.0, dit_kind="ref2va"),
        ),
        (
            "minimax_h3_fl2v_turbo_4step_v1.2_768p_comfyui_bf16.safetensors",
            "comfyui-fused",
            Preset(5, 6.0, 3.0, dit_kind="fl2va"),
        ),
        ("my_turbo.safetensors", "lightx2v-diffusers", None),  # alpha 8: one of four variants
        ("my_turbo.safetensors", "comfyui-fused", None),
    ],
)
def test_lightx2v_presets(tmp_path, name, fmt, preset):
    adapter = read_adapter(write_adapter(tmp_path / name, fmt, TINY_DIT), config=TINY_DIT)
    assert adapter.preset == preset
    if preset is None:
        assert "preset: unknown" in adapter.describe()


def test_presets_from_metadata_and_signature(tmp_path):
    def read(fmt, name, **kw):
        return read_adapter(write_adapter(tmp_path / name, fmt, TINY_DIT, **kw), config=TINY_DIT)

    four = read("lightx2v-diffusers", "a.safetensors", rank=128, metadata={"alpha": "128"})
    assert four.preset == Preset(5, 6.0, 3.0, dit_kind="fl2va")  # only 4-step v1.0/v1.1 768p have alpha 128
    assert read("lightx2v-diffusers", "b.safetensors", rank=128, metadata={"alpha": "8"}).preset is None
    assert read("native", "c.safetensors", rank=64).preset == Preset(9, 12.0, 3.0)  # larryvrh: 64 / AdaLN 16
    assert read("native", "d.safetensors", rank=8).preset is None
    fast = read("fasth3", "e.safetensors")
    assert fast.preset == Preset(5, 12.0, 3.0, sigmas=(0.999, 0.749, 0.5, 0.25, 0.0), tasks=("t2va",), dit_kind="fl2va")
    other = read("fasth3", "f.safetensors", metadata={"finetuned_model": "someone/fasth3-style"})
    assert (other.format, other.preset) == ("fastvideo", None)
    flash = read("flashgen-native", "g.safetensors")
    sigmas = tuple(float(s) for s in FLASHGEN_SCHEDULE.split(","))
    assert flash.preset == Preset(5, None, None, sigmas=sigmas, tasks=("t2va",), dit_kind="fl2va")
    with pytest.raises(AdapterError, match="base_schedule"):
        read("flashgen-native", "h.safetensors", metadata={"base_schedule": "1.0,0.4,0.6,0.0"})
    assert FASTH3_IDENTITY in fast.describe()


def test_touches_adaln(tmp_path):
    assert read_adapter(write_adapter(tmp_path, "native", TINY_DIT), config=TINY_DIT).touches_adaln
    assert not read_adapter(write_adapter(tmp_path, "diffsynth", TINY_DIT), config=TINY_DIT).touches_adaln


# --------------------------------------------------------------------------------------------------- refusals


def refused(path: Path, **kw) -> AdapterError:
    with pytest.raises(AdapterError) as info:
        read_adapter(path, config=TINY_DIT, **kw)
    assert str(path) in str(info.value) and info.value.path == path
    return info.value


def test_refuses_unknown_format(tmp_path):
    path = tmp_path / "random.safetensors"
    save_file({"model.layers.0.mlp.weight": torch.randn(4, 4), "lm_head.weight": torch.randn(4, 4)}, path)
    err = refused(path)
    assert err.key is None and "not an H3 adapter" in str(err)
    path = write_adapter(tmp_path / "kf.safetensors", "native", TINY_DIT, metadata={"key_format": "minimax-h4"})
    assert "minimax-h4" in str(refused(path))


def test_refuses_pruned_base_adaln_shape(tmp_path):
    key = "blocks.0.adaln_proj.linear.lora_B.weight"
    pruned = torch.randn(6 * TINY_DIT.hidden_size, 1).to(torch.bfloat16)  # an AdaLN of one modality, not three
    err = refused(write_adapter(tmp_path, "native", TINY_DIT, tensors={key: pruned}))
    assert err.key == key
    assert "[288, 1]" in str(err) and "[864, 24]" in str(err) and "pruned" in str(err)


def test_refuses_module_the_dit_lacks(tmp_path):
    extra = {
        "blocks.7.attn.qkv_proj.lora_A.weight": torch.randn(4, 48),
        "blocks.7.attn.qkv_proj.lora_B.weight": torch.randn(192, 4),
    }
    err = refused(write_adapter(tmp_path, "native", TINY_DIT, tensors=extra))
    assert err.key in extra and "does not have" in str(err) and "2 blocks" in str(err)
    extra = {"transformer_blocks.0.attn.to_gate_compress.set_weight": torch.randn(2, 48)}
    err = refused(write_adapter(tmp_path, "fasth3", TINY_DIT, tensors=extra))
    assert err.key in extra and "sparse-attention" in str(err)


def test_refuses_pdd(tmp_path):
    err = refused(write_adapter(tmp_path, "pdd", TINY_DIT))
    assert "PDD" in str(err) and "model variant" in str(err)


def test_refuses_half_a_pair_and_misfit_rank(tmp_path):
    key = "blocks.0.mlp.fc2.lora_B.weight"
    err = refused(write_adapter(tmp_path, "native", TINY_DIT, tensors={key: None}))
    assert err.key == "blocks.0.mlp.fc2.lora_A.weight" and "both LoRA factors" in str(err)
    err = refused(write_adapter(tmp_path, "native", TINY_DIT, tensors={key: torch.randn(48, 5)}))
    assert err.key == key and "[48, 5]" in str(err) and "[48, 80]" in str(err)


def test_refusal_leaves_the_model_unchanged(tmp_path):
    model = tiny_dit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    good = read_adapter(write_adapter(tmp_path / "a.safetensors", "native", TINY_DIT), config=TINY_DIT)
    wider = dataclasses.replace(TINY_DIT, ffn_hidden_size=96)
    other = read_adapter(write_adapter(tmp_path / "b.safetensors", "native", wider), config=wider)
    with pytest.raises(AdapterError, match=r"mlp\.fc1\.weight \[192, 48\]; this model's is \[160, 48\]"):
        merge_into(model, [good, other])  # `good` alone would merge: nothing may change before all is checked
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/models/turbo.safetensors", (Path("/models/turbo.safetensors"), 1.0)),
        ("/models/turbo.safetensors:0.75", (Path("/models/turbo.safetensors"), 0.75)),
        ("turbo.safetensors:-1e-1", (Path("turbo.safetensors"), -0.1)),
        ("/data:v2/turbo.safetensors", (Path("/data:v2/turbo.safetensors"), 1.0)),
        ("/data/a:b.safetensors:1", (Path("/data/a:b.safetensors"), 1.0)),
    ],
)
def test_parse_lora_setting(value, expected):
    assert parse_lora_setting(value) == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "empty"),
        ("turbo.safetensors:", "nothing after"),
        ("turbo.safetensors:strong", '"strong" is not a number'),
        (":0.5", "no path"),
        ("turbo.safetensors:nan", '"nan" is not a number'),  # ASCII digits only (errors.decimal_number)
        ("turbo.safetensors:1e999", "finite"),
    ],
)
def test_parse_lora_setting_refuses(value, why):
    with pytest.raises(ValueError, match=why):
        parse_lora_setting(value)


# ------------------------------------------------------------------------------------ stacking and the load hook


def test_stacked_adapters_sum_their_deltas(tmp_path):
    a = read_adapter(write_adapter(tmp_path, "lightx2v-diffusers", TINY_DIT, seed=1), 0.7, config=TINY_DIT)
    b = read_adapter(write_adapter(tmp_path, "musubi", TINY_DIT, seed=2), -0.5, config=TINY_DIT)
    base = tiny_dit().state_dict()
    merged = {}
    for name, chosen in (("a", [a]), ("b", [b]), ("ab", [a, b])):
        model = tiny_dit()
        merge_into(model, chosen)
        merged[name] = model.state_dict()
    both = set(a.shapes) & set(b.shapes)
    assert "blocks.0.attn.qkv_proj.weight" in both
    for name, w in base.items():
        expected = w + (merged["a"][name] - w) + (merged["b"][name] - w)
        torch.testing.assert_close(merged["ab"][name], expected, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_hook_equals_merge_into(tmp_path, dtype):
    file = tmp_path / "dit.safetensors"
    save_file(export_state_dict(tiny_dit(), "stacked"), file)
    chosen = [
        read_adapter(write_adapter(tmp_path, "fasth3", TINY_DIT), 0.8, config=TINY_DIT),
        read_adapter(write_adapter(tmp_path, "native", TINY_DIT), 1.3, config=TINY_DIT),
    ]
    hooked = load_dit(file, config=TINY_DIT, dtype=dtype, qkv_layout="stacked", hook=AdapterMerge(chosen))
    plain = load_dit(file, config=TINY_DIT, dtype=dtype, qkv_layout="stacked")
    merge_into(plain, chosen)
    changed = 0
    for name, tensor in plain.state_dict().items():
        assert torch.equal(hooked.state_dict()[name], tensor), name
        assert tensor.dtype == hooked.state_dict()[name].dtype
        changed += name in chosen[0].shapes or name in chosen[1].shapes
    assert changed == len(set(chosen[0].shapes) | set(chosen[1].shapes))


def test_load_hook_refuses_a_checkpoint_of_another_shape(tmp_path):
    wider = dataclasses.replace(TINY_DIT, ffn_hidden_size=96)
    hook = AdapterMerge([read_adapter(write_adapter(tmp_path, "native", wider), config=wider)])
    with pytest.raises(AdapterError, match=r"checkpoint's is \[160, 48\]"):
        hook.transform("blocks.0.mlp.fc1.weight", torch.zeros(160, 48))
    out = hook.transform("rope.inv_freq", torch.ones(4))
    assert list(out) == ["rope.inv_freq"]
