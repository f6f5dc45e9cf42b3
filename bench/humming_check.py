"""The HUMMING linear backend on the GPU: its GEMMs at the released block-linear shapes against CUTLASS FP8, BF16 and
the float32 reference, then the built-in tiny model rendered end to end with HUMMING block linears.

1. For each block linear of the released DiT config (qkv, attention out, fc1, fc2; K and N from `DiTConfig()`), at
   the reference packed shape (`--rows`, 6435 = 537 text + 186 audio + 5712 video rows), seeded random bf16
   weights (std 0.02) and activations: HummingLinear and Fp8Linear (CUTLASS) made from the same nn.Linear, then
   - their e4m3 weights and scales bitwise equal (and their float32 `reference`s, informative);
   - the first HUMMING call's time (JIT-compiles the shape's kernels unless HUMMING_CACHE_DIR has them);
   - relative error of HUMMING and CUTLASS against the float32 reference (the same e4m3 operands, exact products),
     against each other, and of all three (and BF16) against the unquantized float32 product;
   - a rerun bitwise equal; batch invariance: the rows of a call on the first `--prefixes` rows (and on the last
     1000) bitwise the same rows of the full call (CUTLASS's answer recorded for comparison, not required);
   - time per call (CUDA events, median of `--iters` after `--warmup`) of HUMMING, CUTLASS, BF16 nn.Linear and the
     activation quantization alone; Humming's chosen schedules (informative);
   - optional, not counted in the exit status: the same with Humming's fused per-row activation quantization.
2. The tiny model (`Engine.load(None)`, CUDA, bf16, TORCH_SDPA, eager) rendered with BF16 block linears, then with
   every block linear replaced by HummingLinear: two renders bitwise equal, and close to the BF16 render.

Each check records its exception instead of stopping the run; results go to `--out` after every step. The exit
status is 1 if any required check failed or raised (listed under "failed").

    pip install --no-index --no-deps --target /tmp/site humming_kernels-0.1.20-cp310-abi3-manylinux_2_28_x86_64.whl
    HUMMING_CACHE_DIR=/tmp/humming-cache PYTHONPATH=/tmp/site:$PWD/src \\
        python bench/humming_check.py --out bench/results/humming_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from lib.timing import run_header, time_ms
from torch import nn

from h3serve.accel.humming import COMPUTE_CONFIG, HummingLinear, available, is_humming, quantize_blocks
from h3serve.accel.linear import Fp8Linear, quantize_rows
from h3serve.config import DiTConfig
from h3serve.pipeline.request import RequestFields

# Bounds for the required accuracy checks: HUMMING against the float32 reference of the same e4m3 operands (bf16
# output and bf16 scale roundings, ~3e-3 expected) and the tiny render against its BF16 render (the CUTLASS bound of
# tests/test_gpu_profiles.py).
MAX_REL_ERR_VS_REFERENCE = 1e-2
MAX_TINY_ERR_VS_BF16 = 2e-1


class Record:
    def __init__(self, path: Path):
        self.path = path
        self.failed: list[str] = []
        self.data: dict = {
            **run_header(),
            "capability": list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None,
            "cuda": torch.version.cuda,
            "humming_cache_dir": os.environ.get("HUMMING_CACHE_DIR"),
            "compute_config": COMPUTE_CONFIG,
            "bounds": {"rel_err_vs_reference": MAX_REL_ERR_VS_REFERENCE, "tiny_err_vs_bf16": MAX_TINY_ERR_VS_BF16},
            "shapes": {},
            "failed": self.failed,
            "optional_failed": [],
        }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


class Checks:
    """Runs named steps into `entry`: an exception is recorded (and printed) and the run goes on."""

    def __init__(self, rec: Record, prefix: str, entry: dict):
        self.rec, self.prefix, self.entry = rec, prefix, entry

    def _fail(self, label: str, required: bool) -> None:
        (self.rec.failed if required else self.rec.data["optional_failed"]).append(f"{self.prefix}.{label}")

    def step(self, label: str, fn: Callable[[], None], required: bool = True) -> bool:
        try:
            fn()
            return True
        except Exception as err:
            self.entry.setdefault("errors", {})[label] = f"{type(err).__name__}: {err}"[:3000]
            self._fail(label, required)
            traceback.print_exc()
            return False
        finally:
            self.rec.save()

    def require(self, label: str, ok: bool, required: bool = True) -> None:
        self.entry[label] = bool(ok)
        if not ok:
            self._fail(label, required)


def shapes(cfg: DiTConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of each block linear, as h3serve.model.dit builds them."""
    return {
        "qkv": (cfg.hidden_size, 3 * cfg.inner_dim),
        "out_proj": (cfg.inner_dim, cfg.hidden_size),
        "fc1": (cfg.hidden_size, 2 * cfg.ffn_hidden_size),
        "fc2": (cfg.ffn_hidden_size, cfg.hidden_size),
    }


