"""The video decoder's weights stored in the dtype its autocast computes in.

The released recipe decodes under float16 autocast with float32 weights: every linear and convolution of the decoder
casts its float32 weight and bias to float16 on every call (every tile of every window), and the float32 copies
stay resident. Autocast's cast is a plain round to nearest, so storing those weights already rounded gives the same
float16 operands: the decode is bitwise the same, 2.4 B parameters take half the memory (4.5 GiB less on the
released VAE) and the casts are gone. Everything autocast keeps in float32 stays float32: the norms' weights, the
residual scales, the register tokens (cast where used), and the whole encoder (keyframes encode in float32, no
autocast).

`decoder_passes`: the decoder blocks' element-wise passes and norms in Triton, the same numbers as the plain ops (the
GPU tier checks them bit for bit, tests/test_gpu_decode.py); what they buy is bench/decode.py's.
"""

from __future__ import annotations

import torch
from torch import nn

from h3serve.model.video_vae import DecoderPasses, VideoVAE, check_tile_batch

CAST = (nn.Linear, nn.Conv3d)


def decoder_weights_to(vae: VideoVAE, dtype: torch.dtype) -> int:
    """Store the weights and biases of every linear and convolution the decoder runs under autocast (the decoder's
    and `post_quant_conv`'s) in `dtype`, in place; returns the bytes saved."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the decoder's weights can be stored in float16 or bfloat16 (an autocast dtype), not {dtype}")
    saved = 0
    for module in (vae.post_quant_conv, *vae.decoder.modules()):
        if isinstance(module, CAST):
            for p in (module.weight, module.bias):
                if p is not None and p.dtype != dtype:
                    saved += p.numel() * (p.element_size() - torch.finfo(dtype).bits // 8)
                    p.data = p.data.to(dtype)
    return saved


def decoder_cast_names(vae: VideoVAE) -> frozenset[str]:
    """The names of the tensors `decoder_weights_to` stores in the autocast dtype (on a meta-device model too), so a
    load can convert them as it reads them (`load_video_vae(dtype_of=...)`): the decoder never exists in float32."""
    names = []
    for prefix, root in (("post_quant_conv", vae.post_quant_conv), ("decoder", vae.decoder)):
        for name, module in root.named_modules():
            if isinstance(module, CAST):
                path = f"{prefix}.{name}" if name else prefix
                names += [f"{path}.{leaf}" for leaf in ("weight", "bias") if getattr(module, leaf) is not None]
    return frozenset(names)


def decoder_passes() -> DecoderPasses:
    """The decoder blocks' passes in Triton (`triton_decoder`), each the same numbers as its reference
    (`video_vae.REFERENCE_PASSES`): every residual add with the norm after it in one pass (the norm written in the
    projection's dtype, so autocast's cast is gone), the qk-norm and the rotary of q and k in one, the SwiGLU gate in
    one. Needs a CUDA device and Triton (`fused.available`)."""
    from h3serve.accel import triton_decoder as t

    return DecoderPasses(qk=t.qk, residual=t.residual, swiglu=t.swiglu, norm=t.norm, residual_norm=t.residual_norm)


# A window's tiles decoded together on CUDA (`VideoVAE.tile_batch`; the tiles left over one at a time): the same bits
# as one at a time. cuBLAS's GEMMs and cuDNN's attention give each tile's rows the same values in batches of 1, 2, 4,
# 7 and 14 tiles (bench/decode_batch.py on the H200); tests/test_gpu_decode.py holds batches of 2, 4 and 7 at the
# released shapes. 5% faster per window at the default request (a quarter of the launches), for about 80 MB more
# activations per extra tile (bench/results/README.md, 2026-12-03).
CUDA_TILE_BATCH = 4


def set_tile_batch(vae: VideoVAE, batch: int) -> None:
    """How many of a window's tiles the video decoder runs as one batch (`VideoVAE.tile_batch`)."""
    vae.tile_batch = check_tile_batch(batch)


def set_decoder_passes(vae: VideoVAE, passes: DecoderPasses) -> None:
    """The passes the video decoder's blocks run (`ViTDecoder3d.passes`)."""
    vae.decoder.passes = passes
