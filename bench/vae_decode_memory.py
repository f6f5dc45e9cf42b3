"""Peak RSS of one video VAE decode, tiled or untiled, in a fresh process (CPU):

    PYTHONPATH=src python bench/vae_decode_memory.py {tiled|untiled} T h w

A memory measurement, not a speed benchmark (the times it prints are CPU times of a toy-width model).
"""

import resource
import sys
import time

import torch

from h3serve.model.video_vae import VideoVAE, VideoVAEConfig
from h3serve.pipeline.video_decode import decode

mode, t, h, w = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
torch.set_num_threads(8)
# The conversion script's test architecture (24 latents, 4 levels -> ratio 4, ViT 4 x 4 heads x 32), with the
# released tile proportions scaled to ratio 4: 64 px tiles (16 latents), 16 px minimum overlap (4 latents).
cfg = VideoVAEConfig(
    block_out_channels=(32, 64),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2),
    temporal_downsample_factors=(2, 2),
    decoder_num_layers=4,
    decoder_num_attention_heads=4,
    decoder_attention_head_dim=32,
    latents_mean=[0.0] * 24,
    latents_std=[1.0] * 24,
    tile_size=64,
    tile_overlap_min=16,
)
vae = VideoVAE(cfg).eval()
z = torch.randn(1, 24, t, h, w)


def kb() -> float:
    """Peak resident set of this process so far, MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


base = kb()
t0 = time.perf_counter()
out = decode(vae, z, tiled=(mode == "tiled"), autocast_dtype=None)
dt = time.perf_counter() - t0
out_mb = out.numel() * 4 / 2**20
print(
    f"{mode:8s} latents {tuple(z.shape)} -> {tuple(out.shape)}: peak RSS {kb():.0f} MiB "
    f"(baseline {base:.0f} MiB, +{kb() - base:.0f} MiB; output tensor {out_mb:.0f} MiB) in {dt:.1f} s"
)
