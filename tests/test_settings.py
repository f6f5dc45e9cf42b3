"""Settings: one schema filled from defaults < config file < H3_* environment < flags; every violation reported at
once, each naming its environment variable; the key never shown; `h3serve check` prints the result or the refusals."""

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from h3serve.cli import build_parser, main
from h3serve.errors import shown
from h3serve.settings import CLI_FIELDS, REDACTED, Settings, SettingsError, add_flags, load_settings

KEY = "k3y-" + "abcdefghijklmnopqrstuvwxyz0123456789._~"  # 43 characters of [A-Za-z0-9._~-]
SHORT_KEY = "a" * 31
REMOTE = {"H3_BIND_HOST": "0.0.0.0", "H3_ALLOW_REMOTE_API": "true"}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture(autouse=True)
def no_h3_environment(monkeypatch):
    """load_settings(env=None) and `h3serve check` read os.environ: start every test with no H3_* variable."""
    for var in list(os.environ):
        if var.startswith("H3_"):
            monkeypatch.delenv(var)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(list(argv))


def refusals(env: dict[str, str] | None = None, args=None, config_file=None) -> list[str]:
    with pytest.raises(SettingsError) as info:
        load_settings(args, {} if env is None else env, config_file)
    assert info.value.violations, "a SettingsError must list its violations"
    assert str(info.value) == "\n".join(info.value.violations)
    return info.value.violations


def refused(env=None, *needles: str, args=None, config_file=None) -> str:
    """The one violation that contains every needle (fails if none does); returns all violations as one text."""
    violations = refusals(env, args, config_file)
    assert any(all(n in v for n in needles) for v in violations), f"no violation with {needles}: {violations}"
    return "\n".join(violations)


def write_key_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


# Defaults and the environment ----------------------------------------------------------------------------------


def test_defaults():
    s = load_settings(env={})
    assert (s.bind_host, s.api_port, s.allow_remote_api, s.key) == ("127.0.0.1", 8000, False, None)
    assert s.video_sync_timeout == 7200
    assert s.startup_warmup is True
    assert (s.cache_backend, s.cache_config) == ("none", None)
    assert s.model is None and s.model_id == "h3serve-tiny"


def test_reads_os_environ_when_env_is_none(monkeypatch):
    monkeypatch.setenv("H3_API_PORT", "9001")
    assert load_settings().api_port == 9001


def test_the_suites_own_variables_are_outside_the_settings_prefix(monkeypatch):
    """The test suite's switches (H3TEST_*) are not H3_ variables: the settings neither read nor refuse them, and
    need no list of exceptions."""
    monkeypatch.setenv("H3TEST_REQUIRE_ORACLE", "1")
    assert load_settings().api_port == 8000
    assert load_settings(env={"H3TEST_REQUIRE_ORACLE": "1"}).api_port == 8000
    with pytest.raises(SettingsError, match="H3_REQUIRE_ORACLE: not an h3serve setting"):
        load_settings(env={"H3_REQUIRE_ORACLE": "1"})


def test_unknown_h3_variable_refused_by_name():
    text = refused({"H3_EXECUTON_MODE": "eager"}, "H3_EXECUTON_MODE", "not an h3serve setting", "H3_EXECUTION_MODE")
    assert "H3_EXECUTON_MODE" in text


def test_empty_environment_values_are_unset():
    s = load_settings(env={"H3_API_PORT": "", "H3_BIND_HOST": "", "H3_STARTUP_WARMUP": "", "H3_API_KEY": ""})
    assert (s.api_port, s.bind_host, s.startup_warmup, s.key) == (8000, "127.0.0.1", True, None)


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("false", False)])
def test_boolean_from_environment(value, expected):
    s = load_settings(env={"H3_STARTUP_WARMUP": value, "H3_ALLOW_REMOTE_API": value})
    assert s.startup_warmup is expected and s.allow_remote_api is expected


def test_bad_boolean_refused():
    refused({"H3_STARTUP_WARMUP": "maybe"}, "H3_STARTUP_WARMUP", '"maybe"')


