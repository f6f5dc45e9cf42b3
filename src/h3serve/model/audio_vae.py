"""MiniMax-H3 audio VAE: DAC-style waveform encoder and BigVGAN decoder, mono at 32 kHz, hop 800 (40 latents/s).

Stereo travels as two batch items (L, R) through the same weights. Parameter names are those of the checkpoint,
which the original and diffusers layouts share: weight-normed convolutions keep `weight_g` / `weight_v`, and the
Kaiser low-pass `filter` buffers of the alias-free activations are stored (and loaded) rather than recomputed.

Runs in fp32 only: the weight-normed DAC/BigVGAN stack loses about 20 dB of level in bf16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from h3serve.config import SAMPLE_RATE, from_diffusers_keys
from h3serve.model.latents import HasLatentStats
from h3serve.model.ops import AttentionKernel, attention, sdpa


@dataclass(frozen=True, kw_only=True)
class AudioVAEConfig(HasLatentStats):
    """Field names are the keys of the diffusers `audio_vae/config.json`; `from_original` maps the original
    `audio_vae/metadata.json` + `config.json` (which hard-code the resblock tables and head count)."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    num_attention_heads: int = 8
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sampling_rate: int = SAMPLE_RATE
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("encoder_rates", "decoder_rates", "decoder_kernel_sizes", "resblock_kernel_sizes"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        object.__setattr__(
            self, "resblock_dilation_sizes", tuple(tuple(int(d) for d in ds) for ds in self.resblock_dilation_sizes)
        )

        for name in ("encoder_dim", "latent_dim", "latent_channels", "num_attention_heads", "decoder_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"AudioVAEConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.sampling_rate, int) or self.sampling_rate <= 0:
            raise ValueError(f"sampling_rate must be a positive int, got {self.sampling_rate!r}")
        if not self.encoder_rates or not self.decoder_rates or any(r <= 0 for r in self.encoder_rates):
            raise ValueError("encoder_rates / decoder_rates must be non-empty and positive")
        if math.prod(self.decoder_rates) != self.hop_length:
            raise ValueError(
                f"decoder_rates upsample by {math.prod(self.decoder_rates)}, encoder hop is {self.hop_length}"
            )
        if len(self.decoder_kernel_sizes) != len(self.decoder_rates):
            raise ValueError("decoder_kernel_sizes needs one entry per decoder rate")
        if any(k < r for k, r in zip(self.decoder_kernel_sizes, self.decoder_rates, strict=True)):
            raise ValueError("each decoder kernel must be at least as long as its rate")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError(f"decoder_dim {self.decoder_dim} cannot be halved {len(self.decoder_rates)} times")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes) or not self.resblock_kernel_sizes:
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes must pair up")
        if any(k % 2 == 0 for k in self.resblock_kernel_sizes):
            raise ValueError("resblock kernels must be odd ('same' padding)")
        if self.latent_dim % self.num_attention_heads:
            raise ValueError("latent_dim must be divisible by num_attention_heads")
        if self.latent_dim % self.latent_channels:
            raise ValueError("latent_dim must be a multiple of latent_channels")
        self._check_latent_stats()

    @property
    def hop_length(self) -> int:
        return math.prod(self.encoder_rates)

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> AudioVAEConfig:
        return from_diffusers_keys(cls, dict(config), "audio VAE")

    @classmethod
    def from_original(cls, metadata: Mapping[str, Any], wrapper: Mapping[str, Any]) -> AudioVAEConfig:
        """`metadata` is `audio_vae/metadata.json`, `wrapper` is `audio_vae/config.json`."""
        kwargs = metadata["metadata"]["kwargs"]
        if kwargs.get("decoder_type") != "bigvgan":
            raise ValueError(f"audio_vae decoder_type {kwargs.get('decoder_type')!r} is not supported (bigvgan only)")
        if not kwargs.get("attn_proj", False):
            raise ValueError("audio_vae without the attention latent projection (attn_proj) is not supported")
        channels = kwargs["vae_latent_channels"]
        if wrapper.get("latent_channels", channels) != channels:
            raise ValueError("audio_vae config.json latent_channels disagrees with metadata.json")
        if wrapper.get("sample_rate", kwargs["sample_rate"]) != kwargs["sample_rate"]:
            raise ValueError("audio_vae config.json sample_rate disagrees with metadata.json")
        return cls(
            encoder_dim=kwargs["encoder_dim"],
            encoder_rates=kwargs["encoder_rates"],
            latent_dim=kwargs["latent_dim"],
            latent_channels=channels,
            decoder_dim=kwargs["decoder_dim"],
            decoder_rates=kwargs["decoder_rates"],
            # The original hard-codes its BigVGAN tables; both pair rate u with kernel 2u (even u) or 2u - 1 (odd).
            decoder_kernel_sizes=[2 * r - r % 2 for r in kwargs["decoder_rates"]],
            sampling_rate=kwargs["sample_rate"],
            latents_mean=wrapper["latents_mean"],
            latents_std=wrapper["latents_std"],
        )