def sync() -> None:
    torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def timing(fn: Callable[[], object], flop: float, args) -> dict:
    ms = time_ms(fn, args.warmup, args.iters)
    median = statistics.median(ms)
    return {"ms_median": round(median, 4), "ms_spread": [round(min(ms), 4), round(max(ms), 4)],
            "tflops": round(flop / (median * 1e-3) / 1e12, 1)}  # fmt: skip


def invariance(module: nn.Module, x: torch.Tensor, y: torch.Tensor, prefixes: list[int]) -> dict[str, bool]:
    """Rows of calls on fewer rows (the first p; the last 1000) against the same rows of the full call, bitwise."""
    m = x.shape[0]
    out = {f"first_{p}": torch.equal(module(x[:p]), y[:p]) for p in prefixes if p <= m}
    if m > 1000:
        out["last_1000"] = torch.equal(module(x[-1000:]), y[-1000:])
    return out


@torch.no_grad()
def check_shape(rec: Record, name: str, k: int, n: int, args) -> None:
    m = args.rows
    entry: dict = {"K": k, "N": n, "M": m}
    rec.data["shapes"][name] = entry
    c = Checks(rec, name, entry)
    s: dict = {}  # what the steps share

    def build() -> None:
        g = torch.Generator(device="cuda").manual_seed(args.seed)
        linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
        linear.weight.copy_(torch.randn(n, k, generator=g, device="cuda") * 0.02)
        s["linear"], s["x"] = linear, torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        s["fp8"] = Fp8Linear.from_linear(linear)
        sync()
        start = time.perf_counter()
        s["hl"] = HummingLinear.from_linear(linear, keep_fp8=True)
        sync()
        entry["transform_s"] = round(time.perf_counter() - start, 3)
        entry["humming_weight"] = [list(s["hl"].humming_weight.shape), str(s["hl"].humming_weight.dtype)]
        entry["humming_scale"] = [list(s["hl"].humming_scale.shape), str(s["hl"].humming_scale.dtype)]
        entry["layer_config"] = json.loads(s["hl"].layer_config.to_str())

    if not c.step("build", build):
        return
    linear, x, fp8, hl = s["linear"], s["x"], s["fp8"], s["hl"]

    def weights() -> None:
        c.require("weights_bitwise_cutlass", torch.equal(hl.weight.view(torch.uint8), fp8.weight.view(torch.uint8)))
        c.require("scales_bitwise_cutlass", torch.equal(hl.scale, fp8.scale))
        s["ref"] = fp8.reference(x.float())  # float32 in: the same e4m3 operands, a float32 result
        # Implied by the two above (same operands, same float32 code); tested on the CPU, here informative only.
        c.require("reference_bitwise_cutlass", torch.equal(hl.reference(x.float()), s["ref"]), required=False)

    c.step("weights", weights)

    def first_call() -> None:
        sync()
        start = time.perf_counter()
        s["y"] = hl(x)
        sync()
        entry["first_call_s"] = round(time.perf_counter() - start, 2)
        y = s["y"]
        c.require("output_shape_dtype", y.shape == (m, n) and y.dtype == torch.bfloat16)
        c.require("output_finite", bool(torch.isfinite(y).all()))

    if not c.step("first_call", first_call):
        return
    y = s["y"]

    def accuracy() -> None:
        exact = x.float() @ linear.weight.float().t()  # the unquantized product
        y_fp8, y_bf16 = fp8(x), linear(x)
        errors = {
            "humming_vs_reference": rel(y, s["ref"]) if "ref" in s else None,
            "cutlass_vs_reference": rel(y_fp8, s["ref"]) if "ref" in s else None,
            "humming_vs_cutlass": rel(y, y_fp8),
            "humming_vs_fp32": rel(y, exact),
            "cutlass_vs_fp32": rel(y_fp8, exact),
            "reference_vs_fp32": rel(s["ref"], exact) if "ref" in s else None,
            "bf16_vs_fp32": rel(y_bf16, exact),
        }
        entry["rel_err"] = {key: None if v is None else float(f"{v:.4e}") for key, v in errors.items()}
        if errors["humming_vs_reference"] is not None:
            c.require("humming_close_to_reference", errors["humming_vs_reference"] < MAX_REL_ERR_VS_REFERENCE)

    c.step("accuracy", accuracy)
    c.step("rerun", lambda: c.require("rerun_bitwise", torch.equal(hl(x), y)))

    def batch_invariance() -> None:
        rows = invariance(hl, x, y, args.prefixes)
        entry["batch_invariance"] = rows
        c.require("batch_invariant", all(rows.values()))
        entry["cutlass_batch_invariance"] = invariance(fp8, x, fp8(x), args.prefixes)  # for comparison only

    c.step("batch_invariance", batch_invariance)

    def timings() -> None:
        flop = 2.0 * m * k * n
        entry["time"] = {
            "humming": timing(lambda: hl(x), flop, args),
            "cutlass": timing(lambda: fp8(x), flop, args),
            "bf16": timing(lambda: linear(x), flop, args),
            "quantize_rows": timing(lambda: quantize_rows(x), 0.0, args)["ms_median"],
        }

    c.step("timing", timings)

    def schedules() -> None:
        from humming.tune import get_heuristics_config

        entry["schedules"] = {
            str(rows): get_heuristics_config(hl.layer_config, shape_m=rows, device=x.device, **COMPUTE_CONFIG)
            for rows in sorted({*args.prefixes, m})
        }

    c.step("schedules", schedules, required=False)

    def fused() -> None:
        fe: dict = {}
        entry["fused_quant"] = fe
        hf = HummingLinear.from_linear(linear, fused_quant=True)  # the same weights, Humming's own activation quant
        sync()
        start = time.perf_counter()
        yf = hf(x)
        sync()
        fe["first_call_s"] = round(time.perf_counter() - start, 2)
        if "ref" in s:
            fe["rel_err_vs_reference"] = float(f"{rel(yf, s['ref']):.4e}")
        fe["rel_err_vs_default"] = float(f"{rel(yf, y):.4e}")
        fe["bitwise_default"] = torch.equal(yf, y)
        fe["rerun_bitwise"] = torch.equal(hf(x), yf)
        fe["batch_invariance"] = invariance(hf, x, yf, args.prefixes)
        fe["time"] = timing(lambda: hf(x), 2.0 * m * k * n, args)
        c.require("fused_quant_deterministic_and_invariant",
                  fe["rerun_bitwise"] and all(fe["batch_invariance"].values()), required=False)  # fmt: skip

    c.step("fused_quant", fused, required=False)
    print(name, json.dumps({key: v for key, v in entry.items() if key not in ("layer_config", "schedules")}))
    s.clear()  # the closures above still hold the tensors until this function returns; main empties the cache


