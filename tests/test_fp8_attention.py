"""CUDNN_FP8 on the CPU: the scales' arithmetic by hand, the key smoothing's exactness, the design against the naive
per-tensor scales through the kernel's float32 emulation (`fp8_attention.reference`), and where the backend is
refused. The kernel itself runs on the H200 (tests/test_gpu_fp8_attention.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the naive scales: a benchmark's variant

from lib.variants import naive_quantize

from h3serve.accel import attention, fp8_attention
from h3serve.accel.fp8_attention import E4M3_MAX, Scales, dequantize, quantize, reference
from h3serve.accel.profile import Profile, ProfileError
from h3serve.model import audio_vae, dit, video_vae
from h3serve.settings import SettingsError, load_settings


def test_scales_by_hand_hold_every_heads_logit_scale_equal():
    # amax q = (1, 2), k = (4, 1): products 4 and 2; the first head fills both ranges, the second gives up sqrt(1/2)
    s = Scales.of(torch.tensor([1.0, 2.0]), torch.tensor([4.0, 1.0]), torch.tensor([0.5, 8.0]))
    half = math.sqrt(0.5)
    torch.testing.assert_close(s.q, torch.tensor([448.0, 448.0 * half / 2]))
    torch.testing.assert_close(s.k, torch.tensor([112.0, 448.0 * half]))
    torch.testing.assert_close(s.v, torch.tensor([896.0, 56.0]))
    torch.testing.assert_close(s.descale, torch.tensor([4.0 / 448.0**2]))
    torch.testing.assert_close(s.q * s.k * s.descale, torch.ones(2))  # one descale serves every head


def _qkv(rows: int = 96, heads: int = 4, d: int = 32, key_offset: float = 0.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, rows, heads, d, generator=gen).transpose(1, 2) for _ in range(3))
    # Heads of different sizes, and (optionally) keys that share a per-head offset, as H3's outlier key channels do.
    size = torch.tensor([0.25, 1.0, 3.0, 0.5])[:heads, None, None]
    k = k * size + key_offset * torch.randn(1, heads, 1, d, generator=gen)
    return q * size.flip(0), k, v * size


def test_smoothing_the_keys_is_exact_under_softmax():
    q, k, v = (t.double() for t in _qkv(key_offset=4.0))
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    smoothed = torch.nn.functional.scaled_dot_product_attention(q, k - k.mean(dim=2, keepdim=True), v)
    torch.testing.assert_close(smoothed, plain, rtol=1e-12, atol=1e-12)


def test_quantized_operands_fill_the_range_and_stay_inside_it():
    q, k, v = _qkv(key_offset=4.0)
    q8, k8, v8, scales = quantize(q, k, v)
    for t in (q8, k8, v8):
        assert t.dtype == torch.float8_e4m3fn and t.shape == q.shape and t.stride() == q.stride()  # layout kept
        assert t.float().abs().max() <= E4M3_MAX
    assert q8.float().abs().amax() == E4M3_MAX and k8.float().abs().amax() == E4M3_MAX  # the largest head is full
    assert torch.equal(v8.float().abs().amax(dim=(0, 2, 3)), torch.full((4,), E4M3_MAX))  # V per head
    torch.testing.assert_close(scales.v_mean, v.mean(dim=2, keepdim=True))  # the smoothed V's mean, given back
    assert torch.all(scales.q * scales.k * scales.descale - 1 < 1e-6)


def _emulated(q, k, v, naive: bool) -> torch.Tensor:
    """The backend's output as its float32 emulation computes it (the kernel's own e4m3 output rounding aside); with
    `naive`, over the benchmark's per-tensor scales (bench/lib/variants.py)."""
    q8, k8, v8, scales = (naive_quantize if naive else quantize)(q, k, v)
    return dequantize(reference(q8, k8, v8, scales.descale), scales)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_the_design_ignores_a_shared_key_offset_where_naive_scales_lose_to_it():
    q, k, v = _qkv(rows=256)
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    offset = _qkv(rows=256, key_offset=4.0)[1]  # the same keys plus a per-head offset (softmax ignores it)
    design = [_rel(_emulated(q, keys, v, False), exact) for keys in (k, offset)]
    naive = [_rel(_emulated(q, keys, v, True), exact) for keys in (k, offset)]
    print(f"design {design}, naive {naive}")
    # e4m3's 3 mantissa bits on q and k move a peaked head's logits by ~0.1: ~8% on this random attention
    assert design[0] < 0.1
    assert abs(design[1] - design[0]) < 1e-3 * design[0]  # smoothed keys: the offset costs nothing
    assert design[0] < naive[0]  # per-head scales: the small heads keep more of the range
    assert naive[1] > 1.4 * design[1]  # naive keys spend their range on the offset