# Enumerations and what this build runs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("var", "bad", "allowed"),
    [
        ("H3_DIFFUSION_ATTENTION_BACKEND", "FLASH_ATTN", ("CUDNN_ATTN", "TORCH_SDPA")),
        ("H3_DIFFUSION_ATTENTION_BACKEND", "torch_sdpa", ("CUDNN_ATTN", "TORCH_SDPA")),
        ("H3_EXECUTION_MODE", "jit", ("compile", "eager")),
        ("H3_LINEAR_BACKEND", "FP8", ("BF16", "CUTLASS", "HUMMING")),
        ("H3_CACHE_BACKEND", "teacache", ("none", "cache_dit")),
        ("H3_DTYPE", "float16", ("bfloat16", "float32")),
        ("H3_VAE_AUTOCAST", "bfloat16", ("float16", "none")),
        ("H3_QKV_LAYOUT", "mixed", ("stacked", "interleaved")),
    ],
)
def test_enum_refuses_a_bad_value(var, bad, allowed):
    refused({var: bad}, var, shown(bad), *allowed)


@no_cuda
@pytest.mark.parametrize(
    ("var", "value", "allowed_on_cpu"),
    [
        ("H3_DIFFUSION_ATTENTION_BACKEND", "CUDNN_ATTN", "TORCH_SDPA"),
        ("H3_EXECUTION_MODE", "compile", "eager"),
        ("H3_LINEAR_BACKEND", "CUTLASS", "BF16"),
    ],
)
def test_cuda_only_backends_refused_on_the_cpu(var, value, allowed_on_cpu):
    refused({var: value}, var, value, "needs a CUDA device", f"allowed on cpu: {allowed_on_cpu}")


def test_built_backends_accepted():
    env = {"H3_DIFFUSION_ATTENTION_BACKEND": "TORCH_SDPA", "H3_EXECUTION_MODE": "eager", "H3_LINEAR_BACKEND": "BF16"}
    s = load_settings(env=env)
    assert (s.diffusion_attention_backend, s.execution_mode, s.linear_backend) == ("TORCH_SDPA", "eager", "BF16")


@no_cuda
def test_cuda_device_refused_without_cuda():
    refused(None, "H3_DEVICE (--device)", "CUDA is not available", args=parse("--device", "cuda"))


@no_cuda
def test_float16_vae_autocast_refused_on_cpu():
    refused({"H3_VAE_AUTOCAST": "float16"}, "H3_VAE_AUTOCAST", "needs a CUDA device")


# Bounds ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["0", "65536", "-1", "abc"])
def test_bad_port_refused(port):
    refused({"H3_API_PORT": port}, "H3_API_PORT (--api-port)", shown(port))


@pytest.mark.parametrize("port", [1, 65535])
def test_port_bounds_accepted(port):
    assert load_settings(env={"H3_API_PORT": str(port)}).api_port == port


@pytest.mark.parametrize("timeout", ["599", "14401"])
def test_video_sync_timeout_out_of_bounds_refused(timeout):
    refused({"H3_VIDEO_SYNC_TIMEOUT": timeout}, "H3_VIDEO_SYNC_TIMEOUT (--video-sync-timeout)", timeout)


@pytest.mark.parametrize("timeout", [600, 14400])
def test_video_sync_timeout_bounds_accepted(timeout):
    assert load_settings(env={"H3_VIDEO_SYNC_TIMEOUT": str(timeout)}).video_sync_timeout == timeout


# Step caching and HUMMING -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "needles"),
    [
        ({"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": "{not json"}, ("H3_CACHE_CONFIG", "not valid JSON")),
        ({"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": "[1, 2]"}, ("H3_CACHE_CONFIG", "JSON object", "list")),
        ({"H3_CACHE_CONFIG": '{"Fn": 1}'}, ("H3_CACHE_CONFIG", "H3_CACHE_BACKEND is none")),
        ({"H3_CACHE_BACKEND": "cache_dit"}, ("H3_CACHE_BACKEND", "requires an explicit", "H3_CACHE_CONFIG")),
        (
            {"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": '{"Fn_compute_block": 1}'},
            ("H3_CACHE_CONFIG", '"Fn_compute_block"', "unknown", "did you mean 'Fn_compute_blocks'"),
        ),
        (
            {"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": '{"max_warmup_steps": "4"}'},
            ("H3_CACHE_CONFIG", "max_warmup_steps", "must be an integer"),
        ),
        (
            {"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": '{"residual_diff_threshold": -0.1}'},
            ("H3_CACHE_CONFIG", "residual_diff_threshold", "out of range"),
        ),
        (
            {"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": '{"enable_taylorseer": true}'},
            ("H3_CACHE_CONFIG", "enable_taylorseer", "not built"),
        ),
    ],
    ids=[
        "invalid-json",
        "json-list",
        "config-without-cache",
        "cache-without-config",
        "misspelt-key",
        "wrong-type",
        "out-of-range",
        "taylorseer",
    ],
)
def test_cache_rules(env, needles):
    refused(env, *needles)


