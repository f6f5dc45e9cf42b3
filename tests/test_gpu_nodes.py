"""Two hosts as one over NCCL, one GPU per "node": node 1 (`h3serve serve --node-rank 1` on GPU 1) and `h3serve render`
on node 0 (GPU 0), two independent process trees started by two commands, each with its own copy of the tiny
checkpoint folder, give the MP4 bytes of the same render on one GPU (eager BF16, cuDNN attention: the profile whose
split is bit for bit). The same commands as tests/test_nodes.py's gloo tests, on CUDA.

Not yet run: no machine with two GPUs was lent while it was written (NCCL cannot put two ranks on one GPU). Marked
`gpu` and skipped with fewer than two CUDA devices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from e2e_fixtures import write_tiny_checkpoint
from test_nodes import Hosts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one per node)"),
]

EAGER = {"H3_DEVICE": "cuda", "H3_EXECUTION_MODE": "eager", "H3_LINEAR_BACKEND": "BF16",
         "H3_DIFFUSION_ATTENTION_BACKEND": "CUDNN_ATTN"}  # fmt: skip
ONE_NODE = {"H3_NNODES": "1", "H3_DIST_INIT_ADDR": None, "H3_NODE_KEY": None, "H3_TASK_TYPE": None,
            "H3_NODE_TIMEOUT": None, "H3_NODE_GRACE": None}  # fmt: skip


def test_two_nodes_over_nccl_one_gpu_each_render_the_one_gpu_mp4(tmp_path: Path):
    release = write_tiny_checkpoint(tmp_path / "release" / "FL2VA")
    hosts = Hosts(tmp_path, release)
    args = ["render", "a lighthouse at dusk", "--steps", "4", "--seed", "4", "--width", "224", "--height", "128",
            "--frames", "22", "--no-progress"]  # fmt: skip
    try:
        one = hosts.start("one", [*args, "-o", str(tmp_path / "one.mp4")], 0, CUDA_VISIBLE_DEVICES="0",
                          **EAGER, **ONE_NODE)  # fmt: skip
        assert one.wait(600) == 0, one.log()[-3000:]
        node1 = hosts.serve1(H3_TASK_TYPE="fl2va", CUDA_VISIBLE_DEVICES="1", **EAGER)
        node0 = hosts.start("render0", [*args, "-o", str(tmp_path / "two.mp4")], 0, H3_TASK_TYPE=None,
                            CUDA_VISIBLE_DEVICES="0", **EAGER)  # fmt: skip
        assert node0.wait(600) == 0, node0.log()[-3000:] + node1.log()[-3000:]
        assert "| 2 GPUs" in node0.log()
        assert (tmp_path / "two.mp4").read_bytes() == (tmp_path / "one.mp4").read_bytes()
    finally:
        hosts.close()
