"""Hostile and careless input to the settings and the command line (issue 54, fourth round): each refusal names the
setting at fault, reads numbers as ASCII digits only, and tells a new user what to write instead, in a line or two.

Nothing here waits on the clock: the one test that starts a server takes a free port (`service_fixtures`) and bounds
its waits by what it polls."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from h3serve import startup
from h3serve.cli import main
from h3serve.errors import SettingError
from h3serve.settings import EngineSettings, SettingsError, load_settings

KEY = "n0de-" + "abcdefghijklmnopqrstuvwxyz0123456789"  # 41 characters of [A-Za-z0-9._~-]
NODES = {"H3_DIST_INIT_ADDR": "127.0.0.1:29500", "H3_NODE_KEY": KEY}


@pytest.fixture(autouse=True)
def no_h3_environment(monkeypatch):
    """The commands read os.environ: start every test with no H3_* variable of the developer's."""
    for var in list(os.environ):
        if var.startswith("H3_"):
            monkeypatch.delenv(var)


def refusals(env: dict[str, str], config_file: Path | None = None, schema=None) -> SettingsError:
    with pytest.raises(SettingsError) as info:
        load_settings(None, env, config_file, check_profile=False, **({"schema": schema} if schema else {}))
    return info.value


def usage_error(argv: list[str], capsys) -> list[str]:
    """The lines a refused command line prints (it exits 2, as argparse does)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def free_port_pair() -> int:
    """A loopback port whose next port is free too (the rendezvous listens on PORT and its store on PORT+1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65534:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no pair of free loopback ports")


# ---- settings -------------------------------------------------------------------------------------------------------
def test_nodes_whose_ranks_do_not_divide_the_heads_are_refused_as_h3_nnodes():
    s = load_settings(env={**NODES, "H3_NNODES": "64"}, check_profile=False, schema=EngineSettings)
    with pytest.raises(SettingError) as err:
        startup.plan(s, "fl2va")  # the tiny DiT's 4 heads: this node's one GPU divides them, 64 nodes do not
    assert err.value.setting == "nnodes" and str(err.value).startswith("H3_NNODES (--nnodes): ")


def test_a_taken_store_port_is_named_as_the_store_at_port_plus_one():
    port = free_port_pair()
    s = load_settings(env={**NODES, "H3_NNODES": "2", "H3_DIST_INIT_ADDR": f"127.0.0.1:{port}"}, check_profile=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        with pytest.raises(SettingError) as err:
            startup.check_rendezvous(s)
    assert err.value.setting == "dist_init_addr"
    assert f"127.0.0.1:{port + 1}" in err.value.message and "store" in err.value.message
    assert "PORT+1" in err.value.message


def test_a_tiny_device_memory_setting_is_named_with_its_value():
    s = load_settings(env={"H3_DEVICE": "cpu", "H3_DEVICE_MEMORY_GIB": "0.0001"}, check_profile=False)
    with pytest.raises(SettingError) as err:
        startup.check_memory(s, None, free=(64.0, 64.0, True))
    assert err.value.setting == "device_memory_gib"
    first = str(err.value).splitlines()[0]
    assert first.startswith("H3_DEVICE_MEMORY_GIB (--device-memory-gib): ") and "0.0001 GiB" in first
    assert "0.0 GiB" not in first


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"H3_API_PORT": "٨٠٨٠"}, "api_port"),  # Arabic-Indic digits: int() reads 8080
        ({"H3_API_PORT": "８０８０"}, "api_port"),  # full-width digits
        ({"H3_NUM_GPUS": "2_0"}, "num_gpus"),  # pydantic (and int()) read 20
        ({"H3_DEVICE_MEMORY_GIB": "１"}, "device_memory_gib"),
        ({**NODES, "H3_NNODES": "2", "H3_DIST_INIT_ADDR": "127.0.0.1:٢٩٥٠٠"}, "dist_init_addr"),  # read as 29500
        ({**NODES, "H3_NNODES": "2", "H3_DIST_INIT_ADDR": "127.0.0.1:²⁹"}, "dist_init_addr"),  # int(): its own words
    ],
    ids=["arabic-indic", "full-width", "underscore", "full-width-float", "address-arabic-indic", "address-superscript"],
)
def test_numbers_are_ascii_digits_refused_in_our_words(env, setting):
    err = refusals(env)
    assert err.settings == [setting], err.violations
    (line,) = err.violations
    assert "digits 0-9" in line and "invalid literal" not in line and "Input should be" not in line


def test_numbers_on_the_command_line_are_ascii_digits_too(capsys, tmp_path):
    (line,) = usage_error(["render", "a fox", "--frames", "٢٢", "-o", str(tmp_path / "a.mp4")], capsys)
    assert "--frames" in line and "digits 0-9" in line


def test_node_settings_with_one_node_are_refused_like_the_address_and_the_key():
    env = {"H3_NODE_TIMEOUT": "5", "H3_NODE_GRACE": "5", "H3_ALLOW_REMOTE_NODES": "true"}
    err = refusals(env)
    assert sorted(err.settings) == ["allow_remote_nodes", "node_grace", "node_timeout"]
    assert all("H3_NNODES is 1" in line for line in err.violations)
    address = refusals({"H3_DIST_INIT_ADDR": "127.0.0.1:29500"}).violations[0]
    assert address.split(": ", 1)[1] == err.violations[0].split(": ", 1)[1]  # the same words
    # Their defaults, written out (deploy/.env.example uncommented), choose nothing: accepted.
    load_settings(env={"H3_NODE_TIMEOUT": "300", "H3_NODE_GRACE": "10", "H3_ALLOW_REMOTE_NODES": "false"})


