"""The quick commands stay quick, and a stopped command leaves nothing behind.

`--help`, `--version`, each subcommand's `--help`, `check` without --preflight and `ready` import neither torch nor
transformers (nor av, numpy or httpx where they do not run it); `check` still refuses what the profile's own rules
refuse. Ctrl-C at any moment prints one line and exits 130; SIGTERM during `render` exits 143 the same way; neither
leaves the MP4 or its temporary file. Every run is a real process: what a process imports, and how it ends on a signal,
cannot be seen from inside the test's own.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from h3serve.cli import main

HEAVY = ("torch", "transformers")
# What a command's start should not pay for when it does not run it (0.1-0.2 s of CPU each).
MEDIA = ("av", "numpy", "httpx")
# Runs h3serve.cli.main in a fresh interpreter, then reports on stdout's last line which modules were imported.
PROBE = """
import json, sys
from h3serve.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
names = ("torch", "transformers", "av", "numpy", "httpx")
print(json.dumps({"code": code, "imported": [n for n in names if n in sys.modules]}))
"""


def clean_env() -> dict[str, str]:
    """This environment without H3_* variables (a developer's own would change what the commands read)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("H3_")}


def probe(*argv: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, env=env or clean_env()
    )
    assert proc.stdout.strip(), proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What each command imports --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["render", "--help"],
        ["serve", "--help"],
        ["check", "--help"],
        ["ready", "--help"],
        ["accept", "--help"],
        ["bench", "--help"],
        ["check"],
    ],
    ids=" ".join,
)
def test_the_parsers_and_check_import_no_torch_and_no_media(argv):
    result, err = probe(*argv)
    assert result["code"] == 0, err
    assert result["imported"] == [], f"h3serve {' '.join(argv)} imported {result['imported']}"


def test_ready_imports_httpx_only():
    # Nothing listens on the port: the answer is a refusal (exit 1), after the request was made with httpx.
    result, err = probe("ready", "--api-port", str(free_port()), "--timeout", "2")
    assert result["code"] == 1 and "no answer" in err, err
    assert result["imported"] == ["httpx"]


def test_help_takes_little_cpu():
    """A generous bound, for a loaded CI machine: measured here 0.15 s user+sys (0.56 s before the lazy imports)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result, err = probe("--help")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert result["code"] == 0, err
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 1.5, f"h3serve --help took {cpu:.2f} s of CPU"


# check without --preflight: the profile's rules, not the hardware ------------------------------------------------


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {"H3_LINEAR_BACKEND": "HUMMING", "H3_EXECUTION_MODE": "compile"},
            "H3_LINEAR_BACKEND (--linear-backend): linear HUMMING runs eager only",
        ),
        (
            {"H3_DEVICE": "cpu", "H3_DIFFUSION_ATTENTION_BACKEND": "CUDNN_ATTN"},
            "H3_DIFFUSION_ATTENTION_BACKEND (--diffusion-attention-backend): attention CUDNN_ATTN needs a CUDA device",
        ),
        (  # no device given: refused because neither device runs it
            {"H3_DIFFUSION_ATTENTION_BACKEND": "CUDNN_ATTN", "H3_DTYPE": "float32"},
            "attention CUDNN_ATTN has no float32 kernel",
        ),
    ],
    ids=["humming-compile", "cudnn-on-cpu", "cudnn-float32-any-device"],
)
def test_check_refuses_a_profile_rule_without_preflight_and_without_torch(env, words):
    result, err = probe("check", env={**clean_env(), **env})
    assert result["code"] == 1 and words in err, err
    assert not set(HEAVY) & set(result["imported"])


def test_check_leaves_the_hardware_to_preflight(tmp_path):
    """A CUDA device is a question for the machine: `check` accepts it, `check --preflight` asks (and on a machine
    without CUDA refuses)."""
    result, err = probe("check", "--device", "cuda")
    assert result["code"] == 0 and "--preflight" in err, err
    assert result["imported"] == []
    preflight = ["check", "--preflight", "--device", "cuda", "--output-dir", str(tmp_path / "out")]
    result, err = probe(*preflight, "--api-port", str(free_port()))
    assert "torch" in result["imported"]
    import torch

    if not torch.cuda.is_available():
        assert result["code"] == 1, err
        assert "H3_DEVICE (--device): device 'cuda': CUDA is not available on this machine" in err, err


def test_check_without_preflight_shows_the_profile_on_each_device_an_unset_device_may_become(capsys):
    assert main(["check", "--dtype", "float32"]) == 0
    profile = json.loads(capsys.readouterr().out)["profile"]
    assert profile["cpu"]["device"] == "cpu" and profile["cpu"]["dtype"] == "float32"
    assert profile["cuda"].startswith("invalid: attention CUDNN_ATTN has no float32 kernel")


def test_the_settings_take_the_encoders_defaults_and_bounds():
    from h3serve.config import ENCODER_PRESET, ENCODER_SEGMENT_FRAMES, MAX_ENCODER_THREADS
    from h3serve.media.encoding import MAX_SEGMENT_FRAMES, Encoding
    from h3serve.settings import EngineSettings

    def bounds(name: str) -> tuple:
        field = EngineSettings.model_fields[name]
        found = {type(m).__name__: m for m in field.metadata}
        return found["Ge"].ge, found["Le"].le

    assert bounds("encoder_threads") == (1, MAX_ENCODER_THREADS)
    assert bounds("encoder_segment_frames") == (0, MAX_SEGMENT_FRAMES)
    assert EngineSettings().encoding == Encoding()  # the settings' defaults are the writer's
    assert (Encoding().preset, Encoding().segment) == (ENCODER_PRESET, ENCODER_SEGMENT_FRAMES)
    nvenc = EngineSettings(encoder="nvenc").encoding
    assert (nvenc.preset, nvenc.segment) == ("p4", 0)  # its own preset, one stream
    assert EngineSettings(encoder_segment_frames=0, encoder_preset="medium").encoding.segment == 0


def test_a_refused_old_flag_is_named_as_typed(tmp_path, capsys, monkeypatch):
    for var in [v for v in os.environ if v.startswith("H3_")]:
        monkeypatch.delenv(var)
    for flag in ("--threads", "--encoder-threads"):
        assert main(["render", "a fox", "-o", str(tmp_path / "fox.mp4"), flag, "0"]) == 1
        err = capsys.readouterr().err
        assert "H3_ENCODER_THREADS (--encoder-threads): Input should be greater than or equal to 1" in err, err
        assert f'got "0" (from {flag})' in err, err
    assert list(tmp_path.iterdir()) == []


# Signals ---------------------------------------------------------------------------------------------------------


def console_script() -> str:
    exe = shutil.which("h3serve", path=os.path.dirname(sys.executable))
    assert exe is not None, "the h3serve console script is not installed beside this Python"
    return exe


def default_signals() -> None:
    """In the child: SIGINT and SIGTERM at their defaults, whatever this runner inherited (a shell's background job
    starts with SIGINT ignored, and Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# Long enough to catch in the encode (about 2 s of x264 on noise), short enough to reach it in seconds.
ENCODE_LONG = ["--steps", "2", "--no-progress", "--frames", "226", "--width", "256", "--height", "256"]
STOPPED = [(signal.SIGTERM, 143, "h3serve: terminated"), (signal.SIGINT, 130, "h3serve: interrupted")]
STOPPED_IDS = ["SIGTERM", "SIGINT"]


def assert_stopped(proc: subprocess.Popen, err: str, code: int, line: str, folder: Path) -> None:
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert lines[-1] == line and "Traceback" not in err, err
    assert list(folder.iterdir()) == [], "the partial output (or its temporary file) was left behind"


def start_render(out) -> subprocess.Popen:
    """`h3serve render` of a long tiny clip into `out`, its stderr piped, with default signal handling."""
    return subprocess.Popen(
        [console_script(), "render", "a fox", "-o", str(out), *ENCODE_LONG],
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        preexec_fn=default_signals,
    )


@pytest.mark.parametrize(("sig", "code", "line"), STOPPED, ids=STOPPED_IDS)
def test_a_signal_during_the_encode_removes_the_temporary_file(tmp_path, sig, code, line):
    out = tmp_path / "fox.mp4"
    proc = start_render(out)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".fox.mp4.*.tmp")):
            assert proc.poll() is None, f"ended before its encode was caught: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "no temporary MP4 appeared"
            time.sleep(0.01)
        proc.send_signal(sig)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert_stopped(proc, err, code, line, tmp_path)


