"""`h3serve accept` (the two-render acceptance against a running server) and `h3serve bench` (a benchmark script of
a checkout)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from h3serve.cli.common import EXIT_ERROR, CliError, bound_arg, decimal_arg, whole_arg
from h3serve.vocab import SMOKE_REQUEST


def add_accept_parser(sub: argparse._SubParsersAction) -> None:
    smoke = SMOKE_REQUEST  # not `accept`'s names: importing it pulls httpx and av into every command's start
    # allow_abbrev off: a prefix such as --api-key must not silently become --api-key-file (the key has no flag).
    p = sub.add_parser(
        "accept",
        allow_abbrev=False,
        help="two-render acceptance against a running server",
        description="Check health and model identity, render the fixed request twice through /v1/videos/sync, "
        "check each MP4, compare decoded frames byte for byte and audio by PSNR, and write a JSON report. Exit 0 "
        "only if everything holds. A size, duration or step count not given is the smoke request's where the "
        "server's limits (/v1/models) admit it, else the server's default. The key comes from H3_API_KEY or "
        "--api-key-file.",
    )
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--expect-model", help="the exact id /v1/models must list (default: exactly one model)")
    p.add_argument("--api-key-file", type=Path, help="file holding the bearer key (default: $H3_API_KEY)")
    p.add_argument("--out", type=Path, default=Path("accept"), help="folder for the MP4s and the report (accept/)")
    p.add_argument("--prompt", default=smoke.prompt, help="the prompt (the seed's smoke prompt)")
    fits = "where the server admits it, else the server's default"
    p.add_argument("--width", type=whole_arg, help=f"canvas width ({smoke.width} {fits})")
    p.add_argument("--height", type=whole_arg, help=f"canvas height ({smoke.height} {fits})")
    p.add_argument("--duration", type=decimal_arg, help=f"seconds, as extra_params.duration ({smoke.seconds} {fits})")
    p.add_argument("--steps", type=whole_arg, help=f"num_inference_steps (20 {fits})")
    p.add_argument("--seed", type=whole_arg, default=42, help="seed (42)")
    p.add_argument("--min-audio-psnr", type=bound_arg, default=math.inf, help="audio PSNR bound in dB (inf: identical)")
    p.add_argument("--timeout", type=decimal_arg, default=7200.0, help="seconds to wait for each render (7200)")
    p.add_argument("--wait-ready", type=decimal_arg, default=0.0, help="seconds to wait for the server to be ready (0)")
    p.set_defaults(func=cmd_accept)


BENCHES = (
    "dit-step", "render", "serve-accept", "warm-restart", "cuda-profile-check", "full-size-smoke", "gpu-check",
    "humming-check", "adaln-tables", "stepcache", "ref2va-smoke", "fused-passes", "text-encoder-fp8",
    "vae-decode-memory", "lora", "split", "one-box", "load", "start", "plot-scaling", "fa4-check", "offload", "decode",
    "host-memory", "decode-batch", "event-streams", "encode", "lora-runtime",
)  # fmt: skip


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a GPU benchmark script from a checkout's bench/ folder",
        description="Run bench/<NAME>.py of the repository checkout (the scripts and their library, bench/lib, are "
        "not part of the installed package), with src/ importable. Arguments after NAME go to the script, e.g. "
        "`h3serve bench dit-step --out bench/results/dit_step.json`. Results are recorded in bench/results/.",
    )
    p.add_argument("name", choices=BENCHES, help="which benchmark")
    p.add_argument("--repo", type=Path, default=Path("."), help="the repository checkout (default: here)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    script = args.repo / "bench" / f"{args.name.replace('-', '_')}.py"
    if not script.is_file():
        raise CliError(f"{script}: not found; run `h3serve bench` from the repository checkout or give --repo")
    env = dict(os.environ)
    paths = [str((args.repo / "src").resolve())]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, str(script), *args.script_args], env=env).returncode


def cmd_accept(args: argparse.Namespace) -> int:
    from h3serve.accept import AcceptPlan, run_accept

    key = os.environ.get("H3_API_KEY") or None
    if args.api_key_file is not None:
        try:
            key = args.api_key_file.read_text(encoding="utf-8").strip()
        except OSError as err:
            raise CliError(f"--api-key-file {args.api_key_file}: cannot read it ({err})") from err
    plan = AcceptPlan(
        url=args.url,
        out_dir=args.out,
        key=key,
        expect_model=args.expect_model,
        prompt=args.prompt,
        width=args.width,
        height=args.height,
        duration=args.duration,
        steps=args.steps,
        seed=args.seed,
        min_audio_psnr=args.min_audio_psnr,
        timeout=args.timeout,
        wait_ready=args.wait_ready,
    )
    passed, report = run_accept(plan)
    path = plan.out_dir / "accept-report.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    for check in report["checks"]:
        print(f"{'PASS' if check['passed'] else 'FAIL'}  {check['check']}: {check['detail']}", file=sys.stderr)
    for r in report["renders"]:
        print(f"render {r['index']}: HTTP {r['status']}, {r['client_seconds']} s client, engine "
              f"{r['inference_time_s']} s", file=sys.stderr)  # fmt: skip
    print(f"h3serve accept: {'PASSED' if passed else 'FAILED'} (report: {path})", file=sys.stderr)
    return 0 if passed else EXIT_ERROR
