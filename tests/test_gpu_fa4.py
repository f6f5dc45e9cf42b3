"""FA4 on the GPU: the op the engine calls against float32 attention and against cuDNN at the DiT's and the tiny
model's head sizes, bitwise reruns, heads in separate calls giving the all-heads bits (what makes a split render the
one-GPU render), a fullgraph compile without recompiles, the start's choice (`accel.attention.resolve`), and the tiny
engine with FA4, alone and split on one GPU.

Marked `gpu`: skipped without CUDA, or where FA4 cannot run (`fa4.missing()`: below sm90, or no
`pip install 'h3serve[fa4]'`); run on the GPU machine with `pytest -m gpu`. FA4 in the profile and split tests:
tests/test_gpu_profiles.py, tests/test_gpu_parallel.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from h3serve.accel import fa4
from h3serve.accel.attention import MODULES, cudnn_sdpa, resolve
from h3serve.accel.fa4 import fa4_sdpa
from h3serve.accel.profile import Attention, Profile, ProfileError
from h3serve.config import TINY_DIT, DiTConfig
from h3serve.model import dit as dit_model
from h3serve.model import ops
from h3serve.parallel.workers import ParallelEngine, WorkerSpec
from h3serve.pipeline.engine import Engine
from h3serve.pipeline.request import RequestFields

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = torch.device("cuda")
RELEASED = DiTConfig()
DIT = (RELEASED.num_attention_heads, RELEASED.attention_head_dim)  # 56 heads of 128
TINY = (TINY_DIT.num_attention_heads, TINY_DIT.attention_head_dim)  # 4 heads of 16
ROWS = (1, 17, 131, 2053, 6435)  # one row, and odd counts: below, over and many times FA4's tiles (64 to 256 rows)
# Relative Frobenius error against float32 attention of the same operands (and against cuDNN). Rounding the output to
# bfloat16 alone costs 1.6e-3 on these operands, and an emulation of FA4's roundings (the probabilities to bfloat16
# before the PV product, then the output) 1.7e-3, 2.6e-3 on the worst head (measured on the CPU, every shape here);
# FA4 against cuDNN, two such roundings, measured 3e-3 at 56 heads of 128 on an H200. 1e-2 leaves room for
# FA4's approximate exponentials (Blackwell) and catches what a fault gives: a wrong head, scale or partial tile
# is off by tens of percent where it is seen (`_error` looks at each head and at the last rows alone). The same
# 1e-2 as the start-up self-test's (`fa4.TOLERANCE`), held here at more shapes.
BOUND = 1e-2
TAIL = 64  # the last rows, looked at alone: the partial tile's (its last 64 where it is taller)
PROMPT = "a red fox runs through fresh snow"
REQUEST = dict(num_frames=39, steps=6, seed=42)


@pytest.fixture(autouse=True)
def _fa4():
    missing = fa4.missing()
    if missing is not None:
        pytest.skip(missing)


def _fused(rows: int, heads: int, d: int, seed: int = 0) -> torch.Tensor:
    """A fused QKV projection's bfloat16 output (S, 3 H D), Q, K and V side by side as the DiT's `qkv_proj` gives
    them; heads of four sharpnesses (each head's Q and K scaled by 0.5, 1, 2 or 3)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn(rows, 3, heads, d, generator=gen, device=DEVICE)
    qkv[:, :2] *= torch.tensor([0.5, 1.0, 2.0, 3.0], device=DEVICE).repeat(heads)[:heads, None]
    return qkv.flatten(1).to(torch.bfloat16)


def _views(fused: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V (1, H, S, D) of a fused projection (S, 3 H D): strided views, no copy (`ops.attention`'s call)."""
    return tuple(t.unflatten(-1, (heads, -1))[None].transpose(1, 2) for t in fused.chunk(3, dim=-1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative Frobenius error of (1, H, S, D) `got` against `want`: over all of it, over each head, and
    over the last TAIL rows (a wrong partial tile would be diluted by thousands of right rows in the whole)."""
    parts = [(got, want), (got[..., -TAIL:, :], want[..., -TAIL:, :])]
    parts += [(got[:, h], want[:, h]) for h in range(got.shape[1])]
    return max(_rel(a, b) for a, b in parts)


def _float32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


@pytest.mark.parametrize(("heads", "d"), [DIT, TINY])
@pytest.mark.parametrize("rows", ROWS)
def test_fa4_is_float32_attention_of_the_same_bf16_operands_within_bf16_rounding(rows, heads, d):
    q, k, v = _views(_fused(rows, heads, d), heads)
    got = fa4_sdpa(q, k, v, False)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert got.transpose(1, 2).is_contiguous()  # (B, S, H, D) memory, as cuDNN writes it: the out projection's rows
    error = _error(got, _float32_attention(q, k, v))
    print(f"S={rows} {heads}x{d}: {error:.2e} against float32")
    assert error < BOUND


@pytest.mark.parametrize(("heads", "d"), [DIT, TINY])
@pytest.mark.parametrize("rows", ROWS[1:])  # one row (FA4 returns V itself) is checked against float32 above
def test_fa4_is_cudnn_within_bf16_rounding(rows, heads, d):
    q, k, v = _views(_fused(rows, heads, d), heads)
    got, theirs = fa4_sdpa(q, k, v, False), cudnn_sdpa(q, k, v, False)
    assert got.shape == theirs.shape and got.dtype == theirs.dtype
    assert got.transpose(1, 2).is_contiguous() and theirs.transpose(1, 2).is_contiguous()  # the same layout
    error = _error(got, theirs)
    print(f"S={rows} {heads}x{d}: {error:.2e} against cuDNN")
    assert error < BOUND


@pytest.mark.parametrize(("heads", "d"), [DIT, TINY])
def test_reruns_are_bitwise_identical_and_do_not_depend_on_where_the_operands_lie(heads, d):
    fused = _fused(6435, heads, d)
    first = fa4_sdpa(*_views(fused, heads), False)
    for _ in range(3):
        assert torch.equal(fa4_sdpa(*_views(fused, heads), False), first)
    moved = fused.clone()  # the same numbers at other addresses, as in another step's projection
    assert torch.equal(fa4_sdpa(*_views(moved, heads), False), first)


def _ulysses_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice) -> tuple[torch.Tensor, ...]:
    """What the kernel of the rank holding `heads` gets in a split render (`parallel.ranks._ulysses`): every row of
    those heads, received as one (S, 3, hn, D) buffer, Q, K and V (1, hn, S, D) strided views of it."""
    recv = torch.stack([t[0, heads].transpose(0, 1) for t in (q, k, v)], dim=1)  # (S, 3, hn, D), rows in rank order
    qkv = recv.permute(1, 2, 0, 3)  # (3, hn, S, D), as `_ulysses` views what arrives
    return qkv[0:1], qkv[1:2], qkv[2:3]


@pytest.mark.parametrize(("heads", "d", "groups"), [(*DIT, 2), (*DIT, 4), (*DIT, 7), (*DIT, 8), (*TINY, 2), (*TINY, 4)])
@pytest.mark.parametrize("rows", [131, 6435])
def test_heads_in_separate_calls_give_the_all_heads_bits(rows, heads, d, groups):
    """Each rank of a split runs FA4 on its own heads, over every row: bit for bit those heads of the one-GPU call
    (FA4's tiles are per head and row block; the head count picks no other kernel), so the split's attention adds no
    difference of its own."""
    q, k, v = _views(_fused(rows, heads, d), heads)
    whole = fa4_sdpa(q, k, v, False)
    hn = heads // groups
    for j in range(groups):
        part = slice(j * hn, (j + 1) * hn)
        alone = fa4_sdpa(*_ulysses_operands(q, k, v, part), False)
        assert alone[0].transpose(0, 1).is_contiguous()  # rows first: `_ulysses` sends the output back without a copy
        assert torch.equal(alone, whole[:, part]), (j, (alone.float() - whole[:, part].float()).abs().max().item())


def test_the_op_matches_its_fake_and_traces():
    q, k, v = _views(_fused(131, *TINY), TINY[0])
    torch.library.opcheck(
        torch.ops.h3serve.fa4_attention.default,
        (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),  # forward only: no gradients
    )


def test_fa4_compiles_fullgraph_without_recompiles_across_row_counts_and_gives_the_eager_bits():
    from h3serve.accel.compile import GraphCounter

    heads = DIT[0]

    def attend(fused: torch.Tensor) -> torch.Tensor:
        # (S, 3 H D) -> (S, H D): the DiT attention's work between its two projections
        q, k, v = (t.unflatten(-1, (heads, -1)) for t in fused.chunk(3, dim=-1))
        return ops.attention(q, k, v, kernel=fa4_sdpa).flatten(1)

    counter = GraphCounter("inductor")
    compiled = torch.compile(attend, fullgraph=True, backend=counter)
    for rows in (700, 17, 2053, 6435):
        fused = _fused(rows, *DIT, seed=rows)
        torch._dynamo.mark_dynamic(fused, 0)
        # Bit for bit: FA4 is one opaque call and the graph around it is views only, nothing Inductor could reorder.
        assert torch.equal(compiled(fused), attend(fused))
    assert counter.graphs == 1 and counter.recompiles == 0, counter.compiles


@pytest.mark.parametrize("head_dim", [DIT[1], TINY[1]])
def test_the_self_test_passes_on_this_gpu(head_dim):
    result = fa4.self_test(DEVICE, head_dim)
    print(f"\n{torch.cuda.get_device_name(DEVICE)}, head size {head_dim}: {result.describe()}")
    assert result.ok, result.describe()
    assert result.version == fa4.version() and result.error < BOUND


def test_auto_is_fa4_on_sm90_and_sm100_and_cudnn_elsewhere_with_the_reason():
    profile = Profile.for_device("cuda", linear="BF16")  # compile in bfloat16: auto is left to the device
    assert profile.attention == Attention.AUTO
    chosen, line = resolve(profile, DIT[1])
    major, minor = torch.cuda.get_device_capability(DEVICE)
    print(f"\nsm{major}{minor}: {line}")
    if major in (9, 10):
        assert chosen.attention == Attention.FA4 and line.startswith("attention auto: FA4 (flash-attn-4 "), line
    else:
        assert chosen.attention == Attention.CUDNN_ATTN, line
        assert line == f"attention auto: CUDNN_ATTN ({fa4.auto_refusal(DEVICE)})" and "sm90 and sm100" in line
    assert dataclasses.replace(chosen, attention=Attention.AUTO) == profile  # nothing else changed
    # The engine, given the profile unresolved (a benchmark's or a test's), makes the same choice for its DiT.
    assert Engine.load(None, profile).profile.attention == chosen.attention
    # Under eager there is nothing to ask: auto became CUDNN_ATTN when the profile was built.
    eager = Profile.for_device("cuda", execution="eager")
    assert eager.attention == Attention.CUDNN_ATTN and resolve(eager, DIT[1]) == (eager, None)


@pytest.mark.parametrize("execution", ["eager", "compile"])
def test_an_explicit_fa4_is_self_tested_and_kept(execution):
    profile = Profile.for_device("cuda", attention="FA4", execution=execution)
    chosen, line = resolve(profile, DIT[1])
    assert chosen == profile and line.startswith("attention FA4: flash-attn-4 ") and "rerun bitwise" in line, line


def test_an_fa4_failing_its_self_test_is_refused_when_named_and_passed_over_by_auto(monkeypatch):
    monkeypatch.setattr(fa4, "TOLERANCE", 0.0)  # a bound no rounding meets: the self-test fails as a wrong kernel would
    refused = r"^attention FA4 does not compute correctly on cuda \(.*\): use CUDNN_ATTN$"
    with pytest.raises(ProfileError, match=refused) as err:
        resolve(Profile.for_device("cuda", attention="FA4"), DIT[1])
    assert err.value.setting == "attention"
    chosen, line = resolve(Profile.for_device("cuda"), DIT[1])
    assert chosen.attention == Attention.CUDNN_ATTN  # never FA4
    if fa4.auto_refusal(DEVICE) is None:
        assert line.startswith("attention auto: CUDNN_ATTN (flash-attn-4 ") and "failed: S=" in line, line


def _kernels(model: torch.nn.Module, kind: type | tuple[type, ...] = MODULES) -> set:
    return {m.kernel for m in model.modules() if isinstance(m, kind)}


@pytest.mark.parametrize("execution", ["eager", "compile"])
def test_the_tiny_engine_runs_fa4_in_its_dit_and_cudnn_in_its_decoders_and_reruns_bitwise(execution):
    torch._dynamo.reset()
    engine = Engine.load(None, Profile.for_device("cuda", attention="FA4", execution=execution, linear="BF16"))
    components = engine.components
    assert engine.profile.attention == Attention.FA4
    assert _kernels(components.dit, dit_model.Attention) == {fa4_sdpa}  # the blocks' and the text refiner's
    for decoder in (components.video_vae, components.audio_vae):  # `DIT_ONLY`
        assert _kernels(decoder) == {cudnn_sdpa}, type(decoder).__name__
    request = engine.validate(RequestFields(PROMPT, **REQUEST))
    one, two = engine.render(request), engine.render(request)
    assert one.frames.shape[0] == REQUEST["num_frames"] and one.frames.any() and np.isfinite(one.audio).all()
    np.testing.assert_array_equal(one.frames, two.frames)
    np.testing.assert_array_equal(one.audio, two.audio)
    if execution == "compile":
        assert engine.compiled.graphs >= 1 and engine.compiled.recompiles == 0, engine.compiled.compiles


def test_an_eager_split_render_on_one_gpu_is_the_one_process_render_bit_for_bit():
    """`ParallelEngine` with one worker runs the split path on a group of one: the all-to-alls around FA4 (Q, K and V
    as received, not as views of the projection), the gathers and the agreements, on this GPU."""
    profile = Profile.for_device("cuda", attention="FA4", execution="eager", linear="BF16")
    torch._dynamo.reset()
    engine = Engine.load(None, profile)
    reference = engine.render(engine.validate(RequestFields(PROMPT, **REQUEST)))
    del engine
    torch.cuda.empty_cache()
    split = ParallelEngine(WorkerSpec(None, profile, 1))
    try:
        result = split.render(split.validate(RequestFields(PROMPT, **REQUEST)))
    finally:
        split.close()
    assert len(result.split) == 1, result.split
    np.testing.assert_array_equal(result.frames, reference.frames)
    np.testing.assert_array_equal(result.audio, reference.audio)