@pytest.mark.parametrize(("sig", "code", "line"), STOPPED, ids=STOPPED_IDS)
def test_a_signal_during_the_render_leaves_nothing(tmp_path, sig, code, line):
    """Signalled once the header is out: in the load or the denoise, through the engine's code."""
    out = tmp_path / "fox.mp4"
    proc = start_render(out)
    try:
        header = ""
        while not header.startswith("h3serve: "):
            header = proc.stderr.readline()
            assert header, "ended before its header"
        assert "2 grid points (1 DiT forward)" in header, header
        proc.send_signal(sig)
        err = header + proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert_stopped(proc, err, code, line, tmp_path)


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.7, 1.0, 1.5])
def test_ctrl_c_while_starting_is_one_line_not_a_traceback(tmp_path, delay):
    """From the moment h3serve.cli is imported (before that, no code of ours runs): in the parsers' imports, in the
    settings, in torch's import."""
    code = (
        "import sys\nfrom h3serve.cli import main\nprint('started', flush=True)\n"
        f"sys.exit(main(['render', 'a fox', '-o', {str(tmp_path / 'fox.mp4')!r}, '--no-progress']))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        preexec_fn=default_signals,
    )
    try:
        assert proc.stdout.readline() == "started\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert_stopped(proc, err, 130, "h3serve: interrupted", tmp_path)
    assert err.count("h3serve: interrupted") == 1, err


def test_a_ctrl_c_while_a_native_module_imports_is_held_then_delivered():
    """Triton's native import calls back into Python; a KeyboardInterrupt raised in that callback aborts the process
    (exit -6) where it lands (seen in CI at 1 s after start). `signals_held` keeps the signal pending until the body
    ends, then Ctrl-C raises there as usual."""
    code = (
        "import os, signal, sys\nfrom h3serve.cli.signals import signals_held\n"
        "try:\n    with signals_held():\n        os.kill(os.getpid(), signal.SIGINT)\n"
        "        sum(range(10**6))\n        print('body ended', flush=True)\n"
        "    print('not interrupted', flush=True)\n"
        "except KeyboardInterrupt:\n    print('interrupted after', flush=True)\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env(),
                          preexec_fn=default_signals)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["body ended", "interrupted after", "True"]  # and Python's handler back


def test_render_puts_the_sigterm_handler_back(tmp_path, capsys, monkeypatch):
    """The handler is the command's, for its duration: not set at import, and the one before is back after."""
    for var in [v for v in os.environ if v.startswith("H3_")]:
        monkeypatch.delenv(var)
    seen: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        assert main(["render", "a fox", "-o", str(tmp_path / "fox.mp4"), "--steps", "2", "--no-progress"]) == 0
        assert "2 grid points (1 DiT forward)" in capsys.readouterr().err
        after = signal.getsignal(signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to on_sigterm, not turned into Terminated
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert after is on_sigterm and seen == [signal.SIGTERM]