def test_cache_dit_with_the_balanced_profile_starts():
    """The profile operators ran with the seed's Cache-DiT (H3_CACHE_CONFIG keeps cache-dit's key names)."""
    balanced = (
        '{"Fn_compute_blocks":1,"Bn_compute_blocks":0,"max_warmup_steps":4,"max_cached_steps":-1,'
        '"residual_diff_threshold":0.10,"max_continuous_cached_steps":1,"enable_taylorseer":false}'
    )
    s = load_settings(env={"H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": balanced})
    assert (s.cache_backend, s.cache_config) == ("cache_dit", balanced)


def test_humming_refuses_compile():
    env = {"H3_LINEAR_BACKEND": "HUMMING", "H3_EXECUTION_MODE": "compile"}
    refused(env, "H3_LINEAR_BACKEND", "HUMMING runs eager only", "set execution eager, got compile")


def test_humming_refuses_cache():
    env = {"H3_LINEAR_BACKEND": "HUMMING", "H3_CACHE_BACKEND": "cache_dit", "H3_CACHE_CONFIG": "{}"}
    refused(env, "H3_LINEAR_BACKEND", "HUMMING is the deterministic profile and runs without a step cache", "cache_dit")


@no_cuda
def test_humming_with_eager_is_refused_on_the_cpu_only_for_the_device():
    violations = refusals({"H3_LINEAR_BACKEND": "HUMMING", "H3_EXECUTION_MODE": "eager"})
    assert len(violations) == 1
    assert "H3_LINEAR_BACKEND" in violations[0] and "needs a CUDA device (allowed on cpu: BF16)" in violations[0]


# The network and the key -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_host_needs_no_key(host):
    s = load_settings(env={"H3_BIND_HOST": host})
    assert s.bind_host == host and s.key is None


def test_malformed_host_refused():
    refused({"H3_BIND_HOST": "bad host!"}, "H3_BIND_HOST (--bind-host)", "[A-Za-z0-9.:-]+", '"bad host!"')


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5"])
def test_remote_host_refused_without_allow(host):
    refused({"H3_BIND_HOST": host, "H3_API_KEY": KEY}, "H3_BIND_HOST", host, "H3_ALLOW_REMOTE_API=true")


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5"])
def test_remote_host_refused_with_allow_but_no_key(host):
    refused({**REMOTE, "H3_BIND_HOST": host}, "H3_BIND_HOST", "requires H3_API_KEY or H3_API_KEY_FILE")


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5"])
def test_remote_host_accepted_with_allow_and_key(host):
    s = load_settings(env={**REMOTE, "H3_BIND_HOST": host, "H3_API_KEY": KEY})
    assert (s.bind_host, s.allow_remote_api, s.key) == (host, True, KEY)


@pytest.mark.parametrize(
    "bad_key",
    [SHORT_KEY, "a" * 31 + "/", "a" * 16 + " " + "a" * 16],
    ids=["31-chars", "slash", "space"],
)
@pytest.mark.parametrize("env", [{}, REMOTE], ids=["loopback", "remote"])
def test_weak_key_refused_and_never_shown(env, bad_key):
    text = refused({**env, "H3_API_KEY": bad_key}, "H3_API_KEY", "32 or more characters of [A-Za-z0-9._~-]")
    assert bad_key not in text


def test_key_never_in_violations_or_resolved_output():
    # A valid key next to other mistakes: the key must appear nowhere in what is reported.
    text = refused({**REMOTE, "H3_API_KEY": KEY, "H3_API_PORT": "0", "H3_DTYPE": "x"}, "H3_API_PORT")
    assert KEY not in text
    resolved = load_settings(env={**REMOTE, "H3_API_KEY": KEY}).resolved()
    assert resolved["api_key"] == REDACTED and resolved["api_auth"] is True
    assert KEY not in json.dumps(resolved)


def test_key_file_read_and_stripped(tmp_path):
    path = write_key_file(tmp_path / "key", KEY + "\n")
    s = load_settings(args=parse("--api-key-file", str(path)), env=REMOTE)
    assert s.key == KEY and s.api_key is None
    assert KEY not in json.dumps(s.resolved())
    assert load_settings(env={**REMOTE, "H3_API_KEY_FILE": str(path)}).key == KEY