@torch.no_grad()
def check_tiny(rec: Record) -> None:
    entry: dict = {}
    rec.data["tiny_e2e"] = entry
    c = Checks(rec, "tiny_e2e", entry)
    s: dict = {}

    def run() -> None:
        from h3serve.accel.profile import Profile
        from h3serve.pipeline.engine import Engine

        profile = Profile.for_device("cuda", attention="TORCH_SDPA", execution="eager", linear="BF16")
        engine = Engine.load(None, profile)
        request = engine.validate(RequestFields("a red fox runs through fresh snow", num_frames=39, steps=6, seed=42))
        exact = engine.render(request)
        dit = engine.components.dit
        quantize_blocks(dit)
        entry["replaced"] = sum(isinstance(m, HummingLinear) for m in dit.modules())
        leaves = ("qkv_proj", "out_proj", "fc1", "fc2")
        left = [n for n, m in dit.named_modules() if n.endswith(leaves) and not isinstance(m, HummingLinear)]
        c.require("all_block_linears_humming", is_humming(dit) and not left)
        start = time.perf_counter()
        one = engine.render(request)
        entry["first_render_s"] = round(time.perf_counter() - start, 2)
        start = time.perf_counter()
        two = engine.render(request)
        entry["second_render_s"] = round(time.perf_counter() - start, 2)
        c.require("frames_bitwise", bool((one.frames == two.frames).all()))
        c.require("audio_bitwise", bool((one.audio == two.audio).all()))
        audio_err = float(((one.audio - exact.audio) ** 2).sum() ** 0.5 / ((exact.audio**2).sum() ** 0.5))
        frames_err = float(abs(one.frames.astype("float32") - exact.frames.astype("float32")).mean() / 255)
        entry["audio_err_vs_bf16"], entry["frames_err_vs_bf16"] = audio_err, frames_err
        c.require("close_to_bf16", audio_err < MAX_TINY_ERR_VS_BF16 and frames_err < MAX_TINY_ERR_VS_BF16)
        s["engine"] = engine

    c.step("run", run)
    s.clear()
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=6435, help="M: rows per call (the reference packed shape)")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1, 100, 186, 537, 1000, 4096],
                        help="row counts whose rows must be bitwise those of the full call")  # fmt: skip
    parser.add_argument("--layers", nargs="+", choices=["qkv", "out_proj", "fc1", "fc2"], default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-tiny", action="store_true", help="skip the tiny model's end-to-end renders")
    args = parser.parse_args()

    rec = Record(args.out)
    missing = available()
    rec.data["available"] = missing
    if missing is not None:
        rec.failed.append("available")
        rec.save()
        print(f"HUMMING is not available here: {missing}", file=sys.stderr)
        return 1
    import humming

    rec.data["humming"] = {"version": humming.__version__, "path": str(Path(humming.__file__).parent)}
    # The float32 references must be float32 products, not TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rec.save()

    for name, (k, n) in shapes(DiTConfig()).items():
        if args.layers is None or name in args.layers:
            check_shape(rec, name, k, n, args)
            torch.cuda.empty_cache()
    if not args.skip_tiny:
        check_tiny(rec)
    rec.save()

    print("\nsummary")
    for name, e in rec.data["shapes"].items():
        t = e.get("time", {})
        ms = {key: t.get(key, {}).get("ms_median") for key in ("humming", "cutlass", "bf16")}
        err = e.get("rel_err", {}).get("humming_vs_reference")
        print(
            f"  {name:8s} M={e['M']} K={e['K']} N={e['N']}: first call {e.get('first_call_s')} s; ms {ms}; "
            f"rel err vs ref {err}; rerun {e.get('rerun_bitwise')}; invariant {e.get('batch_invariant')}"
        )
    tiny = rec.data.get("tiny_e2e")
    if tiny is not None:
        print(f"  tiny e2e: replaced {tiny.get('replaced')}, bitwise {tiny.get('frames_bitwise')}/"
              f"{tiny.get('audio_bitwise')}, err vs bf16 {tiny.get('frames_err_vs_bf16')}")  # fmt: skip
    print(f"  failed: {rec.failed or 'none'}; optional failed: {rec.data['optional_failed'] or 'none'}")
    print(f"  written to {args.out}")
    return 1 if rec.failed else 0


if __name__ == "__main__":
    sys.exit(main())
