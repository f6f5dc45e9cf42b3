"""Files that settings name are checked before they are read (issue 43): a FIFO, a character device, a folder, a file
far over its cap or one this user cannot read is refused naming the variable and the path, and nothing blocks or
reads without end on the way. Nested JSON is refused naming its variable; a served model name is one printable line;
a long value is echoed capped, by the one function the API's errors use too.

The commands run as real processes, as an operator runs them: a FIFO that was opened to read would hang the process
forever, and /dev/zero read whole would fill its memory. A process's timeout is there to end such a hang, not to time
the refusal (which takes the start-up of a command, about a second): a busy machine must not fail these tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from adapter_fixtures import write_adapter
from h3serve.checkpoint.adapters import AdapterError, read_adapter
from h3serve.config import TINY_DIT
from h3serve.errors import ECHO_CHARS, SettingError, shown
from h3serve.files import FileRefused, open_regular, read_regular, read_setting_file
from h3serve.settings import CONFIG_FILE_CAP, KEY_FILE_CAP, SettingsError, load_settings
from service_fixtures import free_port

KEY = "k3y-" + "abcdefghijklmnopqrstuvwxyz0123456789._~"  # 43 characters of [A-Za-z0-9._~-]
REAL_OPEN = os.open  # a test may replace os.open; the FIFO's release must not go through the replacement
HANG = 120  # seconds after which a command that has not answered is taken as hung (it answers in about one)
as_root = pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads every file whatever its mode"
)


@pytest.fixture(autouse=True)
def no_h3_environment(monkeypatch):
    for var in list(os.environ):
        if var.startswith("H3_"):
            monkeypatch.delenv(var)


def h3serve(*argv: str, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """`h3serve ARGV` in a fresh process with only the given H3_ variables: its exit code and its stderr. A command
    that blocks on a file fails the test at HANG seconds instead of hanging it."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("H3_")} | env
    code = "import sys; from h3serve.cli import main; sys.exit(main(sys.argv[1:]))"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv], env=full, cwd=cwd, capture_output=True, text=True, timeout=HANG
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"h3serve {' '.join(argv)} did not answer in {HANG} s (blocked on a file?): {err.stderr!r}")
    return proc.returncode, proc.stderr


def violations(env: dict[str, str] | None = None, config_file: Path | None = None) -> list[str]:
    with pytest.raises(SettingsError) as info:
        load_settings(None, env or {}, config_file, check_profile=False)
    return info.value.violations


def the_one(lines: list[str], *needles: str) -> str:
    """The violation holding every needle (the test fails if there is none)."""
    found = [v for v in lines if all(n in v for n in needles)]
    assert found, f"no violation with {needles}: {lines}"
    return found[0]