def test_key_file_readable_by_others_refused(tmp_path):
    path = write_key_file(tmp_path / "key", KEY, mode=0o644)
    env = {"H3_API_KEY_FILE": str(path)}
    text = refused(env, "H3_API_KEY_FILE (--api-key-file)", "readable by others", "mode 644", "chmod 600")
    assert KEY not in text


def test_missing_key_file_refused(tmp_path):
    refused({"H3_API_KEY_FILE": str(tmp_path / "absent")}, "H3_API_KEY_FILE", "does not exist (no such file)")


def test_weak_key_in_file_refused(tmp_path):
    path = write_key_file(tmp_path / "key", SHORT_KEY)
    text = refused({"H3_API_KEY_FILE": str(path)}, "H3_API_KEY_FILE", "32 or more characters")
    assert SHORT_KEY not in text


def test_key_and_key_file_refused_together(tmp_path):
    path = write_key_file(tmp_path / "key", KEY)
    text = refused({"H3_API_KEY": KEY, "H3_API_KEY_FILE": str(path)}, "H3_API_KEY", "H3_API_KEY_FILE", "not both")
    assert KEY not in text


# All at once -----------------------------------------------------------------------------------------------------


def test_every_violation_reported_at_once():
    env = {
        "H3_API_PORT": "0",
        "H3_VIDEO_SYNC_TIMEOUT": "599",
        "H3_BIND_HOST": "bad host!",
        "H3_EXECUTON_MODE": "eager",
        "H3_DTYPE": "float16",
    }
    violations = refusals(env)
    assert len(violations) >= 5
    for var in ("H3_API_PORT", "H3_VIDEO_SYNC_TIMEOUT", "H3_BIND_HOST", "H3_EXECUTON_MODE", "H3_DTYPE"):
        assert any(var in v for v in violations), var


# Sources and precedence ------------------------------------------------------------------------------------------


CONFIG_JSON = '{"api_port": 9000, "video_sync_timeout": 900, "startup_warmup": false, "served_model_name": "h3"}'
CONFIG_TOML = 'api_port = 9000\nvideo_sync_timeout = 900\nstartup_warmup = false\nserved_model_name = "h3"\n'


@pytest.mark.parametrize(("name", "text"), [("h3.json", CONFIG_JSON), ("h3.toml", CONFIG_TOML)])
def test_config_file_sets_values(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    for s in (load_settings(env={}, config_file=path), load_settings(parse("--config", str(path)), env={})):
        assert (s.api_port, s.video_sync_timeout, s.startup_warmup, s.model_id) == (9000, 900, False, "h3")


def test_precedence_file_then_environment_then_flag(tmp_path):
    path = tmp_path / "h3.toml"
    path.write_text("api_port = 9000\nvideo_sync_timeout = 900\n")
    env = {"H3_API_PORT": "9100", "H3_VIDEO_SYNC_TIMEOUT": "1000"}
    s = load_settings(parse("--config", str(path)), env=env)
    assert (s.api_port, s.video_sync_timeout) == (9100, 1000)
    s = load_settings(parse("--config", str(path), "--api-port", "9200"), env=env)
    assert (s.api_port, s.video_sync_timeout) == (9200, 1000)


def test_boolean_flags():
    assert load_settings(parse("--no-startup-warmup"), env={"H3_STARTUP_WARMUP": "true"}).startup_warmup is False
    assert load_settings(parse("--startup-warmup"), env={"H3_STARTUP_WARMUP": "false"}).startup_warmup is True
    assert load_settings(parse(), env={}).startup_warmup is True


def test_bad_value_in_config_file_names_setting_and_source(tmp_path):
    path = tmp_path / "h3.json"
    path.write_text('{"api_port": 70000}')
    refused(None, "H3_API_PORT", "70000", str(path), config_file=path)


def test_unknown_key_in_config_file_refused(tmp_path):
    path = tmp_path / "h3.json"
    path.write_text('{"api_prot": 9000}')
    refused(None, str(path), 'unknown setting "api_prot"', "api_port", config_file=path)


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("h3.json", '{"api_port": 9000', "not valid JSON"),
        ("h3.toml", "api_port = = 9000", "not valid TOML"),
        ("h3.json", "[1, 2]", "must hold a table/object"),
        ("absent.json", None, "does not exist (no such file)"),
        ("a-folder.toml", "", "is a directory, not a regular file"),
    ],
    ids=["bad-json", "bad-toml", "json-list", "missing", "folder"],
)
def test_unreadable_or_invalid_config_file_refused(tmp_path, name, text, needle):
    path = tmp_path / name
    if name.startswith("a-folder"):
        path.mkdir()
    elif text is not None:
        path.write_text(text)
    refused(None, "--config", str(path), needle, config_file=path)