def test_smoothing_v_keeps_what_the_rows_share_out_of_the_outputs_range():
    # Values that share a per-head offset (as every row of a modality gets the AdaLN shift), over many keys: the
    # attention averages the rest away, and the offset fills the output's e4m3 range unless it is taken out.
    q, k, v = _qkv(rows=4096)
    q = 0.3 * q  # nearly even attention over many keys, as at the released default shape
    v = v + 3.0 * torch.randn(1, 4, 1, v.shape[-1], generator=torch.Generator().manual_seed(5))
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    signal = exact - v.double().mean(dim=2, keepdim=True)  # what the attention adds to the shared offset
    design, naive = (_emulated(q, k, v, n).double() - exact for n in (False, True))
    print(f"error against what attention adds: design {design.norm() / signal.norm():.4f}, "
          f"naive {naive.norm() / signal.norm():.4f}")  # fmt: skip
    assert design.norm() < 0.1 * signal.norm() and design.norm() < naive.norm() / 2


def test_the_dit_alone_gets_fp8_attention_and_the_decoders_cudnn():
    from h3serve.model.tiny import TINY_DIT, TINY_VIDEO_VAE

    model = torch.nn.ModuleDict({"dit": dit.H3DiT(TINY_DIT), "vae": video_vae.VideoVAE(TINY_VIDEO_VAE)})
    assert attention.set_kernel(model, "CUDNN_FP8") > 0
    kernels = {type(m): m.kernel for m in model.modules() if isinstance(m, attention.MODULES)}
    assert kernels[dit.Attention] is fp8_attention.fp8_sdpa
    assert kernels[video_vae.Attention] is attention.cudnn_sdpa
    assert attention.DIT_ONLY == {"CUDNN_FP8": "CUDNN_ATTN", "FA4": "CUDNN_ATTN"}
    assert audio_vae.CausalAttention in attention.MODULES


def test_fp8_attention_is_refused_where_it_cannot_run():
    with pytest.raises(ProfileError, match="attention CUDNN_FP8 needs a CUDA device"):
        Profile(attention="CUDNN_FP8")
    with pytest.raises(ProfileError, match="attention CUDNN_FP8 has no float32 kernel"):
        Profile(device="cuda", attention="CUDNN_FP8", dtype="float32")
    with pytest.raises(ValueError, match="runs the DiT's unmasked attention only"):
        fp8_attention.fp8_sdpa(*_qkv(), causal=True)
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in fp8_attention.missing()
    with pytest.raises(SettingsError) as err:
        load_settings(
            env={"H3_NUM_GPUS": "2", "H3_DIFFUSION_ATTENTION_BACKEND": "CUDNN_FP8", "H3_DEVICE": "cuda"},
            check_profile=False,
        )
    assert "H3_NUM_GPUS" in str(err.value) and "attention CUDNN_FP8 runs on one GPU only" in str(err.value)
    assert load_settings(env={"H3_DIFFUSION_ATTENTION_BACKEND": "CUDNN_FP8", "H3_DEVICE": "cuda"},
                         check_profile=False).diffusion_attention_backend == "CUDNN_FP8"  # fmt: skip