def in_thread(call, *, release: Path | None = None):
    """`call()` in a thread; its result or exception. If it has not returned after HANG seconds (blocked in the open
    of the FIFO `release`), a writer is opened on that FIFO to free it, and the test fails."""
    out: dict = {}

    def run():
        try:
            out["result"] = call()
        except BaseException as err:  # handed back to the test
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG)
    if thread.is_alive():
        if release is not None:
            os.close(REAL_OPEN(release, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(HANG)
        pytest.fail(f"blocked for {HANG} s opening a FIFO")
    return out


# ---- the key file --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [("check",), ("ready", "--timeout", "1"), ("check", "--preflight"), ("serve",)])
def test_a_fifo_key_file_is_refused_naming_the_variable(tmp_path, command):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo, 0o600)
    env = {"H3_API_KEY_FILE": str(fifo), "H3_DEVICE": "cpu", "H3_OUTPUT_DIR": str(tmp_path / "out")}
    env["H3_API_PORT"] = str(free_port())  # not the default 8000, which a user's server may hold
    code, err = h3serve(*command, env=env, cwd=tmp_path)
    assert code != 0
    line = the_one(err.splitlines(), "H3_API_KEY_FILE (--api-key-file)", "is a FIFO, not a regular file")
    assert str(fifo) in line, line


def test_dev_zero_as_the_key_file_is_refused_naming_the_variable(tmp_path):
    code, err = h3serve("check", env={"H3_API_KEY_FILE": "/dev/zero"}, cwd=tmp_path)
    assert code != 0
    the_one(err.splitlines(), "H3_API_KEY_FILE", '"/dev/zero" is a character device, not a regular file')
    assert "MemoryError" not in err


def test_a_200_mib_key_file_is_refused_by_its_size_and_the_cap(tmp_path):
    big = tmp_path / "key"
    big.touch(mode=0o600)
    os.truncate(big, 200 << 20)  # sparse: nothing is written
    line = the_one(violations({"H3_API_KEY_FILE": str(big)}), "H3_API_KEY_FILE", str(big))
    assert "200 MiB (209715200 bytes)" in line and "over the cap of 4 KiB" in line, line
    assert KEY_FILE_CAP == 4 << 10


def test_a_key_file_of_the_cap_is_read_and_one_byte_more_is_not(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + " " * (KEY_FILE_CAP - len(KEY)))
    path.chmod(0o600)
    env = {"H3_API_KEY_FILE": str(path), "H3_BIND_HOST": "0.0.0.0", "H3_ALLOW_REMOTE_API": "true"}
    assert load_settings(None, env, check_profile=False).key == KEY
    path.write_text(KEY + " " * (KEY_FILE_CAP + 1 - len(KEY)))
    the_one(violations(env), "H3_API_KEY_FILE", "over the cap of 4 KiB")


def test_a_folder_as_the_key_file_is_refused(tmp_path):
    the_one(violations({"H3_API_KEY_FILE": str(tmp_path)}), "H3_API_KEY_FILE", "is a directory, not a regular file")


def test_a_missing_key_file_is_refused_as_missing(tmp_path):
    the_one(violations({"H3_API_KEY_FILE": str(tmp_path / "absent")}), "H3_API_KEY_FILE", "does not exist")


@as_root
def test_an_unreadable_key_file_is_refused_as_unreadable(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY)
    path.chmod(0o000)
    line = the_one(violations({"H3_API_KEY_FILE": str(path)}), "H3_API_KEY_FILE", "is not readable by this user")
    assert KEY not in line


def test_a_key_file_that_cannot_be_opened_is_refused_as_unreadable(tmp_path, monkeypatch):
    # What a non-root user meets with a mode-000 file, for the suite run as root: the open is refused.
    path = tmp_path / "key"
    path.write_text(KEY)
    path.chmod(0o600)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", refuse)
    line = the_one(violations({"H3_API_KEY_FILE": str(path)}), "H3_API_KEY_FILE", "is not readable by this user")
    assert str(path) in line and KEY not in line


# ---- the config file -----------------------------------------------------------------------------------------------


def test_a_fifo_config_file_is_refused_by_check_naming_the_flag(tmp_path):
    fifo = tmp_path / "h3.json"
    os.mkfifo(fifo)
    code, err = h3serve("check", "--config", str(fifo), env={}, cwd=tmp_path)
    assert code != 0
    the_one(err.splitlines(), "--config", str(fifo), "is a FIFO, not a regular file")


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: Path("/dev/zero"), "is a character device, not a regular file"),
        (lambda p: p, "is a directory, not a regular file"),
        (lambda p: p / "absent.json", "does not exist"),
        (lambda p: big_file(p / "h3.json", 200 << 20), "200 MiB (209715200 bytes), over the cap of 1 MiB"),
    ],
    ids=["dev-zero", "folder", "missing", "200-mib"],
)
def test_a_config_file_that_is_not_one_is_refused(tmp_path, make, words):
    path = make(tmp_path)
    the_one(violations(config_file=path), "--config", str(path), words)


def big_file(path: Path, size: int) -> Path:
    path.touch()
    os.truncate(path, size)
    return path


def test_a_config_file_of_the_cap_is_read(tmp_path):
    path = tmp_path / "h3.json"
    text = '{"api_port": 9000}'
    path.write_text(text + " " * (CONFIG_FILE_CAP - len(text)))
    assert load_settings(None, {}, path, check_profile=False).api_port == 9000
    path.write_text(text + " " * (CONFIG_FILE_CAP + 1 - len(text)))
    the_one(violations(config_file=path), "--config", "over the cap of 1 MiB")


@as_root
def test_an_unreadable_config_file_is_refused(tmp_path):
    path = tmp_path / "h3.json"
    path.write_text("{}")
    path.chmod(0o000)
    the_one(violations(config_file=path), "--config", str(path), "is not readable by this user")