# Generated flags -------------------------------------------------------------------------------------------------


def test_every_setting_but_the_keys_has_a_flag_naming_its_variable():
    parser = argparse.ArgumentParser()
    add_flags(parser)
    flags = parser._option_string_actions
    assert set(CLI_FIELDS) == set(Settings.model_fields) - {"api_key", "node_key"}
    for field in CLI_FIELDS:
        flag = "--" + field.replace("_", "-")
        assert flag in flags, flag
        assert f"H3_{field.upper()}" in flags[flag].help, flag
    assert "--api-key" not in flags and "--node-key" not in flags
    text = parser.format_help()
    assert "--video-sync-timeout" in text and "H3_VIDEO_SYNC_TIMEOUT" in text
    assert "--no-startup-warmup" in text


@pytest.mark.parametrize("command", ["check", "serve"])
def test_cli_has_no_key_flag(command):
    # Not even as an abbreviation of --api-key-file: the key value would be taken as a file name (and echoed).
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--api-key", KEY])


# The model id ----------------------------------------------------------------------------------------------------


def test_model_id():
    assert load_settings(env={}).model_id == "h3serve-tiny"
    assert load_settings(env={"H3_MODEL": "/models/MiniMax-H3/FL2VA"}).model_id == "/models/MiniMax-H3/FL2VA"
    env = {"H3_MODEL": "/models/MiniMax-H3/FL2VA", "H3_SERVED_MODEL_NAME": "minimax-h3"}
    assert load_settings(env=env).model_id == "minimax-h3"


# h3serve check -----------------------------------------------------------------------------------------------------


def test_check_prints_resolved_settings(capsys):
    assert main(["check"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["api_port"] == 8000 and out["video_sync_timeout"] == 7200 and out["api_key"] is None
    assert out["model_id"] == "h3serve-tiny" and out["api_auth"] is False
    if not torch.cuda.is_available():
        assert out["profile"]["cpu"]["device"] == "cpu"


def test_check_redacts_the_key(capsys, monkeypatch):
    monkeypatch.setenv("H3_API_KEY", KEY)
    monkeypatch.setenv("H3_ALLOW_REMOTE_API", "true")
    assert main(["check", "--bind-host", "0.0.0.0"]) == 0
    captured = capsys.readouterr()
    assert KEY not in captured.out + captured.err
    out = json.loads(captured.out)
    assert out["api_key"] == REDACTED and out["bind_host"] == "0.0.0.0"


def test_check_ignores_h3_require_oracle(capsys, monkeypatch):
    monkeypatch.setenv("H3TEST_REQUIRE_ORACLE", "1")
    assert main(["check"]) == 0
    assert json.loads(capsys.readouterr().out)["api_port"] == 8000


def test_check_reports_every_violation(capsys, monkeypatch):
    monkeypatch.setenv("H3_API_PORT", "0")
    monkeypatch.setenv("H3_DTYPE", "float16")
    monkeypatch.setenv("H3_API_KEY", SHORT_KEY)
    assert main(["check", "--video-sync-timeout", "599", "--bind-host", "bad host!"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    needles = ("5 setting(s) refused", "H3_API_PORT", "H3_DTYPE", "H3_API_KEY", "--video-sync-timeout", "bad host!")
    for needle in needles:
        assert needle in captured.err, needle
    assert SHORT_KEY not in captured.err


def test_check_refuses_a_missing_model_folder(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    assert main(["check", "--model", str(missing)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "H3_MODEL (--model)" in captured.err and str(missing) in captured.err


def test_model_id_is_the_model_string_exactly_as_given():
    """The seed's identity gate compares /v1/models to the path as the operator wrote it, trailing slash and all."""
    assert load_settings(env={"H3_MODEL": "./models/x/"}).model_id == "./models/x/"


def test_each_violation_carries_its_setting_as_data():
    env = {"H3_API_PORT": "0", "H3_LINEAR_BACKEND": "HUMMING", "H3_EXECUTION_MODE": "compile", "H3_BIND_HOST": "a b"}
    with pytest.raises(SettingsError) as info:
        load_settings(env=env)
    assert sorted(s for s in info.value.settings if s) == ["api_port", "bind_host", "linear_backend"]
    for line, setting in zip(info.value.violations, info.value.settings, strict=True):
        assert line.startswith(f"H3_{setting.upper()} ("), line