# ----------------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------------
def _weight_norm(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # w = g * v / ||v||, the norm over every dim but 0 (torch.nn.utils.weight_norm's default dim=0).
    return v * (g / torch.linalg.vector_norm(v, dim=tuple(range(1, v.ndim)), keepdim=True))


class WNConv1d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, *, stride: int = 1, dilation: int = 1, padding: int = 0,
                 bias: bool = True):  # fmt: skip
        super().__init__()
        self.stride, self.dilation, self.padding = stride, dilation, padding
        self.weight_g = nn.Parameter(torch.ones(cout, 1, 1))
        self.weight_v = nn.Parameter(torch.empty(cout, cin, kernel))
        self.bias = nn.Parameter(torch.zeros(cout)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _weight_norm(self.weight_v, self.weight_g)
        return F.conv1d(x, w, self.bias, self.stride, self.padding, self.dilation)


class WNConvTranspose1d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int, padding: int):
        super().__init__()
        self.stride, self.padding = stride, padding
        self.weight_g = nn.Parameter(torch.ones(cin, 1, 1))  # transposed weights are (in, out, k): norm per input
        self.weight_v = nn.Parameter(torch.empty(cin, cout, kernel))
        self.bias = nn.Parameter(torch.zeros(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _weight_norm(self.weight_v, self.weight_g)
        return F.conv_transpose1d(x, w, self.bias, self.stride, self.padding)


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass, (1, 1, kernel), normalised to unit DC gain. The checkpoint stores these; this
    only gives a freshly built module sensible values (and lets a test check the stored ones)."""
    half = kernel // 2
    atten = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if atten > 50.0:
        beta = 0.1102 * (atten - 8.7)
    elif atten >= 21.0:
        beta = 0.5842 * (atten - 21) ** 0.4 + 0.07886 * (atten - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel, beta=beta, periodic=False)
    t = torch.arange(-half, half) + 0.5 if kernel % 2 == 0 else torch.arange(kernel) - half
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * t)
    return (taps / taps.sum()).view(1, 1, kernel)


class UpSample1d(nn.Module):
    """Alias-free `ratio`x upsampler: zero-stuffing via a depthwise transposed conv with the Kaiser filter."""

    def __init__(self, ratio: int = 2, kernel: int = 12):
        super().__init__()
        self.ratio = ratio
        self.pad = kernel // ratio - 1
        self.crop_left = self.pad * ratio + (kernel - ratio) // 2
        self.crop_right = self.pad * ratio + (kernel - ratio + 1) // 2
        self.register_buffer("filter", kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = self.ratio * F.conv_transpose1d(x, self.filter.expand(c, -1, -1), stride=self.ratio, groups=c)
        return x[..., self.crop_left : x.shape[-1] - self.crop_right]  # (B, C, ratio * L)


class LowPassFilter1d(nn.Module):
    def __init__(self, ratio: int = 2, kernel: int = 12):
        super().__init__()
        self.stride = ratio
        self.pad_left = kernel // 2 - int(kernel % 2 == 0)
        self.pad_right = kernel // 2
        self.register_buffer("filter", kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, self.filter.expand(c, -1, -1), stride=self.stride, groups=c)  # (B, C, L / ratio)


class DownSample1d(nn.Module):
    def __init__(self, ratio: int = 2, kernel: int = 12):
        super().__init__()
        self.lowpass = LowPassFilter1d(ratio, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class SnakeBeta(nn.Module):
    """x + sin^2(e^alpha x) / e^beta; alpha and beta are stored in log space."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (beta + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class Activation1d(nn.Module):
    """SnakeBeta at twice the rate: its harmonics would alias at the base rate."""

    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = UpSample1d()
        self.downsample = DownSample1d()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


class AMPBlock(nn.Module):
    """BigVGAN AMP block: per dilation, act -> dilated conv -> act -> conv, added to the input."""

    def __init__(self, channels: int, kernel: int, dilations: Sequence[int]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            [WNConv1d(channels, channels, kernel, dilation=d, padding=d * (kernel - 1) // 2) for d in dilations]
        )
        self.convs2 = nn.ModuleList(
            [WNConv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations]
        )
        self.activations = nn.ModuleList([Activation1d(channels) for _ in range(2 * len(dilations))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m, (c1, c2) in enumerate(zip(self.convs1, self.convs2, strict=True)):
            x = x + c2(self.activations[2 * m + 1](c1(self.activations[2 * m](x))))
        return x


class BigVGANDecoder(nn.Module):
    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        ch = cfg.decoder_dim
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.conv_pre = WNConv1d(cfg.latent_dim, ch, 7, padding=3)
        # Each upsampler sits in a one-element ModuleList in the checkpoint (`ups.{i}.0`).
        self.ups = nn.ModuleList(
            [
                nn.ModuleList([WNConvTranspose1d(ch >> i, ch >> (i + 1), k, r, (k - r) // 2)])
                for i, (r, k) in enumerate(zip(cfg.decoder_rates, cfg.decoder_kernel_sizes, strict=True))
            ]
        )
        self.resblocks = nn.ModuleList(
            [
                AMPBlock(ch >> (i + 1), k, d)
                for i in range(len(cfg.decoder_rates))
                for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
            ]
        )
        out_ch = ch >> len(cfg.decoder_rates)
        self.activation_post = Activation1d(out_ch)
        self.conv_post = WNConv1d(out_ch, 1, 7, padding=3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_pre(x)  # (B, decoder_dim, N)
        for i, up in enumerate(self.ups):
            x = up[0](x)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            acc = blocks[0](x)
            for block in blocks[1:]:
                acc = acc + block(x)
            x = acc / self.num_kernels  # multi-receptive-field fusion: the mean of the AMP blocks
        x = self.conv_post(self.activation_post(x))  # (B, 1, N * hop)
        return x.clamp(-1.0, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# Encoder (needed for reference audio only)
# ----------------------------------------------------------------------------------------------------------------
class Snake1d(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            WNConv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation),
            Snake1d(dim),
            WNConv1d(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        crop = (x.shape[-1] - y.shape[-1]) // 2
        if crop > 0:
            x = x[..., crop:-crop]
        return x + y


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int):
        super().__init__()
        half = dim // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1),
            ResidualUnit(half, 3),
            ResidualUnit(half, 9),
            Snake1d(half),
            WNConv1d(half, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class DACEncoder(nn.Module):
    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        dim = cfg.encoder_dim
        layers: list[nn.Module] = [WNConv1d(1, dim, 7, padding=3)]
        for stride in cfg.encoder_rates:
            dim *= 2
            layers.append(EncoderBlock(dim, stride))
        layers += [Snake1d(dim), WNConv1d(dim, cfg.latent_dim, 3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)  # (B, 1, L) -> (B, latent_dim, L / hop)


class CausalAttention(nn.Module):
    """Causal attention that narrows the width: heads are averaged, not concatenated, and the head width is then
    average-pooled down to `out_dim`. The key bias is a stored zero buffer."""

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.heads, self.out_dim = heads, out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)
        self.kernel: AttentionKernel = sdpa  # set from outside (`h3serve.accel.apply`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat([self.q_bias, self.zero_k_bias, self.v_bias]))
        q, k, v = qkv.view(b, s, 3, self.heads, d // self.heads).unbind(2)  # (B, S, nh, hd) each
        out = attention(q, k, v, causal=True, kernel=self.kernel).mean(dim=2)  # (B, S, hd)
        return self.proj(F.adaptive_avg_pool1d(out, self.out_dim))  # (B, S, out_dim)


class GeGLUMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0 = nn.Linear(dim, hidden)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class AttnProjection(nn.Module):
    """`pre_block`: latent_dim -> latent_channels through a residual causal-attention block and a GeGLU MLP."""

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.attn = CausalAttention(in_dim, out_dim, heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim)
        self.norm2 = nn.LayerNorm(out_dim)
        self.mlp = GeGLUMlp(out_dim, 2 * out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AudioVAE(nn.Module):
    def __init__(self, cfg: AudioVAEConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.latent_channels
        self.encoder = DACEncoder(cfg)
        self.pre_block = AttnProjection(cfg.latent_dim, c, cfg.num_attention_heads)
        self.mean_proj = nn.Conv1d(c, c, 1)
        self.logs_proj = nn.Conv1d(c, c, 1)
        self.dec_in_proj = nn.Conv1d(c, cfg.latent_dim, 1)
        self.decoder = BigVGANDecoder(cfg)

    @torch.no_grad()
    def encode(self, wave: torch.Tensor) -> torch.Tensor:
        """Mono waveforms (B, 1, L) at 32 kHz -> posterior mean (B, C, ceil(L / hop)); H3 uses the mean, so the
        log-std head is not evaluated. Stereo: pass L and R as two batch items."""
        if wave.ndim != 3 or wave.shape[1] != 1:
            raise ValueError(f"expected waveforms (B, 1, samples), got {tuple(wave.shape)}")
        hop = self.cfg.hop_length
        wave = F.pad(wave.float(), (0, (-wave.shape[-1]) % hop))
        h = self.encoder(wave)  # (B, latent_dim, N)
        h = self.pre_block(h.transpose(1, 2)).transpose(1, 2)  # (B, C, N)
        return self.mean_proj(h)

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """De-normalised latents (B, C, N) -> waveforms (B, 1, N * hop) fp32, clamped to [-1, 1]."""
        if z.ndim != 3 or z.shape[1] != self.cfg.latent_channels:
            raise ValueError(f"expected latents (B, {self.cfg.latent_channels}, N), got {tuple(z.shape)}")
        return self.decoder(self.dec_in_proj(z.float()))