def test_a_model_path_that_is_a_device_says_what_it_is():
    s = load_settings(env={"H3_MODEL": "/dev/zero"}, check_profile=False)
    with pytest.raises(SettingError) as err:
        startup.plan(s, "fl2va")
    assert err.value.setting == "model"
    assert "a character device" in err.value.message and "not a model folder" in err.value.message
    assert "does not exist" not in err.value.message


# ---- a new user's command lines --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["render", "--prompt", "a fox", "-o", "fox.mp4"], "h3serve render 'a fox' -o OUT.mp4"),
        (["render", "a fox", "--num-frames", "22", "-o", "fox.mp4"], "did you mean --frames?"),
        (["serve", "--api-key", "abc"], "set H3_API_KEY in the environment"),
        (["check", "--num-gpu", "2"], "did you mean --num-gpus?"),
        (["check", "--startup-warmup", "false"], "write --startup-warmup or --no-startup-warmup"),
        (["store", "check", "--outputdir", "o"], "not a flag of h3serve store check; did you mean --output-dir?"),
    ],
    ids=["prompt-flag", "num-frames", "api-key", "num-gpu", "switch-value", "subcommand-flag"],
)
def test_an_unknown_flag_is_answered_in_a_line_with_what_to_write(argv, hint, capsys):
    lines = usage_error(argv, capsys)
    assert len(lines) <= 2 and hint in lines[0], lines
    assert not any(line.startswith("usage:") for line in lines)


def test_a_misspelt_variable_gets_the_nearest_name_not_the_whole_list():
    (line,) = refusals({"H3_MODLE": "/models/h3"}).violations
    assert "did you mean H3_MODEL?" in line and "H3_API_PORT" not in line


def test_a_config_key_with_the_h3_prefix_is_told_to_drop_it(tmp_path):
    config = tmp_path / "h3.toml"
    config.write_text("H3_API_PORT = 9000\nnum-gpus = 1\n")
    lines = refusals({}, config).violations
    assert any("write api_port" in line for line in lines), lines
    assert any("did you mean num_gpus?" in line for line in lines), lines


def test_the_memory_hint_names_only_settings_that_would_change_the_plan():
    from h3serve.startup import StartupError

    s = load_settings(env={"H3_DEVICE": "cpu", "H3_DEVICE_MEMORY_GIB": "1", "H3_OFFLOAD": "all"}, check_profile=False)
    with pytest.raises((SettingError, StartupError)) as err:
        startup.check_memory(s, None, free=(64.0, 64.0, True))
    hint = str(err.value).splitlines()[-1]
    assert "H3_DEVICE_MEMORY_GIB" in hint  # the one that would: more memory to plan within
    for already_or_impossible in ("H3_OFFLOAD", "CUTLASS", "H3_ADALN_WEIGHTS", "H3_ADALN_TABLES_KEPT"):
        assert already_or_impossible not in hint, hint


def test_check_preflight_always_prints_the_budget_and_the_placement(tmp_path, capsys):
    port = free_port_pair()
    assert (
        main(["check", "--preflight", "--device", "cpu", "--output-dir", str(tmp_path), "--api-port", str(port)]) == 0
    )
    out = capsys.readouterr().out
    assert "placement: " in out and "need (weights + largest activations" in out


def test_accept_chooses_a_request_the_tiny_server_admits_and_shows_a_refusal(tmp_path, capsys):
    from service_fixtures import live_server, settings

    with live_server(settings(tmp_path / "server")) as server:
        assert main(["accept", server.url, "--steps", "2", "--out", str(tmp_path / "ok")]) == 0, capsys.readouterr()
        report = json.loads((tmp_path / "ok" / "accept-report.json").read_text())
        assert report["request"]["width"] == "224" and report["request"]["height"] == "128"
        capsys.readouterr()
        args = ["accept", server.url, "--width", "768", "--height", "448", "--steps", "2"]
        assert main([*args, "--out", str(tmp_path / "big")]) == 1
    err = capsys.readouterr().err
    assert "HTTP 400: " in err and "width" in err  # the server's reason on the console, not only in a file


def test_an_accept_plan_left_unset_asks_for_the_smoke_request_never_none():
    """`AcceptPlan.form` of a plan whose size, duration and steps are left to the server's limits, used without them
    (bench/serve_accept.py's async job): the seed's smoke request, not the text "None" (which the server refused)."""
    from h3serve.accept import SMOKE_REQUEST, AcceptPlan

    form = AcceptPlan(url="http://127.0.0.1:1", out_dir=Path(".")).form()
    assert "None" not in json.dumps(form), form
    assert (form["width"], form["height"]) == (str(SMOKE_REQUEST.width), str(SMOKE_REQUEST.height))
    assert json.loads(form["extra_params"])["duration"] == SMOKE_REQUEST.seconds
