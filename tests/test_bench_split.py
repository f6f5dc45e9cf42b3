"""bench/lib/split.py on the CPU (gloo): the harness `dit_step.py --num-gpus` and the multi-GPU tests run. The tiny
DiT's forward split over two spawned ranks gives the plain one-rank forward's outputs bit for bit, and the scaling table
says so, with the collectives' time measured in the split and none in the plain forward; bench/plot_scaling.py draws
that table. About 15 s on 2 cores."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from lib.profiler import collective
from lib.shapes import TINY_SHAPE
from lib.split import Job, run_group, scaling
from plot_scaling import merge, plot

PROFILE = "TORCH_SDPA+eager+BF16"


@pytest.fixture(scope="module")
def groups():
    job = Job("tiny", TINY_SHAPE, (PROFILE,), warmup=0, iters=2, cuda=False)
    return {1: run_group(1, Job("tiny", TINY_SHAPE, (PROFILE,), warmup=0, iters=2, cuda=False, split=False)),
            2: run_group(2, job)}  # fmt: skip


def test_the_split_forward_over_two_gloo_ranks_is_the_plain_forward_bit_for_bit(groups):
    assert [r["rank"] for r in groups[2]] == [0, 1]
    plain, two = groups[1][0]["outputs"][PROFILE], groups[2][0]["outputs"][PROFILE]
    assert two[0].shape[0] > 0 and two[1].shape[0] > 0
    for a, b in zip(two, plain, strict=True):
        np.testing.assert_array_equal(a, b)
    table = scaling(groups)[PROFILE]
    assert table["2"]["bitwise_equal_to_1"] is True and table["2"]["rel_err_vs_1"] == [0.0, 0.0]
    assert table["1"]["speedup_vs_1"] == 1.0 and table["2"]["speedup_vs_1"] > 0
    assert table["2"]["comm_rank0"]["collectives_ms"]["all_to_all"] > 0  # two per block, in the split only
    assert table["1"]["comm_rank0"]["collectives_ms"]["all_to_all"] == 0
    assert len(table["2"]["ms_median_per_rank"]) == 2
    for n in ("1", "2"):  # where the rest of the forward went, by kind of op
        kernels = table[n]["comm_rank0"]["kernels"]
        assert kernels["total"] > 0 and set(kernels) == {"gemm", "attention", "elementwise", "other", "total"}
        assert sum(v for k, v in kernels.items() if k != "total") == pytest.approx(kernels["total"], abs=0.01)


def test_a_simulated_split_runs_rank_0s_part_alone_with_no_collectives():
    job = Job("tiny", TINY_SHAPE, (PROFILE,), warmup=0, iters=1, cuda=False, simulate=True)
    (alone,) = run_group(2, job)  # one process: rank 0 of two, its peer stood in for
    entry = alone["profiles"][PROFILE]
    assert entry["comm"]["collectives_ms"]["all_to_all"] == 0 and entry["comm"]["stand_in_ms"] == 0.0  # on a CPU
    video, audio = alone["outputs"][PROFILE]
    assert video.shape[0] > 0 and np.isfinite(video).all() and np.isfinite(audio).all()


def test_the_plot_draws_every_profile_from_the_result_files(groups, tmp_path):
    result = tmp_path / "split.json"
    result.write_text(json.dumps({"shape": {"name": "default"}, "scaling": scaling(groups)}))
    table, shape = merge([result])
    assert shape == "default" and sorted(table[PROFILE]) == [1, 2]
    plot(table, shape, tmp_path / "scaling.png")
    img = np.asarray(Image.open(tmp_path / "scaling.png").convert("RGB"))
    colours = {tuple(c) for c in img.reshape(-1, 3)[::7]}
    assert (31, 119, 180) in colours and (120, 120, 120) in colours  # ours, and the published points at this shape
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"shape": {"name": "reference"}, "scaling": {}}))
    with pytest.raises(ValueError, match="different runs"):
        merge([result, other])


def test_collectives_are_told_by_nccl_kernel_names_and_not_by_a_gemm_that_says_broadcast():
    kernels = {
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "all_to_all",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_gather",
        "ncclDevKernel_AllReduce_Sum_i32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_reduce",
        "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)": "other_nccl",
        "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::epilogue::fusion::"
        "Sm90RowBroadcast<0, cute::tuple<int, int, int>, float>>>(Params)": None,
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": None,
    }
    for name, kind in kernels.items():
        assert collective(name, cuda=True) == kind, name
    assert collective("c10d::alltoall_base_", cuda=False) == "all_to_all"
    assert collective("aten::mm", cuda=False) is None