@pytest.mark.parametrize(("name", "text"), [("h3.json", "[" * 100_000), ("h3.toml", "a = " + "[" * 100_000)])
def test_a_deeply_nested_config_file_is_refused_naming_it(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    the_one(violations(config_file=path), "--config", str(path), "nested too deeply")


# ---- adapters ------------------------------------------------------------------------------------------------------


def test_dev_zero_as_an_adapter_is_a_character_device_not_a_missing_file(tmp_path):
    line = the_one(violations({"H3_LORA": "/dev/zero:0.5"}), "H3_LORA (--lora)", '"/dev/zero"')
    assert "is a character device, not a regular file" in line and "no such file" not in line, line


def test_a_fifo_or_a_folder_as_an_adapter_is_refused(tmp_path):
    fifo = tmp_path / "turbo.safetensors"
    os.mkfifo(fifo)
    lines = violations({"H3_LORA": f"{fifo},{tmp_path}"})
    the_one(lines, "H3_LORA", str(fifo), "is a FIFO, not a regular file")
    the_one(lines, "H3_LORA", f'"{tmp_path}" is a directory, not a regular file')


def test_a_missing_adapter_still_says_no_such_file(tmp_path):
    the_one(violations({"H3_LORA": str(tmp_path / "absent.safetensors")}), "H3_LORA", "no such file")


def test_a_large_adapter_is_not_refused_by_a_cap(tmp_path):
    path = big_file(tmp_path / "big.safetensors", 200 << 20)  # sparse; what it holds is read later, at start
    assert load_settings(None, {"H3_LORA": str(path)}, check_profile=False).adapter_files() == [(path, 1.0)]


def test_the_adapter_reader_refuses_a_fifo_without_opening_it_to_wait(tmp_path):
    fifo = tmp_path / "turbo.safetensors"
    os.mkfifo(fifo)
    out = in_thread(lambda: read_adapter(fifo, config=TINY_DIT), release=fifo)
    assert isinstance(out.get("error"), AdapterError), out
    assert "is a FIFO, not a regular file" in str(out["error"]) and out["error"].path == fifo


def test_the_adapter_reader_reads_a_real_adapter_through_the_checked_descriptor(tmp_path):
    path = write_adapter(tmp_path / "turbo.safetensors", "native", TINY_DIT)
    adapter = read_adapter(path, 0.5, config=TINY_DIT)
    assert adapter.path == path and adapter.targets > 0 and adapter.scale == 0.5
    with pytest.raises(AdapterError, match="is a character device, not a regular file"):
        read_adapter("/dev/zero", config=TINY_DIT)


# ---- the helper: nothing blocks, nothing past the cap is read ------------------------------------------------------


def test_a_fifo_swapped_in_after_the_check_is_refused_without_blocking(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text(KEY)
    real_open = os.open

    def swap_then_open(file, flags, *args):
        os.unlink(path)
        os.mkfifo(path)  # between the stat and the open: without O_NONBLOCK the open waits for a writer forever
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", swap_then_open)
    out = in_thread(lambda: read_regular(path, 4096), release=path)
    monkeypatch.undo()
    assert isinstance(out.get("error"), FileRefused), out
    assert out["error"].reason == "is a FIFO, not a regular file" and out["error"].path == path


def test_a_file_that_grew_after_the_check_is_refused_on_what_was_opened(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text("x" * 100)
    real_open = os.open

    def grow_then_open(file, flags, *args):
        os.truncate(path, 10 << 20)
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", grow_then_open)
    with pytest.raises(FileRefused, match=r"is 10 MiB \(10485760 bytes\), over the cap of 4 KiB"):
        read_regular(path, 4096)


def test_at_most_one_byte_past_the_cap_is_read_whatever_the_size_says(tmp_path, monkeypatch):
    # A file whose stat says 10 bytes (as /proc's files say 0) but that holds 10,000: the read stops at cap + 1.
    path = tmp_path / "key"
    path.write_text("x" * 10_000)
    real_stat, real_fstat, real_read = os.stat, os.fstat, os.read
    read: list[int] = []

    def small(st: os.stat_result) -> os.stat_result:
        return os.stat_result((*st[:6], 10, *st[7:10]))

    def counting_read(fd, n):
        data = real_read(fd, n)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "stat", lambda p, *a, **k: small(real_stat(p, *a, **k)))
    monkeypatch.setattr(os, "fstat", lambda fd: small(real_fstat(fd)))
    monkeypatch.setattr(os, "read", counting_read)
    with pytest.raises(FileRefused, match="grew past the cap of 100 bytes"):
        read_regular(path, 100)
    assert sum(read) == 101


def test_the_helper_names_the_setting_as_data(tmp_path):
    with pytest.raises(SettingError) as info:
        read_setting_file("api_key_file", Path("/dev/zero"), 4096)
    assert info.value.setting == "api_key_file" and info.value.message.startswith('"/dev/zero" is a character')
    assert read_setting_file("api_key_file", write(tmp_path / "k", "abc"), 4096) == b"abc"
    with open_regular(write(tmp_path / "k", "abc")) as fd:
        assert os.read(fd, 10) == b"abc"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---- nested JSON, the served name, the echo ------------------------------------------------------------------------


def test_a_deeply_nested_cache_config_is_refused_naming_the_variable():
    env = {"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": "[" * 100_000}
    line = the_one(violations(env), "H3_CACHE_CONFIG (--cache-config)", "nested too deeply")
    assert len(line) < 300, line


def test_a_deeply_nested_cache_config_is_refused_by_check(tmp_path):
    env = {"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": '{"a": ' + "[" * 100_000}
    code, err = h3serve("check", env=env, cwd=tmp_path)
    assert code != 0 and "RecursionError" not in err
    the_one(err.splitlines(), "H3_CACHE_CONFIG", "nested too deeply")


@pytest.mark.parametrize(
    "name", ["   ", "h3\nmodel", "h3\n", " h3", "h3 ", "h3\tmodel", "h3\x00", "h3\x1b[31m", "h3\u2028x", "a" * 257]
)
def test_a_served_model_name_that_is_not_one_printable_line_is_refused(name):
    line = the_one(violations({"H3_SERVED_MODEL_NAME": name}), "H3_SERVED_MODEL_NAME (--served-model-name)")
    assert "printable" in line or "at most 256 characters" in line, line
    assert "\n" not in line and "\x1b" not in line


def test_a_blank_served_model_name_in_a_config_file_is_refused(tmp_path):
    path = write(tmp_path / "h3.json", '{"served_model_name": " "}')
    the_one(violations(config_file=path), "H3_SERVED_MODEL_NAME", "printable", 'got " "')


@pytest.mark.parametrize("name", ["h3", "MiniMax-H3 FL2VA (turbo)", "org/model:v1.2", "é-model", "a" * 256])
def test_a_served_model_name_of_one_printable_line_is_accepted(name):
    assert load_settings(None, {"H3_SERVED_MODEL_NAME": name}, check_profile=False).model_id == name


def long_values(tmp_path: Path) -> dict[str, tuple[dict[str, str], Path | None]]:
    mb = 1 << 20
    half = mb // 3  # two of them fit in a config file of at most 1 MiB
    config = write(tmp_path / "h3.json", json.dumps({"api_port": "9" * half, "k" * half: 1}))
    cache = json.dumps({"q" * mb: 1})
    return {
        "api_port and an unknown key in a config file": ({}, config),
        "bind_host": ({"H3_BIND_HOST": "a b" * mb}, None),
        "a remote bind_host": ({"H3_BIND_HOST": "a" * mb}, None),
        "lora": ({"H3_LORA": "/x/" + "y" * mb}, None),
        "a lora scale": ({"H3_LORA": "a:" + "z" * mb}, None),
        "an unknown cache-dit key": ({"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": cache}, None),
        "a served model name": ({"H3_SERVED_MODEL_NAME": "n" * mb}, None),
        "an unknown H3_ variable": ({"H3_" + "V" * mb: "1"}, None),
        "the key file": ({"H3_API_KEY_FILE": "/k/" + "f" * mb}, None),
        "the cache dir": ({"H3_CACHE_DIR": "/proc/" + "c" * mb}, None),
    }


@pytest.mark.parametrize(
    "case",
    [
        "api_port and an unknown key in a config file",
        "bind_host",
        "a remote bind_host",
        "lora",
        "a lora scale",
        "an unknown cache-dit key",
        "a served model name",
        "an unknown H3_ variable",
        "the key file",
        "the cache dir",
    ],
)
def test_a_megabyte_value_is_echoed_capped_with_its_length(tmp_path, case):
    env, config = long_values(tmp_path)[case]
    lines = violations(env, config)
    assert lines
    for line in lines:
        assert len(line) < 1500, f"{len(line)} characters: {line[:300]}"
    assert any("characters)" in line and '..."' in line for line in lines), [line[:300] for line in lines]


def test_settings_and_the_api_echo_by_the_same_function():
    from h3serve.service import errors as api_errors

    assert api_errors.shown is shown
    text = shown("x" * (1 << 20))
    assert text == '"' + "x" * ECHO_CHARS + f'..." ({1 << 20} characters)'
    assert shown("x" * ECHO_CHARS) == '"' + "x" * ECHO_CHARS + '"'
